"""`Trainer`: the GRPO loop. `generate` and `accumulate` read as the algorithm, one line per stage, each
stage implemented in the module named beside it; this file only orchestrates."""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .algo.advantages import group_advantages
from .algo.loss import add_metrics, no_token_metrics, policy_loss, zero_advantage_has_no_gradient
from .memory.fit import eval_batch_size, sampling_prompts_per_decode
from .policy.forwards import Policy
from .policy.models import device_of, load_model, prepare_for_training
from .policy.optim import Updates
from .policy.precision import Precision
from .rollout.batches import Cut, Generation, MicroBatch, generation_metrics, with_advantages
from .rollout.custom import CustomRollouts
from .rollout.dynamic import DynamicSampling
from .rollout.evaluate import eval_options, evaluate
from .rollout.prompts import PromptStream, check_chat_template
from .rollout.reward_models import place_reward_models, reward_callables
from .rollout.rewards import NoSignalWatch, RewardContext, TrainerState, reward_func_names
from .rollout.sampling import Sampler
from .rollout.server import server_sampler
from .rollout.source import RolloutSource
from .rollout.tools import Tools
from .run import lock
from .run.ahead import Ahead, Worker, check_async
from .infra.allocator import decoding_allocations, return_freed_memory
from .infra.distributed import setup as setup_distributed
from .infra.interrupts import StopSignals
from .infra.progress import progress_bar
from .run.logs import logged_lines, peak_memory_gb
from .run.callbacks import Callbacks
from .run.report import Report, TrainOutput
from .run.session import Progress, Session
from .run.startup import check_before_loading
from .run.trackers import Trackers
from .settings import Config
from .settings.plan import RunPlan
from .trl_call import default_tokenizer, trl_call


class Trainer:
    """GRPO on `model` (or `config.model`), rewarded by `reward_funcs`, over `train_dataset` prompts. TRL's
    GRPOTrainer call works as well (trl_call.py): `args=` is `config`, `processing_class=` is `tokenizer`, and
    `model` may be a hub id or folder. `sampler` replaces our decoder, with rollout/sampling.Sampler's contract:
    `sampler(prompts, on_token, streams) -> (rollout, fields)`."""

    def __init__(self, config: Config | None = None, model=None, tokenizer=None, reward_funcs=(),
                 train_dataset=None, eval_dataset=None, rollout_func=None, reward_processing_classes=None, *,
                 args: Config | None = None, processing_class=None, callbacks=None, sampler=None, tools=None,
                 environment_factory=None, **trl_only):
        config, model, tokenizer = trl_call(config, args, model, tokenizer, processing_class, trl_only,  # trl_call
                                            (sampler, rollout_func, tools or environment_factory))
        self.tools = Tools.of(tools, environment_factory) if tools or environment_factory else None  # rollout/tools
        self.dist = setup_distributed()  # world size 1 without torchrun
        # Config(...) resolved it for torchrun's ranks; again for the group's before loading (and a Config changed).
        self.plan = RunPlan.resolve(config, self.dist.world_size)                             # settings/plan
        self.schedule = self.plan.schedule
        self.config, self.eval_dataset = config, eval_dataset
        self.reward_funcs = reward_callables(reward_funcs, reward_processing_classes, config.chat_template_kwargs)
        self.reward_names = reward_func_names(self.reward_funcs)
        check_before_loading(config, self.dist, train_dataset, eval_dataset, self.reward_funcs,     # run/startup
                             model_given=model is not None)
        self.trackers = Trackers(config, self.dist.is_main)  # report_to: a missing package fails here, early
        torch.manual_seed(config.seed + self.dist.rank)  # dropout differs by rank; sampling: rollout/streams
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer(config, model)
        check_chat_template(self.tokenizer, {"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        self.precision = Precision.plan(config.bf16, config.use_lora, device_of(model) if model is not None else None,
                                        config.bf16_weights)
        self.model = prepare_for_training(model if model is not None else load_model(config, self.precision), config,
                                          self.dist.world_size)
        self.policy = Policy(self.model, config, self.dist.world_size, self.precision, is_main=self.dist.is_main)
        # On a CPU freed activations and logits go back to the OS (infra/allocator), decodes aside.
        self.threshold_set = self.policy.device.type == "cpu" and return_freed_memory()
        place_reward_models(self.reward_funcs, self.policy.device)  # reward models next to the policy
        if self.plan.server is not None:  # use_vllm: a vLLM server samples with the run's adapter  rollout/server
            sampler = server_sampler(sampler or rollout_func, self.model, self.tokenizer, self.plan, self.tools,
                                     Path(config.output_dir) / "vllm-adapters")
        if sampler is None:  # our decoder, as many prompts per decode as fit (memory/), or TRL's rollout_func
            sampler = Sampler(self.policy, self.tokenizer, self.plan.sampling,
                              sampling_prompts_per_decode(config, self.model, self.policy.device.type), self.tools) \
                if rollout_func is None else CustomRollouts(rollout_func, self)
        self.sampler = sampler
        if config.async_generation:
            check_async(self.policy.device, custom_sampler=not isinstance(sampler, Sampler))    # run/ahead
        self.prompts = PromptStream(train_dataset, config.seed if config.data_seed is None else config.data_seed,
                                    shuffle=config.shuffle_dataset)
        self.source = RolloutSource(sampler, self.prompts, self.reward_funcs, config.reward_weights,  # rollout/source
                                    dist=self.dist, seed=config.seed, num_generations=config.num_generations,
                                    release_memory=self.threshold_set, environment_factory=environment_factory)
        self.total_steps = self.schedule.total_steps(len(train_dataset), config.num_train_epochs, config.max_steps)
        self.updates = Updates(self.model.parameters(), self.plan.optim, self.total_steps)  # policy/optim
        self.optimizer, self.scheduler = self.updates.optimizer, self.updates.scheduler  # transformers' names
        self.refill = DynamicSampling(config.num_generations, config.dynamic_sampling_max_rounds, self.dist,
                                      self.tokenizer.pad_token_id) if config.dynamic_sampling else None
        # Rows whose advantage is exactly 0 are left out of the forward when their gradient is 0 (algo/loss).
        self.cut = Cut(self.schedule.micro_batch, keep_one=self.dist.world_size > 1, skip_zero_advantage=
                       zero_advantage_has_no_gradient(config.beta, config.top_entropy_quantile, config.entropy_coef))
        self.state = TrainerState(max_steps=self.total_steps, is_world_process_zero=self.dist.is_main,
                                  is_local_process_zero=self.dist.local_rank == 0)  # `step` is its global_step
        self.callbacks = Callbacks(callbacks, config, self.state, self.model, self.tokenizer, self.optimizer,
                                   self.scheduler)                                              # run/callbacks
        self.output_dir = Path(config.output_dir)
        self.report = Report(self.output_dir, self.dist, self.trackers, self.state, self.callbacks,  # run/report
                             self.reward_names, self.schedule.global_batch)
        self.generation: Generation | None = None
        self.no_signal = NoSignalWatch(patience=3)  # steps in a row where every group's rewards were equal
        # async_generation: a forked sampler makes the next generation batch while this one trains (run/ahead).
        self.ahead = Ahead(self._start_sampler, self.prompts, self.schedule, self.total_steps, config.max_staleness) \
            if config.async_generation else None
        self.session = Session(self.output_dir, self.dist, self.policy, self.tokenizer, self.updates, self.prompts,
                               self.schedule, config, self.total_steps, on_save=self.callbacks.on_save,  # run/session
                               sampled_ahead=self.ahead.for_checkpoint if self.ahead else lambda step: None)

    # --- TRL's names for what a caller reads ---
    @property
    def args(self) -> Config:
        return self.config

    @property
    def step(self) -> int:
        """Optimizer steps done: `state.global_step` (and `state.epoch` follows it)."""
        return self.state.global_step

    @step.setter
    def step(self, step: int) -> None:
        self.state.global_step, self.state.epoch = step, self.schedule.epoch(step, len(self.prompts.dataset))

    def save_model(self, output_dir: str | None = None) -> None:
        """transformers' Trainer.save_model: the model (under LoRA its adapter, in peft's format) and
        tokenizer written into `output_dir` (default: config.output_dir) for from_pretrained; no optimizer
        state (a checkpoint holds that). Under torchrun every rank calls it and rank 0 writes."""
        self.session.save_model(Path(output_dir if output_dir is not None else self.config.output_dir))

    # --- the loop ---
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run to `total_steps`, first resuming `resume_from_checkpoint` (transformers' argument, in place of
        config.resume_from_checkpoint) when set; returns transformers' TrainOutput (run/report.py), the logged
        lines being in `state.log_history`. On SIGINT/SIGTERM it saves a checkpoint and raises TrainingInterrupted,
        a KeyboardInterrupt. Holds output_dir for the whole run: another run already in it is a ConfigError."""
        resume = self.config.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
        with lock.hold(self.output_dir, self.dist), self.ahead or contextlib.nullcontext():  # run/lock, run/ahead
            if self.step == 0:  # resumed, or a fresh run that must not append to an earlier one's logs
                self.resume(resume)
            self.report.begin({**asdict(self.config), "resume_from_checkpoint": resume})  # on_train_begin  run/report
            if self.config.eval_on_start and self.step == 0:
                self.evaluate()
            with StopSignals() as signals, self.report.steps_bar(), self.trackers:
                while self.step < self.total_steps:
                    self.callbacks.on_step_begin()
                    metrics = self.report.step(self.run_step(signals))  # its loss counted, the bar advanced
                    control = self.callbacks.on_step_end(*self.plan.cadence.due(  # the callbacks after  settings/plan
                        self.step, self.total_steps, self.schedule.ends_epoch(self.step, len(self.prompts.dataset))))
                    if control.should_log:  # with its batch's completions once, not per pass over it
                        self.report.log(metrics, self.generation.scored, self.schedule.starts_generation(self.step - 1))
                    self.updates.check(self.step, self.session.last_checkpoint)  # too many NaN/inf steps in a row
                    if control.should_evaluate:
                        self.evaluate()
                    if control.should_save or control.should_training_stop:  # a stop saves as the end does
                        self.save(asked=control.should_save)
                    self.session.stop_on_signal(signals.received, self.progress())  # saved first   run/session
                    if control.should_training_stop:
                        break
            return self.report.output()  # then on_train_end

    def run_step(self, signals: StopSignals) -> dict:
        """One optimizer step on the next gradient_accumulation_steps micro-batches of the generation batch,
        sampling a new one when the schedule says (settings/schedule.py)."""
        start, t0 = self.progress(), time.perf_counter()
        try:
            with self.session.undone_on_failure(signals, start):  # saves `start` if the step fails  run/session
                if self.schedule.starts_generation(self.step) or self.generation is None:  # None: resumed elastically
                    self.generation = self.generate() if self.ahead is None else self.taken_ahead()
                if self.ahead is not None:
                    self.ahead.ask_ahead(self.step)  # sampled while this step trains
                totals = self.accumulate(self.generation.micro_batches[self.schedule.micro_batches_of(self.step)])
        except BaseException:  # TrainingInterrupted too, a KeyboardInterrupt
            self.generation = start.generation
            raise
        metrics = {**self.generation.metrics, **totals, **self.updates.apply(totals["loss"], self.step),
                   "step_time": time.perf_counter() - t0, "memory/peak_gb": peak_memory_gb(self.policy.device)}
        self.step += 1
        return {**metrics, "epoch": self.state.epoch}  # transformers logs the epoch on every line

    @torch.no_grad()
    def generate(self) -> Generation:
        """Sample a generation batch, score it, give it advantages and cut it into micro-batches, with the
        log-probs fixed for the whole of it."""
        context = RewardContext(self.state)  # TRL's trainer_state, log_metric, log_extra
        rollout, scored, seconds = self.source.draw(self.schedule.prompts_per_generation, self.step, context)
        self.check_head(rollout)
        refilled = {}
        if self.refill is not None:  # DAPO: only groups with signal, while rounds are left        rollout/dynamic
            rollout, scored, refilled, seconds = self.refill(rollout, scored, context, seconds,
                                                             lambda n: self.source.draw(n, self.step, context))
        generate_s = self.dist.reduce({"s": seconds}, "max")["s"]  # the slowest rank's
        scored = scored.gathered(self.dist)  # every rank's rewards: advantages may span ranks  rollout/batches
        scored.advantages = group_advantages(scored.rewards, self.config.num_generations,  # algo/advantages
                                             scale=self.config.scale_rewards, scored=scored.applied)
        batch = with_advantages(rollout, self.dist.local(scored.advantages),                 # rollout/batches
                                self.config.mask_truncated_completions)
        metrics = {**generation_metrics(batch, scored, context, generate_s, self.reward_names,  # rollout/batches
                                        self.config.num_generations, self.dist), **refilled}
        self.no_signal.update(metrics["frac_reward_zero_std"], show=self.dist.is_main)  # says once what fixes it
        generation = Generation(batch, self.cut, metrics, scored)  # cut into micro-batches          rollout/batches
        generation.fix_logprobs(lambda micro: self.policy.fixed_logprobs(                       # policy/forwards
            micro, old=self.plan.keeps_old_logprobs, reference=self.plan.has_reference))
        if self.plan.sampling_correction is not None:  # a server's samples reweighted        rollout/server
            generation.metrics.update(self.sampler.corrected(generation, self.plan.sampling_correction))
        return generation

    def check_head(self, rollout) -> None:
        """On the first generation batch: our log-probs vs the model's own forward, ranks agreeing (policy)."""
        first = torch.arange(min(self.schedule.micro_batch, len(rollout.completions)))  # a micro-batch's rows
        self.policy.check_head_once(rollout.select(first),
                                    agree=lambda value: self.dist.reduce({"value": value}, "max")["value"])

    def taken_ahead(self) -> Generation:
        """This step's batch from the sampler process (run/ahead), once the trainer's own policy checked its head."""
        generation = self.ahead.take(self.step)
        self.check_head(generation.batch)
        return generation

    def _start_sampler(self) -> Worker:
        """The sampler process: a fork of this trainer that runs `generate` at the step each request names."""
        def generate_at(step: int) -> Generation:
            self.step, self.source.show_progress = step, False
            return self.generate()
        return Worker(generate_at, [p for p in self.model.parameters() if p.requires_grad], self.prompts,
                      self.policy.device, release=self.optimizer.state.clear)

    def accumulate(self, micro_batches: list[MicroBatch]) -> dict:
        """Back-propagate the loss of every micro-batch, each normalized as `loss_type` says with the step's
        counts over all ranks (so the ranks' summed gradients are those of the step's loss); returns metrics.
        Rows whose gradient is exactly 0 are left out (rollout/batches.Rollout.micro_batches), but not from the
        counts."""
        counts = self.generation.step_counts(micro_batches, self.dist.reduce)  # over all ranks  rollout/batches
        totals: dict[str, float] = {"kl": 0.0, "loss": 0.0}  # kl: logged as 0 when there is no reference
        trained = [m for m in micro_batches if not m.empty]  # one process: no forward where no row is left
        with progress_bar(f"training step {self.step + 1}", total=len(trained), unit="micro-batch",
                          enabled=self.dist.is_main, leave=False) as bar:  # the step's second half  infra/progress
            for i, m in enumerate(trained):
                b = m.rollout
                with self.policy.parallel.sync_gradients(i == len(trained) - 1):
                    logprobs, entropies = self.policy.logprobs(b, with_entropy=True)  # [n, C] each      policy
                    old_logprobs = b.old_logprobs if b.old_logprobs is not None else logprobs.detach()
                    loss, metrics = policy_loss(                                                   # algo/loss
                        logprobs, old_logprobs, b.ref_logprobs, b.advantages, b.loss_mask, entropies=entropies,
                        **self.plan.loss, num_tokens=counts.divisor, num_sequences=m.rows,
                        micro_batch_tokens=m.tokens, num_micro_batches=counts.micro_batches,
                        sampling_weights=b.sampling_weights)
                    self.policy.parallel.backward(loss)
                add_metrics(totals, metrics, share=m.trained_tokens / max(1, counts.trained))  # rows trained  algo/loss
                totals["loss"] += loss.item()
                bar.update(1)
        # Per-token metrics (entropy, ratio, clip ratios) are the rows trained's; 0 where no row was trained.
        totals = {**no_token_metrics(**self.plan.loss), **self.dist.reduce(totals)}  # algo/loss
        return {**totals, "skipped/zero_gradient": counts.skipped / counts.rows}

    def evaluate(self) -> dict:
        """Greedy pass@1 on the eval dataset, logged as its own metrics.jsonl line (rollout/evaluate.py's keys). Under
        torchrun every rank evaluates the whole set (FSDP ranks must generate together) and rank 0 writes."""
        batch_size = eval_batch_size(self.config, self.model, self.policy.device.type)  # memory/fit
        with decoding_allocations(self.threshold_set):
            metrics, _ = evaluate(self.model, self.tokenizer, self.eval_dataset, self.reward_funcs,
                                  **eval_options(self.config, batch_size), progress=self.dist.is_main,
                                  unsharded=self.policy.parallel.unsharded, tools=self.tools)
        return self.report.evaluation(metrics)                                                 # run/report

    # --- checkpoints: what they hold, writing and finding them (run/session.py, run/checkpoint.py) ---
    def progress(self) -> Progress:
        return Progress(self.step, self.generation, self.updates.nonfinite)

    def save(self, asked: bool = False) -> Path | None:
        """Write checkpoint-STEP once per step (under save_strategy="no" only if `asked`: a callback's should_save),
        then on_save; returns its path or None. Under torchrun every rank calls it; rank 0 writes, the others wait."""
        return self.session.save(self.progress(), asked)

    def resume(self, spec: str | bool | None) -> None:
        """Start as resume_from_checkpoint `spec` says: from a checkpoint folder, "latest" or True, or fresh
        (None or False) in an output_dir no earlier run wrote in (run/session.Session.resume)."""
        resumed = self.session.resume(spec)
        if resumed is not None:
            self.step, self.generation, self.updates.nonfinite = resumed.step, resumed.generation, resumed.nonfinite
            if self.ahead is not None:
                self.ahead.restore(resumed.ahead)
            self.state.log_history = logged_lines(self.output_dir, self.step)  # transformers restores it too
