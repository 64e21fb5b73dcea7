"""bf16 weights that still learn from small updates: AdamW computed in float32 on a float32 copy of a slice
of the weight, written back to bf16 with stochastic rounding.

bf16 keeps 8 significant bits: neighbouring values are 2^-8 to 2^-7 apart, relative. A step of lr ~1e-6
times Adam's O(1) normalized update is far below half that spacing, so round-to-nearest writes back the
same weight, every step: the update is lost. Stochastic rounding rounds up with probability equal to the
distance already covered, so the expected written value is the float32 one and small steps add up."""
from __future__ import annotations

import math

import torch

_LOW_BITS = 1 << 16  # the float32 bits below bf16's mantissa
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32: keeps sign, exponent and bf16's 7 mantissa bits


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (float32) rounded to bf16, up or down at random so that E[result] == x: 16 uniform random bits added
    below bf16's mantissa, then truncated, carry into the kept bits with probability (x - round_down(x)) /
    spacing (sign-magnitude: negative values alike). inf stays inf; NaN stays NaN for the NaNs arithmetic
    produces (0x7FC00000, 0xFFC00000)."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 takes float32, got {x.dtype}")
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = noise.add_(x.view(torch.int32)).bitwise_and_(_HIGH_MASK)  # exactly representable in bf16 now
    return bits.view(torch.float32).to(torch.bfloat16)


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW for bf16 (or float32) weights with float32 states. Each weight is updated in slices of
    `slice_size` elements: the slice and its gradient are copied to float32, updated, and a bf16 weight
    gets the result stochastically rounded (a float32 weight gets it as is). Float32 temporaries stay at a
    few slices, never a whole embedding."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8,
                 slice_size: int = 1 << 22):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps})
        self.slice_size = slice_size

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                state["step"] += 1
                self._update(p, state, group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        p.data = p.data.contiguous()  # a no-op for the parameters models make
        weight, grad = p.data.view(-1), grad.contiguous().view(-1)  # [n] each
        m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)  # [n] float32
        lr, (beta1, beta2), step = group["lr"], group["betas"], state["step"]  # step counts from 1
        for start in range(0, weight.numel(), self.slice_size):
            part = slice(start, start + self.slice_size)
            w32, g32 = weight[part].float(), grad[part].float()  # w32: a copy for bf16, the weight itself for float32
            # torch.optim.AdamW's arithmetic, in place
            w32.mul_(1 - lr * group["weight_decay"])
            m[part].lerp_(g32, 1 - beta1)
            v[part].mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            denom = (v[part].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
            w32.addcdiv_(m[part], denom, value=-lr / (1 - beta1**step))
            if weight.dtype == torch.bfloat16:
                weight[part].copy_(stochastic_round_to_bf16(w32))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating states to the weight's dtype (bf16 here): put the saved float32 back."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[params[index]][key] = saved[key].to(params[index].device, torch.float32, copy=True)
