"""Runs anywhere, in about a minute on 2 CPU cores, with nothing downloaded: a 2-layer Qwen2-style model
and a tokenizer built in code learn to answer "Write K digits:" with digits.

    python -m grpo.train recipes/tiny.py
"""
import random

from datasets import Dataset

from grpo import Config
from grpo.tasks.tiny import model_for, train_tokenizer

config = Config(
    output_dir="runs/tiny",
    max_steps=20,
    per_device_train_batch_size=16,  # completions: 4 prompts x 4 generations per micro-batch
    gradient_accumulation_steps=1,
    num_generations=4,
    max_prompt_length=32,
    max_completion_length=16,
    learning_rate=1e-3,
    optim="adamw",
    adam_beta2=0.99,  # TRL's default is 0.999; the published figures of this recipe were measured at 0.99
    gradient_checkpointing=False,
    use_bias_correction_kl=False,
    beta=0.04,
    logging_steps=1,
    save_steps=10,
    save_total_limit=1,
    seed=0,
)


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"Write {k} digits:", "num_digits": k} for k in (rng.randint(1, 9) for _ in range(n))]


def digit_share(completions, **kwargs):
    """Share of the completion's non-space characters that are digits."""
    out = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


def digit_count(completions, num_digits, **kwargs):
    """1 when the completion holds exactly `num_digits` digits, falling off linearly with the miss."""
    return [max(0.0, 1.0 - abs(sum(c.isdigit() for c in t) - k) / k) for t, k in zip(completions, num_digits)]


reward_funcs = [digit_share, digit_count]


def train_dataset():
    return Dataset.from_list(rows(256, seed=0))


def build_model(config):
    """The tokenizer is trained on the task's own text; the model is random-weight."""
    corpus = [r["prompt"] + " " + "".join(str(d % 10) for d in range(r["num_digits"])) for r in rows(2000, seed=1)]
    tokenizer = train_tokenizer(corpus, vocab_size=256)
    return model_for(tokenizer, hidden_size=64, num_layers=2, seed=config.seed), tokenizer
