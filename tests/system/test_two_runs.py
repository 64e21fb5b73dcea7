"""Two runs started at the same moment into one output_dir: one trains, the other refuses in one line (the
folder's lock, grpo/run/lock.py), and the logs hold each step once. They meet at a barrier after building
their Trainers, so that both have passed every check made before training starts."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = """
import sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
from grpo import Config, Trainer
from grpo.errors import UserError
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

out, barrier = sys.argv[1], Path(sys.argv[2])
tokenizer = tiny_tokenizer()
config = Config(output_dir=out, max_steps=4, per_device_train_batch_size=4, num_generations=2,
                max_prompt_length=16, max_completion_length=8, optim="adamw", save_steps=1, seed=0)
trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                  train_dataset=digit_prompts())
(barrier / sys.argv[3]).touch()
while len(list(barrier.iterdir())) < 2:  # the barrier: both Trainers are built
    time.sleep(0.001)
try:
    trainer.train()
    print("trained", trainer.step)
except UserError as error:
    print(f"error: {{error}}")
"""


@pytest.mark.slow
def test_two_runs_started_together_into_one_folder(tmp_path):
    script, out, barrier = tmp_path / "run.py", tmp_path / "run", tmp_path / "barrier"
    script.write_text(textwrap.dedent(RUN.format(root=str(ROOT), tests=str(ROOT / "tests"))))
    barrier.mkdir()
    runs = [subprocess.Popen([sys.executable, str(script), str(out), str(barrier), name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
            for name in ("a", "b")]
    results = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in results]
    said = sorted(stdout.strip() for stdout, _ in results)
    assert said[0].startswith(f"error: {out} is in use by another run (pid "), said
    assert said[0].endswith("): wait for it to end, or pick another output_dir") and "\n" not in said[0]
    assert said[1] == "trained 4"
    assert all("Traceback" not in err for _, err in results)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
