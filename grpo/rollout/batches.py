"""The experience, the one type a step carries from the engine to the loss (`Rollout`), the one place it is cut
into micro-batches (`Rollout.micro_batches`), the generation batch that `num_iterations` steps reuse
(`Generation`, checkpointed by field name), and its metrics."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..algo.advantages import zero_std_fraction
from ..algo.sampling_correction import correction_metrics, sampling_correction
from .rewards import RewardContext, reward_metrics

PROMPT_SIDE = ("prompt_ids", "prompt_mask")  # [N, P], left-padded; every other tensor but PER_ROW's is [N, C]
PER_ROW = ("truncated", "advantages", "tool_calls", "tool_failures", "rewards", "per_func")  # [N] or [N, F]
LISTS = ("completions", "prompts", "tool_notes")  # N Python objects
IDS = ("prompt_ids", "completion_ids")  # padded with the pad token, the rest with 0


@dataclass
class Rollout:
    """Rows of sampled completions and what GRPO attaches to them, row by row: this rank's generation batch, or a
    micro-batch of it. Row i belongs to prompt i // num_generations."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C] right-padded
    completion_mask: torch.Tensor  # [N, C] what attention sees: 1 up to and including EOS
    completions: list  # N strings, or N chat lists [{"role": "assistant", "content": ...}]
    truncated: torch.Tensor  # [N] bool: not ended by an EOS of the model's own within max_completion_length
    # [N, C] the completion tokens trained on, which the loss, its token counts and metrics read (None: the
    # completion mask); 0 on tokens the model did not write and, with mask_truncated_completions, on truncated rows.
    loss_mask: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [N]
    old_logprobs: torch.Tensor | None = None  # [N, C], only when later steps are off-policy
    ref_logprobs: torch.Tensor | None = None  # [N, C], only with a reference
    tool_calls: torch.Tensor | None = None  # [N] the tool calls each completion made, when it could make some
    tool_failures: torch.Tensor | None = None  # [N] those that failed (raised, timed out, unknown, malformed)
    # [N, C] the log-probs an inference server gave its sampled tokens (NaN where it gave none), and the
    # importance-sampling correction the loss multiplies by (Generation.correct_sampling); None: our own samples
    sampling_logprobs: torch.Tensor | None = None
    sampling_weights: torch.Tensor | None = None
    tool_notes: list | None = None  # N lists of lines, what went wrong in each completion's tool calls
    prompts: list | None = None  # N prompts as the reward functions saw them, once scored
    rewards: torch.Tensor | None = None  # [N] weighted sum over the reward functions
    per_func: torch.Tensor | None = None  # [N, F] each function's reward, NaN where it returned None
    extras: dict | None = None  # the reward functions' log_extra columns, N values each (None where not logged)

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # [N, P+C]

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # [N, P+C]

    @property
    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids up to and including EOS (reward functions' `completion_ids`)."""
        return [row[mask.bool()].tolist() for row, mask in zip(self.completion_ids, self.completion_mask)]

    @property
    def applied(self) -> torch.Tensor:
        """[N] False where every reward function returned None: such a completion has no score."""
        return ~self.per_func.isnan().all(dim=1)

    def to(self, device: torch.device) -> Rollout:
        return Rollout(**{f.name: v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                          for f in dataclasses.fields(self)})

    @classmethod
    def cat(cls, parts: list[Rollout], pad_id: int) -> Rollout:
        """The rows of `parts` in order as one rollout, each side padded to the widest (ids with `pad_id`)."""
        if len(parts) == 1:
            return parts[0]
        widths = {"P": max(r.prompt_ids.shape[1] for r in parts), "C": max(r.completion_ids.shape[1] for r in parts)}

        def joined(name: str):
            tensors = [getattr(r, name) for r in parts]
            if name in LISTS:
                return None if tensors[0] is None else [x for t in tensors for x in t]
            if name == "extras":  # a column one part did not log is None there
                columns = dict.fromkeys(c for r in parts for c in r.extras or {})
                return None if tensors[0] is None else {
                    c: [x for r in parts for x in (r.extras or {}).get(c, [None] * len(r.completions))]
                    for c in columns}
            if tensors[0] is None or name in PER_ROW:
                return None if tensors[0] is None else torch.cat(tensors)  # [sum N]
            width, left = (widths["P"], True) if name in PROMPT_SIDE else (widths["C"], False)
            value = pad_id if name in IDS else 0
            return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]),
                                                      value=value) for t in tensors])  # [sum N, width]
        return cls(**{f.name: joined(f.name) for f in dataclasses.fields(cls)})

    def select(self, rows: torch.Tensor, multiple: int | None = None) -> Rollout:
        """Rows `rows` [n] (indices, in order), without the columns no kept row attends to, so that their compute
        does not depend on the rows left out. With `multiple` (TRL's pad_to_multiple_of), both sides are padded to
        a multiple of it again, the padding masked (ids and values 0)."""
        prompt_mask, completion_mask = self.prompt_mask[rows], self.completion_mask[rows]  # [n, P], [n, C]
        used = prompt_mask.any(dim=0).nonzero()  # [p, 1]
        P = prompt_mask.shape[1]
        p = int(used.min()) if used.numel() else P  # the first column a row uses
        used = completion_mask.any(dim=0).nonzero()  # [c, 1]
        c = int(used.max()) + 1 if used.numel() else 1
        if multiple:  # p < 0 and c > C pad beyond the batch's own columns
            p, c = P + (p - P) // multiple * multiple, -(-c // multiple) * multiple  # widths rounded up

        def take(name: str):
            value = getattr(self, name)
            if name in LISTS and value is not None:
                return [value[i] for i in rows.tolist()]
            if name == "extras" and value is not None:
                return {c: [v[i] for i in rows.tolist()] for c, v in value.items()}
            if value is None or name in PER_ROW:
                return None if value is None else value[rows]  # [n]
            if name in PROMPT_SIDE:
                return torch.nn.functional.pad(value[rows, max(p, 0):], (max(-p, 0), 0))  # [n, P - p]
            return torch.nn.functional.pad(value[rows, :c], (0, max(c - value.shape[1], 0)))  # [n, c]
        return Rollout(**{f.name: take(f.name) for f in dataclasses.fields(self)})

    def micro_batches(self, cut: Cut) -> list[MicroBatch]:
        """The generation batch cut into micro-batches of `cut.size` rows in order (a prompt's group may span two),
        each holding only its rows whose gradient is not exactly 0 (rows with no token in the loss mask unless
        `cut.every_row`, and with `cut.skip_zero_advantage` rows of advantage 0, are left out) and counting all of
        them for the loss's divisors. With `cut.keep_one` (several ranks) a micro-batch left with no row keeps its
        first, its masks zeroed: every rank must run every micro-batch, or DDP's and FSDP's collectives hang."""
        N = len(self.completions)
        needed = torch.full((N,), cut.every_row) | self.loss_mask.bool().any(dim=1).cpu()  # [N]
        if cut.skip_zero_advantage:
            needed &= self.advantages.cpu() != 0
        batches = []
        for start in range(0, N, cut.size):
            part = torch.arange(start, min(start + cut.size, N))  # [S], on the CPU: it indexes either device
            keep, source = part[needed[part]], self  # [n]
            if keep.numel() == 0 and cut.keep_one:
                keep = part[:1]  # [1]
                zeros = torch.zeros_like(self.completion_mask)  # [N, C]
                source = dataclasses.replace(self, completion_mask=zeros, loss_mask=zeros)
            batches.append(MicroBatch(source.select(keep, cut.pad_to_multiple_of), keep, len(part),
                                      int(self.loss_mask[part].sum().item())))
        return batches


@dataclass(frozen=True)
class Cut:
    """How a generation batch is cut into micro-batches (`Rollout.micro_batches`), kept with its fixed log-probs."""

    size: int  # rows per micro-batch
    skip_zero_advantage: bool
    keep_one: bool
    # Every row trains, none masked out of the loss left out either: a mixture-of-experts router's load-balancing
    # loss (policy/router.py) is over all the rows' tokens. Not in checkpoints written before it: False there.
    every_row: bool = False
    pad_to_multiple_of: int | None = None  # TRL's: each micro-batch's prompt and completion widths a multiple of it


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch ready for the loss: `rollout` holds the rows the forward sees, rows `index` of the
    generation batch; `rows` and `tokens` (in the loss mask) count the whole micro-batch, the loss's divisors."""

    rollout: Rollout
    index: torch.Tensor  # [n]
    rows: int
    tokens: int

    @property
    def trained_tokens(self) -> int:
        """Loss tokens of the rows the forward sees: what per-token metrics average over."""
        return int(self.rollout.loss_mask.sum().item())

    @property
    def empty(self) -> bool:
        """No row left to forward (one process only: the cut keeps one where there are several ranks)."""
        return len(self.rollout.completions) == 0

    @property
    def skipped(self) -> int:
        """Rows left out of the forward and backward (a row kept only to run the forward counts too)."""
        return self.rows - int(self.rollout.loss_mask.any(dim=1).sum().item())


@dataclass(frozen=True)
class StepCounts:
    """What the loss and metrics of one optimizer step count, over all ranks."""

    tokens: float  # the generation batch's loss tokens, counted before rows were skipped
    trained: float  # the step's loss tokens trained on: per-token metrics average over them
    micro_batches: float
    rows: float
    skipped: float
    divisor: float  # the generation batch's loss tokens per step it feeds: TRL's dapo/cispo divisor


@dataclass
class Generation:
    """One generation batch for `num_iterations` optimizer steps: `batch` whole, cut by `cut` into `micro_batches`."""

    batch: Rollout  # this rank's
    cut: Cut
    metrics: dict

    def __post_init__(self):
        self.micro_batches = self.batch.micro_batches(self.cut)

    def fix_logprobs(self, forward) -> None:
        """Attach to each micro-batch with rows the log-probs fixed for the generation batch, `forward(rollout)`'s
        {"old_logprobs" | "ref_logprobs": [n, c]}, and write them into the whole batch's [N, C], which a checkpoint
        saves."""
        for m in (m for m in self.micro_batches if not m.empty):
            for name, values in forward(m.rollout).items():  # [n, c] each
                setattr(m.rollout, name, values)
                if getattr(self.batch, name) is None:
                    setattr(self.batch, name, values.new_zeros(self.batch.completion_ids.shape))  # [N, C]
                getattr(self.batch, name)[m.index, :values.shape[1]] = values[:, :self.batch.completion_ids.shape[1]]

    def correct_sampling(self, settings) -> dict[str, float]:
        """TRL's importance-sampling correction of a server's samples (algo/sampling_correction, `settings` its
        keywords): each micro-batch's `sampling_weights` (and the whole batch's [N, C] for a checkpoint); returns
        the batch's metrics, over the rows trained on."""
        differences, ratios = [], []
        for m in (m for m in self.micro_batches if not m.empty):
            r = m.rollout
            weights, d, ratio = sampling_correction(r.old_logprobs, r.sampling_logprobs, r.loss_mask, **settings)
            r.sampling_weights = weights.contiguous()  # [n, c]
            if self.batch.sampling_weights is None:
                self.batch.sampling_weights = torch.ones_like(self.batch.sampling_logprobs)  # [N, C]
            self.batch.sampling_weights[m.index, :weights.shape[1]] = weights[:, :self.batch.completion_ids.shape[1]]
            differences.append(d)
            ratios.append(ratio)
        return correction_metrics(torch.cat(differences).float().cpu() if differences else torch.zeros(0),
                                  torch.cat(ratios).float().cpu() if ratios else torch.zeros(0))

    def step_counts(self, step: list[MicroBatch], reduce) -> StepCounts:
        """The counts of an optimizer step on micro-batches `step`, summed over ranks by `reduce`."""
        counts = reduce({"tokens": int(self.batch.loss_mask.sum().item()),
                         "trained": sum(m.trained_tokens for m in step), "micro_batches": len(step),
                         "rows": sum(m.rows for m in step), "skipped": sum(m.skipped for m in step)})
        return StepCounts(**counts, divisor=counts["tokens"] * len(step) / len(self.micro_batches))

    def state_dict(self) -> dict:
        """The checkpoint's form: the batch's fields by name, the cut and metrics."""
        return {"batch": {f.name: getattr(self.batch, f.name) for f in dataclasses.fields(self.batch)},
                "cut": dataclasses.asdict(self.cut), "metrics": self.metrics}

    @classmethod
    def from_state_dict(cls, saved: dict, device: torch.device) -> Generation:
        """The inverse of `state_dict`, the batch's tensors moved (back) to `device` and cut again."""
        batch = Rollout(**saved["batch"]).to(device)
        return cls(batch, Cut(**saved["cut"]), saved["metrics"])


def with_advantages(rollout: Rollout, advantages: torch.Tensor, mask_truncated: bool) -> Rollout:
    """`rollout` with its advantages [N] and the loss mask the loss reads (no truncated row with `mask_truncated`)."""
    loss_mask = rollout.loss_mask
    if mask_truncated:
        loss_mask = loss_mask * (~rollout.truncated).to(loss_mask.dtype)[:, None]  # [N, C]
    return dataclasses.replace(rollout, loss_mask=loss_mask, advantages=advantages.to(rollout.completion_ids.device))


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/*` metrics from lengths [N] and truncation flags [N] (terminated: 0 where none ended)."""
    ended = lengths[~truncated.bool()].float()  # [n]
    ended = ended if ended.numel() else torch.zeros(1)  # [n >= 1]
    return {"completions/mean_length": lengths.float().mean().item(),
            "completions/min_length": lengths.float().min().item(),
            "completions/max_length": lengths.float().max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}


def tool_metrics(calls: torch.Tensor, failures: torch.Tensor) -> dict[str, float]:
    """TRL's tool metrics from each completion's calls [N] and failed calls [N] (failures per call, 0 without)."""
    return {"tools/call_frequency": calls.mean().item(),
            "tools/failure_frequency": (failures.sum() / calls.sum().clamp(min=1)).item()}


def generation_metrics(rollout: Rollout, rewards: torch.Tensor, per_func: torch.Tensor, context: RewardContext,
                       generate_s: float, reward_names: list[str], num_generations: int, dist) -> dict[str, float]:
    """A generation batch's metrics over all ranks (`dist`: infra/distributed's): rewards (every rank's, `rewards`
    [W*N] and `per_func` [W*N, F]), lengths, groups without signal, what the reward functions logged, timing."""
    lengths = dist.gather(rollout.completion_mask.sum(1).float())  # [W*N]
    truncated = dist.gather(rollout.truncated.float())  # [W*N]
    tools = {} if rollout.tool_calls is None else tool_metrics(dist.gather(rollout.tool_calls.float()),
                                                               dist.gather(rollout.tool_failures.float()))
    applied = ~per_func.isnan().all(dim=1)  # [W*N]
    return {**reward_metrics(rewards, per_func, reward_names), **length_metrics(lengths, truncated), **tools,
            "frac_reward_zero_std": zero_std_fraction(rewards, num_generations, applied),
            **context.metrics_over(dist), "perf/generate_s": generate_s,
            "perf/tokens_per_s": lengths.sum().item() / generate_s}
