"""The shared-prompt forward (policy/prefix.py), with its completions as padded rows and as one packed row, gives
the whole rows' log-probs, entropies and gradients of every trainable parameter, on tiny random configs of many
families, under full fine-tuning, LoRA (adapter on and off), QLoRA, gradient checkpointing, eager attention and
bf16 autocast; models it cannot serve take the whole rows, saying so once."""
import pytest
import torch
from tolerances import f32_sum
from transformers import AutoConfig, AutoModelForCausalLM

from grpo import Config
from grpo.policy.forwards import Policy
from grpo.policy.models import completion_logprobs, prepare_for_training, reference_context
from grpo.policy.precision import Precision
from grpo.policy.packing import packed_mask, packing_pays, packing_refusal
from grpo.policy.prefix import CacheDropped, refusal, shared_prompt_logprobs, shared_prompts
from grpo.rollout.batches import Rollout
from grpo.settings.components import LogprobSettings

V, P, C = 96, 20, 9
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
             pad_token_id=0)
# Prompts of P = 20 tokens against sliding windows of 8: the completions see only the prompt's last tokens.
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "phi3": {}, "olmo2": {}, "granite": dict(logits_scaling=4.0),
    "mistral": dict(sliding_window=8), "gemma2": dict(final_logit_softcapping=3.0, sliding_window=8),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def tiny(model_type: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES[model_type]}))
    with torch.no_grad():
        for p in model.get_output_embeddings().parameters():
            p.mul_(20)  # logits of ~10, as trained models have: a soft cap bends them
    return model


def grouped_rows(groups=(3, 2, 1), seed: int = 1):
    """Rows of prompts repeated per group (a cut group, a lone row too), left-padded, completions right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, V, (len(groups), P), generator=g)  # [B, P]
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :4] = prompt_mask[2, :P - 3] = 0  # left padding
    owner = torch.arange(len(groups)).repeat_interleave(torch.tensor(groups))  # [N]
    completions = torch.randint(1, V, (len(owner), C), generator=g)  # [N, C]
    completion_mask = torch.ones_like(completions)
    completion_mask[1, 6:] = completion_mask[4, 3:] = 0  # after EOS
    return prompts[owner], prompt_mask[owner], completions, completion_mask


def both_paths(model, rows, seed: int = 2, pack: bool = False):
    """(whole rows, shared prompt): each (logprobs, entropies, {name: grad}) of a loss weighing both; `pack`: the
    shared prompt's completions as one packed row."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows
    g = torch.Generator().manual_seed(seed)
    w, u = torch.randn(completion_ids.shape, generator=g), torch.randn(completion_ids.shape, generator=g)
    results = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            lp, ent = shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                             temperature=0.7, chunk_size=7, return_entropy=True, pack=pack)
        else:
            lp, ent = completion_logprobs(model, torch.cat([prompt_ids, completion_ids], 1),
                                          torch.cat([prompt_mask, completion_mask], 1), P, temperature=0.7,
                                          chunk_size=7, return_entropy=True)
        ((lp * w + ent * u) * completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach() * completion_mask, ent.detach() * completion_mask, grads))
    return results


# Whole rows and shared prompt compute the same values, summing in other orders: float32 rounding of at most
# f32_sum(n) of each tensor's largest entry (tolerances.py), n the terms along a value's path: the whole rows'
# 6 x 29 tokens, V = 96 logits, and per layer the MLP's 64 + 32, attention's <= 29 keys and o_proj's 32 (2 layers:
# ~600), so RTOL = 3.6e-5 (measured: <= 6.8e-6 on 5 CPU variants). A bug (a completion seeing another prompt's
# cache, a position off by one, a row left out of the gradient) changes them by ~1e-2 and more (tried: positions
# off by one, 8e-3 in llama's log-probs, 14x the bound; a row's gradient dropped fails too).
RTOL = f32_sum(600)


def assert_same(whole, shared, rtol=RTOL):
    (lp, ent, grads), (lp2, ent2, grads2) = whole, shared
    torch.testing.assert_close(lp2, lp, rtol=rtol, atol=rtol * lp.abs().max().item())
    torch.testing.assert_close(ent2, ent, rtol=rtol, atol=rtol * ent.abs().max().item())
    assert grads.keys() == grads2.keys() and grads
    for name in grads:  # relative to the largest entry of each gradient
        torch.testing.assert_close(grads2[name], grads[name], rtol=rtol, atol=rtol * grads[name].abs().max().item(),
                                   msg=name)


def test_rows_with_one_prompt_are_found_in_runs():
    prompt_ids, prompt_mask, _, _ = grouped_rows()
    first, owner = shared_prompts(prompt_ids, prompt_mask)
    assert first.tolist() == [0, 3, 5] and owner.tolist() == [0, 0, 0, 1, 1, 2]
    same_ids_other_padding = prompt_mask.clone()
    same_ids_other_padding[1, 0] = 0
    assert shared_prompts(prompt_ids, same_ids_other_padding)[1].tolist() == [0, 1, 2, 3, 3, 4]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_same_logprobs_and_gradients_as_whole_rows(model_type, checkpointing, pack):
    model = tiny(model_type)
    assert refusal(model) is None and packing_refusal(model) is None
    config = Config(use_lora=False, gradient_checkpointing=checkpointing, disable_dropout=True)
    model = prepare_for_training(model, config)
    if checkpointing and model_type == "gpt2":  # GPT-2's body drops the cache under checkpointing
        with pytest.raises(CacheDropped):
            both_paths(model, grouped_rows(), pack=pack)
        return
    assert_same(*both_paths(model, grouped_rows(), pack=pack))


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_adapter_on_and_off(checkpointing, pack):
    config = Config(use_lora=True, lora_r=4, gradient_checkpointing=checkpointing, disable_dropout=True)
    model = prepare_for_training(tiny("qwen2"), config)
    with torch.no_grad():  # a trained adapter: B is 0 at initialization
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert_same(*both_paths(model, grouped_rows(), pack=pack))
    reference, context = reference_context(model, None)
    with context, torch.no_grad():
        rows = grouped_rows()
        whole = completion_logprobs(reference, torch.cat([rows[0], rows[2]], 1), torch.cat([rows[1], rows[3]], 1),
                                    P, temperature=0.7, chunk_size=7)
        shared = shared_prompt_logprobs(reference, *rows, temperature=0.7, chunk_size=7, pack=pack)
    torch.testing.assert_close(shared * rows[3], whole * rows[3], rtol=RTOL, atol=RTOL * whole.abs().max().item())


@pytest.mark.parametrize("pack", [False, True])
def test_eager_attention(pack):
    model = tiny("llama")
    model.config._attn_implementation = "eager"
    model = prepare_for_training(model, Config(use_lora=False, gradient_checkpointing=False, disable_dropout=True))
    assert_same(*both_paths(model, grouped_rows(), pack=pack))


@pytest.mark.parametrize("pack", [False, True])
def test_qlora_with_checkpointing(pack):
    from tiny_setup import tiny_4bit_model, tiny_tokenizer

    config = Config(use_lora=True, lora_r=4, gradient_checkpointing=True, disable_dropout=True)
    model = prepare_for_training(tiny_4bit_model(tiny_tokenizer()), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    # tiny_4bit_model's widths: 174 tokens, V = 200, per layer 256 + 128 + 29 + 128: ~1450 terms (as RTOL's)
    assert_same(*both_paths(model, grouped_rows(), pack=pack), rtol=f32_sum(1450))


@pytest.mark.parametrize("pack", [False, True])
def test_bf16_autocast_is_close(pack):
    model = prepare_for_training(tiny("llama"), Config(use_lora=False, disable_dropout=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (lp, ent, grads), (lp2, ent2, grads2) = both_paths(model, grouped_rows(), pack=pack)
    # bf16 matmuls (u = 2**-8) round logits of ~10 by ~10 u = 0.04 on each path: 0.1 nats; a gradient's norm
    # averages its entries' rounding (a few u each): 5% = 13 u (measured <= 0.7%). A bug is off by O(1).
    assert (lp - lp2).abs().max() < 0.1 and (ent - ent2).abs().max() < 0.1
    for name in grads:
        assert (grads[name] - grads2[name]).norm() <= 0.05 * grads[name].norm() + 1e-6, name


def test_packed_mask_by_hand():
    # Prompts [B=2, P=3], the second left-padded by one; rows 0, 1 share prompt 0, row 2 has prompt 1; completions
    # [N=3, C=2] with row 1 ending after one token: T = 5 packed tokens (rows 0, 0, 1, 2, 2).
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    owner = torch.tensor([0, 0, 1])
    completion_mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    completion_positions = torch.tensor([[3, 4], [3, 4], [2, 3]])  # after 3 and 2 real prompt tokens
    mask = packed_mask(prompt_mask, owner, completion_mask, completion_positions)[0, 0].int()  # [5, 6 + 5]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0],   # row 0, token 0: prompt 0, itself
                             [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0],   # row 0, token 1: prompt 0, row 0 so far
                             [1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0],   # row 1: prompt 0 again, not row 0's tokens
                             [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0],   # row 2: prompt 1's real tokens only
                             [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]]
    # A sliding window of 2: keys fewer than 2 positions back. Row 0's token at position 4 sees positions 3, 4;
    # row 2's at position 3 sees prompt 1's last token (position 1 of it) no more: 3 - 1 = 2.
    windowed = packed_mask(prompt_mask, owner, completion_mask, completion_positions, window=2)[0, 0].int()
    assert windowed[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert windowed[4].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert windowed[3].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0]


def test_packing_is_taken_where_it_costs_less():
    # hidden 576 -> 6 x 576 = 3456 per token. Padded: 8 rows x 60 x (3456 + 145 + 60) = 1,757,280; packed 360 real
    # tokens: 360 x (3456 + 145 + 360) = 1,425,960 < padded.
    assert packing_pays(576, (1, 145), (8, 60), 360)
    # Every row full (480 tokens): 480 x (3456 + 145 + 480) = 1,958,880 > 1,757,280: the longer attention loses.
    assert not packing_pays(576, (1, 145), (8, 60), 480)
    assert not packing_pays(576, (1, 145), (1, 60), 0)  # a rank's inert row: nothing to pack


def test_attention_without_4d_masks_is_not_packed():
    model = tiny("llama")
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_refusal(model)


def test_models_it_cannot_serve_are_named():
    settings = dict(SMALL, num_hidden_layers=2, block_types=["recurrent", "attention"], lru_width=32,
                    attention_window_size=16)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("recurrent_gemma", **settings))
    assert "keeps a recurrent or linear-attention state, which the shared-prompt forward cannot" in refusal(model)


def policy_and_rollout(shared_prompt_forward=True, model_type="llama", is_main=True):
    config = Config(use_lora=False, beta=0.0, temperature=0.7, logprob_chunk_size=7, disable_dropout=True,
                    shared_prompt_forward=shared_prompt_forward)
    model = prepare_for_training(tiny(model_type), config)
    policy = Policy(model, LogprobSettings.of(config), world_size=1,
                    precision=Precision.plan(False, False, device="cpu"), is_main=is_main)
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_rows()
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, [""] * len(prompt_ids),
                      torch.zeros(len(prompt_ids), dtype=torch.bool))
    return policy, rollout


def test_policy_takes_the_shared_path_and_its_first_step_check_passes(monkeypatch, capsys):
    policy, rollout = policy_and_rollout()
    calls = []
    monkeypatch.setattr("grpo.policy.forwards.shared_prompt_logprobs",
                        lambda *a, **k: calls.append(1) or shared_prompt_logprobs(*a, **k))
    policy.check_head_once(rollout, agree=lambda x: x)
    assert policy.shared_prompt and "shared_prompt_forward" not in capsys.readouterr().err
    policy.logprobs(rollout)
    assert len(calls) == 1
    off, _ = policy_and_rollout(shared_prompt_forward=False)
    off.check_head_once(rollout, agree=lambda x: x)
    whole = off.logprobs(rollout) * rollout.completion_mask
    torch.testing.assert_close(whole, policy.logprobs(rollout) * rollout.completion_mask, rtol=RTOL,
                               atol=RTOL * whole.abs().max().item())  # as assert_same
    assert len(calls) == 2


def test_a_first_step_check_that_fails_turns_it_off_with_one_line(monkeypatch, capsys):
    policy, rollout = policy_and_rollout()
    monkeypatch.setattr("grpo.policy.prefix.shared_prompt_logprobs",
                        lambda *a, **k: shared_prompt_logprobs(*a, **k) + 0.5)
    policy.check_head_once(rollout, agree=lambda x: x)
    err = capsys.readouterr().err
    assert not policy.shared_prompt and err.count("shared_prompt_forward is off") == 1, err


def test_the_first_step_check_covers_the_packed_row(monkeypatch, capsys):
    policy, rollout = policy_and_rollout()
    monkeypatch.setattr("grpo.policy.prefix.shared_prompt_logprobs",
                        lambda *a, pack=None, **k: shared_prompt_logprobs(*a, pack=pack, **k) + 0.5 * bool(pack))
    policy.check_head_once(rollout, agree=lambda x: x)
    assert not policy.shared_prompt and "shared_prompt_forward is off" in capsys.readouterr().err


def test_the_fallback_line_is_said_by_the_first_rank_only(capsys):
    policy, _ = policy_and_rollout(is_main=False)
    policy._whole_rows("a reason")
    assert not policy.shared_prompt and capsys.readouterr().err == ""
    policy, _ = policy_and_rollout()
    policy._whole_rows("a reason")
    assert capsys.readouterr().err.count("a reason") == 1


def test_a_model_dropping_the_cache_falls_back_once(capsys):
    config = Config(use_lora=False, beta=0.0, temperature=0.7, logprob_chunk_size=7, disable_dropout=True,
                    gradient_checkpointing=True, shared_prompt_forward=True)
    model = prepare_for_training(tiny("gpt2"), config)
    policy = Policy(model, LogprobSettings.of(config), world_size=1,
                    precision=Precision.plan(False, False, device="cpu"), is_main=True)
    rows = grouped_rows()
    rollout = Rollout(*rows, [""] * len(rows[0]), torch.zeros(len(rows[0]), dtype=torch.bool))
    first = policy.logprobs(rollout)
    second = policy.logprobs(rollout)
    torch.testing.assert_close(first, second)
    err = capsys.readouterr().err
    assert not policy.shared_prompt and err.count("drops the cache") == 1, err
