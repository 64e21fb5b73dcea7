"""Int8 copies of linear weights for sampling on a CPU (Config.int8_sampling_weights): each output channel
quantized to int8 with its own scale (symmetric, 127 steps each side), packed for fbgemm's int8 GEMM. On AVX2's
integer instructions a decoding step's 16-64 rows then multiply 1.5-4x faster than in float32, where such a step
is compute-bound (docs/benchmarks.md, "Decoding at the speed of memory", which also measures the accuracy).

fbgemm's own activation quantization (`quantized::linear_dynamic`: 7 bits, one scale for all the rows) would
make a row's result depend on the other rows of the batch and lose a small model's activations. So each row is
divided by its own largest magnitude and goes in as two passes on fbgemm's 127-step grid of [-1, 1] (about 14
bits, `Int8Linear.__call__`), with a guard row [1, -1, 0, ..] that pins every call's range to [-1, 1]: fbgemm
reads every value exactly and each row's output is the same whatever the batch."""
from __future__ import annotations

import weakref

import torch

ENGINES = ("x86", "fbgemm")  # torch's quantized engines whose linear_dynamic is fbgemm's
TINY = 1e-30  # the scale of an all-zero row or channel (its values stay 0)
STEP = 2 / 127  # the activations' grid: fbgemm quantizes the range [-1, 1] to 0..127 (reduce_range), zero at 64


def int8_refusal() -> str | None:
    """Why int8 sampling weights cannot run with this torch on this CPU (one line), or None."""
    engine = torch.backends.quantized.engine
    if engine not in ENGINES or not any(e in torch.backends.quantized.supported_engines for e in ENGINES):
        return (f"int8_sampling_weights=True needs torch's fbgemm (x86) quantized engine, and this torch's is "
                f"{engine!r} (supported: {', '.join(torch.backends.quantized.supported_engines) or 'none'})")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return (f"int8_sampling_weights=True needs an x86 CPU with AVX2 for fbgemm's int8 products; this one "
                f"offers {capability}")
    return None


class Int8Linear:
    """`x [n, in] -> x @ W.T + b [n, out]` on int8 copies of the weights of one or more linears sharing their
    input, stacked by output (q, k and v as one product), made when constructed (module docstring)."""

    def __init__(self, linears: list[torch.nn.Linear]):
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in linears]).float()  # [out, in]
            scales = weight.abs().amax(1).clamp(min=TINY) / 127  # [out]
            zero = torch.zeros(len(weight), dtype=torch.long)
            quantized = torch.quantize_per_channel(weight, scales.double(), zero, 0, torch.qint8)  # [out, in]
            del weight
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
            biases = [m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features)
                      for m in linears]
            self.bias = torch.cat(biases) if any(m.bias is not None for m in linears) else None  # [out]
            self.guard = torch.zeros(1, linears[0].in_features)  # [1, in]: the range every call quantizes
            self.guard[0, :2] = torch.tensor([1.0, -1.0])
        self.sizes = [m.out_features for m in linears]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        a = x.abs().amax(-1, keepdim=True).clamp(min=TINY)  # [n, 1]: each row's own scale
        v = x / (a * STEP)  # [n, in]: in steps of the grid, within [-63.5, 63.5]
        # Both passes on the grid (fbgemm's rounding never decides), inside the guard's range (-64 steps would
        # widen it, and the grid would depend on the batch): x = a * STEP * (k + r / 127) to 1/127 of a step.
        k = v.round().clamp_(-63, 63)  # [n, in]
        r = (v - k).mul_(127).round_().clamp_(-63, 63)  # [n, in]: what k missed, in 127ths of a step
        y = torch.ops.quantized.linear_dynamic(torch.cat([k.mul_(STEP), r.mul_(STEP), self.guard]), self.packed,
                                               True)  # [2n+1, out]
        y = torch.add(y[:n], y[n:2 * n], alpha=1 / 127).mul_(a)  # [n, out]
        return y if self.bias is None else y + self.bias

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The product's outputs of each stacked linear: views [n, out_i]."""
        return self(x).split(self.sizes, -1)


_kept: list = []  # [(a frozen weight, its version, its copy)]: the last frozen linear quantized (a run's LM head)


def int8_copy(linear: torch.nn.Linear) -> Int8Linear:
    """`Int8Linear([linear])`, kept from one decode to the next while `linear`'s weight is frozen and unchanged
    (the same tensor, its version counter not moved by an in-place write): a LoRA run's LM head is quantized
    once; a trained weight is quantized at every decode."""
    weight = linear.weight
    if weight.requires_grad:
        return Int8Linear([linear])
    if not (_kept and _kept[0][0]() is weight and _kept[0][1] == weight._version):
        _kept[:] = [(weakref.ref(weight), weight._version, Int8Linear([linear]))]
    return _kept[0][2]
