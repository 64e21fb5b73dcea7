"""`Trainer`: wires sampling, rewards, advantages, log-probs and the loss into the GRPO loop.
The math lives in advantages.py, logprobs.py and loss.py, the logs in run_logs.py, saving and resuming
in trainer_state.py; this file only orchestrates."""
from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import trainer_state
from .advantages import group_advantages
from .batches import Batch, Generation
from .checkpoint import rng_state, set_rng_state
from .config import Config
from .data import PromptStream, check_dataset
from .distributed import setup as setup_distributed
from .errors import ConfigError, TrainingStopped
from .evaluate import check_eval_funcs, evaluate
from .interrupts import StepAbandoned, StopSignals, TrainingInterrupted
from .loss import policy_loss
from .models import (check_load_options, completion_logprobs, device_of, load_model, load_tokenizer,
                     make_reference, prepare_for_training, reference_context)
from .optim import build_optimizer, build_scheduler
from .parallel import ParallelPolicy, check_settings as check_parallel_settings
from .rewards import compute_rewards, reward_func_names, reward_metrics
from .run_logs import log_completions, log_eval, log_metrics, peak_memory_gb
from .sampling import PromptEncoder, Rollout, sample


def repeat_each(values: list, times: int) -> list:
    return [v for v in values for _ in range(times)]


class Trainer:
    """GRPO on `model` (or `config.model`), rewarded by `reward_funcs`, over `train_dataset` prompts."""

    def __init__(self, config: Config, model=None, tokenizer=None, reward_funcs=(), train_dataset=None,
                 eval_dataset=None):
        if not reward_funcs:
            raise ValueError("Trainer needs at least one reward function")
        check_dataset(train_dataset)
        self.config = config
        self.reward_funcs = list(reward_funcs)
        self.reward_names = reward_func_names(self.reward_funcs)
        self.eval_dataset = eval_dataset
        if config.eval_steps > 0 or config.eval_on_start:
            if eval_dataset is None:
                raise ConfigError("eval_steps / eval_on_start need an eval_dataset")
            check_eval_funcs(self.reward_funcs, config.eval_accuracy_func, config.eval_format_func)
        check_load_options(config, model_given=model is not None)
        self.dist = setup_distributed()  # world size 1 without torchrun
        check_parallel_settings(self.dist.world_size, config.fsdp, config.optim, config.use_lora)
        torch.manual_seed(config.seed + self.dist.rank)  # ranks sample differently; wrapping syncs the weights
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.model = prepare_for_training(model if model is not None else load_model(config), config,
                                          self.dist.world_size)
        self.reference = make_reference(self.model, config.use_lora, config.beta)
        # Before the optimizer: FSDP replaces the parameters by their shards.
        self.policy = ParallelPolicy(self.model, self.dist, fsdp=config.fsdp, bf16=config.bf16)
        self.device = device_of(self.model)
        self.reference_forwards = 0
        self.encode = PromptEncoder(self.tokenizer, config.max_prompt_length)
        self.prompts = PromptStream(train_dataset, config.seed)
        self.prompts_per_step = (config.per_device_train_batch_size * config.gradient_accumulation_steps
                                 * self.dist.world_size)
        self.total_steps = self._total_steps(len(train_dataset))
        self.optimizer = build_optimizer(self.model.parameters(), config.optim, config.learning_rate,
                                         (config.adam_beta1, config.adam_beta2), config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, config.warmup_ratio,
                                         config.lr_scheduler_type)
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self.generation: Generation | None = None
        self.nonfinite_streak = self.nonfinite_total = 0  # optimizer steps skipped for a NaN/inf loss or grad
        self.last_checkpoint: Path | None = None
        self.saved_step: int | None = None  # the step last saved: saving it again is a no-op

    def _total_steps(self, num_prompts: int) -> int:
        if self.config.max_steps > 0:
            return self.config.max_steps
        rounds = math.ceil(self.config.num_train_epochs * num_prompts / self.prompts_per_step)
        return max(1, rounds) * self.config.num_iterations

    # --- the loop ---
    def train(self) -> list[dict]:
        """Run to `total_steps`, first resuming `config.resume_from_checkpoint` when set; returns the logged
        metrics lines. On SIGINT/SIGTERM it saves a checkpoint and raises TrainingInterrupted."""
        trainer_state.start_or_resume(self)
        history = []
        if self.config.eval_on_start and self.step == 0:
            history.append(self.evaluate())
        bar = tqdm(total=self.total_steps, initial=self.step, desc="grpo", dynamic_ncols=True,
                   disable=not self.dist.is_main)
        with StopSignals() as signals, bar:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                metrics = self.run_step(signals)
                metrics["perf/step_s"] = time.perf_counter() - t0
                metrics["memory/peak_gb"] = peak_memory_gb(self.device)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}")
                if self.step % self.config.logging_steps == 0 or self.step == self.total_steps:
                    history.append(self.log(metrics))
                if self.nonfinite_streak >= self.config.max_nonfinite_steps:
                    raise self._nonfinite_stop()
                if self.config.eval_steps > 0 and (self.step % self.config.eval_steps == 0
                                                   or self.step == self.total_steps):
                    history.append(self.evaluate())
                if self.step % self.config.save_steps == 0 and self.step < self.total_steps:
                    self.save()
                received = self.dist.agree_on_signal(signals.received)  # every rank stops at the same step
                if received is not None:
                    raise TrainingInterrupted(received, self.step, trainer_state.save_if_trained(self))
            self.save()
        return history

    def run_step(self, signals: StopSignals) -> dict:
        """One optimizer step, sampling a new generation batch every `num_iterations` steps. A stop signal
        or an error before the update rolls the step back (data position, RNG states, gradients) and saves
        the steps done, so that only this one is lost and resuming repeats it exactly."""
        start = (rng_state(), self.prompts.state_dict(), self.generation)
        try:
            # Ranks cannot abandon a step alone: the others would wait for them in a collective.
            with signals.abandonable() if self.dist.world_size == 1 else contextlib.nullcontext():
                if self.step % self.config.num_iterations == 0:
                    self.generation = self.generate_step()
                totals = self.accumulate(self.generation.batches)
        except Exception as error:
            set_rng_state(start[0])
            self.prompts.load_state_dict(start[1])
            self.generation = start[2]
            self.optimizer.zero_grad(set_to_none=True)
            if isinstance(error, StepAbandoned):
                raise TrainingInterrupted(signals.received, self.step, trainer_state.save_if_trained(self)) from None
            if self.dist.world_size == 1:  # saving is collective: a rank failing alone cannot
                trainer_state.save_after_error(self)
            raise
        metrics = {**self.generation.metrics, **self.apply_update(totals)}
        self.step += 1
        return metrics

    @torch.no_grad()
    def generate_step(self) -> Generation:
        """Sample every micro-batch of one step, score it and compute advantages over the whole step."""
        cfg, G, dist = self.config, self.config.num_generations, self.dist
        t0 = time.perf_counter()
        # Every rank draws the same global micro-batch and keeps its own share of whole prompts.
        rows = [dist.shard(self.prompts.next(cfg.per_device_train_batch_size * dist.world_size))
                for _ in range(cfg.gradient_accumulation_steps)]
        rollouts = [self.policy.generate(lambda model: sample(
            model, self.tokenizer, self.encode, r["prompt"], num_generations=G,
            max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, stop_at_eos=cfg.stop_at_eos)) for r in rows]
        generate_s = dist.reduce({"s": time.perf_counter() - t0}, "max")["s"]  # the slowest rank's
        prompts = repeat_each([p for r in rows for p in r["prompt"]], G)
        completions = [c for ro in rollouts for c in ro.completions]
        columns = {k: repeat_each([v for r in rows for v in r[k]], G) for k in rows[0] if k != "prompt"}
        rewards, per_func, metrics = compute_rewards(self.reward_funcs, prompts, completions, columns,
                                                     cfg.reward_weights)
        # Rewards of all ranks (rank-major): step-wide metrics and "batch" scaling need them all.
        rewards, per_func = dist.gather(rewards), dist.gather(per_func)  # [W*B*G*GA], [W*B*G*GA, F]
        if dist.world_size > 1:
            metrics = reward_metrics(rewards, per_func, self.reward_names)
        advantages = group_advantages(rewards, G, scale=cfg.scale_rewards)  # [W*B*G*GA]
        sizes = [len(ro.completions) for ro in rollouts]
        batches = [Batch(ro, adv.to(self.device)) for ro, adv in zip(rollouts, dist.local(advantages).split(sizes))]
        for b in batches:
            self._attach_fixed_logprobs(b)
        lengths = dist.gather(torch.cat([ro.completion_mask.sum(1) for ro in rollouts]).float())  # [W*B*G*GA]
        truncated = dist.gather(torch.cat([ro.truncated for ro in rollouts]).float())  # [W*B*G*GA]
        metrics.update({
            "completion/length_mean": lengths.mean().item(),
            "completion/truncated_frac": truncated.mean().item(),
            "perf/generate_s": generate_s,
            "perf/tokens_per_s": lengths.sum().item() / generate_s,
        })
        return Generation(batches, metrics, (prompts, completions, rewards, per_func, advantages))

    def _attach_fixed_logprobs(self, b: Batch) -> None:
        """Old log-probs (only when they differ from the current ones) and reference log-probs."""
        cfg, ro = self.config, b.rollout
        P = ro.prompt_ids.shape[1]
        if cfg.num_iterations > 1:
            with self._autocast():
                b.old_logprobs = self.policy(lambda model: self._logprobs(model, ro, P))
        if cfg.beta > 0:
            def reference_logprobs(policy_model):
                model, context = reference_context(policy_model, self.reference)
                with context, self._autocast():
                    return self._logprobs(model, ro, P)

            b.ref_logprobs = self.policy(reference_logprobs)
            self.reference_forwards += 1

    def _logprobs(self, model, ro: Rollout, prompt_length: int) -> torch.Tensor:
        return completion_logprobs(model, ro.input_ids, ro.attention_mask, prompt_length,
                                   temperature=self.config.temperature, chunk_size=self.config.logprob_chunk_size)

    def accumulate(self, batches: list[Batch]) -> dict:
        """Back-propagate the loss of every micro-batch, normalized by the step's totals (over all ranks, so
        that the ranks' summed gradients are those of the whole step's loss); returns metrics."""
        cfg = self.config
        counts = self.dist.reduce({"tokens": sum(b.rollout.completion_mask.sum().item() for b in batches),
                                   "sequences": sum(len(b.advantages) for b in batches)})
        num_tokens, num_sequences = counts["tokens"], int(counts["sequences"])
        totals: dict[str, float] = {"kl": 0.0}  # logged as 0 when there is no reference
        for i, b in enumerate(batches):
            ro = b.rollout
            with self.policy.sync_gradients(i == len(batches) - 1):
                with self._autocast():
                    logprobs = self.policy(lambda model: self._logprobs(model, ro, ro.prompt_ids.shape[1]))  # [N, C]
                old_logprobs = b.old_logprobs if b.old_logprobs is not None else logprobs.detach()
                loss, m = policy_loss(
                    logprobs, old_logprobs, b.ref_logprobs, b.advantages, ro.completion_mask,
                    epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                    aggregation=cfg.loss_aggregation, max_completion_length=cfg.max_completion_length,
                    num_tokens=num_tokens, num_sequences=num_sequences,
                )
                self.policy.backward(loss)
            # Per-token metrics are means over this micro-batch: weight them by its share of the step's
            # tokens (so that summing over ranks gives the step's means, as the losses sum to the step's).
            share = ro.completion_mask.sum().item() / max(1, num_tokens)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + (v if k.startswith("loss/") else v * share)
            totals["loss"] = totals.get("loss", 0.0) + loss.item()
        totals = self.dist.reduce(totals)
        return totals

    def apply_update(self, totals: dict) -> dict:
        """Clip and apply the accumulated gradients; a NaN/inf loss or gradient norm skips the update
        (the weights stay finite) and counts towards `max_nonfinite_steps`."""
        cfg = self.config
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        totals["lr"] = self.scheduler.get_last_lr()[0]
        totals["grad_norm"] = grad_norm.item()
        if math.isfinite(totals["loss"]) and math.isfinite(totals["grad_norm"]):
            self.optimizer.step()
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            self.nonfinite_total += 1
            tqdm.write(f"step {self.step + 1}: loss {totals['loss']}, grad norm {totals['grad_norm']}: update skipped "
                       f"({self.nonfinite_streak} in a row; stopping at {cfg.max_nonfinite_steps})", file=sys.stderr)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals["skipped/nonfinite"] = float(self.nonfinite_total)
        return totals

    def _autocast(self):
        use_bf16 = self.config.bf16 and self.device.type == "cuda"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=use_bf16)

    def evaluate(self) -> dict:
        """Greedy pass@1 on the eval dataset, logged as its own metrics.jsonl line (`eval/*` keys). Under
        torchrun every rank evaluates the whole set (FSDP ranks must generate together) and rank 0 writes."""
        cfg = self.config
        metrics, _ = evaluate(self.model, self.tokenizer, self.eval_dataset, self.reward_funcs,
                              accuracy_func=cfg.eval_accuracy_func, format_func=cfg.eval_format_func,
                              max_prompt_length=cfg.max_prompt_length, max_completion_length=cfg.max_completion_length,
                              batch_size=cfg.eval_batch_size, limit=cfg.eval_limit, progress=self.dist.is_main,
                              generate=self.policy.generate)
        return log_eval(self.output_dir, self.step, metrics, self.dist.is_main)

    # --- output and checkpoints (run_logs.py, trainer_state.py) ---
    def log(self, metrics: dict) -> dict:
        """Every rank calls it (it gathers); rank 0 writes. Timings and memory are the slowest / largest rank's."""
        line = log_metrics(self.output_dir, self.step, metrics, self.dist)
        if (self.step - 1) % self.config.num_iterations == 0:  # once per generation batch, not per pass
            log_completions(self.output_dir, self.step, self.generation.rows, self.reward_names, self.dist)
        return line

    def save(self) -> Path:
        """Write checkpoint-STEP with everything `resume` needs (once per step); returns its path. Under
        torchrun every rank calls it (gathering is collective) and rank 0 writes. See trainer_state.py."""
        return trainer_state.save(self)

    def resume(self, checkpoint: str) -> None:
        """Continue from `checkpoint`, a folder or "latest" (the newest complete one in output_dir; none
        yet means step 0), dropping log lines written after its step. See trainer_state.py."""
        trainer_state.resume(self, checkpoint)

    def _nonfinite_stop(self) -> TrainingStopped:
        n = self.nonfinite_streak
        return TrainingStopped(
            f"stopped at step {self.step}: the loss or gradient norm was NaN/inf for {n} steps in a row "
            f"(max_nonfinite_steps={self.config.max_nonfinite_steps}); their updates were skipped, so the weights "
            f"are those of step {self.step - n}. Newest checkpoint: {self.last_checkpoint or 'none yet'}. Try a lower "
            f"--learning_rate or --max_grad_norm, or check the rewards, then --resume_from_checkpoint=latest.")
