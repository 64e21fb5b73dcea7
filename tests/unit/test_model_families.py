"""Log-probs and sampling logits equal each model family's own forward, including the transforms some families
apply to the LM head's output (Cohere's logit scale, Granite's logits scaling, Gemma 2's soft cap, ...), on
tiny random configs; transforms grpo does not know are refused, and the start-up check catches the rest."""
import pytest
import torch
from tiny_setup import decode_settings, digit_prompts, digit_share, tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from grpo import Config, Trainer
from grpo.algo.logprobs import token_logprobs
from grpo.errors import ConfigError
from grpo.policy.head import HeadTransform, head_transform
from grpo.policy.models import check_logprobs_match_forward, completion_logprobs
from grpo.rollout.engines.kv_cache import DecodingRows
from grpo.policy.head import head_logits, positions
from grpo.rollout.engines.decoding import decode

V = 96
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
# model_type -> settings beyond SMALL; transforms are set where they bend logits of size ~10 visibly.
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {}, "phi3": {}, "gemma": {}, "olmo": {}, "olmo2": {},
    "phi": {}, "stablelm": {}, "gpt_neox": {}, "starcoder2": {}, "smollm3": {},
    "gpt2": dict(n_embd=32, n_layer=1, n_head=4, n_positions=64),
    "gemma2": dict(final_logit_softcapping=3.0), "gemma3_text": dict(final_logit_softcapping=3.0),
    "vaultgemma": dict(final_logit_softcapping=3.0), "nanochat": dict(final_logit_softcapping=3.0),
    "recurrent_gemma": dict(logits_soft_cap=3.0, num_hidden_layers=2, block_types=["recurrent", "attention"],
                            lru_width=32, attention_window_size=16),
    "cohere": dict(logit_scale=0.25), "cohere2": dict(logit_scale=0.25),
    "granite": dict(logits_scaling=4.0), "granitemoe": dict(logits_scaling=4.0, num_local_experts=2,
                                                            num_experts_per_tok=1),
    "hyperclovax": dict(logits_scaling=0.5),  # multiplies, despite sharing Granite's name
    "minicpm3": dict(dim_model_base=8, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8),  # divides the hidden states by 32 / 8
}


def tiny_family(model_type: str):
    torch.manual_seed(0)
    settings = {**SMALL, **FAMILIES[model_type]}
    if model_type == "minicpm3":
        settings.pop("head_dim")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings)).eval()
    with torch.no_grad():
        for p in model.get_output_embeddings().parameters():
            p.mul_(20)  # logits of ~10, a trained model's size: random ones (~0.5) hardly feel a soft cap
    return model


def left_padded_prompts(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` random 6-token prompts [rows, 6] and their mask, rows 1 and 3 left-padded by 2 and 4 tokens."""
    ids = torch.randint(1, V, (rows, 6), generator=torch.Generator().manual_seed(0))  # [rows, 6]
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[3, :4] = 0  # left padding
    return ids, mask


def left_padded_batch(seed: int = 0):
    ids = torch.randint(1, V, (3, 14), generator=torch.Generator().manual_seed(seed))  # [N, P+C], P = 5
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[2, :4] = 0  # left padding
    mask[2, 11:] = 0  # and padding after an EOS
    return ids, mask


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_logprobs_and_sampling_logits_are_the_models_own(model_type):
    model, (ids, mask), P, tau = tiny_family(model_type), left_padded_batch(), 5, 0.7
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits.float()  # [N, P+C, V]
        reference = torch.log_softmax(logits[:, P - 1:-1] / tau, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
        ours = completion_logprobs(model, ids, mask, P, temperature=tau, chunk_size=7)  # [N, C]
        hidden = model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                                  use_cache=False).last_hidden_state  # [N, P+C, H]
        sampling = head_logits(model)(hidden[:, -1])  # [N, V]: what generate draws from
        head = model.get_output_embeddings()
        untransformed = token_logprobs(hidden[:, P - 1:-1], head.weight, ids[:, P:], temperature=tau, bias=head.bias)
    real = mask[:, P:].bool()  # [N, C]
    # float32 both ways in other orders (chunked head, other kernels), on logits of ~10 (x 20 above): ~250 terms
    # along a value's path (V = 96, 1 layer's 64 + 32 + 14 keys + 32) round by ~sqrt(n) * u * 10 = 1e-5 (measured
    # <= 3.8e-6); a transform left out is off by > 0.05 (asserted below): 1e-4
    assert (ours - reference)[real].abs().max() <= 1e-4
    torch.testing.assert_close(sampling, logits[:, -1], rtol=1e-5, atol=1e-4)
    before = (untransformed - reference)[real].abs().max().item()  # what log-probs were without the transform
    assert (before > 0.05) == (head_transform(model.config) != HeadTransform()), before
    assert check_logprobs_match_forward(model, ids, mask, P, temperature=tau, chunk_size=4) <= 1e-4


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_rows_leaving_the_decoding_batch_change_no_greedy_token(model_type, monkeypatch):
    # Finished rows leave the batch and every cache layer (sliding-window, hybrid and MLA ones too); RecurrentGemma
    # keeps its own state outside the cache, so its batch stays whole.
    model = tiny_family(model_type)
    ids, mask = left_padded_prompts(8)  # [N, P]
    sizes = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _, args: sizes.append(args[0].shape[0]))

    def greedy(eos: int) -> torch.Tensor:
        settings = decode_settings(max_new_tokens=12, eos_ids=[eos], pad_id=0,
                                  greedy=True)
        return decode(model, ids, mask, settings).completion_ids  # [N, C]

    def ends(t: int) -> list:
        return [int((row == t).nonzero()[0]) if (row == t).any() else None for row in free]

    free = greedy(V)  # an EOS never drawn
    eos = max(free.unique().tolist(), key=lambda t: len(set(ends(t))))  # rows finish one after another
    assert len(set(ends(eos))) >= 3
    sizes.clear()
    compacted = greedy(eos)
    assert (min(sizes) == 8) == (model_type == "recurrent_gemma"), sizes
    monkeypatch.setattr(DecodingRows, "compact", lambda self, cache, *tensors: tensors)
    assert torch.equal(compacted, greedy(eos))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_shared_prefill_changes_no_greedy_token(model_type):
    # 4 prompts read once and their cache (every layer kind) repeated twice = the 8 repeated prompts read row by row.
    model = tiny_family(model_type)
    ids, mask = left_padded_prompts(4)  # [B, P]
    settings = decode_settings(max_new_tokens=8, eos_ids=[V], pad_id=0, greedy=True)
    shared = decode(model, ids, mask, settings, repeats=2).completion_ids  # [8, C]
    repeated = decode(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), settings)
    assert torch.equal(shared, repeated.completion_ids)


def test_a_model_keeping_its_own_state_decodes_transformers_greedy_tokens():
    # RecurrentGemma holds its recurrent state in its modules and zeroes it when the batch size changes: its rows
    # are prefilled one per copy and none leave, whatever transformers marks it, so rows finishing at different
    # steps and prompts repeated decode what `generate` decodes.
    model = tiny_family("recurrent_gemma")
    ids, mask = left_padded_prompts(4)  # [B, P]
    theirs = model.generate(ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0),
                            do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=75)[:, ids.shape[1]:]
    assert (theirs == 75).any(1).sum() == 2 and theirs.shape[1] == 10, "some rows end, others decode on"
    ours = decode(model, ids, mask, decode_settings(max_new_tokens=10, eos_ids=[75],
                                                   pad_id=0, greedy=True), repeats=2).completion_ids  # [8, C]
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("model_type,experts", [("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16)),
                                                ("gpt_oss", dict(num_local_experts=4)),
                                                ("granitemoe", dict(num_local_experts=4))])
def test_the_routers_load_balancing_loss_is_the_models_own(model_type, experts):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **experts, "num_experts_per_tok": 2})
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = left_padded_batch()
    logprobs, aux = completion_logprobs(model, ids, mask, 5, temperature=1.0, chunk_size=7, router_aux=True)
    own = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), output_router_logits=True)
    assert torch.allclose(logprobs, completion_logprobs(model, ids, mask, 5, temperature=1.0, chunk_size=7))
    torch.testing.assert_close(aux, own.aux_loss)
    aux.backward()  # it trains the routers
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" in n or ".gate." in n)


def test_transforms_read_from_configs():
    def read(model_type, **settings):
        return head_transform(AutoConfig.for_model(model_type, **settings))

    assert read("qwen2") == HeadTransform()
    assert read("cohere") == HeadTransform(scale=0.0625)  # Cohere's default logit_scale
    assert read("granite", logits_scaling=8.0) == HeadTransform(scale=0.125)
    assert read("hyperclovax", logits_scaling=8.0) == HeadTransform(scale=8.0)
    assert read("falcon_h1", lm_head_multiplier=0.5) == HeadTransform(scale=0.5)
    assert read("minicpm3", hidden_size=1024, num_attention_heads=16, dim_model_base=256) == HeadTransform(scale=0.25)
    assert read("gemma2") == HeadTransform(softcap=30.0)  # Gemma 2's default final_logit_softcapping
    assert read("gemma3n", text_config={"final_logit_softcapping": 20.0}) == HeadTransform(softcap=20.0)  # nested
    assert read("aya_vision") == HeadTransform()  # its text config has Cohere's scale; its forward ignores it
    assert read("muse_spark", text_config={"output_multiplier": 0.5, "final_logit_softcapping": 20.0}) == \
        HeadTransform(scale=0.5, softcap=20.0)


def test_transforms_grpo_does_not_know_are_refused():
    config = AutoConfig.for_model("llama")
    config.final_logits_multiplier = 2.0  # a made-up family's head multiplier
    with pytest.raises(ConfigError, match="final_logits_multiplier = 2.0"):
        head_transform(config)
    config.final_logits_multiplier = 1.0  # neutral: nothing to do
    assert head_transform(config) == HeadTransform()
    with pytest.raises(ConfigError, match="MptForCausalLM ignores it"):
        head_transform(AutoConfig.for_model("mpt", logit_scale=0.5))
    with pytest.raises(ConfigError, match="unpadded_vocab_size"):
        head_transform(AutoConfig.for_model("inkling_text", unpadded_vocab_size=1000, vocab_size=1024))
    with pytest.raises(ConfigError, match="positive number"):
        head_transform(AutoConfig.for_model("cohere", logit_scale=0.0))


class ScaledLlama(LlamaForCausalLM):
    """A family whose forward scales its logits without a config attribute that says so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out


def test_the_start_up_check_names_the_model_and_the_mismatch():
    torch.manual_seed(0)
    model = ScaledLlama(AutoConfig.for_model("llama", **SMALL)).train()
    ids, mask = left_padded_batch()
    with pytest.raises(ConfigError, match=r"ScaledLlama's own forward by up to \d"):
        check_logprobs_match_forward(model, ids, mask, 5, temperature=1.0, chunk_size=4)
    assert model.training  # restored after the check's eval-mode forwards
    # Another rank over the tolerance stops this one too, whose own rows match.
    good, seen = tiny_family("cohere"), []
    with pytest.raises(ConfigError, match="2x the tolerance on the worst rank"):
        check_logprobs_match_forward(good, ids, mask, 5, temperature=1.0, chunk_size=4,
                                     agree=lambda excess: seen.append(excess) or 2.0)
    assert len(seen) == 1 and seen[0] < 0.01


def test_the_start_up_check_under_bf16_weights():
    # Gemma 2 soft-caps bf16 logits in bf16 (~0.025 from ours, in float32): within the 16-bit tolerance.
    ids, mask = left_padded_batch()
    for model_type in ("gemma2", "cohere"):
        model = tiny_family(model_type).to(torch.bfloat16)
        assert check_logprobs_match_forward(model, ids, mask, 5, temperature=0.7, chunk_size=4) < 0.1
    torch.manual_seed(0)
    model = ScaledLlama(AutoConfig.for_model("llama", **SMALL)).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits of ~10: the 16-bit tolerance grows with them
    with pytest.raises(ConfigError, match="ScaledLlama"):
        check_logprobs_match_forward(model, ids, mask, 5, temperature=0.7, chunk_size=4)


def test_the_trainer_runs_the_check_on_its_first_generation(tmp_path):
    tokenizer = tiny_tokenizer()
    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2,
                    num_generations=2, max_prompt_length=16, max_completion_length=4, optim="adamw", beta=0.0)
    settings = {**SMALL, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)
    model = ScaledLlama(AutoConfig.for_model("llama", **settings))
    trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts(4))
    with pytest.raises(ConfigError, match="ScaledLlama"):
        trainer.batches.take(0)
    cohere = AutoModelForCausalLM.from_config(AutoConfig.for_model("cohere", **settings, logit_scale=0.25))
    trainer = Trainer(config, model=cohere, tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts(4))
    trainer.batches.take(0)
    assert trainer.policy.head_checked


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_preallocated_cache_decodes_what_the_dynamic_cache_decodes(model_type, monkeypatch):
    # Greedy and sampled, with compaction, a shared prefill, a repetition penalty and min-p: the same tokens as
    # transformers' DynamicCache. Families with sliding windows or recurrent state keep the DynamicCache.
    import grpo.rollout.engines.decoding
    from transformers import DynamicCache

    from grpo.rollout.engines.kv_cache import PreallocatedLayer, preallocated_cache

    model = tiny_family(model_type)
    ids, mask = left_padded_prompts(4)  # [B, P]
    plain = all(isinstance(layer, PreallocatedLayer) for layer in preallocated_cache(model.config, 8).layers)
    assert plain == (model_type not in ("cohere2", "gemma2", "gemma3_text", "mistral", "recurrent_gemma",
                                        "vaultgemma")), "sliding windows and recurrent state stay dynamic"

    def run(**settings) -> torch.Tensor:
        torch.manual_seed(0)
        return decode(model, ids, mask, decode_settings(max_new_tokens=10, top_p=1.0, top_k=0, eos_ids=[5, 7], pad_id=0,
                                                       **settings), repeats=2).completion_ids  # [8, C]

    cases = [dict(temperature=1.0, greedy=True), dict(temperature=1.0, repetition_penalty=1.5, greedy=True),
             dict(temperature=2.0, min_p=0.05), dict(temperature=2.0, repetition_penalty=1.3)]
    ours = [run(**case) for case in cases]
    monkeypatch.setattr(grpo.rollout.engines.decoding, "preallocated_cache",
                        lambda config, _: DynamicCache(config=config))
    for case, tokens in zip(cases, ours):
        assert torch.equal(tokens, run(**case)), case


def test_the_preallocated_cache_is_written_in_place():
    from grpo.rollout.engines.kv_cache import preallocated_cache

    model = tiny_family("llama")
    cache = preallocated_cache(model.config, 6 + 10)
    seen = []
    model.model.norm.register_forward_hook(lambda *_: seen.append([  # after every forward, fused steps too
        (layer.key_buffer.data_ptr(), layer.key_buffer.shape) for layer in cache.layers]))
    import grpo.rollout.engines.decoding

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo.rollout.engines.decoding, "preallocated_cache", lambda *_: cache)
        ids = torch.randint(1, V, (4, 6), generator=torch.Generator().manual_seed(0))  # [B, P]
        decode(model, ids, torch.ones_like(ids), decode_settings(max_new_tokens=10, eos_ids=[V], pad_id=0, greedy=True),
               repeats=2)
    # The prefill's 4 rows, then their 8 copies (one copy of the buffers), then the same buffers every step.
    assert seen[0][0][1] == (4, 2, 16, 8) and len(seen) == 10
    assert all(step == seen[1] for step in seen[2:]) and seen[1][0][1] == (8, 2, 16, 8)
    assert cache.layers[0].get_seq_length() == 6 + 9  # the last token is sampled, never fed back


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_prefix_all_prompts_share_is_read_once_and_changes_no_greedy_token(model_type, monkeypatch):
    # 3 left-padded prompts of 20-24 tokens whose first 18 are the same: read once, its cache given to every row
    # (plain-attention families; the others read every prompt whole), then each prompt's own tokens.
    import grpo.rollout.engines.decoding

    model = tiny_family(model_type)
    prefix = torch.randint(1, V, (18,), generator=torch.Generator().manual_seed(1))
    own = [torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 6, 4)]
    ids = torch.zeros(3, 24, dtype=torch.long)  # [B, P]
    mask = torch.zeros_like(ids)
    for i, rest in enumerate(own):
        row = torch.cat([prefix, rest])
        ids[i, 24 - len(row):], mask[i, 24 - len(row):] = row, 1
    assert grpo.rollout.engines.decoding.shared_prefix_length(ids, mask) == 18
    reads = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _, args: reads.append(tuple(args[0].shape)))
    settings = decode_settings(max_new_tokens=8, eos_ids=[V], pad_id=0,
                              greedy=True, repetition_penalty=1.3)
    shared = decode(model, ids, mask, settings, repeats=2).completion_ids  # [6, C]
    stays_whole = model_type in ("cohere2", "gemma2", "gemma3_text", "mistral", "recurrent_gemma", "vaultgemma")
    whole = [(6 if model_type == "recurrent_gemma" else 3, 24), (6, 1)]  # its own state: prefilled row by row
    assert reads[:2] == (whole if stays_whole else [(1, 18), (3, 6)]), reads[:2]
    monkeypatch.setattr(grpo.rollout.engines.decoding, "MIN_SHARED_PREFIX", 10**6)
    assert torch.equal(shared, decode(model, ids, mask, settings, repeats=2).completion_ids)
