"""A run's session with its output folder: what a checkpoint holds besides the weights (`state_dict`), writing
one (`save`), resuming from one (`resume`), and a step undone when it fails or a stop signal abandons it, the
steps done saved so that only that one is lost (`undone_on_failure`, `saved_when_logs_fail`). run/checkpoint.py
writes and finds the folders."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import TrainingStopped, UserError
from ..policy.forwards import Policy
from ..policy.lora import save_options
from ..policy.optim import Updates, rescheduled, set_hyperparameters
from ..infra.progress import quiet_library_bars
from ..rollout.prompts import PromptStream
from ..settings.components import OptimSettings, SessionSettings
from . import checkpoint, elastic
from .logs import LogNotWritten, drop_log_lines_after
from .state import rng_state, set_rng_state
from ..infra.distributed import Distributed
from ..infra.interrupts import StepAbandoned, StopSignals, TrainingInterrupted


class CheckpointNotWritten(TrainingStopped):
    """A checkpoint could not be written into output_dir: the message names the folder, the cause and the rescue
    folder that holds the state instead (run/checkpoint.save_or_rescue)."""


@dataclass(frozen=True)
class Progress:
    """Where a run stands besides its weights, optimizer and batches: the optimizer steps done and the steps whose
    update a NaN/inf loss or gradient skipped (in a row, in all)."""

    step: int
    nonfinite: tuple[int, int]


class Session:
    """Checkpoints of one run in `output_dir`. Under torchrun every rank calls every method (gathering and
    saving are collective) and rank 0 writes. `batches`: the run's batch supply (run/supply)."""

    def __init__(self, output_dir: Path, dist: Distributed, policy: Policy, tokenizer, updates: Updates,
                 prompts: PromptStream, batches, settings: SessionSettings, total_steps: int,
                 entropy, optim: OptimSettings, sync_ref_model: bool, on_save=lambda: None):
        self.output_dir, self.dist, self.parallel = output_dir, dist, policy.parallel
        self.reference = policy.reference if sync_ref_model else None  # moves: saved too
        self.model, self.tokenizer, self.optimizer, self.scheduler = (policy.model, tokenizer, updates.optimizer,
                                                                      updates.scheduler)
        self.prompts, self.batches, self.settings, self.optim = prompts, batches, settings, optim  # optim: the plan's
        self.total_steps, self.warmup_steps = total_steps, updates.warmup_steps
        self.on_save = on_save  # called after each checkpoint written (the callbacks' on_save)
        self.entropy = entropy  # the entropy bonus's coefficient (policy/gradients.EntropyControl)
        self.last_checkpoint: Path | None = None  # the newest checkpoint, written or resumed from
        self.saved_step: int | None = None  # its step: saving again at it does nothing

    def state_dict(self, progress: Progress) -> dict:
        """Everything besides the weights that resuming needs (docs/checkpoints-and-failures.md), each rank's RNG
        states and batch supply's state included; rank 0 gets the whole."""
        own = {"rng": rng_state(), "batches": self.batches.state_dict(progress.step)}
        return {"step": progress.step, "total_steps": self.total_steps,
                "optimizer": self.parallel.optimizer_state(self.optimizer),
                "scheduler": self.scheduler.state_dict(), "prompts": self.prompts.state_dict(),
                "nonfinite": progress.nonfinite,
                **({} if self.reference is None else {"reference": self.reference.state_dict()}),
                "entropy_control": self.entropy.state_dict(),
                **(own if self.dist.world_size == 1 else {"ranks": self.dist.gather_to_main(own)})}

    def load_state_dict(self, state: dict) -> Progress:
        """The inverse of `state_dict`; the current settings (learning rate, betas) win over the saved ones."""
        s, o = self.settings, self.optim
        own = elastic.rank_state(state, self.dist.rank, self.dist.world_size)  # None: saved by another rank count
        redraw = elastic.unfinished_prompts(state, s.num_generations) if own is None else 0  # drawn again
        self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_hyperparameters(self.optimizer, self.scheduler, o.learning_rate, o.betas, o.weight_decay)
        self.prompts.load_state_dict(state["prompts"], redraw)
        if own is None:  # run/elastic.py: what later steps would have reused is sampled anew, seeded per rank
            elastic.seed_rank(s.seed, self.dist.rank, state["step"])
        else:
            self.batches.load_state_dict(own["batches"])
            set_rng_state(own["rng"])
        if self.reference is not None and "reference" in state:  # saved since sync_ref_model was on
            self.reference.load_state_dict(state["reference"])
        if "entropy_control" in state:  # not in checkpoints written before it was kept
            self.entropy.load_state_dict(state["entropy_control"])
        streak, total = state["nonfinite"]
        return Progress(state["step"], (streak, total))

    def save(self, progress: Progress, asked: bool = False) -> Path | None:
        """Write checkpoint-STEP (once per step), then `on_save`; returns its path, or None under
        save_strategy="no" unless `asked` (a callback's control.should_save, obeyed whatever the strategy)."""
        if self.settings.save_strategy == "no" and not asked:
            return None
        if self.saved_step != progress.step:
            state, weights = self.state_dict(progress), self.parallel.full_state_dict()  # FSDP: gathered
            written, problem = None, None
            if self.dist.is_main:  # a folder that cannot take it: a rescue folder does (run/checkpoint)
                written, problem = checkpoint.save_or_rescue(str(self.output_dir), progress.step, self.model,
                                                             self.tokenizer, self.settings.record, state,
                                                             self.settings.save_total_limit, weights)
            if self.dist.world_size > 1:  # every rank stops with rank 0's line
                problem = self.dist.gather_objects([problem])[0]
            self.dist.barrier()
            if problem is not None:
                self.last_checkpoint = written or self.last_checkpoint
                raise CheckpointNotWritten(problem)
            self.last_checkpoint = self.output_dir / f"checkpoint-{progress.step}"
            self.saved_step = progress.step
            self.on_save()
        return self.last_checkpoint

    def save_model(self, path: Path) -> None:
        """The model (under LoRA its adapter, in peft's format) and tokenizer written into `path` for
        from_pretrained; no optimizer state (a checkpoint holds that)."""
        weights = self.parallel.full_state_dict()  # FSDP: gathered
        if self.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            with quiet_library_bars():
                self.model.save_pretrained(path, safe_serialization=True, state_dict=weights,
                                           **save_options(self.model))
            self.tokenizer.save_pretrained(path)
        self.dist.barrier()

    def resume(self, spec: str | bool | None, logged: bool = False) -> Progress | None:
        """Start as resume_from_checkpoint `spec` says: None or False, a fresh run, which moves an earlier run's
        files aside (None returned; `logged`: the logs there are this run's own, an evaluation's before its first
        step); a checkpoint folder, "latest" or True (checkpoint.find_checkpoint; none yet: step 0, and None is
        returned). Lines of the logs written after its step are dropped, so they never repeat."""
        if not spec:
            moved = None if logged or not self.dist.is_main else checkpoint.move_earlier_run(str(self.output_dir))
            if moved is not None:
                print(f"warning: {moved}", file=sys.stderr)
            self.dist.barrier()  # the other ranks read the folder rank 0 has cleared
            return None
        s = self.settings
        path, passed_over = checkpoint.find_checkpoint(spec, str(self.output_dir))
        if passed_over and self.dist.is_main:
            print("\n".join(passed_over), file=sys.stderr)
        progress = None
        if path is None:
            unfinished = [p.name for p in sorted(self.output_dir.glob("checkpoint-*"))
                          if p.is_dir() and not (p / checkpoint.COMPLETE).exists()]
            said = (f"no complete checkpoint in {self.output_dir} ({', '.join(unfinished)}: no {checkpoint.COMPLETE} "
                    f"marker, its save was interrupted, so it cannot be resumed and a save of its step replaces it)"
                    if unfinished else f"no checkpoint in {self.output_dir} yet")
            print(f"{said}: starting from step 0", file=sys.stderr)
        else:
            state = checkpoint.load_state(path)
            notes = [f"resuming from {path} (step {state['step']} of {self.total_steps})"]
            notes += [f"resuming with a changed setting: {c}" for c in checkpoint.changed_settings(path, s.record)]
            notes += elastic.rank_change_notes(checkpoint.saved_config(path), state, s.record, self.dist.world_size)
            if state.get("total_steps", self.total_steps) != self.total_steps:  # e.g. a finished run extended
                o = self.optim
                notes.append(rescheduled(state["total_steps"], self.total_steps, state["step"], o.learning_rate,
                                         self.warmup_steps, o.lr_scheduler_type, o.lr_scheduler_kwargs))
            self.parallel.load_weights(path)
            progress = self.load_state_dict(state)
            if self.dist.is_main:  # once it loaded: a checkpoint that does not is one error line
                print("\n".join(notes), file=sys.stderr)
            self.last_checkpoint, self.saved_step = path, progress.step
        if self.dist.is_main:  # the one writer; with no checkpoint even step 0's evaluation is done again
            drop_log_lines_after(str(self.output_dir), progress.step if progress is not None else -1)
        return progress

    @contextlib.contextmanager
    def saved_when_logs_fail(self, progress):
        """A log line output_dir cannot take stops the run with the steps done saved (`progress()`: where the run
        stands then), into a rescue folder when output_dir cannot take that either (`save`)."""
        try:
            yield
        except LogNotWritten as error:
            done = progress()
            if done.step == 0 or self.dist.world_size > 1:  # nothing to save; saving is collective, logging not
                raise
            path = self.save(done, asked=True)
            raise LogNotWritten(f"{error}: the state after step {done.step} is saved in {path}") from None

    def stop_on_signal(self, received: int | None, progress: Progress) -> None:
        """Raise `interrupted` when a rank received a stop signal (`received`: this rank's), every rank at the same
        step: ranks see a signal at different moments."""
        received = self.dist.agree_on_signal(received)
        if received is not None:
            raise self.interrupted(received, progress)

    def interrupted(self, signum: int, progress: Progress) -> TrainingInterrupted:
        """The error a stop signal ends the run with, the steps done saved first (unless save_strategy="no")."""
        unsaved = "nothing to save yet" if progress.step == 0 else 'nothing saved (save_strategy="no")'
        return TrainingInterrupted(signum, progress.step, self.save(progress) if progress.step > 0 else None, unsaved)

    @contextlib.contextmanager
    def undone_on_failure(self, signals: StopSignals, progress: Progress):
        """A stop signal or an error inside rolls the step back (batch in training, data position, RNG states,
        gradients) and saves `progress`, the steps done: resuming repeats the step exactly."""
        rng, prompts = rng_state(), self.prompts.state_dict()
        try:
            # Ranks cannot abandon a step alone: the others would wait for them in a collective. The batch is
            # put back outside the abandonable part, so that no signal cuts that short.
            with self.batches.undone_on_failure(), \
                    signals.abandonable() if self.dist.world_size == 1 else contextlib.nullcontext():
                yield
        except Exception as error:
            set_rng_state(rng)
            self.prompts.load_state_dict(prompts)
            self.optimizer.zero_grad(set_to_none=True)
            if isinstance(error, StepAbandoned):
                raise self.interrupted(signals.received, progress) from None
            if self.dist.world_size == 1:  # saving is collective: a rank failing alone cannot
                self._save_after_error(progress)
            raise

    def _save_after_error(self, progress: Progress) -> None:
        """Keep the steps done before a failing one; never let the save hide the error itself."""
        try:
            path = self.save(progress) if progress.step > 0 else None
        except Exception as save_error:  # noqa: BLE001 -- the error being raised matters more
            said = save_error if isinstance(save_error, UserError) else repr(save_error)
            print(f"could not save a checkpoint after the error below: {said}", file=sys.stderr)
            return
        if path is not None:
            print(f"step {progress.step + 1} failed; {path} holds the state after step {progress.step}",
                  file=sys.stderr)
