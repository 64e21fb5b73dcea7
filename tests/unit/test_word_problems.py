"""The generated word problems: whole-number answers that match the text, disjoint and reproducible splits,
chat prompts with the system prompt and one worked example; and the no-learning-signal warning."""
import json
import re

import pytest
import torch

from grpo.tasks import word_problems as wp
from grpo.algo.advantages import zero_std_fraction
from grpo.run.state import NoSignalWatch
from grpo.tasks.gsm8k import SYSTEM_PROMPT, answer_accuracy_reward, xml_format_reward


@pytest.fixture(scope="module")
def splits():
    return wp.split(num_train=10_000, num_eval=500, seed=0)


def recompute(p: wp.Problem) -> int:
    """The answer worked out again from the question's own numbers, by the template's operations."""
    nums = [int(x) for x in re.findall(r"\d+", p.question)]
    assert tuple(nums) == p.numbers, (p.question, p.numbers)
    a, b, *rest = nums
    text = wp.TEMPLATES[p.template][2]
    if p.operations == 1:
        if "more" in text or "in total" in text:
            return a + b
        if "gave" in text or "takes" in text:
            return a - b
        if "Each bag" in text or "cost?" in text:
            return a * b
        return a // b if a % b == 0 else None
    c = rest[0]
    return {8: a + b - c, 9: a * b + c, 10: a - b * c, 11: a // b + c if a % b == 0 else None}[p.template]


def test_a_training_mix_of_its_own_keeps_the_held_out_problems(splits):
    train, held_out = wp.split(num_train=2_000, num_eval=500, seed=0, train_two_step_share=0.8)
    assert held_out == splits[1]
    assert not {p.key for p in train} & {p.key for p in held_out}
    two_step = lambda problems: sum(p.operations == 2 for p in problems) / len(problems)  # noqa: E731
    assert two_step(train) > 0.75 and 0.2 < two_step(held_out) < 0.4  # 0.8 and 0.3 drawn (duplicates redrawn)


def test_sizes_disjoint_and_reproducible(splits):
    train, held_out = splits
    assert len(train) == 10_000 and len(held_out) == 500
    assert not {p.key for p in train} & {p.key for p in held_out}, "a held-out problem is also in train"
    assert not {p.question for p in train} & {p.question for p in held_out}
    assert len({p.key for p in train}) == len(train) and wp.EXAMPLE_KEY not in {p.key for p in train + held_out}
    again = wp.split(num_train=10_000, num_eval=500, seed=0)
    assert [p.question for p in again[1]] == [p.question for p in held_out]


def test_answers_are_whole_numbers_that_match_the_text(splits):
    train, held_out = splits
    for p in train[:3000] + held_out:
        assert isinstance(p.answer, int) and p.answer >= 0
        assert recompute(p) == p.answer, p.question
    assert {p.operations for p in held_out} == {1, 2} and len({p.template for p in held_out}) == len(wp.TEMPLATES)


def test_rows_are_chat_prompts_with_a_worked_example_and_the_answer(splits):
    row = wp.rows(splits[1][:1])[0]
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["system", "user", "assistant", "user"] and row["prompt"][0]["content"] == SYSTEM_PROMPT
    assert row["prompt"][-1]["content"] == splits[1][0].question and row["answer"] == str(splits[1][0].answer)
    example = [{"role": "assistant", "content": wp.EXAMPLE_ANSWER}]
    # The worked example itself earns full marks from the rewards the recipe trains with.
    assert xml_format_reward([example]) == [1.0] and answer_accuracy_reward([example], answer=["14"]) == [1.0]
    assert [m["role"] for m in wp.rows(splits[1][:1], worked_example=False)[0]["prompt"]] == ["system", "user"]


def test_zero_std_fraction_counts_groups_with_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.2, 0.2, 0.2, 0.2])
    assert zero_std_fraction(rewards, 4) == 0.5
    assert zero_std_fraction(torch.zeros(8), 2) == 1.0


def test_no_signal_warning_after_a_streak_once():
    watch = NoSignalWatch(patience=3)
    assert [watch.update(f) for f in (1.0, 1.0, 0.5, 1.0, 1.0)] == [None] * 5  # the streak was broken
    message = watch.update(1.0)
    assert message and "worked example" in message and "temperature" in message and "partial" in message
    assert watch.update(1.0) is None  # once


def test_constant_reward_warns_once_and_logs_the_fraction(tmp_path, capsys):
    from grpo import Config, Trainer
    from tiny_setup import digit_prompts, tiny_model, tiny_tokenizer

    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    tokenizer = tiny_tokenizer()
    config = Config(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=2, num_generations=2,
                    max_prompt_length=16, max_completion_length=4, optim="adamw", beta=0.0, save_steps=100)
    Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[constant],
            train_dataset=digit_prompts()).train()
    err = capsys.readouterr().err
    assert err.count("no learning signal for 3 steps in a row") == 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["frac_reward_zero_std"] for line in lines] == [1.0] * 4
