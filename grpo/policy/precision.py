"""The run's dtype plan, decided once from the device and the `bf16` setting (`uses_bf16`), so that every
place that casts or autocasts reads the same answer, on CUDA and in the CPU rehearsal of the CUDA plan alike.

Under bf16: a frozen LoRA base (and QLoRA's 4-bit layers' compute) in bf16 with float32 adapters (peft upcasts
them); fully trained weights stay float32, since bf16 weights would round away updates of lr ~1e-6, and their
forwards run under bf16 autocast; full fine-tuning's frozen reference copy is bf16 (forward-only: half the
memory); FSDP gathers bf16 and reduces float32. Otherwise everything is float32."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """The dtypes of a run, built once (Precision.plan) and read by loading, the reference copy and autocast."""

    device_type: str  # "cuda" or "cpu": where the policy runs
    bf16: bool  # compute in bf16 (autocast for the forwards that score tokens)
    base_dtype: torch.dtype  # the weights load_model loads (bf16 only for a frozen LoRA / 4-bit base)
    reference_dtype: torch.dtype  # full fine-tuning's frozen reference copy

    @classmethod
    def plan(cls, bf16: bool | None, use_lora: bool, device: torch.device | str | None = None,
             bf16_weights: bool = False) -> Precision:
        """The plan for `Config.bf16`, `use_lora` and `bf16_weights` on `device` (None: the one load_model uses).
        `bf16_weights` (full fine-tuning) keeps the trained weights and the reference in bf16 on any device: the
        optimizer rounds stochastically (policy/rounding.py)."""
        device_type = torch.device(device if device is not None else default_device()).type
        half = uses_bf16(bf16, device_type)
        low = torch.bfloat16 if half else torch.float32
        trained_bf16 = bf16_weights and not use_lora
        base = low if use_lora else torch.bfloat16 if trained_bf16 else torch.float32
        return cls(device_type=device_type, bf16=half, base_dtype=base,
                   reference_dtype=torch.bfloat16 if trained_bf16 else low)

    def autocast(self):
        """bf16 autocast for the policy's and the reference's log-prob forwards (sampling runs without it, in
        the weights' dtype)."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)


def default_device() -> torch.device:
    """Where load_model puts the policy: this rank's GPU when there is one (distributed.setup picks it)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def uses_bf16(bf16: bool | None, device_type: str) -> bool:
    """Whether a run computes in bf16: `bf16` None means on CUDA only (CPU kernels are slower in bf16, and
    float32 keeps CPU runs exact); True asks for the CUDA plan on CPU too (a rehearsal), False never."""
    return device_type == "cuda" if bf16 is None else bf16
