"""TRL 1.16's hooks through a real (tiny) run: what reward functions log lands in metrics.jsonl and
completions.jsonl, and a `rollout_func` replaces our decoder."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.rollout.engines.custom import RolloutFuncEngine, RolloutFuncError


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def config(tmp_path, **overrides) -> Config:
    return Config(**{**dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8,
                            num_generations=4, max_prompt_length=16, max_completion_length=6, learning_rate=1e-2,
                            optim="adamw", seed=0), **overrides})


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_reward_logs_reach_metrics_and_completions(tmp_path, tokenizer):
    steps = []

    def logging_reward(completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
        steps.append(trainer_state.global_step)
        log_metric("tokens/mean", sum(map(len, completion_ids)) / len(completion_ids))
        log_extra("num_tokens", [len(ids) for ids in completion_ids])
        return [float(len(ids) % 2) for ids in completion_ids]

    trainer = Trainer(config(tmp_path), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[logging_reward, digit_share], train_dataset=digit_prompts())
    trainer.train()
    assert steps == [0, 1]
    metrics, rows = read(tmp_path / "run" / "metrics.jsonl"), read(tmp_path / "run" / "completions.jsonl")
    assert len(rows) == 16 and all(isinstance(r["num_tokens"], int) and r["num_tokens"] >= 1 for r in rows)
    for line in metrics:  # the logged metric is the mean of that step's logged column
        step_rows = [r["num_tokens"] for r in rows if r["step"] == line["step"]]
        assert line["tokens/mean"] == pytest.approx(sum(step_rows) / len(step_rows))


def test_rollout_func_replaces_the_decoder(tmp_path, tokenizer):
    calls, seen_ids = [], []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def fixed_rollouts(prompts, trainer):
        """TRL's contract: one entry per completion (each prompt num_generations times in a row)."""
        calls.append(len(prompts))
        digits = [tokenizer(str(i % 10))["input_ids"] for i in range(len(prompts))]
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts],
                "completion_ids": [d + [eos] if i % 2 else d * 3 for i, d in enumerate(digits)],
                "logprobs": [[0.0] * 3 for _ in prompts]}

    def spy(completion_ids, **kwargs):
        seen_ids.extend(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    trainer = Trainer(config(tmp_path), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[spy], train_dataset=digit_prompts(), rollout_func=fixed_rollouts)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert calls == [8, 8], "one call per generation batch (2 prompts x 4), one generation batch per step"
    one = tokenizer("1")["input_ids"]
    assert seen_ids[:2] == [tokenizer("0")["input_ids"] * 3, one + [eos]]  # EOS kept, as our decoder keeps it
    rows = read(tmp_path / "run" / "completions.jsonl")
    assert [r["completion"] for r in rows[:4]] == ["000", "1", "222", "3"]
    assert max((a - b).abs().max().item() for a, b in zip(before, trainer.model.parameters())) > 1e-4


def digit_rollouts(tokenizer, calls: list, **fields):
    """A rollout_func whose completion i is the digit i % 10 then EOS, returning `fields` besides its tokens
    (each a value, or a function of the number of completions giving a list)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts],
                "completion_ids": [tokenizer(str(i % 10))["input_ids"] + [eos] for i in range(len(prompts))],
                "logprobs": [[0.0, 0.0] for _ in prompts],
                **{k: v(len(prompts)) if callable(v) else v for k, v in fields.items()}}
    return rollout_func


def test_rollout_func_is_called_once_per_generation_batch_and_its_fields_reach_the_rewards(tmp_path, tokenizer):
    calls, seen = [], []

    def spy(prompts, completions, digit, engine, num_digits, **kwargs):
        seen.append((prompts, completions, digit, engine, num_digits))
        return [float(d) / 10 for d in digit]

    # 6 completions per micro-batch, 4 micro-batches per generation batch (24 completions: 6 prompts x 4),
    # 2 per optimizer step: a generation batch feeds 2 steps, and the 2nd prompt's group spans 2 micro-batches.
    cfg = config(tmp_path, max_steps=4, per_device_train_batch_size=6, gradient_accumulation_steps=2,
                 steps_per_generation=4)
    rollout_func = digit_rollouts(tokenizer, calls, digit=lambda n: [str(i % 10) for i in range(n)],
                                  engine="mine", num_digits=lambda n: [-1] * n)
    trainer = Trainer(cfg, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[spy],
                      train_dataset=digit_prompts(12), rollout_func=rollout_func)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert len(calls) == 2 and all(len(c) == 24 for c in calls), "once per generation batch, not per micro-batch"
    for c in calls:  # each of its 6 prompts num_generations times in a row
        assert all(c[i:i + 4] == [c[i]] * 4 for i in range(0, 24, 4))
    assert sorted(calls[0][::4] + calls[1][::4]) == sorted(digit_prompts(12)["prompt"]), "one epoch, 6 + 6"
    assert [len(b.rollout.completions) for b in trainer.generation.micro_batches] == [6, 6, 6, 6]
    assert len(seen) == 2
    for call, (prompts, completions, digit, engine, num_digits) in zip(calls, seen):
        assert prompts == call and completions == [str(i % 10) for i in range(24)]  # in the function's order
        assert digit == completions, "one value per completion, the one the rollout_func gave it"
        assert engine == ["mine"] * 24, "a value that is not a list is every completion's, as in TRL"
        assert num_digits == [-1] * 24, "a field named like a dataset column wins over it, as in TRL"
    rows = read(tmp_path / "run" / "completions.jsonl")
    assert [r["prompt"] for r in rows] == calls[0] + calls[1]
    assert [r["reward/spy"] for r in rows] == pytest.approx([i % 10 / 10 for i in range(24)] * 2)
    assert max((a - b).abs().max().item() for a, b in zip(before, trainer.model.parameters())) > 1e-4


@pytest.mark.parametrize("fields, message", [
    ({"digit": lambda n: ["1"] * (n - 1)}, (r"returned 7 values of 'digit' for 8 completions: a list field "
                                            r"holds one value per completion")),
    ({"prompts": lambda n: ["x"] * n}, r"returned a field 'prompts', a name the reward functions' own arguments use"),
    ({"completion": "x"}, r"returned a field 'completion', a name the reward functions' own arguments use"),
    ({"env_mask": lambda n: [[1]] * n}, r"returned an env_mask whose rows are not as long as their completion_ids"),
])
def test_rollout_func_fields_are_checked(tmp_path, tokenizer, fields, message):
    trainer = Trainer(config(tmp_path, max_steps=1), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[digit_share], train_dataset=digit_prompts(),
                      rollout_func=digit_rollouts(tokenizer, [], **fields))
    with pytest.raises(RolloutFuncError, match=message):
        trainer.train()


def test_rollout_func_output_is_checked(tmp_path, tokenizer):
    def wrong(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[1]], "logprobs": None}

    trainer = Trainer(config(tmp_path, max_steps=1), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[digit_share], train_dataset=digit_prompts(), rollout_func=wrong)
    with pytest.raises(RolloutFuncError, match="returned 8 prompt_ids and 1 completion_ids for 8 prompts"):
        trainer.train()


def test_rollout_func_rows_are_on_the_policys_device(tokenizer):
    # The meta device stands in for CUDA: a tensor left on the CPU (the truncation flags multiplied into the
    # completion mask by mask_truncated_completions) shows as on another device.
    meta = torch.device("meta")
    policy = SimpleNamespace(model=tiny_model(tokenizer), device=meta)
    settings = SimpleNamespace(num_generations=2, max_completion_length=4)
    engine = RolloutFuncEngine(lambda prompts, trainer: None, None, policy, tokenizer, settings)
    rollout = engine.rollout(["a", "a"], [[5, 6], [7]], [[8], [9, 10]], None)
    tensors = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)
               if isinstance(getattr(rollout, f.name), torch.Tensor)}
    assert set(tensors) == {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "loss_mask", "truncated"}
    assert all(t.device == meta for t in tensors.values())
