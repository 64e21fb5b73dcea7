"""async_generation: a forked sampler makes the next generation batch while the current one trains. With
max_staleness=0 it is the synchronous run bit for bit; with 1, each batch is sampled with the weights one step
old and its old log-probs are those weights'; a killed sampler ends the run with one line and a checkpoint, Ctrl-C
saves and stops the sampler; a resumed run trains on what the uninterrupted one did."""
import copy
import json
import os
import signal

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.run.ahead import SamplerDied
from grpo.run.checkpoint import complete_checkpoints

VOLATILE = ("perf/", "memory/", "step_time", "async/wait_s")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_trainer(out, tokenizer, reward=digit_share, **overrides) -> Trainer:
    base = dict(output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=8,
                gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16, max_completion_length=8,
                learning_rate=1e-2, optim="adamw", beta=0.04, seed=0, use_lora=True, lora_r=4, lora_alpha=8)
    return Trainer(Config(**{**base, **overrides}), model=tiny_model(tokenizer), tokenizer=tokenizer,
                   reward_funcs=[reward], train_dataset=digit_prompts())


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stable(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if not k.startswith(VOLATILE)} for line in lines]


def assert_same_weights(a: Trainer, b: Trainer) -> None:
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs"


# num_iterations=2: the old log-probs' forward draws LoRA dropout from the RNG inside generate, in the sampler.
@pytest.mark.parametrize("settings", [{}, {"num_iterations": 2}], ids=["one-step-per-batch", "num_iterations=2"])
def test_staleness_zero_is_the_synchronous_run_bit_for_bit(tmp_path, tokenizer, settings):
    sync = make_trainer(tmp_path / "sync", tokenizer, lora_dropout=0.1, **settings)
    sync.train()
    waited = make_trainer(tmp_path / "async", tokenizer, lora_dropout=0.1, async_generation=True, max_staleness=0,
                          **settings)
    waited.train()
    assert_same_weights(sync, waited)
    lines = read_jsonl(tmp_path / "async" / "metrics.jsonl")
    assert [line.get("async/staleness", 0) for line in lines] == [0, 0, 0, 0]
    assert stable([{k: v for k, v in line.items() if k != "async/staleness"} for line in lines]) == \
        stable(read_jsonl(tmp_path / "sync" / "metrics.jsonl"))
    assert read_jsonl(tmp_path / "async" / "completions.jsonl") == read_jsonl(tmp_path / "sync" / "completions.jsonl")


def test_a_batch_is_sampled_with_the_weights_one_step_old_and_scored_against_them(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path / "run", tokenizer, max_steps=2, save_strategy="no", async_generation=True,
                           lora_dropout=0.0)  # log-probs without dropout, so that they can be taken again
    initial = copy.deepcopy(trainer.model.state_dict())
    trainer.train()
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [line["async/staleness"] for line in lines] == [0, 1]  # step 1's batch was asked for before step 0's update
    assert all(torch.isfinite(torch.tensor(line["loss"])) for line in lines)
    # Step 2's batch (the trainer's last) was sampled with the initial weights: its old log-probs are theirs.
    trained = copy.deepcopy(trainer.model.state_dict())
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    trainer.model.load_state_dict(initial)
    for m in trainer.generation.micro_batches:
        if not m.empty:
            expected = trainer.policy.logprobs(m.rollout).detach()  # [n, c]
            torch.testing.assert_close(m.rollout.old_logprobs * m.rollout.completion_mask,
                                       expected * m.rollout.completion_mask)


def test_resuming_trains_on_what_the_uninterrupted_run_did(tmp_path, tokenizer):
    reference = make_trainer(tmp_path / "reference", tokenizer, async_generation=True)
    reference.train()
    out = tmp_path / "run"
    first = make_trainer(out, tokenizer, async_generation=True)
    original = first.accumulate

    def crash_in_step_3(*args):
        if first.step == 2:
            raise KeyboardInterrupt  # stands in for the process dying: nothing saves it
        return original(*args)

    first.accumulate = crash_in_step_3
    with pytest.raises(KeyboardInterrupt):
        first.train()
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]
    saved = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    kept = saved["batches"]["ahead"]
    assert kept["step"] == 2 and kept["version"] == 1, "step 3's batch, sampled after step 1"
    resumed = make_trainer(out, tokenizer, async_generation=True, resume_from_checkpoint="latest")
    resumed.train()
    assert_same_weights(reference, resumed)
    assert stable(read_jsonl(out / "metrics.jsonl")) == stable(read_jsonl(tmp_path / "reference" / "metrics.jsonl"))


def dies_in_step_3(completions, trainer_state, **kwargs):
    """A reward that kills the process it runs in (the sampler's) when it scores step 3's batch."""
    if trainer_state.global_step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_share(completions)


def test_a_killed_sampler_ends_the_run_with_one_line_and_a_checkpoint(tmp_path, tokenizer):
    out = tmp_path / "run"
    trainer = make_trainer(out, tokenizer, reward=dies_in_step_3, save_steps=10, async_generation=True,
                           max_staleness=0)
    with pytest.raises(SamplerDied, match=r"killed by SIGKILL.*step 3.*resume_from_checkpoint"):
        trainer.train()
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]


def test_ctrl_c_saves_the_steps_done_and_stops_the_sampler(tmp_path, tokenizer):
    out = tmp_path / "run"
    trainer = make_trainer(out, tokenizer, save_steps=10, async_generation=True)
    original, sampler = trainer.accumulate, []

    def ctrl_c_in_step_3(*args):
        if trainer.step == 2:
            sampler.append(trainer.batches.worker.process)  # sampling step 4's batch now
            os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C reaches both; the sampler ignores it
        return original(*args)

    trainer.accumulate = ctrl_c_in_step_3
    with pytest.raises(KeyboardInterrupt, match=r"interrupted by SIGINT after step 2: saved .*checkpoint-2"):
        trainer.train()
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]
    assert sampler and not sampler[0].is_alive() and trainer.batches.worker is None


def test_settings_it_cannot_run_with_are_one_line(tokenizer):
    with pytest.raises(ConfigError, match="max_staleness"):
        Config(async_generation=True, max_staleness=-1)
    with pytest.raises(ConfigError, match="rollout_func"):
        Trainer(Config(async_generation=True, max_steps=1, per_device_train_batch_size=4, num_generations=4),
                model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                train_dataset=digit_prompts(), rollout_func=lambda prompts, trainer: {})
