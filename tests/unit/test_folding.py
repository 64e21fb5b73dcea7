"""LoRA folded into copies of its base weights, and on a CPU the LM head's weight packed for oneDNN, while sampling
(policy/folding): the reference (adapter off) and the policy stay bit for bit what they were, and greedy
tokens are the plain decode's."""
import contextlib

import pytest
import torch
from tiny_setup import tiny_model, tiny_tokenizer

import grpo.rollout.engines.sampling
from grpo import Config
from grpo.policy.folding import foldable_layers, sampling_weights
from grpo.policy.models import prepare_for_training
from grpo.rollout.engines.sampling import PromptEncoder, sample_completions


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def lora_model(tokenizer, dtype=torch.float32):
    model = prepare_for_training(tiny_model(tokenizer).to(dtype), Config(use_lora=True, lora_r=4, lora_alpha=8))
    torch.manual_seed(0)
    with torch.no_grad():  # peft starts B at 0: an adapter that changes nothing would hide a wrong fold
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


def test_the_reference_and_the_policy_are_bit_for_bit_the_same_after_sampling(tokenizer):
    model = lora_model(tokenizer)
    assert len(foldable_layers(model)) > 0
    ids = torch.tensor([tokenizer("Write 3 digits: 012")["input_ids"]])  # [1, T]

    def logits(adapter: bool) -> torch.Tensor:
        with torch.no_grad(), (contextlib.nullcontext() if adapter else model.disable_adapter()):
            return model(input_ids=ids).logits  # [1, T, V]

    before = {"reference": logits(False), "policy": logits(True)}
    weights = {n: p.clone() for n, p in model.named_parameters()}
    sample_completions(model, tokenizer, PromptEncoder(tokenizer, 64), ["Write 3 digits:"], num_generations=4,
                       max_completion_length=6)
    assert torch.equal(logits(False), before["reference"]) and torch.equal(logits(True), before["policy"])
    assert not torch.equal(before["reference"], before["policy"])
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


@pytest.mark.parametrize("lora", [True, False])
def test_greedy_tokens_are_the_plain_decodes(tokenizer, monkeypatch, lora):
    model = lora_model(tokenizer) if lora else tiny_model(tokenizer).eval()
    prompts = ["Write 3 digits:", "Write 12 digits", "<reasoning>"]

    def greedy() -> torch.Tensor:
        return sample_completions(model, tokenizer, PromptEncoder(tokenizer, 64), prompts, num_generations=1,
                                  greedy=True, max_completion_length=12).completion_ids  # [3, C]

    folded = greedy()
    monkeypatch.setattr(grpo.rollout.engines.sampling, "sampling_weights", lambda *_: contextlib.nullcontext())
    assert torch.equal(folded, greedy())


def test_layers_are_folded_only_where_exact_enough(tokenizer):
    model = lora_model(tokenizer)
    layer = foldable_layers(model)[0]
    weight = layer.get_base_layer().weight
    x = torch.randn(3, weight.shape[1])  # [3, in]
    with sampling_weights(model):  # inside: the folded weight stands in for the base one; the adapter skipped
        assert layer.merged and layer.get_base_layer().weight is not weight
        assert not any("forward" in vars(m) for m in model.modules()), "the body's linears are not packed"
        folded = torch.nn.functional.linear(x, weight + layer.get_delta_weight("default"))  # [3, out]
        # float32, x @ (W + BA) against x W + x B A: 32 + 4 terms per output of size ~1, rounding
        # <= 36 * 2**-24 = 2e-6 (measured 3.6e-7); a missing or doubled adapter is off by its delta, ~1e-1
        assert torch.allclose(layer(x), folded, atol=1e-5)
    assert not layer.merged and layer.get_base_layer().weight is weight
    assert foldable_layers(lora_model(tokenizer, torch.bfloat16)) == [], "a bf16 sum would round the update away"
    assert foldable_layers(tiny_model(tokenizer)) == []  # no adapters
    bf16 = lora_model(tokenizer, torch.bfloat16)
    with sampling_weights(bf16):  # neither folded nor packed: oneDNN packing here is for float32 only
        assert not any("forward" in vars(m) for m in bf16.modules())
    with model.disable_adapter():
        assert foldable_layers(model) == []  # the reference's forward: nothing to fold


def test_the_lm_head_is_packed_for_the_decode_and_gives_its_logits(tokenizer):
    from grpo.policy.head import head_logits
    from grpo.policy.models import unwrap

    model = lora_model(tokenizer)
    hidden = torch.randn(5, unwrap(model).config.hidden_size)  # [5, H]
    with sampling_weights(model) as head_matmul:
        assert head_matmul is not None
        packed = head_logits(unwrap(model), head_matmul)(hidden)  # [5, V]
    assert torch.allclose(packed, head_logits(unwrap(model))(hidden), atol=1e-5)  # as above: H = 32 terms
