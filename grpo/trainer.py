"""`Trainer`: wires sampling, rewards, advantages, log-probs and the loss into the GRPO loop.
The math lives in advantages.py, logprobs.py and loss.py; this file only orchestrates and logs."""
from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .advantages import group_advantages
from .checkpoint import save_checkpoint
from .config import Config
from .data import PromptStream, check_dataset
from .loss import policy_loss
from .models import (check_load_options, completion_logprobs, device_of, load_model, load_tokenizer,
                     make_reference, prepare_for_training, reference_context)
from .optim import build_optimizer, build_scheduler
from .rewards import compute_rewards, reward_func_name
from .sampling import PromptEncoder, Rollout, sample


@dataclass
class Batch:
    """One micro-batch ready for the loss: a rollout plus what GRPO attaches to it."""

    rollout: Rollout
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None = None  # [N, C], only when num_iterations > 1
    ref_logprobs: torch.Tensor | None = None  # [N, C], only when beta > 0


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


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
        self.reward_names = [reward_func_name(f) for f in self.reward_funcs]
        self.eval_dataset = eval_dataset
        check_load_options(config, model_given=model is not None)
        torch.manual_seed(config.seed)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.model = prepare_for_training(model if model is not None else load_model(config), config)
        self.device = device_of(self.model)
        self.reference = make_reference(self.model, config.use_lora, config.beta)
        self.reference_forwards = 0
        self.encode = PromptEncoder(self.tokenizer, config.max_prompt_length)
        self.prompts = PromptStream(train_dataset, config.seed)
        self.prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
        self.total_steps = self._total_steps(len(train_dataset))
        self.optimizer = build_optimizer(self.model.parameters(), config.optim, config.learning_rate,
                                         (config.adam_beta1, config.adam_beta2), config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, config.warmup_ratio,
                                         config.lr_scheduler_type)
        self.step = 0
        self.output_dir = Path(config.output_dir)

    def _total_steps(self, num_prompts: int) -> int:
        if self.config.max_steps > 0:
            return self.config.max_steps
        rounds = math.ceil(self.config.num_train_epochs * num_prompts / self.prompts_per_step)
        return max(1, rounds) * self.config.num_iterations

    # --- the loop ---
    def train(self) -> list[dict]:
        """Run to `total_steps`; returns the logged metrics lines."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        history = []
        bar = tqdm(total=self.total_steps, initial=self.step, desc="grpo", dynamic_ncols=True)
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batches, metrics = self.generate_step()
            for _ in range(self.config.num_iterations):
                if self.step >= self.total_steps:
                    break
                metrics.update(self.optimize_step(batches))
                self.step += 1
                metrics["perf/step_s"] = time.perf_counter() - t0
                metrics["memory/peak_gb"] = peak_memory_gb(self.device)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}")
                if self.step % self.config.logging_steps == 0 or self.step == self.total_steps:
                    history.append(self.log(metrics, batches))
                if self.step % self.config.save_steps == 0 and self.step < self.total_steps:
                    self.save()
                t0 = time.perf_counter()
        bar.close()
        self.save()
        return history

    @torch.no_grad()
    def generate_step(self) -> tuple[list[Batch], dict]:
        """Sample every micro-batch of one step, score it and compute advantages over the whole step."""
        cfg, G = self.config, self.config.num_generations
        t0 = time.perf_counter()
        rows = [self.prompts.next(cfg.per_device_train_batch_size) for _ in range(cfg.gradient_accumulation_steps)]
        rollouts = [sample(self.model, self.tokenizer, self.encode, r["prompt"], num_generations=G,
                           max_completion_length=cfg.max_completion_length, temperature=cfg.temperature,
                           top_p=cfg.top_p, top_k=cfg.top_k, stop_at_eos=cfg.stop_at_eos) for r in rows]
        generate_s = time.perf_counter() - t0
        prompts = repeat_each([p for r in rows for p in r["prompt"]], G)
        completions = [c for ro in rollouts for c in ro.completions]
        columns = {k: repeat_each([v for r in rows for v in r[k]], G) for k in rows[0] if k != "prompt"}
        rewards, per_func, metrics = compute_rewards(self.reward_funcs, prompts, completions, columns,
                                                     cfg.reward_weights)
        advantages = group_advantages(rewards, G, scale=cfg.scale_rewards)  # [B*G*GA]
        sizes = [len(ro.completions) for ro in rollouts]
        batches = [Batch(ro, adv.to(self.device)) for ro, adv in zip(rollouts, advantages.split(sizes))]
        for b in batches:
            self._attach_fixed_logprobs(b)
        lengths = torch.cat([ro.completion_mask.sum(1) for ro in rollouts]).float()  # [B*G*GA]
        metrics.update({
            "completion/length_mean": lengths.mean().item(),
            "completion/truncated_frac": torch.cat([ro.truncated for ro in rollouts]).float().mean().item(),
            "perf/generate_s": generate_s,
            "perf/tokens_per_s": lengths.sum().item() / generate_s,
        })
        self._last_log_rows = (prompts, completions, rewards, per_func, advantages)
        return batches, metrics

    def _attach_fixed_logprobs(self, b: Batch) -> None:
        """Old log-probs (only when they differ from the current ones) and reference log-probs."""
        cfg, ro = self.config, b.rollout
        P = ro.prompt_ids.shape[1]
        if cfg.num_iterations > 1:
            with self._autocast():
                b.old_logprobs = self._logprobs(self.model, ro, P)
        if cfg.beta > 0:
            model, context = reference_context(self.model, self.reference)
            with context, self._autocast():
                b.ref_logprobs = self._logprobs(model, ro, P)
            self.reference_forwards += 1

    def _logprobs(self, model, ro: Rollout, prompt_length: int) -> torch.Tensor:
        return completion_logprobs(model, ro.input_ids, ro.attention_mask, prompt_length,
                                   temperature=self.config.temperature, chunk_size=self.config.logprob_chunk_size)

    def optimize_step(self, batches: list[Batch]) -> dict:
        """One optimizer step: accumulate the loss over micro-batches, normalized by the step's totals."""
        cfg = self.config
        num_tokens = sum(b.rollout.completion_mask.sum().item() for b in batches)
        num_sequences = sum(len(b.advantages) for b in batches)
        totals: dict[str, float] = {"kl": 0.0}  # logged as 0 when there is no reference
        for b in batches:
            ro = b.rollout
            with self._autocast():
                logprobs = self._logprobs(self.model, ro, ro.prompt_ids.shape[1])  # [N, C]
            old_logprobs = b.old_logprobs if b.old_logprobs is not None else logprobs.detach()
            loss, m = policy_loss(
                logprobs, old_logprobs, b.ref_logprobs, b.advantages, ro.completion_mask,
                epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                aggregation=cfg.loss_aggregation, max_completion_length=cfg.max_completion_length,
                num_tokens=num_tokens, num_sequences=num_sequences,
            )
            loss.backward()
            # Per-token metrics are means over this micro-batch: weight them by its share of tokens.
            share = ro.completion_mask.sum().item() / max(1, num_tokens)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + (v if k.startswith("loss/") else v * share)
            totals["loss"] = totals.get("loss", 0.0) + loss.item()
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        totals["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"] = grad_norm.item()
        return totals

    def _autocast(self):
        use_bf16 = self.config.bf16 and self.device.type == "cuda"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=use_bf16)

    # --- output ---
    def log(self, metrics: dict, batches: list[Batch]) -> dict:
        line = {"step": self.step, **{k: float(v) for k, v in sorted(metrics.items())}}
        with open(self.output_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        prompts, completions, rewards, per_func, advantages = self._last_log_rows
        with open(self.output_dir / "completions.jsonl", "a") as f:
            for i in range(len(completions)):
                row = {"step": self.step, "prompt": prompts[i], "completion": completions[i],
                       "reward": rewards[i].item(), "advantage": advantages[i].item()}
                for j, name in enumerate(self.reward_names):
                    value = per_func[i, j].item()
                    row[f"reward/{name}"] = None if math.isnan(value) else value
                f.write(json.dumps(row) + "\n")
        return line

    def save(self) -> Path:
        return save_checkpoint(str(self.output_dir), self.step, self.model, self.tokenizer, asdict(self.config),
                               self.config.save_total_limit)
