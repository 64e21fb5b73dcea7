"""Predicted peak memory of a GRPO run, from architecture numbers and settings alone (pure arithmetic): which
parts (memory/parts.py: their bytes) each moment of a step holds, and the largest moment.

Optimizer states exist from the first step on, gradients only between the first backward and the optimizer step
(they are freed, not zeroed). A decode takes as many prompts as fit beside the peak of the other moments, so it never
raises it (`Estimate.decode_prompts`, `Estimate.eval_prompts`). With `async_generation` the sampler process
decodes during every training moment. Sizes are in bytes; `GB` is 1e9 bytes, as `memory/peak_gb`'s."""
from __future__ import annotations

from dataclasses import dataclass

from ..policy.precision import Precision
from ..settings.components import MemorySettings
from ..settings.plan import RunPlan
from .parts import Architecture, Dtypes, dtypes, generation_bytes, part_bytes, prompts_to_evaluate, prompts_to_sample

GB = 1e9
KEPT = ("weights", "optimizer states", "reference model", "rollouts")  # parts every moment holds


@dataclass
class Estimate:
    """Bytes per part, the parts each moment holds, the peak moment, and the prompts a decode takes."""

    parts: dict[str, float]
    moments: dict[str, tuple[str, ...]]
    decode_prompts: int = 1  # prompts one sampling decode takes (this rank's)
    eval_prompts: int = 1  # prompts one greedy evaluation decode takes

    def total(self, moment: str) -> float:
        return sum(self.parts[p] for p in self.moments[moment])

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_moment)


def settings_of(config, device: str = "cuda") -> tuple[MemorySettings, Precision]:
    """What the planner reads of a `grpo.Config` on `device` ("cuda" or "cpu"): the settings as the run plan
    resolves them for one rank (the ranks are not known here), and the dtype plan."""
    precision = Precision.of(config, device)
    return RunPlan.resolve(config, world_size=1, bf16_sampling=precision.bf16_sampling).memory, precision


def estimate(a: Architecture, config, device: str = "cuda") -> Estimate:
    """Peak memory of training `a` with the settings of `config` (a `grpo.Config`) on `device` ("cuda" or
    "cpu"): `plan_peak` of `settings_of`."""
    m, precision = settings_of(config, device)
    return plan_peak(a, m, dtypes(precision, m.use_lora))


def plan_peak(a: Architecture, m: MemorySettings, d: Dtypes) -> Estimate:
    """Peak memory of training `a` with the planner's settings `m` under the dtype plan `d`, prompts counted at
    max_prompt_length (the worst case), the decodes sized to the room the moments leave."""
    own = moments = _moments(m, d)  # the trainer's, decoding in its generation moment
    if m.async_generation:  # the sampler process decodes while the trainer trains (run/ahead.py): every training
        # moment holds a decode too, and every moment the trainable weights' copy the two share
        decoding = ("KV cache", "sampling buffers", "sampling weight copies", "sampler's weight copy")
        moments = {name: held + (decoding if name != "generation" else ("sampler's weight copy",))
                   for name, held in own.items()}
    # A decode's room: what the peak leaves beside what every moment keeps and the sampling weight copies. The
    # sampling decode's own parts count nothing until it is sized.
    parts = {**part_bytes(a, m, d), "KV cache": 0.0, "sampling buffers": 0.0}
    kept, copies = sum(parts[p] for p in KEPT), parts["sampling weight copies"]
    prompts = prompts_to_sample(a, m, d, Estimate(parts, own).peak - kept - copies)
    parts["KV cache"], parts["sampling buffers"] = generation_bytes(a, m, d, prompts * m.num_generations, prompts)
    # Evaluation runs between steps, within the training peak that the run needs anyway.
    evaluation = prompts_to_evaluate(a, m, d, Estimate(parts, moments).peak - kept - copies)
    return Estimate(parts, moments, prompts, evaluation)


def _moments(m: MemorySettings, d: Dtypes) -> dict[str, tuple[str, ...]]:
    """The parts each moment of the trainer's step holds."""
    kept = KEPT
    # Autocast keeps its weight copies until the forward ends; for backward too, unless checkpointing
    # recomputes them layer by layer.
    copies = () if m.gradient_checkpointing else ("autocast weight copies",)
    # While the log-prob backward runs, the head's gradient grows in the float32 accumulator, when there is one.
    head_accumulating = (("LM-head float32 accumulator", "LM-head gradient block") if d.bf16_trained
                         else ("LM-head gradient",))
    return {
        "generation": kept + ("KV cache", "sampling buffers", "sampling weight copies"),
        "forward end": kept + ("activations", "autocast weight copies", "log-prob chunk", "log-prob jacobian",
                               "earlier micro-batches' gradients"),
        "backward start": kept + ("activations", "log-prob chunk", "log-prob jacobian",
                                  "earlier micro-batches' gradients") + head_accumulating + copies,
        "log-prob backward end": kept + ("activations", "LM-head float32 accumulator", "LM-head gradient",
                                         "earlier micro-batches' gradients"),
        "layer recompute": kept + ("activations", "recomputed layer", "LM-head gradient",
                                   "earlier micro-batches' gradients"),
        "backward end": kept + ("gradients", "pending embedding gradients"),
        "optimizer step": kept + ("gradients", "optimizer step temporaries"),
    }
