"""Tool calls that end badly, end to end through `Trainer` with the scripted policy of tests/scripted.py: a tool
stuck in a busy loop is stopped at its timeout (later steps are not slower, the process exits right after
`train()` returns), and every bad end of a tool turn (unknown tool, malformed call, a result that does not fit, a
timeout, a raise) counts in `tools/failure_frequency` and says what happened in completions.jsonl."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset
from scripted import CALL, UNKNOWN_CALL, chain, scripted_model, scripted_tokenizer

from grpo import Config, Trainer

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]

STUCK_RUN = """
import json, os, sys, time
from datasets import Dataset
from scripted import CALL, UNKNOWN_CALL, chain, scripted_model, scripted_tokenizer
from grpo import Config, Trainer
from grpo.rollout.tools import Tools


def multiply(a: int, b: int) -> int:
    '''
    Multiplies two integers, or would: a code-execution tool stuck in `while True`.

    Args:
        a: The first integer.
        b: The second integer.
    '''
    while True:
        pass


QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]
tokenizer = scripted_tokenizer(CALL, UNKNOWN_CALL)
prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
model = scripted_model(tokenizer, chain(tokenizer, prompt, "<tool_call>", CALL, "</tool_call>"))
config = Config(output_dir=sys.argv[1], max_steps=5, per_device_train_batch_size=4, num_generations=4,
                max_prompt_length=1024, max_completion_length=160, learning_rate=1e-2, optim="adamw", beta=0.0,
                save_steps=1000, max_tool_calling_iterations=1)
trainer = Trainer(config, model=model, tokenizer=tokenizer, train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 4),
                  reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                  tools=Tools.of([multiply], timeout_s=0.5))
trainer.train()
cpu = sum(os.times()[:2])
time.sleep(1.0)
print(json.dumps({"returned": time.time() - 1.0, "cpu_in_the_second_after": sum(os.times()[:2]) - cpu}), flush=True)
"""


@pytest.mark.slow
def test_a_busy_looping_tool_is_stopped_at_its_timeout_and_the_process_exits(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_RUN)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, str(script), str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        said = run.stdout.readline()
        assert said, run.stderr.read()[-3000:]
        returned = json.loads(said)
        run.wait(timeout=30)
        exited = time.time()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    print(f"exit {exited - returned['returned']:.2f} s after train() returned; "
          f"{returned['cpu_in_the_second_after']:.2f} CPU s in the second after it")
    # Interpreter teardown alone (torch's) takes 1-6 s on a loaded 2-core machine, without tools too; 61195b5 waited
    # for the stuck calls forever.
    assert exited - returned["returned"] < 15.0, "the process waits for the stuck calls"
    assert returned["cpu_in_the_second_after"] < 0.3, "the stuck calls still burn CPU"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(line["tools/failure_frequency"] == 1.0 for line in lines)
    seconds = [line.get("step_time", line.get("perf/step_s")) for line in lines]
    print("step seconds", [f"{s:.2f}" for s in seconds])
    # 61195b5: every step left 4 more threads spinning in the trainer's process, each taking its share of the GIL
    assert seconds[-1] < 2 * seconds[1] + 1.0, f"later steps slow down: {seconds}"
    completion = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert completion["tool_failures"] == ["multiply timed out after 0.5 s"]


def trainer(tmp_path, model_script: list[str], tools, max_completion_length=160, **overrides) -> Trainer:
    tokenizer = scripted_tokenizer(CALL, UNKNOWN_CALL)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    model = scripted_model(tokenizer, chain(tokenizer, prompt, *model_script))
    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                    max_prompt_length=1024, max_completion_length=max_completion_length, learning_rate=1e-2,
                    optim="adamw", beta=0.0, save_steps=1000, max_tool_calling_iterations=1, **overrides)
    return Trainer(config, model=model, tokenizer=tokenizer, tools=tools,
                   train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 4),
                   reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])


def long_multiply(a: int, b: int) -> str:
    """
    Multiplies two integers, at length.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return "twelve " * 200


long_multiply.__name__ = "multiply"


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


@pytest.mark.parametrize("case", ["does-not-fit", "unknown", "malformed"])
def test_a_tool_turn_that_ends_the_row_counts_as_a_failure_and_says_so_in_completions_jsonl(tmp_path, case):
    script, tools = {"does-not-fit": (["<tool_call>", CALL, "</tool_call>"], [long_multiply]),
                     "unknown": (["<tool_call>", UNKNOWN_CALL, "</tool_call>"], [multiply]),
                     "malformed": (["<tool_call>", CALL], [multiply])}[case]  # never closed
    trainer(tmp_path, script, tools).train()
    (line,) = [json.loads(text) for text in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["tools/failure_frequency"] == 1.0
    rows = [json.loads(text) for text in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    (failure,) = rows[0]["tool_failures"]
    expected = {"does-not-fit": r"the result of multiply \(\d+ tokens\) did not fit in the \d+ tokens left, the row "
                                r"ended",
                "unknown": r"unknown tool 'divide', the row ended",
                "malformed": r"malformed call, the row ended: an unclosed <tool_call> in .*"}[case]
    assert re.fullmatch(expected, failure, flags=re.S), failure


def test_a_raising_tool_is_named_in_completions_jsonl(tmp_path):
    def broken(a: int, b: int) -> int:
        """
        Multiplies two integers, or fails to.

        Args:
            a: The first integer.
            b: The second integer.
        """
        raise ZeroDivisionError("division by zero")
    broken.__name__ = "multiply"
    trainer(tmp_path, ["<tool_call>", CALL, "</tool_call>"], [broken]).train()
    rows = [json.loads(text) for text in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert rows[0]["tool_failures"] == ["multiply raised ZeroDivisionError: division by zero"]
    assert rows[0]["completion"][1]["content"] == "{'error': 'division by zero'}"


def test_rows_without_failures_have_an_empty_list(tmp_path):
    trainer(tmp_path, ["<tool_call>", CALL, "</tool_call>"], [multiply]).train()
    rows = [json.loads(text) for text in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert all(row["tool_failures"] == [] for row in rows)
