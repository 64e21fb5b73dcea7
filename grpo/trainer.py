"""`Trainer`: the GRPO loop. Each step takes the batch of that step from the generation pipeline
(rollout/pipeline: made now, or ahead by a sampler process, run/ahead) and updates the policy on it
(policy/gradients, policy/optim); run/ logs and saves."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from .infra.allocator import decoding_allocations, return_freed_memory
from .infra.distributed import setup as setup_distributed
from .infra.interrupts import StopSignals
from .policy.forwards import Policy
from .policy.gradients import accumulate
from .policy.models import load_model, prepare_for_training
from .policy.optim import Updates
from .rollout.evaluate import evaluate
from .rollout.pipeline import Pipeline, Synchronous, engine
from .rollout.prompts import PromptStream, check_chat_template
from .rollout.reward_models import place_reward_models, reward_callables
from .rollout.tools import Tools
from .run import lock
from .run.ahead import Ahead
from .run.callbacks import Callbacks
from .run.logs import logged_lines, peak_memory_gb
from .run.report import Report, TrainOutput
from .run.session import Progress, Session
from .run.startup import check_before_loading, prepare
from .run.state import NoSignalWatch, TrainerState
from .run.trackers import Trackers
from .settings import Config
from .trl_call import default_tokenizer, trl_call


class Trainer:
    """GRPO on `model` (or `config.model`), rewarded by `reward_funcs`, over `train_dataset` prompts; TRL's
    GRPOTrainer call works too (trl_call.py). `sampler` replaces our decoder, with rollout/sampling.Sampler's
    contract: `sampler(prompts, on_token, streams) -> (rollout, fields)`."""

    def __init__(self, config: Config | None = None, model=None, tokenizer=None, reward_funcs=(),
                 train_dataset=None, eval_dataset=None, rollout_func=None, reward_processing_classes=None,
                 *, args: Config | None = None, processing_class=None, callbacks=None, sampler=None,
                 tools=None, environment_factory=None, **trl_only):
        config, model, tokenizer = trl_call(config, args, model, tokenizer, processing_class, trl_only,
                                            (sampler, rollout_func, tools or environment_factory))
        self.config, self.eval_dataset = config, eval_dataset
        self.tools = Tools.of(tools, environment_factory) if tools or environment_factory else None
        self._setup_plan(config, model, reward_funcs, reward_processing_classes, train_dataset,
                         eval_dataset, own_sampler=sampler is None and rollout_func is None)
        self._setup_policy(config, model, tokenizer, train_dataset, eval_dataset)
        self._setup_generation(config, sampler, rollout_func, train_dataset)
        self._setup_run(config, callbacks)

    def _setup_plan(self, config, model, reward_funcs, reward_processing_classes, train_dataset,
                    eval_dataset, own_sampler: bool) -> None:
        """All decided and checked before a model loads (run/startup): plan, precision, rewards."""
        self.dist = setup_distributed()  # world size 1 without torchrun
        self.reward_funcs = reward_callables(reward_funcs, reward_processing_classes, config.chat_template_kwargs)
        check_before_loading(config, self.dist, train_dataset, eval_dataset, self.reward_funcs,
                             model_given=model is not None, columns_known=own_sampler)
        self.plan, self.precision = prepare(config, self.dist.world_size, len(train_dataset), model, own_sampler)
        self.schedule, self.total_steps = self.plan.schedule, self.plan.total_steps
        self.trackers = Trackers(self.plan.trackers, self.dist.is_main)  # a missing package fails here
        torch.manual_seed(config.seed + self.dist.rank)  # dropout differs by rank; sampling: streams

    def _setup_policy(self, config, model, tokenizer, train_dataset, eval_dataset) -> None:
        """The tokenizer, the model prepared for training, the policy that forwards it, its updates."""
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer(config, model)
        check_chat_template(self.tokenizer, {"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        model = model if model is not None else load_model(config, self.precision)
        self.model = prepare_for_training(model, config, self.dist.world_size)
        self.policy = Policy(self.model, self.plan.logprobs, self.dist.world_size, self.precision,
                             is_main=self.dist.is_main)
        self.threshold_set = self.policy.device.type == "cpu" and return_freed_memory()  # infra/allocator
        place_reward_models(self.reward_funcs, self.policy.device)  # next to the policy
        self.updates = Updates(self.model.parameters(), self.plan.optim, self.total_steps)
        self.optimizer, self.scheduler = self.updates.optimizer, self.updates.scheduler  # TRL's names

    def _setup_generation(self, config, sampler, rollout_func, train_dataset):
        """The generation pipeline and the batches it makes, now (synchronous) or ahead (run/ahead)."""
        self.state = TrainerState.of(self.total_steps, self.dist)  # its global_step is `step`
        self.no_signal = NoSignalWatch(patience=3)  # steps in a row where every group's rewards were equal
        sampler = engine(sampler, rollout_func, self)  # ours, a vLLM server, a rollout_func or the caller's
        s = self.plan.generation
        self.sampler, self.prompts = sampler, PromptStream(train_dataset, s.data_seed, shuffle=s.shuffle_dataset)
        self.pipeline = Pipeline.build(sampler, self.prompts, self.reward_funcs, self.policy, self.dist, s,
                                       self.plan.loss, pad_id=self.tokenizer.pad_token_id,
                                       release_memory=self.threshold_set, tools=self.tools)
        self.batches = Synchronous(self.pipeline, self.schedule, self.state) if s.max_staleness is None else \
            Ahead(self.pipeline, self.state, self.schedule, self.total_steps, s.max_staleness,
                  release=self.optimizer.state.clear)

    def _setup_run(self, config, callbacks) -> None:  # callbacks, what is logged, checkpoints (run/)
        self.callbacks = Callbacks(callbacks, config, self.state, self.model, self.tokenizer, self.optimizer,
                                   self.scheduler)
        self.output_dir = Path(config.output_dir)
        self.report = Report(self.output_dir, self.dist, self.trackers, self.state, self.callbacks,
                             self.pipeline.reward_names, self.schedule.global_batch)
        self.session = Session(self.output_dir, self.dist, self.policy, self.tokenizer, self.updates,
                               self.prompts, self.schedule, self.plan.session, self.total_steps,
                               on_save=self.callbacks.on_save, sampled_ahead=self.batches.for_checkpoint)

    @property
    def args(self) -> Config:  # TRL's name
        return self.config

    @property
    def step(self) -> int:  # optimizer steps done: state.global_step, which state.epoch follows
        return self.state.global_step

    @step.setter
    def step(self, step: int) -> None:
        self.state.global_step, self.state.epoch = step, self.schedule.epoch(step, len(self.prompts.dataset))

    @property
    def generation(self):  # the generation batch in training (rollout/batches), None before the first
        return self.batches.current

    def save_model(self, output_dir: str | None = None) -> None:  # transformers': no optimizer state
        self.session.save_model(Path(output_dir if output_dir is not None else self.config.output_dir))

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run to `total_steps`, resumed from `resume_from_checkpoint` (else config's) when set; SIGINT
        and SIGTERM save a checkpoint and raise TrainingInterrupted. Returns transformers' TrainOutput."""
        resume = resume_from_checkpoint
        resume = self.config.resume_from_checkpoint if resume is None else resume
        with lock.hold(self.output_dir, self.dist), self.batches:  # a sampler process ends with it
            if self.step == 0:  # resumed, or a fresh run that must not append to an earlier one's logs
                self.resume(resume)
            self.report.begin({**asdict(self.config), "resume_from_checkpoint": resume})
            if self.config.eval_on_start and self.step == 0:
                self.evaluate()
            with StopSignals() as signals, self.report.steps_bar(), self.trackers:
                while self.step < self.total_steps and not self.after_step(signals, self.run_step(signals)):
                    pass
            return self.report.output()  # then on_train_end

    def run_step(self, signals: StopSignals) -> dict:
        """One optimizer step: the batch of this step, then the update on its next micro-batches."""
        self.callbacks.on_step_begin()
        start, t0 = self.progress(), time.perf_counter()
        try:
            with self.session.undone_on_failure(signals, start):  # saves `start` if the step fails
                generation = self.batches.take(self.step)
                if generation is not start.generation:  # says once what fixes a run without signal
                    self.no_signal.update(generation.metrics["frac_reward_zero_std"], show=self.dist.is_main)
                totals = self.accumulate(generation.micro_batches[self.schedule.micro_batches_of(self.step)])
        except BaseException:  # TrainingInterrupted too, a KeyboardInterrupt
            self.batches.current = start.generation
            raise
        metrics = {**generation.metrics, **totals, **self.updates.apply(totals["loss"], self.step),
                   "step_time": time.perf_counter() - t0, "memory/peak_gb": peak_memory_gb(self.policy.device)}
        self.step += 1
        return self.report.step({**metrics, "epoch": self.state.epoch})  # its loss counted, the bar on

    def after_step(self, signals: StopSignals, metrics: dict) -> bool:
        """What the callbacks and the cadence ask once a step is done: log, evaluate, save; True to stop."""
        ended = self.schedule.ends_epoch(self.step, len(self.prompts.dataset))
        control = self.callbacks.on_step_end(*self.plan.cadence.due(self.step, self.total_steps, ended))
        if control.should_log:  # with its batch's completions once, not per pass over it
            self.report.log(metrics, self.generation.batch, self.schedule.starts_generation(self.step - 1))
        self.updates.check(self.step, self.session.last_checkpoint)  # too many NaN/inf steps in a row
        if control.should_evaluate:
            self.evaluate()
        if control.should_save or control.should_training_stop:  # a stop saves as the end does
            self.save(asked=control.should_save)
        self.session.stop_on_signal(signals.received, self.progress())  # saved first
        return control.should_training_stop

    def accumulate(self, micro_batches: list) -> dict:  # the step's gradients on them (policy/gradients)
        counts = self.generation.step_counts(micro_batches, self.dist.reduce)  # over all ranks
        return accumulate(self.policy, micro_batches, counts, self.plan.loss, self.dist.reduce, step=self.step,
                          show=self.dist.is_main)

    def evaluate(self) -> dict:
        """Greedy pass@1 on the eval dataset (rollout/evaluate), logged as its own metrics.jsonl line."""
        with decoding_allocations(self.threshold_set):
            metrics, _ = evaluate(self.model, self.tokenizer, self.eval_dataset, self.reward_funcs,
                                  self.plan.evaluation, batch_size=self.plan.decode.evaluation,
                                  progress=self.dist.is_main, unsharded=self.policy.parallel.unsharded,
                                  tools=self.tools, trainer_state=self.state)
        return self.report.evaluation(metrics)

    def progress(self) -> Progress:
        return Progress(self.step, self.generation, self.updates.nonfinite)

    def save(self, asked: bool = False) -> Path | None:  # checkpoint-STEP once; "no": only if `asked`
        return self.session.save(self.progress(), asked)

    def resume(self, spec: str | bool | None) -> None:  # as resume_from_checkpoint says (run/session)
        resumed = self.session.resume(spec)
        if resumed is not None:
            self.step, self.updates.nonfinite = resumed.step, resumed.nonfinite
            self.batches.restore(resumed.generation, resumed.ahead)
            self.state.log_history = logged_lines(self.output_dir, self.step)  # as transformers does
