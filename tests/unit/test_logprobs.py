import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo.algo.logprobs as logprobs_module
from grpo.algo.logprobs import token_logprobs

ROOT = Path(__file__).resolve().parents[2]


def reference(hidden, weight, targets, temperature=1.0, bias=None, scale=1.0, softcap=None):
    """Full-logits float64 log-probs and entropy: the plain formula."""
    logits = hidden.double() @ weight.double().T  # [B, T, V]
    if bias is not None:
        logits = logits + bias.double()
    logits = scale * logits if softcap is None else softcap * torch.tanh(scale * logits / softcap)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # [B, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    return logp, entropy


def make_inputs(B, T, V, H, dtype, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (B, T), generator=gen)
    return hidden, weight, b, targets


def grads(out, grad_out, tensors):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], grad_out)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (dtype, tol) below: the relative error against the float64 full-logits reference. float32: a value's path sums
# ~70 terms (H = 16, V = 37, <= 18 tokens for a weight's gradient), n * u = 4e-6 the worst case (measured <= 1.7e-6);
# 1e-5. float64: 1e-10 is 10^5 x its 70 * 2**-53 = 8e-15. A wrong softmax, temperature, bias or transform is off
# by >= 1e-3 (each test's own "must matter" check: > 0.1, > 0.01).


def test_hand_computed():
    # V=2, H=1, W = [[1], [0]], h = ln 3: logits [ln 3, 0] -> softmax [3/4, 1/4]
    # logp(0) = ln 0.75 = -0.2876821, logp(1) = ln 0.25 = -1.3862944
    # entropy = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623351
    # tau = 2: logits [ln 3 / 2, 0] -> exp [sqrt 3, 1] -> p0 = sqrt3 / (1 + sqrt3) = 0.6339746
    hidden = torch.full((1, 2, 1), math.log(3.0), dtype=torch.float64)
    weight = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    targets = torch.tensor([[0, 1]])
    logp, ent = token_logprobs(hidden, weight, targets, return_entropy=True)
    # float64 against hand values kept to 7 decimals (within 5e-8): abs 1e-7, here and below
    assert logp.tolist()[0] == pytest.approx([-0.2876821, -1.3862944], abs=1e-7)
    assert ent.tolist()[0] == pytest.approx([0.5623351] * 2, abs=1e-7)
    logp = token_logprobs(hidden, weight, targets, temperature=2.0)
    assert logp[0, 0].item() == pytest.approx(math.log(0.6339746), abs=1e-7)
    # bias [0, ln 3] cancels the hidden term: uniform, logp = ln 0.5 = -0.6931472
    bias = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    logp = token_logprobs(hidden, weight, targets, bias=bias)
    assert logp.tolist()[0] == pytest.approx([-0.6931472] * 2, abs=1e-7)


CASES = [
    # B, T, chunk_size, temperature, bias
    (2, 8, 4, 1.0, False),  # chunk divides T
    (2, 7, 3, 0.7, True),  # chunk divides neither T nor N
    (3, 5, 512, 1.3, False),  # one chunk larger than N
    (1, 9, 1, 0.5, True),  # one row per chunk
]


@pytest.mark.parametrize("B, T, chunk, tau, with_bias", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_reference_values_and_grads(B, T, chunk, tau, with_bias, dtype, tol):
    V, H = 37, 16
    hidden, weight, bias, targets = make_inputs(B, T, V, H, dtype, seed=B * T, bias=with_bias)
    logp = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias, chunk_size=chunk)
    expected, _ = reference(hidden, weight, targets, tau, bias)
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert logp.shape == (B, T)
    assert rel_err(logp, expected) < tol
    grad_out = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = grads(logp, grad_out.to(logp.dtype), (hidden, weight, bias))
    want = grads(expected, grad_out, (hidden, weight, bias))
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert rel_err(g, w) < tol


def test_hand_computed_head_transforms():
    # scale 0.5 turns logits [2, 0] into [1, 0]: logp(0) = 1 - ln(1 + e) = -0.3132617
    hidden = torch.full((1, 1, 1), 2.0, dtype=torch.float64)
    weight = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    logp = token_logprobs(hidden, weight, torch.tensor([[0]]), logit_scale=0.5)
    assert logp.item() == pytest.approx(-0.3132617, abs=1e-7)
    # soft cap 2 turns x = 2 atanh(ln 3 / 2) into 2 tanh(x / 2) = ln 3: softmax [3/4, 1/4] as above
    hidden = torch.full((1, 2, 1), 2 * math.atanh(math.log(3.0) / 2), dtype=torch.float64)
    logp = token_logprobs(hidden, weight, torch.tensor([[0, 1]]), softcap=2.0)
    assert logp.tolist()[0] == pytest.approx([-0.2876821, -1.3862944], abs=1e-7)
    # scale 2 and cap 2 on x = atanh(ln 3 / 2): the scale comes first, then the cap
    hidden = torch.full((1, 1, 1), math.atanh(math.log(3.0) / 2), dtype=torch.float64)
    logp = token_logprobs(hidden, weight, torch.tensor([[0]]), logit_scale=2.0, softcap=2.0)
    assert logp.item() == pytest.approx(-0.2876821, abs=1e-7)


TRANSFORMS = [
    # logit_scale, softcap, temperature, bias
    (0.0625, None, 1.0, False),  # Cohere's scale
    (1 / 8, None, 0.7, True),  # Granite's logits_scaling = 8, with a temperature
    (1.0, 1.5, 1.0, True),  # a Gemma 2 soft cap tight enough to bend most logits
    (3.0, 2.0, 0.6, False),  # scale and cap together (MuseSpark's order)
]


@pytest.mark.parametrize("scale, cap, tau, with_bias", TRANSFORMS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_head_transforms_match_reference_chunked_and_not(scale, cap, tau, with_bias, dtype, tol, monkeypatch):
    monkeypatch.setattr(logprobs_module, "_GRAD_BLOCK", 8)  # a soft cap's backward in 5 column blocks
    B, T, V, H = 2, 7, 37, 16
    hidden, weight, bias, targets = make_inputs(B, T, V, H, dtype, seed=23, bias=with_bias)
    with torch.no_grad():
        weight *= 4  # logits of size ~5-10: where a cap of 1.5-2 changes them most
    expected, expected_ent = reference(hidden, weight, targets, tau, bias, scale, cap)
    plain, _ = reference(hidden, weight, targets, tau, bias)
    assert (expected - plain).abs().max() > 0.1, "the transform must matter here, or the test proves nothing"
    grad_out = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads(expected, grad_out, (hidden, weight, bias))
    results = []
    for chunk in (3, B * T):  # chunked, and one chunk holding every row
        logp, ent = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias, chunk_size=chunk,
                                   logit_scale=scale, softcap=cap, return_entropy=True)
        assert rel_err(logp, expected) < tol and rel_err(ent, expected_ent) < tol
        got = grads(logp, grad_out.to(logp.dtype), (hidden, weight, bias))
        for g, w in zip(got, want):
            assert rel_err(g, w) < tol
        results.append((logp, got))
    (chunked, chunked_grads), (whole, whole_grads) = results
    # chunked against one chunk, the same dtype: assert_close's defaults (float32: rtol 1.3e-6 = 22 u, atol 1e-5;
    # float64: 1e-7) hold values that round alike but in other blocks (measured: <= 15% of the bound)
    torch.testing.assert_close(chunked, whole)
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b)


def test_gradcheck_float64_with_scale_and_softcap():
    hidden, weight, bias, targets = make_inputs(2, 3, 5, 3, torch.float64, seed=19, bias=True)

    def f(h, w, b):
        return token_logprobs(h, w, targets, temperature=0.7, bias=b, chunk_size=4, logit_scale=2.5, softcap=1.2)

    assert torch.autograd.gradcheck(f, ((hidden * 2).detach().requires_grad_(), weight, bias))

@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_inputs(with_bias):
    B, T, V, H = 2, 9, 50, 32
    hidden, weight, bias, targets = make_inputs(B, T, V, H, torch.bfloat16, seed=3, bias=with_bias)
    logp, ent = token_logprobs(hidden, weight, targets, temperature=0.8, bias=bias, chunk_size=4,
                               return_entropy=True)
    # The reference sees the same bf16 values, exactly, but multiplies in float64.
    expected, expected_ent = reference(hidden, weight, targets, 0.8, bias)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # bf16 rounds the matmul output (8 bits of mantissa, u = 2**-8): ~1e-2 on logits of size ~2 (measured 1.4e-2)
    assert (logp.double() - expected).abs().max() < 5e-2
    assert (ent.double() - expected_ent).abs().max() < 5e-2
    grad_out = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    got = grads(logp, grad_out, (hidden, weight, bias))
    want = grads(expected, grad_out.double(), (hidden, weight, bias))
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        # a bf16 gradient: its output rounded (u = 3.9e-3) after the logits' ~1e-2 (measured <= 3.7e-3)
        assert rel_err(g, w) < 3e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk, tau, with_bias", [(3, 1.0, False), (5, 0.6, True)])
def test_entropy_matches_reference(dtype, tol, chunk, tau, with_bias):
    hidden, weight, bias, targets = make_inputs(2, 6, 41, 8, dtype, seed=7, bias=with_bias)
    logp, ent = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias,
                               chunk_size=chunk, return_entropy=True)
    plain = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias, chunk_size=chunk)
    expected_logp, expected_ent = reference(hidden, weight, targets, tau, bias)
    assert rel_err(ent, expected_ent) < tol
    assert rel_err(logp, expected_logp) < tol
    assert torch.equal(logp, plain)
    assert ent.requires_grad and logp.requires_grad


def test_entropy_gradient_hand_computed():
    # logits z = [h, 0] with h = ln 3: p = [3/4, 1/4], H = 0.5623351 (test_hand_computed)
    # dH/dz_j = -p_j (log p_j + H): dH/dz_0 = -0.75 (-0.2876821 + 0.5623351) = -0.2059898, dH/dz_1 = +0.2059898
    # W = [[1], [0]]: dH/dh = dH/dz_0 = -0.2059898, dH/dW = [dH/dz_0 * h, dH/dz_1 * h] = [-0.2263029, 0.2263029]
    hidden = torch.full((1, 1, 1), math.log(3.0), dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[1.0], [0.0]], dtype=torch.float64, requires_grad=True)
    _, ent = token_logprobs(hidden, weight, torch.tensor([[0]]), return_entropy=True)
    ent.sum().backward()  # the log-probs are left out of the loss: only the entropy's gradient
    assert hidden.grad.item() == pytest.approx(-0.2059898, abs=1e-7)
    assert weight.grad.flatten().tolist() == pytest.approx([-0.2263029, 0.2263029], abs=1e-7)


@pytest.mark.parametrize("scale, cap, tau, with_bias", [(1.0, None, 1.0, False), (1.0, None, 0.7, True),
                                                        *TRANSFORMS[1:]])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_entropy_bonus_gradient_matches_reference(scale, cap, tau, with_bias, dtype, tol, monkeypatch):
    # L = sum(a * logp + b * H), an entropy bonus's shape: both gradients, chunked rows and column blocks
    monkeypatch.setattr(logprobs_module, "_GRAD_BLOCK", 8)  # 5 column blocks of V = 37
    B, T, V, H = 2, 7, 37, 16
    hidden, weight, bias, targets = make_inputs(B, T, V, H, dtype, seed=29, bias=with_bias)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(B, T, dtype=torch.float64, generator=gen), torch.randn(B, T, dtype=torch.float64, generator=gen)
    tensors = (hidden, weight, bias)
    expected = lambda: reference(hidden, weight, targets, tau, bias, scale, cap)  # noqa: E731 -- a fresh graph each
    want = grads(sum((c * x).sum() for c, x in zip((a, b), expected())), None, tensors)
    want_ent_only = grads(expected()[1], b, tensors)
    assert rel_err(want[0], grads(expected()[0], a, tensors)[0]) > 0.01, "the entropy term must matter here"
    logp, ent = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias, chunk_size=3, logit_scale=scale,
                               softcap=cap, return_entropy=True)
    got = grads((a.to(dtype) * logp + b.to(dtype) * ent).sum(), None, tensors)
    for g, w in zip(got, want):
        assert rel_err(g, w) < tol
    _, ent = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias, chunk_size=3, logit_scale=scale,
                            softcap=cap, return_entropy=True)
    for g, w in zip(grads(ent, b.to(dtype), tensors), want_ent_only):
        assert rel_err(g, w) < tol


def test_gradcheck_float64_entropy_with_softcap():
    hidden, weight, bias, targets = make_inputs(2, 3, 5, 3, torch.float64, seed=31, bias=True)

    def f(h, w, b):
        return token_logprobs(h, w, targets, temperature=0.7, bias=b, chunk_size=4, logit_scale=2.5, softcap=1.2,
                              return_entropy=True)

    assert torch.autograd.gradcheck(f, ((hidden * 2).detach().requires_grad_(), weight, bias))


def test_frozen_weight_gets_no_grad_and_hidden_grad_is_right():
    hidden, weight, bias, targets = make_inputs(2, 5, 23, 8, torch.float64, seed=11, bias=True)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    logp = token_logprobs(hidden, weight, targets, temperature=0.9, bias=bias, chunk_size=3)
    grad_out = torch.randn(2, 5, dtype=torch.float64)
    logp.backward(grad_out)
    assert weight.grad is None and bias.grad is None
    expected, _ = reference(hidden, weight, targets, 0.9, bias)
    (want,) = torch.autograd.grad(expected, hidden, grad_out)
    assert rel_err(hidden.grad, want) < 1e-10  # float64: as (dtype, tol) above


@pytest.mark.parametrize("scale, tau, with_bias, with_entropy", [(1.0, 1.0, False, False), (2.5, 0.7, True, False),
                                                                (1.0, 0.9, True, True)])
def test_frozen_head_backward_recomputes_no_logits(scale, tau, with_bias, with_entropy, monkeypatch):
    # A frozen head (LoRA): forward keeps d logp / d hidden, so backward computes no chunk's logits again, and
    # the gradient is the float64 reference's; an entropy in the output that the loss leaves alone changes nothing.
    hidden, weight, bias, targets = make_inputs(2, 7, 29, 8, torch.float64, seed=41, bias=with_bias)
    weight.requires_grad_(False)
    if bias is not None:
        bias.requires_grad_(False)
    out = token_logprobs(hidden, weight, targets, temperature=tau, bias=bias, chunk_size=3, logit_scale=scale,
                         return_entropy=with_entropy)
    logp = out[0] if with_entropy else out
    calls = []
    real = logprobs_module._Workspace.chunk_logits
    monkeypatch.setattr(logprobs_module._Workspace, "chunk_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    grad_out = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad(logp, hidden, grad_out)
    assert calls == []
    (want,) = torch.autograd.grad(reference(hidden, weight, targets, tau, bias, scale)[0], hidden, grad_out)
    assert rel_err(got, want) < 1e-12  # float64, ~40 terms (V = 29, H = 8): 40 * 2**-53 = 4e-15; measured 4e-16


def test_frozen_head_gradcheck_and_entropy_bonus_falls_back_to_recomputing(monkeypatch):
    hidden, weight, bias, targets = make_inputs(2, 3, 5, 3, torch.float64, seed=43, bias=True)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    assert torch.autograd.gradcheck(lambda h: token_logprobs(h, weight, targets, temperature=0.7, bias=bias,
                                                             chunk_size=4, logit_scale=1.5), (hidden,))
    # With the entropy in the loss the kept d logp / d hidden is not enough: backward recomputes, and is right.
    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    logp, ent = token_logprobs(hidden, weight, targets, temperature=0.7, bias=bias, chunk_size=4, return_entropy=True)
    calls = []
    real = logprobs_module._Workspace.chunk_logits
    monkeypatch.setattr(logprobs_module._Workspace, "chunk_logits", lambda *a_, **k: calls.append(1) or real(*a_, **k))
    (got,) = torch.autograd.grad((a * logp + b * ent).sum(), hidden)
    assert calls, "the entropy's gradient needs the logits again"
    ref_logp, ref_ent = reference(hidden, weight, targets, 0.7, bias)
    (want,) = torch.autograd.grad((a * ref_logp + b * ref_ent).sum(), hidden)
    assert rel_err(got, want) < 1e-10  # float64: as (dtype, tol) above


def test_frozen_weight_allocates_no_weight_sized_buffer(monkeypatch):
    # A frozen LM head under LoRA must not cost a [V, H] gradient buffer, in forward or backward.
    V, H = 4099, 8
    hidden, weight, _, targets = make_inputs(1, 4, V, H, torch.float32, seed=2)
    weight.requires_grad_(False)
    sizes = []
    real_zeros, real_empty = torch.Tensor.new_zeros, torch.Tensor.new_empty

    def spy(real):
        def wrapped(self, *shape, **kw):
            out = real(self, *shape, **kw)
            sizes.append(out.numel())
            return out
        return wrapped

    monkeypatch.setattr(torch.Tensor, "new_zeros", spy(real_zeros))
    monkeypatch.setattr(torch.Tensor, "new_empty", spy(real_empty))
    token_logprobs(hidden, weight, targets, chunk_size=2).sum().backward()
    assert sizes, "the spy saw no allocation; the test would prove nothing"
    assert max(sizes) < V * H
    assert hidden.grad is not None and weight.grad is None


def test_saves_no_logits_for_backward():
    # Only hidden, weight, bias, targets and a per-row logsumexp may be kept for backward.
    B, T, V, H = 2, 6, 97, 4
    hidden, weight, bias, targets = make_inputs(B, T, V, H, torch.float32, seed=5, bias=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(hidden, weight, targets, bias=bias, chunk_size=4)
    allowed = hidden.numel() + weight.numel() + bias.numel() + targets.numel() + B * T
    assert saved and sum(saved) <= allowed


def test_gradcheck_float64():
    hidden, weight, bias, targets = make_inputs(2, 3, 5, 3, torch.float64, seed=13, bias=True)

    def f(h, w, b):
        return token_logprobs(h, w, targets, temperature=0.7, bias=b, chunk_size=4)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_autocast_does_not_change_the_result():
    # Under CPU autocast the forward matmul would run in bf16 but a backward outside autocast
    # would recompute in float32: the function must be immune to the ambient autocast.
    hidden, weight, _, targets = make_inputs(2, 4, 19, 8, torch.float32, seed=17)
    plain = token_logprobs(hidden, weight, targets, chunk_size=3)
    (plain_grad,) = torch.autograd.grad(plain.sum(), hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = token_logprobs(hidden, weight, targets, chunk_size=3)
    (auto_grad,) = torch.autograd.grad(auto.sum(), hidden)
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)
    torch.testing.assert_close(auto_grad, plain_grad, rtol=0, atol=0)


def test_bad_inputs_raise():
    hidden, weight, _, targets = make_inputs(1, 3, 7, 4, torch.float32)
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        token_logprobs(hidden, weight, torch.tensor([[0, 7, 1]]))
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        token_logprobs(hidden, weight, torch.tensor([[0, -100, 1]]))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, weight, targets[:, :2])
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="logit_scale"):
        token_logprobs(hidden, weight, targets, logit_scale=0.0)
    with pytest.raises(ValueError, match="softcap"):
        token_logprobs(hidden, weight, targets, softcap=-30.0)


MEMORY_CHILD = r"""
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from grpo.algo.logprobs import token_logprobs
from grpo.run.logs import peak_rss_bytes

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def vm_size():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()

B, T, V, H = 2, 1024, 151936, 256
torch.manual_seed(0)
hidden = torch.randn(B, T, H, requires_grad=True)
weight = (torch.randn(V, H) * 0.05).requires_grad_()
targets = torch.randint(0, V, (B, T))
# If chunking ever broke, full logits (1.2 GB each, several held at once) must not swamp a shared machine.
cap = vm_size() + 2 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
before = rss()
token_logprobs(hidden, weight, targets).sum().backward()
peak = peak_rss_bytes()  # VmHWM: ru_maxrss would keep the pytest parent's RSS from before exec
print(json.dumps({"extra": peak - before, "grad_ok": bool(torch.isfinite(weight.grad).all())}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_memory_is_bounded_at_full_vocab():
    # Unchunked float32 logits alone: 2 * 1024 * 151936 * 4 B = 1.24 GB. Chunked (512 rows):
    # one 311 MB logits chunk + the 156 MB float32 weight gradient + small change.
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grad_ok"]
    assert result["extra"] < 0.75e9, f"forward+backward added {result['extra'] / 1e9:.2f} GB"
