"""A generation batch is sampled whole, scored and given advantages whole, then trained in micro-batches of
per_device_train_batch_size completions (TRL 1.16's meaning): how it is cut must not change the update."""
from types import SimpleNamespace

import pytest
import torch
from distributed_worker import FixedSampler
from tiny_setup import digit_prompts, digit_share, text_length, tiny_model, tiny_tokenizer
from tolerances import adamw_rounding

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.settings.schedule import Schedule


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def train(tmp_path, name, tokenizer, reward=digit_share, **batch) -> Trainer:
    """Completions that depend on the prompt text alone (FixedSampler), so that runs cut differently see the same."""
    config = Config(**{**dict(output_dir=str(tmp_path / name), max_steps=2, num_generations=4, max_prompt_length=16,
                              max_completion_length=8, learning_rate=1e-2, optim="adamw", beta=0.04, seed=0,
                              save_steps=10**6), **batch})
    model = tiny_model(tokenizer)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[reward],
                      train_dataset=digit_prompts(8), sampler=FixedSampler(model, tokenizer, config))
    trainer.train()
    return trainer


def test_a_group_spanning_two_micro_batches_trains_as_one_micro_batch(tmp_path, tokenizer):
    whole = train(tmp_path, "whole", tokenizer, per_device_train_batch_size=12)  # 3 prompts x 4, one micro-batch
    # 6 completions per micro-batch: the 2nd prompt's group is split 2 + 2 over the two micro-batches.
    split = train(tmp_path, "split", tokenizer, per_device_train_batch_size=6, gradient_accumulation_steps=2)
    assert split.schedule.micro_batches_per_generation == 2
    assert [len(b.rollout.completions) for b in split.generation.micro_batches] == [6, 6]
    assert whole.prompts.state_dict() == split.prompts.state_dict() == {"epoch": 0, "position": 6}
    worst = max((a - b).abs().max().item() for a, b in zip(whole.model.parameters(), split.model.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(whole.model.parameters(),
                                                            tiny_model(tokenizer).parameters()))
    # 2 AdamW steps of the same gradients in other micro-batches: steps * lr / 100 = 2e-4 (tolerances.py;
    # measured 8e-9 .. 1.2e-7 on 5 CPU variants); a group's advantages taken per micro-batch half, or a row
    # trained twice, would move the elements it dominates by ~lr. `moved`: the weights did move, by ~lr a step.
    assert worst < adamw_rounding(2, 1e-2) and moved > 1e-3, (worst, moved)


def test_steps_per_generation_feeds_several_optimizer_steps(tmp_path, tokenizer):
    # TRL's steps_per_generation = 2 x gradient_accumulation_steps: one generation batch, two optimizer steps.
    # Random completions rewarded by length, so that no group has equal rewards and nothing to train.
    trainer = train(tmp_path, "spg", tokenizer, per_device_train_batch_size=4, steps_per_generation=2, beta=0.0,
                    reward=text_length)
    assert trainer.prompts.state_dict()["position"] == 2, "one generation batch of 2 prompts for both steps"
    micro_batches = trainer.generation.micro_batches
    assert len(micro_batches) == 2 and micro_batches[1].rollout.old_logprobs is not None


@pytest.mark.parametrize("settings, world_size, message", [
    (dict(steps=2, generation_batch_size=8), 1, "set steps_per_generation or generation_batch_size, not both"),
    (dict(generation_batch_size=6), 2, "generation_batch_size=6 must be a multiple of per_device_train_batch_size"),
    (dict(steps=3), 1, "steps_per_generation=3 must be a multiple of gradient_accumulation_steps=2"),
    (dict(per_device=3), 1, "a generation batch of 6 completions per rank"),
])
def test_generation_batch_settings_resolve_as_in_trl_or_say_why_not(settings, world_size, message):
    names = dict(per_device="per_device_train_batch_size", accumulation="gradient_accumulation_steps",
                 steps="steps_per_generation")
    args = dict(per_device=4, accumulation=2, steps=None, generation_batch_size=None, num_generations=4,
                num_iterations=1)

    def resolve(world_size, **changes):
        fields = {names.get(k, k): v for k, v in {**args, **changes}.items()}
        return Schedule.resolve(SimpleNamespace(**fields), world_size)

    with pytest.raises(ConfigError, match=message):
        resolve(world_size, **settings)
    # TRL's relations: generation_batch_size = per_device x ranks x steps_per_generation.
    assert resolve(2, generation_batch_size=32).micro_batches_per_generation == 4
    assert resolve(2).micro_batches_per_generation == 2
    assert resolve(2).prompts_per_generation == 2 * 4 * 2 // 4 and resolve(2).global_batch == 4 * 2 * 2


def test_micro_batches_keep_only_their_own_padding(tokenizer):
    from grpo.rollout.batches import Cut, Rollout

    def rollout(prompt_len, completion_len, rows):
        ones = lambda n: torch.ones(rows, n, dtype=torch.long)  # noqa: E731
        return Rollout(ones(prompt_len) * 5, ones(prompt_len), ones(completion_len) * 7, ones(completion_len),
                       ["x"] * rows, torch.zeros(rows, dtype=torch.bool))

    whole = Rollout.cat([rollout(2, 3, 4), rollout(5, 1, 4)], pad_id=0)
    a, b = (m.rollout for m in whole.micro_batches(Cut(3, False, False))[1:])  # rows 3..5 mix both, 6..7 are b's
    assert a.prompt_ids.tolist() == [[0, 0, 0, 5, 5], [5] * 5, [5] * 5] and a.completion_mask.tolist() == [
        [1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert b.prompt_ids.shape == (2, 5) and b.completion_ids.tolist() == [[7], [7]]


def test_a_sampler_and_a_rollout_func_together_are_refused(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="pass one of a sampler, a rollout_func, tools/environment_factory"):
        Trainer(Config(output_dir=str(tmp_path / "both")), tokenizer=tokenizer, train_dataset=digit_prompts(8),
                sampler=lambda prompts, on_token=None: ([], {}), rollout_func=lambda prompts, trainer: {})



class ClosingSampler:
    """A sampler passed in that holds something to let go when the run ends (a connection, a server's state)."""

    def __init__(self, sampler):
        self.sampler, self.closed = sampler, 0

    def __call__(self, prompts, on_token=None, streams=None):
        return self.sampler(prompts, on_token, streams)

    def close(self):
        self.closed += 1


def test_a_sampler_passed_in_is_closed_when_the_run_ends(tmp_path, tokenizer):
    """The engine interface's optional `close` (rollout/engines/engine.Engine) is called once the run ends, for a
    sampler passed in as for a server's engine."""
    config = Config(output_dir=str(tmp_path), max_steps=1, num_generations=4, max_prompt_length=16,
                    max_completion_length=8, per_device_train_batch_size=8, save_strategy="no")
    model = tiny_model(tokenizer)
    sampler = ClosingSampler(FixedSampler(model, tokenizer, config))
    Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[digit_share], train_dataset=digit_prompts(8),
            sampler=sampler).train()
    assert sampler.closed == 1
