"""A recipe (the next candidate for recipes/calculator.py, measured on seed 0 only; docs/benchmarks.md): the
calculator recipe with a one-step worked example before its two-step one and a third reward, 0.25 x "the answer
is the last calculator result" (grpo.tasks.calculator.last_result_reward).

    python benchmarks/real_model.py --recipe benchmarks/calculator_two_examples.py --seeds 0 1 2 --steps 60
"""
import runpy
from dataclasses import replace
from pathlib import Path

from datasets import Dataset

from grpo.tasks import word_problems
from grpo.tasks.calculator import INLINE_EXAMPLE_ANSWER, last_result_reward

CALCULATOR = runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes" / "calculator.py"))
ONE_STEP = [{"role": "user", "content": "Tom has 12 marbles and finds 7 more. How many marbles does Tom have?"},
            {"role": "assistant",
             "content": "<reasoning>\n12 + 7 = <<12+7=19>>19\n</reasoning>\n<answer>\n19\n</answer>"}]

config = replace(CALCULATOR["config"], output_dir="runs/calculator_two_examples", reward_weights=[0.25, 1.0, 0.25])
reward_funcs = [*CALCULATOR["reward_funcs"], last_result_reward]
tools = CALCULATOR["tools"]


def rows(problems):
    """word_problems' rows, the one-step example turn after the system prompt."""
    out = word_problems.rows(problems, example_answer=INLINE_EXAMPLE_ANSWER)
    for row in out:
        row["prompt"] = [row["prompt"][0], *ONE_STEP, *row["prompt"][1:]]
    return out


def train_dataset():
    return Dataset.from_list(rows(CALCULATOR["BASE"]["TRAIN"]))


def eval_dataset():
    return Dataset.from_list(rows(CALCULATOR["BASE"]["HELD_OUT"]))
