"""Resuming is exact: 6 steps in one run and the same run stopped after step 4 (crash or signal), then
resumed, end with bit-identical weights and the same metrics and completions lines."""
import hashlib
import json
import os
import re
import signal

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, logged, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.run.checkpoint import complete_checkpoints
from grpo.infra.interrupts import TrainingInterrupted

VOLATILE = ("perf/", "memory/", "step_time")  # timings and memory differ between any two runs
SETTINGS = {
    # A reference copy, and num_iterations=2 puts checkpoint-3 in the middle of a generation batch.
    "full-adamw-mid-batch": dict(optim="adamw", beta=0.04, num_iterations=2),
    # 8-bit AdamW state, LoRA dropout drawing from the RNG in every forward, gradient checkpointing.
    "lora-8bit-dropout": dict(use_lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.1, optim="adamw_8bit",
                              gradient_checkpointing=True, beta=0.04),
    # bf16 weights: float32 optimizer states, stochastic rounding drawing from the RNG in every update.
    "full-bf16-weights": dict(optim="adamw", beta=0.04, bf16_weights=True),
}


class Crash(BaseException):
    """Stands in for the process dying: not an Exception, so nothing catches it or saves."""


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_trainer(out, tokenizer, settings, **overrides) -> Trainer:
    base = dict(output_dir=str(out), max_steps=6, save_steps=3, per_device_train_batch_size=8,
                gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16, max_completion_length=8,
                learning_rate=1e-2, warmup_ratio=0.2, lr_scheduler_type="linear", seed=0)
    config = Config(**{**base, **settings, **overrides})
    return Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                   train_dataset=digit_prompts())


def stop_when(trainer, method: str, step: int, stop) -> None:
    """Call `stop()` when `trainer.<method>` is entered while `step` steps are done."""
    original = getattr(trainer, method)

    def wrapped(*args):
        if trainer.step == step:
            stop()
        return original(*args)

    setattr(trainer, method, wrapped)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stable(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if not k.startswith(VOLATILE)} for line in lines]


_uninterrupted = {}


def uninterrupted(name, tmp_path_factory, tokenizer):
    """The 6-step run every stopped-and-resumed one must equal (made once per settings)."""
    if name not in _uninterrupted:
        out = tmp_path_factory.mktemp(name)
        trainer = make_trainer(out, tokenizer, SETTINGS[name])
        trainer.train()
        _uninterrupted[name] = (trainer, out)
    return _uninterrupted[name]


def assert_same_run(resumed, out, reference, reference_out):
    for (name, p), q in zip(reference.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after resume"
    assert [line["step"] for line in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert stable(read_jsonl(out / "metrics.jsonl")) == stable(read_jsonl(reference_out / "metrics.jsonl"))
    assert read_jsonl(out / "completions.jsonl") == read_jsonl(reference_out / "completions.jsonl")


def crash_inside_step_5(out, tokenizer, name: str) -> None:
    """Run `name` into `out` until it dies inside step 5 (its checkpoint-3 written, step 4 logged)."""
    first = make_trainer(out, tokenizer, SETTINGS[name])
    stop_when(first, "accumulate", 4, lambda: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        first.train()


def resumed_after_a_crash_inside_step_5(run, out) -> Trainer:
    """`run(out, **overrides)`'s Trainer, dead inside step 5, then resumed from its latest checkpoint to the end."""
    first = run(out)
    stop_when(first, "accumulate", 4, lambda: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        first.train()
    resumed = run(out, resume_from_checkpoint="latest")
    resumed.train()
    return resumed


@pytest.mark.parametrize("name", SETTINGS)
def test_resume_after_a_crash_is_bit_identical(tmp_path, tmp_path_factory, tokenizer, name):
    reference, reference_out = uninterrupted(name, tmp_path_factory, tokenizer)
    out = tmp_path / "run"
    crash_inside_step_5(out, tokenizer, name)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-3"]
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == 4, "step 4's lines were written after checkpoint-3"

    resumed = make_trainer(out, tokenizer, SETTINGS[name], resume_from_checkpoint="latest")
    resumed.train()
    assert_same_run(resumed, out, reference, reference_out)


def test_a_checkpoint_in_the_earlier_layout_resumes_exactly(tmp_path, tmp_path_factory, tokenizer):
    """Before the batch supply kept one "batches" entry, "generation" and "ahead" sat beside "rng"."""
    name = "full-adamw-mid-batch"
    reference, reference_out = uninterrupted(name, tmp_path_factory, tokenizer)
    out = tmp_path / "run"
    crash_inside_step_5(out, tokenizer, name)
    saved = out / "checkpoint-3"
    state = torch.load(saved / "trainer_state.pt", weights_only=True)
    state.update(state.pop("batches"))  # written before: "generation" (and "ahead") beside "rng"
    assert state["generation"] is not None, "checkpoint-3 keeps the batch step 4 trains on"
    torch.save(state, saved / "trainer_state.pt")
    sums = (saved / "checksums.sha256").read_text().splitlines()
    digest = hashlib.sha256((saved / "trainer_state.pt").read_bytes()).hexdigest()
    (saved / "checksums.sha256").write_text("".join(
        f"{digest}  trainer_state.pt\n" if line.endswith("  trainer_state.pt") else f"{line}\n" for line in sums))

    resumed = make_trainer(out, tokenizer, SETTINGS[name], resume_from_checkpoint="latest")
    resumed.train()
    assert_same_run(resumed, out, reference, reference_out)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_step_rolls_it_back_saves_and_resumes_exactly(tmp_path, tmp_path_factory, tokenizer, signum):
    name = "full-adamw-mid-batch"
    reference, reference_out = uninterrupted(name, tmp_path_factory, tokenizer)
    out = tmp_path / "run"
    first = make_trainer(out, tokenizer, SETTINGS[name])
    # Step 5 has generated a batch (RNG and data position moved on) and is about to back-propagate.
    stop_when(first, "accumulate", 4, lambda: os.kill(os.getpid(), signum))
    handler = signal.getsignal(signum)
    with pytest.raises(TrainingInterrupted) as info:
        first.train()
    assert (info.value.signum, info.value.step, info.value.checkpoint) == (signum, 4, out / "checkpoint-4")
    assert signal.getsignal(signum) is handler, "the previous handler is back"

    resumed = make_trainer(out, tokenizer, SETTINGS[name], resume_from_checkpoint=str(out / "checkpoint-4"))
    resumed.train()
    assert_same_run(resumed, out, reference, reference_out)


def test_latest_without_a_checkpoint_starts_afresh_and_drops_unsaved_lines(tmp_path, tokenizer):
    out = tmp_path / "run"
    first = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, save_steps=10)
    stop_when(first, "accumulate", 1, lambda: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        first.train()
    assert len(read_jsonl(out / "metrics.jsonl")) == 1 and not complete_checkpoints(out)
    with open(out / "metrics.jsonl", "a") as f:  # as eval_on_start writes it: the new start evaluates again
        f.write('{"step": 0, "eval/accuracy": 0.5}\n')
    resumed = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, save_steps=10,
                           resume_from_checkpoint="latest")
    resumed.train()
    assert [line["step"] for line in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_a_fresh_run_does_not_write_over_an_earlier_one(tmp_path, tokenizer, capsys):
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=1).train()
    before = (out / "metrics.jsonl").read_text()
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=1).train()
    assert re.search(r"held an earlier run \(checkpoint-1, .*moved it to .*previous-run-1 for this fresh run; "
                     r"resume_from_checkpoint=True", capsys.readouterr().err)
    assert (out / "previous-run-1" / "metrics.jsonl").read_text() == before
    assert complete_checkpoints(out / "previous-run-1") and [p.name for p in complete_checkpoints(out)] == [
        "checkpoint-1"]


@pytest.mark.parametrize("spec, message", [
    ("missing", "no such folder"),
    (".", "is a run folder, not a checkpoint: pass one of its checkpoints"),
    (".checkpoint-3.tmp", r"is not a complete checkpoint \(no COMPLETE marker: its save was interrupted\)"),
    ("empty", "holds no checkpoint: it is empty; resume_from_checkpoint=True in the Config picks the newest"),
    ("checkpoint-1", r"holds checkpoints newer than .*checkpoint-1 \(checkpoint-2\): continuing from it there would "
                     "mix two runs"),
])
def test_resume_from_a_bad_folder_says_why(tmp_path, tokenizer, spec, message):
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, save_steps=1).train()
    (out / ".checkpoint-3.tmp").mkdir()
    (out / ".checkpoint-3.tmp" / "config.json").write_text("{}")  # a save cut short after its first file
    (out / "empty").mkdir()
    with pytest.raises(ConfigError, match=message):
        make_trainer(out, tokenizer, {}, optim="adamw", resume_from_checkpoint=str(out / spec)).train()


def test_resume_refuses_other_state_shaping_settings(tmp_path, tokenizer):
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=1).train()
    with pytest.raises(ConfigError, match='saved with optim="adamw"; resuming needs the same optim'):
        make_trainer(out, tokenizer, {}, optim="adamw_8bit", resume_from_checkpoint="latest").train()


@pytest.mark.parametrize("schedule, extended", [
    # lr 1e-2 x the multiplier of step s of 5 (no warmup): linear 1 - s/5, cosine (1 + cos(pi s/5)) / 2.
    ("linear", [1e-2 * (1 - 3 / 5), 1e-2 * (1 - 4 / 5)]),                      # 4e-3, 2e-3
    ("cosine", [1e-2 * 0.5 * (1 - 0.3090170), 1e-2 * 0.5 * (1 - 0.8090170)]),  # cos(3pi/5), cos(4pi/5)
])
def test_a_finished_run_extended_continues_on_the_new_totals_schedule(tmp_path, tokenizer, capsys, schedule,
                                                                      extended):
    out = tmp_path / "run"
    first = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=3, warmup_ratio=0.0,
                         lr_scheduler_type=schedule)
    # 3 steps: linear 1 - s/3 (1, 2/3, 1/3), cosine (1 + cos(pi s/3)) / 2 (1, 3/4, 1/4).
    ended = [1.0, 2 / 3, 1 / 3] if schedule == "linear" else [1.0, 0.75, 0.25]
    first.train()
    assert [line["learning_rate"] for line in logged(first)] == pytest.approx([1e-2 * m for m in ended])
    saved = [p.detach().clone() for p in first.model.parameters()]
    capsys.readouterr()

    resumed = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=5, warmup_ratio=0.0,
                           lr_scheduler_type=schedule, resume_from_checkpoint="latest")
    spy, lrs = resumed.optimizer.step, []
    resumed.optimizer.step = lambda: (lrs.append(resumed.optimizer.param_groups[0]["lr"]), spy())[1]
    resumed.train()
    assert [line["step"] for line in logged(resumed)] == [1, 2, 3, 4, 5]  # the first train()'s lines too
    history = logged(resumed)[3:]
    assert [line["learning_rate"] for line in history] == pytest.approx(extended) and lrs == pytest.approx(extended)
    assert any(not torch.equal(p, q) for p, q in zip(saved, resumed.model.parameters())), "step 4 trained"
    assert (f"resuming a run of 3 steps as one of 5: the {schedule} learning-rate schedule is now that of 5 "
            f"steps, from step 3 on (lr {extended[0]:.3g} for step 4)") in capsys.readouterr().err


def test_a_run_shortened_below_its_restored_step_says_nothing_is_trained():
    from grpo.policy.optim import rescheduled

    assert rescheduled(100, 1, 119, 1e-3, 0, "linear") == (
        "resuming a run of 100 steps as one of 1: step 119 is past its end, so no step is trained")
    # 5 steps of 10, linear without warmup: lr 1e-3 x (1 - 5/10) for step 6.
    assert rescheduled(5, 10, 5, 1e-3, 0, "linear").endswith("from step 5 on (lr 0.0005 for step 6)")



def test_resume_with_tools_mid_generation_batch_is_bit_identical(tmp_path):
    # The scripted policy writes "<<3*4=" and the calculator feeds "12>>": the checkpoint in the middle of a
    # generation batch (num_iterations=2) holds tool tokens, the loss mask without them and the call counts.
    from datasets import Dataset
    from scripted import chain, scripted_model, scripted_tokenizer

    from grpo.tasks.calculator import INLINE_CALCULATOR
    tokenizer = scripted_tokenizer("<<", "3*4")
    prompt = "Compute 3*4: "

    def by_place(completions, **kwargs):
        return [i / len(completions) for i in range(len(completions))]

    def run(out, **overrides):
        config = Config(output_dir=str(out), max_steps=6, save_steps=3, per_device_train_batch_size=8,
                        gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16,
                        max_completion_length=12, learning_rate=1e-2, optim="adamw", num_iterations=2, seed=0,
                        **overrides)
        model = scripted_model(tokenizer, chain(tokenizer, prompt, "<<", "3*4", "="))
        return Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[by_place],
                       train_dataset=Dataset.from_list([{"prompt": prompt}] * 8), tools=[INLINE_CALCULATOR])
    reference = run(tmp_path / "reference")
    reference.train()
    assert all(line["tools/call_frequency"] == 1 for line in read_jsonl(tmp_path / "reference" / "metrics.jsonl"))
    assert_same_run(resumed_after_a_crash_inside_step_5(run, tmp_path / "run"), tmp_path / "run", reference,
                    tmp_path / "reference")


def test_a_streaming_dataset_resumes_at_its_row_in_a_later_epoch(tmp_path, tokenizer):
    # 3 prompts a stream of, 1 a step, reshuffled each epoch: checkpoint-4 is one row into the second epoch.
    from datasets import IterableDataset

    def run(out, **overrides):
        config = Config(output_dir=str(out), max_steps=6, save_steps=4, per_device_train_batch_size=4,
                        num_generations=4, max_prompt_length=16, max_completion_length=8, learning_rate=1e-2,
                        seed=0, **overrides)
        stream = IterableDataset.from_generator(lambda: (yield from digit_prompts(3)))
        return Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                       train_dataset=stream)
    reference = run(tmp_path / "reference")
    reference.train()
    prompts = [row["prompt"] for row in read_jsonl(tmp_path / "reference" / "completions.jsonl")][::4]
    assert sorted(prompts[:3]) == sorted(prompts[3:]) == sorted(digit_prompts(3)["prompt"]), "each epoch all rows"
    assert_same_run(resumed_after_a_crash_inside_step_5(run, tmp_path / "run"), tmp_path / "run", reference,
                    tmp_path / "reference")
