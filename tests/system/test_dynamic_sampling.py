"""DAPO's dynamic sampling (`dynamic_sampling`): groups whose rewards are all equal are replaced by newly
sampled ones, the generation batch stays full, and a run stopped and resumed is still exact."""
import json

import pytest
import torch
from tiny_setup import digit_prompts, logged, odd_digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer

# odd_digit_share is constant (0.5) for prompts asking for an even number of digits: half the groups of
# digit_prompts carry no signal, and which ones a generation batch draws depends on the seeded order.
SETTINGS = dict(max_steps=4, save_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                num_generations=4, max_prompt_length=16, max_completion_length=8, learning_rate=1e-2,
                optim="adamw", beta=0.04, seed=0, dynamic_sampling=True, logging_steps=1)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_trainer(out, tokenizer, **overrides) -> Trainer:
    return Trainer(Config(output_dir=str(out), **{**SETTINGS, **overrides}), model=tiny_model(tokenizer),
                   tokenizer=tokenizer, reward_funcs=[odd_digit_share], train_dataset=digit_prompts(18))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_groups_without_signal_are_replaced_and_the_batch_stays_full(tmp_path, tokenizer):
    # Rounds enough that every batch fills with groups with signal (an odd prompt's group can be equal too).
    trainer = make_trainer(tmp_path / "run", tokenizer, dynamic_sampling_max_rounds=16)
    trainer.train()
    lines = logged(trainer)
    # 4 prompts a generation batch (2 micro-batches of 8 = 16 completions): every one of them odd.
    assert [len(b.rollout.completions) for b in trainer.generation.micro_batches] == [8, 8]
    digits = [int(p.split()[1]) for p in trainer.generation.batch.prompts]
    assert len(digits) == 16 and all(n % 2 for n in digits), digits
    assert all(line["frac_reward_zero_std"] == 0.0 for line in lines if "frac_reward_zero_std" in line)
    dropped = [line["dynamic_sampling/dropped_groups"] for line in lines if "dynamic_sampling/rounds" in line]
    assert len(dropped) == 4 and sum(dropped) > 0, dropped  # even prompts were drawn, and left out
    assert all(line["dynamic_sampling/filler_groups"] == 0 for line in lines if "dynamic_sampling/rounds" in line)
    completions = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(completions) == 4 * 16 and all(int(c["prompt"].split()[1]) % 2 for c in completions)


def test_without_rounds_left_the_batch_is_topped_up_with_dropped_groups(tmp_path, tokenizer):
    # A reward constant for every prompt: no round finds a group with signal.
    constant = lambda completions, **kwargs: [1.0] * len(completions)  # noqa: E731
    trainer = Trainer(Config(output_dir=str(tmp_path / "run"), **{**SETTINGS, "max_steps": 1,
                                                                  "dynamic_sampling_max_rounds": 2}),
                      model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[constant],
                      train_dataset=digit_prompts(18))
    trainer.train()
    line = logged(trainer)[-1]
    assert line["dynamic_sampling/rounds"] == 2 and line["dynamic_sampling/filler_groups"] == 4
    assert line["dynamic_sampling/dropped_groups"] == 4 + 4 + 4 - 4  # 3 rounds of 4 groups sampled, 4 kept
    assert trainer.prompts.state_dict()["position"] == 12
    assert [len(b.rollout.completions) for b in trainer.generation.micro_batches] == [8, 8]


def test_off_by_default_is_the_plain_run(tmp_path, tokenizer):
    plain = make_trainer(tmp_path / "plain", tokenizer, dynamic_sampling=False, max_steps=2)
    plain.train()
    lines = logged(plain)
    assert not any(k.startswith("dynamic_sampling/") for line in lines for k in line)
    assert any(line["frac_reward_zero_std"] > 0 for line in lines)


class Crash(BaseException):
    """Stands in for the process dying: nothing catches it or saves."""


def test_resume_is_exact(tmp_path, tokenizer):
    reference = make_trainer(tmp_path / "whole", tokenizer)
    reference.train()
    first = make_trainer(tmp_path / "run", tokenizer)
    accumulate = first.accumulate

    def crash_in_step_3(batches):
        if first.step == 2:
            raise Crash()
        return accumulate(batches)

    first.accumulate = crash_in_step_3
    with pytest.raises(Crash):
        first.train()
    resumed = make_trainer(tmp_path / "run", tokenizer, resume_from_checkpoint="latest")
    resumed.train()
    for (name, p), q in zip(reference.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after resume"
    volatile = ("perf/", "memory/", "step_time")

    def stable(path):
        return [{k: v for k, v in line.items() if not k.startswith(volatile)} for line in read_jsonl(path)]

    assert stable(tmp_path / "run" / "metrics.jsonl") == stable(tmp_path / "whole" / "metrics.jsonl")
    assert read_jsonl(tmp_path / "run" / "completions.jsonl") == read_jsonl(tmp_path / "whole" / "completions.jsonl")
