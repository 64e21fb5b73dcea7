"""`Trainer`: the GRPO loop. `generate` and `accumulate` read as the algorithm, one line per stage, each
stage implemented in the module named beside it; this file only orchestrates."""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .algo.advantages import group_advantages, has_signal, zero_std_fraction
from .algo.loss import add_metrics, no_token_metrics, policy_loss, zero_advantage_has_no_gradient
from .settings import Config
from .errors import ConfigError, nonfinite_stop
from .memory.fit import eval_batch_size, sampling_prompts_per_decode
from .policy.forwards import Policy
from .policy.models import check_load_options, device_of, load_model, load_tokenizer, prepare_for_training
from .policy.optim import (build_optimizer, build_scheduler, optimizer_step, rescheduled, set_hyperparameters,
                           warmup_of)
from .policy.parallel import check_settings as check_parallel_settings
from .policy.precision import Precision
from .rollout.batches import (Batch, Generation, Scored, concat, generation_from_dict, length_metrics, loss_batches,
                              regroup, rollout_rows)
from .rollout.custom import CustomRollouts
from .rollout.evaluate import check_eval_setup, eval_options, evaluate
from .rollout.progress import TokenProgress, progress_bar, quiet_library_bars
from .rollout.prompts import PromptStream, check_dataset, per_completion
from .rollout.reward_models import place_reward_models, reward_callables
from .rollout.rewards import (NoSignalWatch, RewardContext, TrainerState, check_reward_weights,
                              compute_rewards, reward_func_names, reward_metrics)
from .rollout.sampling import Rollout, Sampler
from .rollout.streams import PromptStreams
from .run import checkpoint, elastic, lock
from .run.allocator import decoding_allocations, return_freed_memory
from .run.distributed import setup as setup_distributed
from .run.interrupts import StepAbandoned, StopSignals, TrainingInterrupted
from .run.logs import log_completions, log_eval, log_metrics, peak_memory_gb
from .run.trackers import Trackers
from .settings.schedule import Schedule
from .settings.trl_names import TRAINER_ONLY


class Trainer:
    """GRPO on `model` (or `config.model`), rewarded by `reward_funcs`, over `train_dataset` prompts. TRL's
    GRPOTrainer call works as well: `args=` is `config`, `processing_class=` is `tokenizer`, and `model` may
    be a hub id or folder (then it is `config.model`); a model object comes with its tokenizer, or one is
    loaded from the folder or hub id its config names, as TRL does."""

    def __init__(self, config: Config | None = None, model=None, tokenizer=None, reward_funcs=(),
                 train_dataset=None, eval_dataset=None, rollout_func=None, reward_processing_classes=None, *,
                 args: Config | None = None, processing_class=None, **trl_only):
        config, model, tokenizer = _trl_call(config, args, model, tokenizer, processing_class, trl_only)
        check_dataset(train_dataset)
        self.config = config
        self.reward_funcs = reward_callables(reward_funcs, reward_processing_classes, config.chat_template_kwargs)
        self.reward_names = reward_func_names(self.reward_funcs)
        check_reward_weights(config.reward_weights, self.reward_names)
        self.eval_dataset = eval_dataset
        check_eval_setup(config, eval_dataset, self.reward_funcs)
        check_load_options(config, model_given=model is not None)
        checkpoint.check_output_dir(config.output_dir)
        self.dist = setup_distributed()  # world size 1 without torchrun
        lock.check_free(config.output_dir, self.dist)  # before loading anything; taken when training starts
        self.trackers = Trackers(config, self.dist.is_main)  # report_to: a missing package fails here, early
        check_parallel_settings(self.dist.world_size, config.fsdp, config.optim, config.use_lora)
        torch.manual_seed(config.seed + self.dist.rank)  # ranks sample differently; wrapping syncs the weights
        self.tokenizer = tokenizer if tokenizer is not None else _default_tokenizer(config, model)
        self.precision = Precision.plan(config.bf16, config.use_lora, device_of(model) if model is not None else None,
                                        config.bf16_weights)
        self.model = prepare_for_training(model if model is not None else load_model(config, self.precision), config,
                                          self.dist.world_size)
        self.policy = Policy(self.model, config, self.dist.world_size, self.precision)
        # On a CPU freed activations and logits go back to the OS (run/allocator), decodes aside.
        self.threshold_set = self.policy.device.type == "cpu" and return_freed_memory()
        place_reward_models(self.reward_funcs, self.policy.device)  # reward models next to the policy
        self.sampler = Sampler(self.policy, self.tokenizer, config,  # as many prompts per decode as fit (memory/)
                               sampling_prompts_per_decode(config, self.model, self.policy.device.type)) \
            if rollout_func is None else CustomRollouts(rollout_func, self)
        self.prompts = PromptStream(train_dataset, config.seed)
        self.schedule = Schedule.resolve(config, self.dist.world_size)
        self.total_steps = self.schedule.total_steps(len(train_dataset), config.num_train_epochs, config.max_steps)
        self.loss_settings = config.loss_settings()
        self.skip_zero_advantage = zero_advantage_has_no_gradient(config.beta, config.top_entropy_quantile,
                                                                  config.entropy_coef)
        self.optimizer = build_optimizer(self.model.parameters(), config.optim, config.learning_rate,
                                         (config.adam_beta1, config.adam_beta2), config.weight_decay)
        self.warmup_steps = warmup_of(self.total_steps, config.warmup_ratio, config.warmup_steps)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, self.warmup_steps,
                                         config.lr_scheduler_type)
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self.generation: Generation | None = None
        self.nonfinite_streak = self.nonfinite_total = 0  # optimizer steps skipped for a NaN/inf loss or grad
        self.last_checkpoint, self.saved_step = None, None  # the newest checkpoint; its step (saving again: no-op)
        self.no_signal = NoSignalWatch(patience=3)  # steps in a row where every group's rewards were equal

    # --- TRL's names for what a caller reads ---
    @property
    def args(self) -> Config:
        return self.config

    @property
    def state(self) -> TrainerState:
        """transformers' `trainer.state`: `global_step` (optimizer steps done) and `max_steps`."""
        return TrainerState(self.step, self.total_steps)

    def save_model(self, output_dir: str | None = None) -> None:
        """transformers' Trainer.save_model: the model (under LoRA its adapter, in peft's format) and
        tokenizer written into `output_dir` (default: config.output_dir) for from_pretrained; no optimizer
        state (a checkpoint holds that). Under torchrun every rank calls it and rank 0 writes."""
        weights = self.policy.parallel.full_state_dict()  # FSDP: gathered
        if self.dist.is_main:
            path = Path(output_dir if output_dir is not None else self.config.output_dir)
            path.mkdir(parents=True, exist_ok=True)
            with quiet_library_bars():
                self.model.save_pretrained(path, safe_serialization=True, state_dict=weights)
            self.tokenizer.save_pretrained(path)
        self.dist.barrier()

    # --- the loop ---
    def train(self) -> list[dict]:
        """Run to `total_steps`, first resuming `config.resume_from_checkpoint` when set; returns the logged
        metrics lines. On SIGINT/SIGTERM it saves a checkpoint and raises TrainingInterrupted. Holds
        output_dir for the whole run: another run already in it is a ConfigError."""
        with lock.hold(self.output_dir, self.dist):                                          # run/lock
            return self._train()

    def _train(self) -> list[dict]:
        if self.step == 0 and self.config.resume_from_checkpoint:
            self.resume(self.config.resume_from_checkpoint)
        elif self.step == 0:  # a fresh run must not append to an earlier one's logs
            checkpoint.check_no_earlier_run(str(self.output_dir))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.trackers.start(asdict(self.config), self.step)
        history = []
        if self.config.eval_on_start and self.step == 0:
            history.append(self.evaluate())
        bar = progress_bar("grpo", total=self.total_steps, initial=self.step, unit="step",
                           enabled=self.dist.is_main)
        with StopSignals() as signals, bar, self.trackers:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                metrics = self.run_step(signals)
                metrics["perf/step_s"] = time.perf_counter() - t0
                metrics["memory/peak_gb"] = peak_memory_gb(self.policy.device)
                bar.update(1)
                reward = f"{metrics['reward/mean']:.3f}" if "reward/mean" in metrics else "none scored"
                bar.set_postfix(reward=reward, kl=f"{metrics['kl']:.4f}")
                if self.step % self.config.logging_steps == 0 or self.step == self.total_steps:
                    history.append(self.log(metrics))
                if self.nonfinite_streak >= self.config.max_nonfinite_steps:
                    raise nonfinite_stop(self.step, self.nonfinite_streak, self.config.max_nonfinite_steps,
                                         self.last_checkpoint)
                if self.config.eval_steps > 0 and (self.step % self.config.eval_steps == 0
                                                   or self.step == self.total_steps):
                    history.append(self.evaluate())
                if self.step % self.config.save_steps == 0 and self.step < self.total_steps:
                    self.save()
                received = self.dist.agree_on_signal(signals.received)  # every rank stops at the same step
                if received is not None:
                    raise TrainingInterrupted(received, self.step, self._save_if_trained())
            self.save()
        return history

    def run_step(self, signals: StopSignals) -> dict:
        """One optimizer step on the next gradient_accumulation_steps micro-batches of the generation batch,
        sampling a new one when the schedule says (settings/schedule.py)."""
        with self._undone_on_failure(signals):
            if self.schedule.starts_generation(self.step) or self.generation is None:  # None: resumed elastically
                self.generation = self.generate()
            totals = self.accumulate(self.generation.batches[self.schedule.micro_batches_of(self.step)])
        metrics = {**self.generation.metrics, **self.apply_update(totals)}
        self.step += 1
        return metrics

    @torch.no_grad()
    def generate(self) -> Generation:
        """Sample a generation batch, score it, and cut it into micro-batches with what the loss needs."""
        context = RewardContext(self.step, self.total_steps)  # TRL's trainer_state, log_metric, log_extra
        rollouts, scored, seconds = self.sample(self.schedule.prompts_per_generation, context)
        self.policy.check_head_once(rollouts[0], agree=self.largest)  # first step: vs the model's own forward
        refill = {}
        if self.config.dynamic_sampling:  # DAPO: only groups with signal, while rounds are left
            rollouts, scored, refill, more_seconds = self.fill_with_signal(rollouts, scored, context)
            seconds += more_seconds
        generate_s = self.dist.reduce({"s": seconds}, "max")["s"]  # the slowest rank's
        # Every rank's rewards [W*N] and per function [W*N, F], rank-major: advantages may span ranks (scale).
        scored = replace(scored, rewards=self.dist.gather(scored.rewards), per_func=self.dist.gather(scored.per_func))
        scored.advantages = group_advantages(scored.rewards, self.config.num_generations,  # algo/advantages
                                             scale=self.config.scale_rewards, scored=scored.applied)
        rollouts = regroup(rollouts, self.schedule.micro_batch, self.tokenizer.pad_token_id)  # rollout/batches
        batches = self.micro_batches(rollouts, self.dist.local(scored.advantages))        # rollout/batches
        metrics = {**self.generation_metrics(rollouts, scored, context, generate_s), **refill}
        return Generation(batches, metrics, scored)

    def sample(self, num_prompts: int, context: RewardContext) -> tuple[list[Rollout], Scored, float]:
        """`num_prompts` new prompts over all ranks, this rank's share sampled and scored: its rollouts (the
        sampler's, in chunks of whole prompts), their scores (this rank's rows: rewards [N], per_func [N, F]),
        and the seconds sampling took."""
        t0 = time.perf_counter()
        # Every rank draws the same global prompts and keeps its own share of whole prompts.
        streams = PromptStreams(self.config.seed, self.step, self.prompts.drawn).after(  # what each prompt draws
            self.dist.rank * (num_prompts // self.dist.world_size))                      # rollout/streams
        rows = self.dist.shard(self.prompts.next(num_prompts))                            # rollout/prompts
        with TokenProgress(f"sampling step {self.step + 1}", enabled=self.dist.is_main) as on_token:
            with decoding_allocations(self.threshold_set):                               # run/allocator
                rollouts, fields = self.sampler(rows["prompt"], on_token, streams)       # rollout/sampling
        seconds = time.perf_counter() - t0
        columns = {**per_completion(rows, self.config.num_generations), **fields}  # a rollout_func's fields win
        prompts, completions = columns.pop("prompt"), [c for ro in rollouts for c in ro.completions]
        rewards, per_func = compute_rewards(self.reward_funcs, prompts, completions, columns,  # rollout/rewards
                                            self.config.reward_weights, context=context,
                                            completion_ids=[i for ro in rollouts for i in ro.completion_id_lists])
        return rollouts, Scored(prompts, completions, rewards, per_func, extras=context.extras), seconds

    def fill_with_signal(self, rollouts: list[Rollout], scored: Scored,
                         context: RewardContext) -> tuple[list[Rollout], Scored, dict, float]:
        """DAPO's dynamic sampling on this rank's share: keep its groups with signal (algo/advantages.has_signal),
        sampling more prompts, as many per rank as the rank shortest of groups lacks, while one lacks any and
        rounds are left; a rank still short tops up with groups it dropped (they train nothing). Every rank runs
        as many rounds of as many prompts, so the collectives (and FSDP's sampling) stay in step."""
        G, cfg = self.config.num_generations, self.config
        need = len(scored.completions) // G  # this rank's groups in a generation batch
        parts, seconds, rounds = [(rollouts, scored)], 0.0, 0
        signal = has_signal(scored.rewards, G, scored.applied)  # [n] per group sampled so far
        while rounds < cfg.dynamic_sampling_max_rounds:
            missing = int(self.largest(float(max(0, need - int(signal.sum())))))
            if missing == 0:
                break
            more, more_scored, more_seconds = self.sample(missing * self.dist.world_size, context)
            parts.append((more, more_scored))
            signal = torch.cat([signal, has_signal(more_scored.rewards, G, more_scored.applied)])  # [n]
            seconds, rounds = seconds + more_seconds, rounds + 1
        # Groups with signal first, then dropped ones to fill the batch, each kept in the order it was sampled.
        keep = torch.cat([signal.nonzero(), (~signal).nonzero()]).flatten()[:need].sort().values  # [need]
        rows = (keep[:, None] * G + torch.arange(G)).flatten()  # [need * G]
        index = rows.tolist()
        prompts = [p for _, s in parts for p in s.prompts]
        completions = [c for _, s in parts for c in s.completions]
        kept = Scored([prompts[i] for i in index], [completions[i] for i in index],
                      torch.cat([s.rewards for _, s in parts])[rows], torch.cat([s.per_func for _, s in parts])[rows],
                      extras={k: [v[i] for i in index if i < len(v)] for k, v in context.extras.items()})
        whole = concat([r for rs, _ in parts for r in rs], self.tokenizer.pad_token_id)
        counts = self.dist.reduce({"dropped": float(len(signal) - need), "filler": float(need - signal[keep].sum())})
        metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/dropped_groups": counts["dropped"],
                   "dynamic_sampling/filler_groups": counts["filler"]}
        return [rollout_rows(whole, rows)], kept, metrics, seconds

    def micro_batches(self, rollouts: list[Rollout], advantages: torch.Tensor) -> list[Batch]:
        """The micro-batches the loss takes, cut to the rows with a gradient (rollout/batches.trained_rows), with
        the log-probs fixed for the whole generation batch: the old policy's when later steps are off-policy, the
        reference's when there is one."""
        batches = loss_batches(rollouts, advantages, self.config.mask_truncated_completions, self.policy.device,
                               self.skip_zero_advantage, keep_one=self.dist.world_size > 1)
        for b in (b for b in batches if not b.empty):
            if self.schedule.optimizer_steps_per_generation > 1:
                b.old_logprobs = self.policy.logprobs(b.rollout)                          # policy/forwards
            if self.policy.has_reference:
                b.ref_logprobs = self.policy.reference_logprobs(b.rollout)                # policy/forwards
        return batches

    def generation_metrics(self, rollouts: list[Rollout], scored: Scored, context: RewardContext,
                           generate_s: float) -> dict:
        """The generation batch's metrics over all ranks: rewards, lengths, groups without signal, timing."""
        lengths = self.dist.gather(torch.cat([ro.completion_mask.sum(1) for ro in rollouts]).float())  # [W*N]
        truncated = self.dist.gather(torch.cat([ro.truncated for ro in rollouts]).float())  # [W*N]
        zero_std = zero_std_fraction(scored.rewards, self.config.num_generations, scored.applied)
        self.no_signal.update(zero_std, show=self.dist.is_main)  # says once what usually fixes it
        return {**reward_metrics(scored.rewards, scored.per_func, self.reward_names),
                **length_metrics(lengths, truncated), "frac_reward_zero_std": zero_std,
                **context.metrics_over(self.dist), "perf/generate_s": generate_s,
                "perf/tokens_per_s": lengths.sum().item() / generate_s}

    def largest(self, value: float) -> float:
        """The largest of every rank's `value`."""
        return self.dist.reduce({"value": value}, "max")["value"]

    def accumulate(self, batches: list[Batch]) -> dict:
        """Back-propagate the loss of every micro-batch, each normalized as `loss_type` says with the step's
        counts over all ranks (so the ranks' summed gradients are those of the step's loss); returns metrics.
        Rows whose gradient is exactly 0 are left out (rollout/batches.trained_rows), but not from the counts."""
        counts = self.generation.step_counts(batches, self.dist.reduce)  # over all ranks      rollout/batches
        totals: dict[str, float] = {"kl": 0.0, "loss": 0.0}  # kl: logged as 0 when there is no reference
        trained = [b for b in batches if not b.empty]  # one process: no forward where no row is left (ranks keep one)
        for i, b in enumerate(trained):
            with self.policy.parallel.sync_gradients(i == len(trained) - 1):
                logprobs, entropies = self.policy.logprobs(b.rollout, with_entropy=True)  # [n, C] each  policy
                old_logprobs = b.old_logprobs if b.old_logprobs is not None else logprobs.detach()
                loss, m = policy_loss(                                                         # algo/loss
                    logprobs, old_logprobs, b.ref_logprobs, b.advantages, b.rollout.completion_mask,
                    entropies=entropies, **self.loss_settings, num_tokens=counts["divisor"],
                    num_sequences=b.rows, micro_batch_tokens=b.tokens, num_micro_batches=counts["micro_batches"])
                self.policy.parallel.backward(loss)
            add_metrics(totals, m, share=b.trained_tokens / max(1, counts["trained"]))  # over rows trained  algo/loss
            totals["loss"] += loss.item()
        # Per-token metrics (entropy, ratio, clip ratios) are the rows trained's; 0 where no row was trained.
        totals = {**no_token_metrics(**self.loss_settings), **self.dist.reduce(totals)}  # algo/loss
        return {**totals, "skipped/zero_gradient": counts["skipped"] / counts["rows"]}

    def apply_update(self, totals: dict) -> dict:
        """Clip and apply the accumulated gradients; a NaN/inf loss or gradient norm skips the update
        (the weights stay finite) and counts towards `max_nonfinite_steps`."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        metrics, applied = optimizer_step(params, self.optimizer, self.scheduler, self.config.max_grad_norm,
                                          totals["loss"])                                     # policy/optim
        self.nonfinite_streak, self.nonfinite_total = (0, self.nonfinite_total) if applied else (
            self.nonfinite_streak + 1, self.nonfinite_total + 1)
        if not applied:
            tqdm.write(f"step {self.step + 1}: loss {totals['loss']}, grad norm {metrics['grad_norm']}: update skipped "
                       f"({self.nonfinite_streak} in a row; stopping at {self.config.max_nonfinite_steps})",
                       file=sys.stderr)
        return {**totals, **metrics, "skipped/nonfinite": float(self.nonfinite_total)}

    @contextlib.contextmanager
    def _undone_on_failure(self, signals: StopSignals):
        """A stop signal or an error before the update rolls the step back (data position, RNG states,
        gradients) and saves the steps done, so that only this one is lost and resuming repeats it exactly."""
        start = (checkpoint.rng_state(), self.prompts.state_dict(), self.generation)
        try:
            # Ranks cannot abandon a step alone: the others would wait for them in a collective.
            with signals.abandonable() if self.dist.world_size == 1 else contextlib.nullcontext():
                yield
        except Exception as error:
            checkpoint.set_rng_state(start[0])
            self.prompts.load_state_dict(start[1])
            self.generation = start[2]
            self.optimizer.zero_grad(set_to_none=True)
            if isinstance(error, StepAbandoned):
                raise TrainingInterrupted(signals.received, self.step, self._save_if_trained()) from None
            if self.dist.world_size == 1:  # saving is collective: a rank failing alone cannot
                self._save_after_error()
            raise

    def evaluate(self) -> dict:
        """Greedy pass@1 on the eval dataset, logged as its own metrics.jsonl line (`eval/*` keys). Under
        torchrun every rank evaluates the whole set (FSDP ranks must generate together) and rank 0 writes."""
        cfg = self.config
        batch_size = eval_batch_size(cfg, self.model, self.policy.device.type)  # memory/fit
        with decoding_allocations(self.threshold_set):
            metrics, _ = evaluate(self.model, self.tokenizer, self.eval_dataset, self.reward_funcs,
                                  **eval_options(cfg, batch_size), progress=self.dist.is_main,
                                  unsharded=self.policy.parallel.unsharded)
        return log_eval(self.output_dir, self.step, metrics, self.dist.is_main, self.trackers)

    def log(self, metrics: dict) -> dict:
        """Every rank calls it (it gathers); rank 0 writes. Timings and memory are the slowest / largest rank's."""
        line = log_metrics(self.output_dir, self.step, metrics, self.dist, self.trackers)
        if self.schedule.starts_generation(self.step - 1):  # once per generation batch, not per pass
            log_completions(self.output_dir, self.step, self.generation.scored, self.reward_names, self.dist,
                            self.trackers)
        return line

    # --- checkpoints: what they hold (state_dict), and writing and finding them (run/checkpoint.py) ---
    def state_dict(self) -> dict:
        """Everything besides the weights that resuming needs: optimizer, schedule, data position, step and
        skipped-step counters, each rank's RNG states and a generation batch later steps still use. Under
        torchrun every rank calls it (gathering is collective); rank 0 gets the whole."""
        mid_batch = not self.schedule.starts_generation(self.step)
        own = {"rng": checkpoint.rng_state(), "generation": asdict(self.generation) if mid_batch else None}
        return {"step": self.step, "total_steps": self.total_steps,
                "optimizer": self.policy.parallel.optimizer_state(self.optimizer),
                "scheduler": self.scheduler.state_dict(), "prompts": self.prompts.state_dict(),
                "nonfinite": (self.nonfinite_streak, self.nonfinite_total),
                **(own if self.dist.world_size == 1 else {"ranks": self.dist.gather_to_main(own)})}

    def load_state_dict(self, state: dict) -> None:
        """The inverse of `state_dict`; the current settings (learning rate, betas) win over the saved ones."""
        cfg = self.config
        own = elastic.rank_state(state, self.dist.rank, self.dist.world_size)  # None: saved by another rank count
        self.policy.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_hyperparameters(self.optimizer, self.scheduler, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                            cfg.weight_decay)
        self.prompts.load_state_dict(state["prompts"])
        self.nonfinite_streak, self.nonfinite_total = state["nonfinite"]
        if own is None:  # run/elastic.py: sample anew what later steps would have reused, seeded per rank
            self.prompts.rewind(elastic.unfinished_prompts(state, cfg.num_generations))
            elastic.seed_rank(cfg.seed, self.dist.rank, state["step"])
        else:
            if own["generation"] is not None:
                self.generation = generation_from_dict(own["generation"], self.policy.device)
            checkpoint.set_rng_state(own["rng"])
        self.step = state["step"]

    def save(self) -> Path:
        """Write checkpoint-STEP (once per step); returns its path. Under torchrun every rank calls it and
        rank 0 writes; the others wait until the checkpoint is complete."""
        if self.saved_step != self.step:
            state, weights = self.state_dict(), self.policy.parallel.full_state_dict()  # FSDP: gathered
            if self.dist.is_main:
                checkpoint.save_checkpoint(str(self.output_dir), self.step, self.model, self.tokenizer,
                                           asdict(self.config), state, self.config.save_total_limit, weights)
            self.dist.barrier()
            self.last_checkpoint, self.saved_step = self.output_dir / f"checkpoint-{self.step}", self.step
        return self.last_checkpoint

    def resume(self, spec: str) -> None:
        """Continue from `spec`, a checkpoint folder or "latest" (the newest loadable one in output_dir,
        saying which damaged ones it passed over; none yet means step 0). Lines of the logs written after its
        step are dropped, so they never repeat."""
        path, passed_over = checkpoint.find_checkpoint(spec, str(self.output_dir))
        if passed_over and self.dist.is_main:
            print("\n".join(passed_over), file=sys.stderr)
        if path is None:
            print(f"no checkpoint in {self.output_dir} yet: starting from step 0", file=sys.stderr)
        else:
            state, config = checkpoint.load_state(path), asdict(self.config)
            notes = [f"resuming with a changed setting: {c}" for c in checkpoint.changed_settings(path, config)]
            notes += elastic.rank_change_notes(checkpoint.saved_config(path), state, config, self.dist.world_size)
            if state.get("total_steps", self.total_steps) != self.total_steps:  # e.g. a finished run extended
                notes.append(rescheduled(state["total_steps"], self.total_steps, state["step"],
                                         self.config.learning_rate, self.warmup_steps,
                                         self.config.lr_scheduler_type))                      # policy/optim
            if notes and self.dist.is_main:
                print("\n".join(notes), file=sys.stderr)
            self.policy.parallel.load_weights(path)
            self.load_state_dict(state)
            self.last_checkpoint, self.saved_step = path, self.step
        if self.dist.is_main:  # the one writer; with no checkpoint even step 0's evaluation is done again
            checkpoint.drop_log_lines_after(str(self.output_dir), self.step if path is not None else -1)

    def _save_if_trained(self) -> Path | None:
        return self.save() if self.step > 0 else None

    def _save_after_error(self) -> None:
        """Keep the steps done before a failing one; never let the save hide the error itself."""
        try:
            path = self._save_if_trained()
        except Exception as save_error:  # noqa: BLE001 -- the error being raised matters more
            print(f"could not save a checkpoint after the error below: {save_error!r}", file=sys.stderr)
            return
        if path is not None:
            print(f"step {self.step + 1} failed; {path} holds the state after step {self.step}", file=sys.stderr)


def _trl_call(config, args, model, tokenizer, processing_class, trl_only: dict):
    """(config, model, tokenizer) from either call shape, ours or TRL's; ConfigError for what cannot work."""
    refused = [f"Trainer's `{k}`: {TRAINER_ONLY[k]}" for k, v in trl_only.items()
               if k in TRAINER_ONLY and v not in (None, (None, None), [])]
    unknown = [k for k in trl_only if k not in TRAINER_ONLY]
    if unknown:
        raise TypeError(f"Trainer() got an unexpected keyword argument '{unknown[0]}'")
    if refused:
        raise ConfigError("; ".join(refused))
    if config is not None and not isinstance(config, Config):  # e.g. TRL's positional (model, reward_funcs)
        raise ConfigError(f"Trainer's first argument is a grpo Config (TRL's `args=`), got "
                          f"{type(config).__name__} {config!r:.60}: pass the model as model=, the settings "
                          f"as args=Config(...)")
    if args is not None and config is not None:
        raise ConfigError("pass the Config once: as `config` or as TRL's `args=`, not both")
    if processing_class is not None and tokenizer is not None:
        raise ConfigError("pass the tokenizer once: as `tokenizer=` or as TRL's `processing_class=`, not "
                          "both")
    config = args if args is not None else config if config is not None else Config()
    if not isinstance(config, Config):
        raise ConfigError(f"args= must be a grpo Config, got {type(config).__name__}: build it with "
                          f"grpo.Config(...) (TRL's GRPOConfig keywords work there)")
    if isinstance(model, str):  # TRL: a hub id or folder to load
        config, model = dataclasses.replace(config, model=model), None
    return config, model, tokenizer if tokenizer is not None else processing_class


def _default_tokenizer(config: Config, model):
    """The tokenizer when none is given: `config.model`'s, or for a model object the one of the folder or
    hub id its config names (TRL's choice). A model built in code names none, and the default model is not
    its."""
    if model is None:
        return load_tokenizer(config.model)
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not source:
        raise ConfigError("a model passed to Trainer needs its tokenizer: pass processing_class=tokenizer "
                          "(TRL's name; tokenizer= works too); its config names no folder or hub id to load "
                          "one from")
    try:
        return load_tokenizer(source)
    except ConfigError as error:
        raise ConfigError(f"a model passed to Trainer without its tokenizer: loading one from {source}, "
                          f"where its config says it comes from, fails ({error}); pass "
                          f"processing_class=tokenizer") from None
