"""`Trainer`: the GRPO loop: each step takes its batch (rollout/pipeline) and updates the policy."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

from .algo.loss_terms import high_entropy_mask, trl_off_policy_mask
from .infra.allocator import decoding_allocations, return_freed_memory
from .infra.interrupts import StopSignals
from .policy.forwards import Policy
from .policy.gradients import EntropyControl, accumulate, eval_loss
from .policy.models import default_tokenizer, load_model, prepare_for_training
from .policy.optim import Updates
from .rollout.engines.engine import make_engine
from .rollout.evaluate import evaluate
from .rollout.pipeline import Pipeline
from .rollout.prompts import check_chat_template, eval_sets
from .rollout.reward_models import place_reward_models
from .rollout.tools import Tools
from .run import lock
from .run.callbacks import Callbacks, ReferenceSync
from .run.logs import logged_lines, peak_memory_gb
from .run.report import Report, TrainOutput
from .run.session import Progress, Session
from .run.startup import prepare
from .run.supply import supply
from .run.state import NoSignalWatch, TrainerState
from .run.trackers import Trackers
from .settings import Config
from .trl_call import trl_attributes, trl_call


class Trainer:
    """GRPO on `model` (or `config.model`), rewarded by `reward_funcs`, over `train_dataset`; TRL's
    call works too (trl_call.py). `sampler` replaces our decoder (its contract: rollout/engines/engine.Engine)."""

    def __init__(self, config: Config | None = None, model=None, tokenizer=None, reward_funcs=(), train_dataset=None,
                 eval_dataset=None, rollout_func=None, reward_processing_classes=None, *, args: Config | None = None,
                 processing_class=None, callbacks=None, sampler=None, tools=None, environment_factory=None, **trl_only):
        engines = (sampler, rollout_func, tools or environment_factory)  # one at most
        config, model, tokenizer = trl_call(config, args, model, tokenizer, processing_class, trl_only, engines)
        self.config = config
        self.eval_dataset = eval_dataset
        self.tools = Tools.of(tools, environment_factory) if tools or environment_factory else None
        self.dist, self.plan, self.precision, self.reward_funcs, self.prompts, rows = prepare(  # before loading
            config, train_dataset, eval_dataset, reward_funcs, reward_processing_classes, model,
            sampler=sampler is not None, rollout_func=rollout_func is not None, tools=self.tools)
        self.schedule, self.total_steps = self.plan.schedule, self.plan.total_steps
        self.trackers = Trackers(self.plan.trackers, self.dist.is_main)  # a missing package fails
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer(self.plan.loading.model, model)
        check_chat_template(self.tokenizer, *rows)  # before loading too
        self._setup_policy(model)
        self._setup_generation(sampler, rollout_func)
        self._setup_run(callbacks)
        vars(self).update(trl_attributes(self))  # TRL's names a script reads

    def _setup_policy(self, model) -> None:
        """The model loaded and prepared as the plan says, its policy and updates."""
        model = model if model is not None else load_model(self.plan.loading, self.precision)
        self.model = prepare_for_training(model, self.plan.loading, self.dist.world_size)
        self.policy = Policy(self.model, self.plan.logprobs, self.dist.world_size, self.precision,
                             is_main=self.dist.is_main)
        self.threshold_set = self.policy.device.type == "cpu" and return_freed_memory()
        self.updates = Updates(self.model.parameters(), self.plan.optim, self.total_steps)
        self.entropy = EntropyControl(self.plan.loss, self.plan.entropy)  # policy_loss's settings at each step
        self.optimizer, self.scheduler = self.updates.optimizer, self.updates.scheduler  # TRL's

    def _setup_generation(self, sampler, rollout_func) -> None:
        """The engine that samples the completions, the rewards next to the policy."""
        self.state = TrainerState.of(self.total_steps, self.dist)  # its global_step is `step`
        self.no_signal = NoSignalWatch(patience=3)  # steps in a row where all rewards were equal
        self.engine, self.encode = make_engine(sampler, rollout_func, self, self.plan, self.policy, self.tokenizer,
                                               self.tools)  # the encoder: eval's too
        place_reward_models(self.reward_funcs, self.policy.device)  # next to the policy

    def _setup_run(self, callbacks) -> None:
        """The pipeline and the steps' batches it makes (now or ahead), the callbacks, the report, the session."""
        self.pipeline = Pipeline.build(self.engine, self.prompts, self.reward_funcs, self.policy, self.dist,
                                       self.plan.generation, self.plan.loss, self.tokenizer.pad_token_id,
                                       self.threshold_set, self.tools)
        self.batches = supply(self.pipeline, self.state, self.schedule, self.total_steps,
                              self.plan.generation.max_staleness, release=self.optimizer.state.clear)
        synced = [ReferenceSync(self.policy)] if self.plan.sync_ref_model else []  # TRL adds it after the rest
        self.callbacks = Callbacks([*(callbacks or ()), *synced], self.config, self.state, self.model,
                                   self.tokenizer, self.optimizer, self.scheduler)  # TRL's `args`: the Config
        self.report = Report(self.plan.output_dir, self.dist, self.trackers, self.state, self.callbacks,
                             self.pipeline.reward_names, self.schedule.global_batch)
        self.session = Session(self.plan.output_dir, self.dist, self.policy, self.tokenizer, self.updates,
                               self.prompts, self.batches, self.plan.session, self.total_steps, self.entropy,
                               self.plan.optim, self.plan.sync_ref_model, on_save=self.callbacks.on_save)

    @property
    def step(self) -> int:  # optimizer steps done: state.global_step, which state.epoch follows
        return self.state.global_step

    @step.setter
    def step(self, step: int) -> None:
        self.state.global_step = step
        self.state.epoch = self.schedule.epoch(step, self.prompts.epoch_rows)

    def get_high_entropy_mask(self, entropies, mask, threshold: float):  # TRL's (a method of its trainer)
        return high_entropy_mask(entropies, mask, threshold)
    get_off_policy_mask = staticmethod(trl_off_policy_mask)  # TRL's

    @property
    def generation(self):  # the generation batch in training (rollout/batches); None before one
        return self.batches.current

    entropy_coef = property(lambda self: self.entropy.coef)  # TRL's: the entropy bonus's coefficient now

    def save_model(self, output_dir: str | None = None) -> None:  # transformers': no optimizer
        self.session.save_model(Path(output_dir) if output_dir is not None else self.plan.output_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run to `total_steps`, resumed as `resume_from_checkpoint` (else config's) says; SIGINT
        and SIGTERM save a checkpoint and raise TrainingInterrupted. transformers' TrainOutput."""
        resume = self.config.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
        with lock.hold(self.plan.output_dir, self.dist), self.batches:  # a sampler process ends with it
            if self.step == 0:  # resumed, or a fresh run that must not append to earlier logs
                self.resume(resume)
            if self.dist.is_main:  # once it can train: a run that cannot has its error as its only line
                print(self.precision.statement, file=sys.stderr)
            self.report.begin({**asdict(self.config), "resume_from_checkpoint": resume})
            if self.plan.cadence.eval_on_start and self.step == 0:
                self.evaluate()
            with StopSignals() as signals, self.report.steps_bar(), self.trackers, \
                    self.session.saved_when_logs_fail(self.progress):
                while self.step < self.total_steps:
                    if self.after_step(signals, self.run_step(signals)):
                        break
            return self.report.output()  # then on_train_end

    def run_step(self, signals: StopSignals) -> dict:
        """One optimizer step: the batch of this step, then the update on its next micro-batches."""
        self.callbacks.on_step_begin()
        before, t0 = self.generation, time.perf_counter()
        with self.session.undone_on_failure(signals, self.progress()):  # saves the steps done if it fails
            generation = self.batches.take(self.step)
            if generation is not before:  # says once what fixes a run without signal
                zero_std = generation.metrics["frac_reward_zero_std"]
                self.no_signal.update(zero_std, show=self.dist.is_main)
            micro_batches = generation.micro_batches[self.schedule.micro_batches_of(self.step)]
            totals = self.accumulate(micro_batches)
        metrics = {**generation.metrics, **totals, **self.updates.apply(totals["loss"], self.step),
                   **self.entropy.update(totals["entropy"]), "step_time": time.perf_counter() - t0,
                   "memory/peak_gb": peak_memory_gb(self.policy.device)}
        self.step += 1
        return self.report.step({**metrics, "epoch": self.state.epoch})  # its loss counted

    def after_step(self, signals: StopSignals, metrics: dict) -> bool:
        """What the callbacks and the cadence ask after a step: log, evaluate, save; True: stop."""
        ended = self.schedule.ends_epoch(self.step, self.prompts.epoch_rows)
        due = self.plan.cadence.due(self.step, self.total_steps, ended)
        control = self.callbacks.on_step_end(*due)
        if control.should_log:  # with its batch's completions once, not per pass over it
            first = self.schedule.starts_generation(self.step - 1)
            self.report.log(metrics, self.generation.batch, first)
        self.updates.check(self.step, self.session.last_checkpoint)  # too many NaN/inf steps
        if control.should_evaluate:
            self.evaluate()
        if control.should_save or control.should_training_stop:  # a stop saves as the end does
            self.save(asked=control.should_save)
        self.session.stop_on_signal(signals.received, self.progress())  # saved first
        return control.should_training_stop

    def accumulate(self, micro_batches: list) -> dict:  # the step's gradients (policy/gradients)
        counts = self.generation.step_counts(micro_batches, self.dist.reduce)  # over all ranks
        return accumulate(self.policy, micro_batches, counts, self.entropy.loss(), self.dist.reduce,
                          step=self.step, show=self.dist.is_main)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Greedy pass@1 and TRL's eval_loss on `eval_dataset` (else the Trainer's; each of several) as a logged
        line, keys under `metric_key_prefix` (rollout/evaluate); `ignore_keys` (model outputs): none here."""
        lines = {}
        for suffix, dataset in eval_sets(self.eval_dataset if eval_dataset is None else eval_dataset).items():
            with decoding_allocations(self.threshold_set):
                metrics, _ = evaluate(self.model, self.tokenizer, dataset, self.reward_funcs, self.plan.evaluation,
                                      batch_size=self.plan.decode.evaluation, progress=self.dist.is_main,
                                      trainer_state=self.state, unsharded=self.policy.parallel.unsharded,
                                      encode=self.encode, loss_of=partial(eval_loss, self.policy, self.entropy.loss()),
                                      key_prefix=metric_key_prefix + suffix)
            lines.update(self.report.evaluation(metrics, metric_key_prefix + suffix))
        return lines

    def progress(self) -> Progress:
        return Progress(self.step, self.updates.nonfinite)

    def save(self, asked: bool = False) -> Path | None:  # checkpoint-STEP; "no": only if `asked`
        return self.session.save(self.progress(), asked)

    def resume(self, spec: str | bool | None) -> None:  # as resume_from_checkpoint says
        resumed = self.session.resume(spec, logged=bool(self.state.log_history))  # evaluate() came first
        if resumed is not None:
            self.step, self.updates.nonfinite = resumed.step, resumed.nonfinite
            self.state.log_history = logged_lines(self.plan.output_dir, self.step)  # as transformers
