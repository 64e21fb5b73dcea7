"""Each prompt's own random stream, so that what a seed samples does not depend on how prompts are batched: how
many decode together (the memory plan), the evaluation batch size, the number of ranks.

Completion row j of a prompt draws its uniform for decoding step t as the t-th output of SplitMix64 (Steele,
Lea and Flood 2014) started from a hash of (run seed, step, the prompt's place in the run's prompt stream, j).
The draw is counter-based: a few integer operations on the rows still decoding, whatever rows have left, with
the same numbers on a CPU and a GPU. int64 tensors stand in for uint64 ones (which torch supports only in part):
sums and products wrap modulo 2^64 alike, and right shifts are made logical with a mask."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 over the golden ratio, odd
MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # its finalizer's (Stafford's "Mix13")


def int64(value: int) -> int:
    """`value` modulo 2^64 as a signed 64-bit integer: the int64 holding its uint64 bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """z >> k as on uint64 bits (torch's >> on int64 copies the sign bit into the top k)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors read as uint64: every output bit depends on every input bit."""
    z = (z ^ shift_right(z, 30)) * int64(MULTIPLIERS[0])
    z = (z ^ shift_right(z, 27)) * int64(MULTIPLIERS[1])
    return z ^ shift_right(z, 31)


@dataclass(frozen=True)
class PromptStreams:
    """The random streams of consecutive prompts: the i-th prompt handed over is the `first + i`-th the run has
    drawn from its prompt stream (all ranks counted), sampled at optimizer step `step`."""

    seed: int
    step: int = 0
    first: int = 0

    def after(self, n: int) -> PromptStreams:
        """The streams of the prompts from the n-th on."""
        return replace(self, first=self.first + n)

    def seeds(self, prompts: int, repeats: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N] int64: where each row's stream starts, for `prompts` prompts of `repeats` rows each, in a row."""
        prompt = self.first + torch.arange(prompts, device=device).repeat_interleave(repeats)  # [N]
        copy = torch.arange(repeats, device=device).repeat(prompts)  # [N]
        key = torch.zeros_like(prompt)  # [N]
        for part in (int64(self.seed), int64(self.step), prompt, copy):
            key = mix((key ^ part) + int64(GAMMA))  # [N]
        return key


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[n, s] float64 in [0, 1): draws `steps` [s] of the streams starting at `seeds` [n], 53 random bits each."""
    z = mix(seeds[:, None] + (steps + 1) * int64(GAMMA))  # [n, s]
    return shift_right(z, 11).double() * 2.0 ** -53  # [n, s]
