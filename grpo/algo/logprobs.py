"""Per-token log-probabilities from hidden states and the LM head, without full logits.

Full logits are ``[B, T, V]``; with V ~ 150k they dwarf everything else in a GRPO step (B=8, T=1024 is ~5 GB in
float32; plain autograd peaks at about four such copies). ``token_logprobs`` walks the ``N = B * T`` token rows
in chunks, keeps only one chunk of logits alive at a time, and recomputes a chunk's logits in backward.

Some model families transform the LM head's output before the softmax (Cohere scales it, Granite divides
it, Gemma 2 soft-caps it): ``transform_logits_`` applies ``softcap * tanh(scale * x / softcap)`` (or
``scale * x`` without a cap) here and in sampling alike, so both score the model's own distribution."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import HEAD_GRAD_BLOCK, LOGPROB_CHUNK_SIZE

# Vocabulary columns per block of a soft cap's or the entropy's backward: bounds their [c, block] temporaries.
_GRAD_BLOCK = 4096
# Elements per row block of the entropy's forward (16 MB in float32): bounds its exponentials' temporary.
_ENTROPY_BLOCK = 1 << 22


def transform_logits_(logits: Tensor, scale: float = 1.0, softcap: float | None = None) -> Tensor:
    """In place: ``softcap * tanh(scale * logits / softcap)``, or ``scale * logits`` when ``softcap`` is None;
    what a family's forward does to ``hidden @ W.T + b`` before returning its logits."""
    if softcap is None:
        if scale != 1.0:
            logits *= scale
        return logits
    logits *= scale / softcap
    return logits.tanh_().mul_(softcap)


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types; float64 stays float64 (gradcheck needs it)."""
    return torch.promote_types(dtype, torch.float32)


class _Workspace:
    """Chunk-sized logits buffers reused across chunks: on CPU, every fresh multi-hundred-MB allocation is a new
    mmap whose page faults cost more than the matmul."""

    def __init__(self, rows: int, weight: Tensor):
        vocab, dtype = weight.shape[0], _softmax_dtype(weight.dtype)
        self.logits = weight.new_empty(rows, vocab, dtype=dtype)  # [c, V]
        # Low-precision matmul output, upcast into self.logits (none when already float32).
        self.raw = weight.new_empty(rows, vocab) if weight.dtype != dtype else None  # [c, V]

    def chunk_logits(self, h: Tensor, weight: Tensor, bias: Tensor | None, scale: float, softcap: float | None,
                     temperature: float) -> Tensor:
        """Transformed, tempered float32 logits of one chunk of rows, in the shared buffer."""
        c = h.shape[0]
        logits = self.logits[:c]  # [c, V]
        h = h.to(weight.dtype)  # [c, H]
        if self.raw is None:
            torch.mm(h, weight.T, out=logits)
        else:
            # Matmul in the input dtype: no float32 copy of the [V, H] weight.
            logits.copy_(torch.mm(h, weight.T, out=self.raw[:c]))
        if bias is not None:
            logits += bias  # [c, V]
        transform_logits_(logits, scale, softcap)  # [c, V]
        if temperature != 1.0:
            logits /= temperature  # [c, V]
        return logits

    def low_precision(self, values: Tensor, dtype: torch.dtype) -> Tensor:
        """``values`` cast to ``dtype``, in the shared buffer when a cast is needed."""
        if values.dtype == dtype:
            return values
        return self.raw[: values.shape[0]].copy_(values)  # [c, V]


def _forward_chunk(
    logits: Tensor, targets: Tensor, want_entropy: bool, leave_probs: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Return (logprob of target, logsumexp, entropy or None) of a chunk; destroys ``logits``, or with
    ``leave_probs`` leaves the softmax probabilities in it."""
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)  # [c]
    row_max = logits.amax(dim=1, keepdim=True)  # [c, 1]
    logits -= row_max  # [c, V], shifted so exp cannot overflow
    if want_entropy:
        # H = log Z - sum(e * z) / Z with z the shifted logits, e = exp(z) and Z = sum(e). It needs z and e
        # together: by blocks of rows, so e is a small temporary instead of a second [c, V] buffer.
        sum_exp, weighted = logits.new_empty(logits.shape[0]), logits.new_empty(logits.shape[0])  # [c], [c]
        rows = max(1, _ENTROPY_BLOCK // logits.shape[1])
        for r in range(0, logits.shape[0], rows):
            z = logits[r:r + rows]  # [r, V]
            e = z.exp()  # [r, V]
            sum_exp[r:r + rows] = e.sum(dim=1)
            weighted[r:r + rows] = e.mul_(z).sum(dim=1)
        entropy = sum_exp.log() - weighted / sum_exp  # [c]
        if leave_probs:
            logits.sub_(sum_exp.log()[:, None]).exp_()  # [c, V]
    else:
        sum_exp = logits.exp_().sum(dim=1)  # [c]
        entropy = None
        if leave_probs:
            logits /= sum_exp[:, None]  # [c, V]
    lse = row_max.squeeze(1) + sum_exp.log()  # [c]
    return target_logits - lse, lse, entropy


def _blocked_grad_(z: Tensor, lse: Tensor, targets: Tensor, g_logp: Tensor, entropy_grad: tuple | None,
                   tau_over_cap: float | None) -> Tensor:
    """In place: dL/dz for L = sum_r g_logp[r] logp[r, t_r] + g_ent[r] H[r] over the tempered logits z[c, V], times
    (1 - tanh^2) under a soft cap (tanh = z * tau / cap). With p = softmax(z) and log p = z - lse,
    dH/dz = -p (log p + H), so dL/dz = g_logp onehot(t) - p (g_logp + g_ent (log p + H)). `entropy_grad` is
    (g_ent, H), or None when the entropy is not in the loss. Column blocks keep the temporaries [c, block]."""
    g = g_logp[:, None]  # [c, 1]
    target = g  # [c, 1]: the one-hot term
    if tau_over_cap is not None:
        target = g * (z.gather(1, targets[:, None]) * tau_over_cap).square_().neg_().add_(1.0)  # [c, 1]
    for v0 in range(0, z.shape[1], _GRAD_BLOCK):
        block = z[:, v0:v0 + _GRAD_BLOCK]  # [c, v]
        dtanh = None if tau_over_cap is None else torch.mul(block, tau_over_cap).square_().neg_().add_(1.0)  # [c, v]
        block.sub_(lse[:, None])  # [c, v]: log p
        if entropy_grad is None:
            block.exp_().mul_(-g)  # [c, v]
        else:
            g_ent, entropy = entropy_grad  # [c], [c]
            probs = block.exp()  # [c, v]
            block.add_(entropy[:, None]).mul_(g_ent[:, None]).add_(g).mul_(probs).neg_()  # [c, v]
        if dtanh is not None:
            block.mul_(dtanh)  # [c, v]
    return z.scatter_add_(1, targets[:, None], target)  # [c, V]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked log-softmax-gather whose backward recomputes logits chunk by chunk; or, when only the hidden
    states need a gradient (a frozen head: LoRA), whose forward keeps d logp / d hidden, so backward only scales it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, temperature, chunk_size, want_entropy):
        n, dtype = hidden.shape[0], _softmax_dtype(weight.dtype)
        logprobs = hidden.new_empty(n, dtype=dtype)  # [N]
        lse = hidden.new_empty(n, dtype=dtype)  # [N]
        entropy = hidden.new_empty(n if want_entropy else 0, dtype=dtype)  # [N] or [0]
        # d logp[t] / d hidden = (onehot(t) - p) @ W * f'/tau does not depend on the loss: with a frozen head,
        # taking it now from the probabilities at hand spares backward the chunk's logits, recomputed (the
        # entropy's gradient, when the loss has one, still recomputes them). Not under a soft cap: f' varies.
        frozen_head = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3]) and softcap is None
        jacobian = hidden.new_empty(hidden.shape, dtype=dtype) if frozen_head else None  # [N, H]
        work = _Workspace(min(chunk_size, n), weight)
        # Autocast would change the matmul dtype between forward and the recomputation in
        # backward, making the saved logsumexp inconsistent with the recomputed logits.
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                logits = work.chunk_logits(hidden[s:e], weight, bias, scale, softcap, temperature)  # [c, V]
                lp, chunk_lse, ent = _forward_chunk(logits, targets[s:e], want_entropy, leave_probs=frozen_head)
                if frozen_head:
                    grad_z = logits.neg_().scatter_add_(1, targets[s:e, None], torch.ones_like(lp[:, None]))  # [c, V]
                    jacobian[s:e] = work.low_precision(grad_z, weight.dtype) @ weight  # [c, H]
                logprobs[s:e] = lp
                lse[s:e] = chunk_lse
                if want_entropy:
                    entropy[s:e] = ent
        del work
        if frozen_head:
            jacobian *= scale / temperature  # [N, H]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, jacobian)
        ctx.scale, ctx.softcap, ctx.temperature, ctx.chunk_size = scale, softcap, temperature, chunk_size
        ctx.set_materialize_grads(False)  # an output left out of the loss gets None: no entropy term to add
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, jacobian = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if jacobian is not None and grad_entropy is None and grad_logprobs is not None:
            grad_hidden = (grad_logprobs[:, None] * jacobian).to(hidden.dtype)  # [N, H]
            return grad_hidden, None, None, None, None, None, None, None, None
        scale, cap, tau, n = ctx.scale, ctx.softcap, ctx.temperature, hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_h else None  # [N, H]
        # Float32 accumulators only for what is trained: a frozen head costs no [V, H] buffer.
        acc_dtype = lse.dtype
        grad_weight = weight.new_zeros(weight.shape, dtype=acc_dtype) if need_w else None  # [V, H]
        grad_bias = bias.new_zeros(bias.shape, dtype=acc_dtype) if need_b else None  # [V]
        if grad_logprobs is None:  # only the entropy is in the loss
            grad_logprobs = torch.zeros_like(lse)  # [N]
        work = _Workspace(min(ctx.chunk_size, n), weight)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, ctx.chunk_size):
                e = min(s + ctx.chunk_size, n)
                logits = work.chunk_logits(hidden[s:e], weight, bias, scale, cap, tau)  # [c, V]
                # z = f(x) / tau with x = h @ W.T + b: d logp[t] / dx = (onehot(t) - softmax(z)) * f'(x) / tau,
                # f'(x) = scale, or scale * (1 - tanh^2) under a soft cap.
                if cap is None and grad_entropy is None:
                    probs = logits.sub_(lse[s:e, None]).exp_()  # [c, V], softmax in place
                    grad_logits = probs.neg_()  # [c, V]
                    grad_logits.scatter_add_(1, targets[s:e, None], torch.ones_like(lse[s:e, None]))
                    grad_logits *= (grad_logprobs[s:e] * scale / tau)[:, None]  # [c, V]
                else:
                    entropy_grad = None if grad_entropy is None else (grad_entropy[s:e], entropy[s:e])
                    grad_logits = _blocked_grad_(logits, lse[s:e], targets[s:e], grad_logprobs[s:e], entropy_grad,
                                                 None if cap is None else tau / cap)  # [c, V]
                    grad_logits *= scale / tau  # [c, V]
                if need_b:
                    grad_bias += grad_logits.sum(dim=0)  # [V]
                grad_logits = work.low_precision(grad_logits, weight.dtype)  # [c, V]
                if need_h:
                    grad_hidden[s:e] = (grad_logits @ weight).to(hidden.dtype)  # [c, H]
                if need_w and grad_logits.dtype == acc_dtype:
                    grad_weight.addmm_(grad_logits.T, hidden[s:e].to(weight.dtype))  # [V, H]
                elif need_w:  # a low-precision matmul for speed, summed into float32 across chunks, blocked over V
                    h = hidden[s:e].to(weight.dtype)  # [c, H]
                    for v0 in range(0, grad_weight.shape[0], HEAD_GRAD_BLOCK):
                        block = slice(v0, v0 + HEAD_GRAD_BLOCK)
                        grad_weight[block] += grad_logits[:, block].T @ h  # [v, H]
        del work
        grad_weight = grad_weight.to(weight.dtype) if need_w else None  # [V, H]
        grad_bias = grad_bias.to(bias.dtype) if need_b else None  # [V]
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, logit_scale: float,
                  softcap: float | None, temperature: float, chunk_size: int) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree: {tuple(hidden.shape)} vs "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be hidden's shape without H, "
                         f"{tuple(hidden.shape[:-1])}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < logit_scale < float("inf"):
        raise ValueError(f"logit_scale must be positive and finite, got {logit_scale}")
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be None or positive and finite, got {softcap}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.is_floating_point():
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if targets.numel() and (targets.min() < 0 or targets.max() >= weight.shape[0]):
        # gather would raise on CPU but may corrupt or assert on an accelerator.
        raise ValueError(f"targets must lie in [0, {weight.shape[0]}); got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")


def token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                   bias: Tensor | None = None, chunk_size: int = LOGPROB_CHUNK_SIZE, return_entropy: bool = False,
                   logit_scale: float = 1.0, softcap: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each target token ``[B, T]`` (ids in ``[0, V)``) under ``softmax(f(hidden @ weight.T +
    bias) / temperature)`` (hidden ``[B, T, H]``, any leading shape; weight ``[V, H]``; bias ``[V]`` or None),
    with ``f(x) = softcap * tanh(logit_scale * x / softcap)``, or ``logit_scale * x`` when ``softcap`` is None
    (the model family's transform, grpo.policy.head). ``chunk_size`` token rows have their logits materialized
    at once: peak extra memory about ``chunk_size * V * 4`` bytes (1.5 times for a bf16 head), plus the weight
    gradient when it is trained. ``return_entropy``: also the per-token entropy of the tempered distribution
    (differentiable, its gradient recomputed chunk by chunk like the log-probs').

    The matmul runs in the weight's dtype, the softmax in float32 (float64 for a float64 weight). Gradients go to
    ``weight`` / ``bias`` only when they require grad; when only ``hidden`` does (a frozen head, no soft cap),
    forward keeps ``d logp / d hidden`` ``[N, H]`` (float32): one head matmul per chunk instead of two.

    Returns:
        float32 ``[B, T]`` log-probs, or ``(logprobs, entropy)`` with entropy float32 ``[B, T]``."""
    _check_inputs(hidden, weight, targets, bias, logit_scale, softcap, temperature, chunk_size)
    logprobs, entropy = _TokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(), float(logit_scale),
        None if softcap is None else float(softcap), float(temperature), int(chunk_size), return_entropy)  # [N]
    logprobs = logprobs.view(targets.shape)  # [B, T]
    return (logprobs, entropy.view(targets.shape)) if return_entropy else logprobs  # [B, T], [B, T]
