"""policy/decoder: a Llama-shaped model's decoding step, fused, gives the hidden states transformers' forward gives
(the same cache, left-padded rows, grouped-query attention, q/k/v biases, LoRA folded in), writes the same keys and
values, and is used only where its math is the model's."""
import pytest
import torch
from test_model_families import V, left_padded_prompts, tiny_family

from grpo import Config
from grpo.policy.decoder import fused_decoder
from grpo.policy.folding import sampling_weights
from grpo.policy.head import positions
from grpo.policy.models import prepare_for_training, unwrap
from grpo.rollout.engines.kv_cache import preallocated_cache


def prefilled(model, ids, mask, steps: int):
    """The model's cache after reading `ids` [N, P], sized for `steps` more tokens."""
    cache = preallocated_cache(model.config, ids.shape[1] + steps)
    model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache)
    return cache


@pytest.mark.parametrize("model_type,lora", [("llama", False), ("qwen2", False), ("llama", True)])
def test_a_fused_step_is_transformers_forward(model_type, lora):
    model = tiny_family(model_type)  # qwen2: q/k/v biases; both: 4 query heads over 2 key/value heads
    if lora:
        model = prepare_for_training(model, Config(use_lora=True, lora_r=4, lora_alpha=8)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)  # peft starts B at 0: an adapter that changes nothing hides a missing fold
    hf = unwrap(model)
    ids, mask = left_padded_prompts(4)  # [4, 6]
    with torch.no_grad(), sampling_weights(model):
        plain, fused = prefilled(hf, ids, mask, 3), prefilled(hf, ids, mask, 3)
        step = fused_decoder(hf.base_model, fused)
        assert step is not None
        full_mask = torch.cat([mask, mask.new_ones(4, 3)], 1)  # [4, 9]
        position_ids = positions(mask)[:, -1:]  # [4, 1]
        for t in range(3):
            token = torch.randint(1, V, (4, 1), generator=torch.Generator().manual_seed(t))  # [4, 1]
            position_ids = position_ids + 1
            want = hf.base_model(input_ids=token, attention_mask=full_mask[:, :7 + t], position_ids=position_ids,
                                 past_key_values=plain).last_hidden_state[:, -1]  # [4, H]
            got = step(token, full_mask[:, :7 + t], position_ids)  # [4, H]
            # float32, sums of <= 64 terms of size ~1 in another order: a few 1e-7; a wrong mask, position,
            # head order or missing adapter is off by ~1e-1
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    for a, b in zip(plain.layers, fused.layers):
        assert a.length == b.length and torch.allclose(a.keys, b.keys, atol=1e-5)
        assert torch.allclose(a.values, b.values, atol=1e-5)


def test_only_models_it_computes_exactly_are_fused():
    for model_type in ("gemma", "qwen3", "phi3", "smollm3"):  # a scaled embedding, q/k norms, fused weights, NoPE
        model = tiny_family(model_type)
        assert fused_decoder(model.base_model, preallocated_cache(model.config, 8)) is None, model_type
    model = prepare_for_training(tiny_family("llama"), Config(use_lora=True, lora_r=4, lora_alpha=8))
    cache = preallocated_cache(model.config, 8)
    assert fused_decoder(unwrap(model).base_model, cache) is None  # an adapter not folded: peft's forward
    with sampling_weights(model):
        assert fused_decoder(unwrap(model).base_model, cache) is not None


def test_a_bf16_step_runs_the_bf16_base_with_its_adapter_unfolded():
    """The precision plan's bf16 sampling on a CPU (policy/precision): the LoRA base is bf16, the adapters float32
    and not folded (a bf16 sum would round small updates away); the fused step adds each adapter's low-rank
    product and gives transformers' bf16 forward within bf16 rounding, its keys and values cached in bf16."""
    model = prepare_for_training(tiny_family("llama").to(torch.bfloat16),
                                 Config(use_lora=True, lora_r=4, lora_alpha=8)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    hf = unwrap(model)
    ids, mask = left_padded_prompts(4)  # [4, 6]
    with torch.no_grad(), sampling_weights(model):  # folds nothing: the base is not float32
        assert fused_decoder(hf.base_model, preallocated_cache(hf.config, 8)) is None  # the float32 plan's step
        plain, fused = prefilled(hf, ids, mask, 3), prefilled(hf, ids, mask, 3)
        step = fused_decoder(hf.base_model, fused, bf16=True)
        assert step is not None
        full_mask = torch.cat([mask, mask.new_ones(4, 3)], 1)  # [4, 9]
        position_ids = positions(mask)[:, -1:]  # [4, 1]
        for t in range(3):
            token = torch.randint(1, V, (4, 1), generator=torch.Generator().manual_seed(t))  # [4, 1]
            position_ids = position_ids + 1
            want = hf.base_model(input_ids=token, attention_mask=full_mask[:, :7 + t], position_ids=position_ids,
                                 past_key_values=plain).last_hidden_state[:, -1]  # [4, H]
            with model.disable_adapter():
                bare = hf.base_model(input_ids=token, attention_mask=full_mask[:, :7 + t],
                                     position_ids=position_ids, past_key_values=prefilled(
                                         hf, ids, mask, 3)).last_hidden_state[:, -1]  # [4, H]
            got = step(token, full_mask[:, :7 + t], position_ids)  # [4, H]
            assert got.dtype == torch.bfloat16
            # bf16 keeps 8 significant bits: hidden states up to ~3 differ by ~0.02 (measured) between two
            # orders of the same sums; the adapter (B ~ 0.3) moves them by 3-5
            assert (got - want).float().abs().max() < 0.06, (got - want).abs().max()
            assert (got - bare).float().abs().max() > 1
    assert all(layer.keys.dtype == torch.bfloat16 for layer in fused.layers)
