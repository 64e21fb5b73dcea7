import sys, time, json, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
torch.set_num_threads(1)
from profile_step import Recorder, instrument, summarize, rss_bytes
from grpo.recipe import load_with_overrides
import grpo.train as T
rec = Recorder(); instrument(rec)
recipe, config = load_with_overrides("recipes/word_problems.py", sys.argv[1:])
base = rss_bytes()
rec.step_start = (time.perf_counter(), time.process_time())
T.run(recipe, config, [])
print("baseline", base/1e9)
for i, s in enumerate(rec.steps[:-1]):
    print(i+1, {k: (round(v["cpu_s"],1), round(v["entry_gb"],2), round(v["peak_gb"],2)) for k, v in s.items() if isinstance(v, dict) and "entry_gb" in v})
