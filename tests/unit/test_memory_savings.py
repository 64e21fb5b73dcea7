"""Memory savings that must not change the math: the tied embedding's sparse lookup gradient and fused AdamW."""
import torch

from grpo.policy.models import completion_logprobs, sparse_tied_embedding_gradient
from grpo.policy.optim import build_optimizer
from grpo.tasks.tiny import tiny_qwen2


def accumulated_gradient(sparse: bool) -> torch.Tensor:
    model = tiny_qwen2(1000, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
    if sparse:
        sparse_tied_embedding_gradient(model)
        assert model.get_input_embeddings().sparse
    ids = torch.randint(0, 1000, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two micro-batches: the second adds into the stored gradient
        logprobs = completion_logprobs(model, ids, torch.ones_like(ids), 4, temperature=1.0, chunk_size=8)
        logprobs.sum().backward()
    return model.get_input_embeddings().weight.grad


def test_tied_embedding_gradient_is_dense_and_unchanged_when_its_lookup_is_sparse():
    dense, sparse = accumulated_gradient(False), accumulated_gradient(True)
    assert sparse.layout == torch.strided
    # the same 96 lookups' gradients added into the same rows: float32's defaults (rtol 1.3e-6, atol 1e-5) hold
    # any order of them (measured: equal); a lost micro-batch halves them
    torch.testing.assert_close(sparse, dense)


def test_untied_embeddings_stay_dense():
    model = tiny_qwen2(1000, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, tie_word_embeddings=False)
    sparse_tied_embedding_gradient(model)
    assert not model.get_input_embeddings().sparse


def test_fused_adamw_matches_the_reference_implementation():
    torch.manual_seed(0)
    weights = [torch.randn(64, 8), torch.randn(8)]
    grads = [torch.randn_like(w) for w in weights]
    results = []
    for make in (lambda ps: build_optimizer(ps, "adamw", 1e-2, (0.9, 0.99), 0.1),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = make(params)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
        results.append(params)
    assert results[0][0] is not results[1][0]
    assert build_optimizer([torch.nn.Parameter(torch.ones(2))], "adamw", 1e-3, (0.9, 0.99), 0.0).defaults["fused"]
    for a, b in zip(*results):  # the same formula in another order: ulps (2**-24) of weights ~1, measured 7e-9
        torch.testing.assert_close(a, b)


def test_8bit_adamw_in_slices_on_cpu_matches_bitsandbytes(monkeypatch):
    import bitsandbytes as bnb

    import grpo.policy.optim

    monkeypatch.setattr(grpo.policy.optim, "BNB_CPU_SLICE", 1024)  # 4 blocks per slice; 5000 elements end mid-block
    torch.manual_seed(0)
    weight = torch.randn(50, 100)
    grads = [torch.randn_like(weight) for _ in range(3)]
    results = []
    for make in (lambda ps: build_optimizer(ps, "adamw_8bit", 1e-2, (0.9, 0.99), 0.1),
                 lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)):
        param = torch.nn.Parameter(weight.clone())
        optimizer = make([param])
        for g in grads:
            param.grad = g.clone()
            optimizer.step()
        results.append((param.detach(), optimizer.state[param]))
    (sliced, s_state), (whole, w_state) = results
    assert s_state["state1"].dtype == torch.uint8 and not torch.equal(sliced, weight)
    torch.testing.assert_close(sliced, whole, rtol=0, atol=0)
    for key in ("state1", "state2", "absmax1", "absmax2"):
        torch.testing.assert_close(s_state[key], w_state[key], rtol=0, atol=0)


def test_cpu_slices_end_on_a_bitsandbytes_block():
    from grpo.memory.parts import BNB_BLOCK
    from grpo.policy.optim import BNB_CPU_SLICE

    assert BNB_CPU_SLICE % BNB_BLOCK == 0  # a slice ending mid-block would split one absmax over two updates
