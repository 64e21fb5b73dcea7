"""The run's dtype plan, decided once from the device, the CPU and the `bf16` setting (`Precision.plan`), so that
every place that casts or autocasts reads the same answer, on CUDA and on a CPU alike (docs/architecture.md#precision:
what runs in bf16, `CpuBf16.read`, GRPO_CPU_BF16). Fully trained weights stay float32 (bf16 would round away updates
of lr ~1e-6) unless `bf16_weights`."""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError

ENV = "GRPO_CPU_BF16"  # "1" or "0": the plan takes the CPU to compute bf16 natively or not, whatever it reports


@dataclass(frozen=True)
class CpuBf16:
    """Whether this CPU computes bf16 natively (`native`), and what says so (`source`: its flags, or `ENV`)."""

    native: bool
    source: str

    @classmethod
    def read(cls) -> CpuBf16:
        """The CPU's answer, or GRPO_CPU_BF16's where it is set (ConfigError for a value other than 0 or 1)."""
        forced = os.environ.get(ENV)
        if forced is not None:
            if forced not in ("0", "1"):
                raise ConfigError(f"{ENV}={forced!r}: set it to 1 (the CPU computes bf16 natively), 0 (it does "
                                  f"not), or unset it (the CPU's own flags decide)")
            return cls(forced == "1", f"{ENV}={forced}")
        return _flags()


@functools.cache
def _flags() -> CpuBf16:
    """What the CPU's flags and torch's oneDNN say, asked once per process."""
    flags = [name for name, has in (("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
                                    ("AMX", torch.cpu._is_amx_tile_supported())) if has]
    if flags and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return CpuBf16(True, " and ".join(flags))
    return CpuBf16(False, f"{' and '.join(flags)}, but no oneDNN bf16" if flags else "no AVX512-BF16 or AMX")


@dataclass(frozen=True)
class Precision:
    """The dtypes of a run, built once (Precision.plan), read by loading, the reference, autocast, the sampler."""

    device_type: str  # "cuda" or "cpu": where the policy runs
    bf16: bool  # compute in bf16 (autocast for the forwards that score tokens)
    base_dtype: torch.dtype  # the weights load_model loads (bf16 only for a frozen LoRA / 4-bit base)
    reference_dtype: torch.dtype  # full fine-tuning's frozen reference copy
    why: str = ""  # what decided `bf16`, as `statement` says it

    @classmethod
    def plan(cls, bf16: bool | None, use_lora: bool, device: torch.device | str | None = None,
             bf16_weights: bool = False, cpu: CpuBf16 | None = None, int8_sampling: bool = False) -> Precision:
        """The plan for `Config.bf16`, `use_lora` and `bf16_weights` on `device` (None: the one load_model uses),
        `cpu` the CPU's answer (None: read here, where it decides). `bf16` True or False forces bf16; None means on
        CUDA, and on a CPU that computes bf16 natively unless int8_sampling_weights asks for float32 weights.
        `bf16_weights` (full fine-tuning) keeps the trained weights and the reference in bf16 on any device
        (policy/rounding.py)."""
        device_type = torch.device(device if device is not None else default_device()).type
        if bf16 is not None:
            half, why = bf16, f"bf16={bf16}"
        elif device_type == "cuda":
            half, why = True, "bf16=None and CUDA computes bf16 natively"
        elif device_type != "cpu":
            half, why = False, "bf16=None and bf16 on CUDA or a CPU only"
        elif int8_sampling:
            half, why = False, "bf16=None and int8_sampling_weights=True samples on int8 copies of float32 weights"
        else:  # only here the CPU's answer decides: a plan with bf16 set never asks the CPU
            cpu = cpu if cpu is not None else CpuBf16.read()
            half = cpu.native
            why = (f"bf16=None and this CPU computes bf16 natively ({cpu.source}); bf16=False keeps float32" if half
                   else f"bf16=None and this CPU has no native bf16 ({cpu.source}); bf16=True forces it, slower")
        low = torch.bfloat16 if half else torch.float32
        trained_bf16 = bf16_weights and not use_lora
        base = low if use_lora else torch.bfloat16 if trained_bf16 else torch.float32
        return cls(device_type=device_type, bf16=half, base_dtype=base,
                   reference_dtype=torch.bfloat16 if trained_bf16 else low, why=why)

    @classmethod
    def of(cls, config, device: torch.device | str | None = None) -> Precision:
        """The plan of a `grpo.Config` on `device` (`plan` of its settings)."""
        return cls.plan(config.bf16, config.use_lora, device, config.bf16_weights,
                        int8_sampling=config.int8_sampling_weights)

    @property
    def bf16_sampling(self) -> bool:
        """Whether our decode samples in bf16 (policy/decoder), its log-probs kept for TRL's correction: under
        bf16 on a CPU (on CUDA the decode runs on the weights as they are, uncorrected)."""
        return self.bf16 and self.device_type == "cpu"

    @property
    def statement(self) -> str:
        """The plan in one line, as a run says it at its start and `python -m grpo.plan` prints it."""
        return f"precision: {'bf16' if self.bf16 else 'float32'} on {self.device_type}: {self.why}"

    def autocast(self):
        """bf16 autocast for the policy's and the reference's log-prob forwards (sampling runs without it)."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()


def default_device() -> torch.device:
    """Where load_model puts the policy: this rank's GPU when there is one (distributed.setup picks it)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
