"""int8_sampling_weights: decoding steps on int8 copies of the weights (policy/int8) stay close to the float32 ones,
do not depend on the other rows of the batch, and the decode records each sampled token's log-prob under the
int8 sampler's distribution, which TRL's importance-sampling correction then compares with the policy's (its
metrics logged); refused in one line where it cannot run."""
import pytest
import torch
from test_fused_decoder import prefilled
from test_model_families import V, left_padded_prompts, tiny_family
from tiny_setup import digit_prompts, logged, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.policy.decoder import fused_decoder
from grpo.policy.folding import sampling_weights
from grpo.policy.head import positions
from grpo.policy.int8 import int8_copy, int8_refusal
from grpo.policy.models import prepare_for_training, unwrap
from grpo.rollout.engines.decoding import DecodeSettings, decode
from grpo.rollout.engines.kv_cache import preallocated_cache
from grpo.settings.plan import RunPlan
from grpo.settings.components import SamplingKnobs

pytestmark = pytest.mark.skipif(int8_refusal() is not None, reason="no fbgemm int8 engine on this machine")


def uneven_lora_model():
    """A tiny Llama with LoRA (B not zero), whose output channels have scales as different as a trained model's
    (e^N(0,1)): one scale per weight tensor would round the small channels away."""
    model = prepare_for_training(tiny_family("llama"), Config(use_lora=True, lora_r=4, lora_alpha=8)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=g)
            elif p.dim() == 2 and any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                                          "lm_head")) and "lora_" not in name:
                p.mul_(torch.exp(torch.randn(p.shape[0], 1, generator=g)))
    return model


def steps(hf, ids, mask, int8: bool, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The hidden states [n, H] of fused decoding steps fed `tokens` [n, S] after prompts `ids` [n, P]."""
    n, P = ids.shape
    cache = prefilled(hf, ids, mask, tokens.shape[1])
    step = fused_decoder(hf.base_model, cache, int8)
    full_mask = torch.cat([mask, mask.new_ones(n, tokens.shape[1])], 1)  # [n, P+S]
    position_ids, out = positions(mask)[:, -1:], []  # [n, 1]
    for t in range(tokens.shape[1]):
        position_ids = position_ids + 1
        out.append(step(tokens[:, t:t + 1], full_mask[:, :P + t + 1], position_ids))  # [n, H]
    return out


def test_an_int8_step_gives_the_float32_steps_logits_within_its_rounding():
    model = uneven_lora_model()
    hf = unwrap(model)
    ids, mask = left_padded_prompts(4)  # [4, 6]
    tokens = torch.randint(1, V, (4, 3), generator=torch.Generator().manual_seed(2))  # [4, 3]
    with torch.no_grad(), sampling_weights(model, int8=True) as int8_head:
        head = hf.get_output_embeddings()
        for plain, int8 in zip(steps(hf, ids, mask, False, tokens), steps(hf, ids, mask, True, tokens)):
            want, got = head(plain), int8_head(int8)  # [4, V]: logits of ~10
            # per output channel and two activation passes: 1.5-2.1% of the logits' norm (measured); one scale
            # per tensor: 4.2-5.6%; one activation pass (7 bits): 3.8-5.2%
            error = ((got - want).norm(dim=1) / want.norm(dim=1)).max()
            assert error < 0.03, error
            assert error > 1e-4  # the int8 copies are what ran


def test_a_rows_int8_step_does_not_depend_on_the_other_rows():
    model = uneven_lora_model()
    hf = unwrap(model)
    ids, mask = left_padded_prompts(4)  # [4, 6]
    tokens = torch.randint(1, V, (4, 2), generator=torch.Generator().manual_seed(3))  # [4, 2]
    with torch.no_grad(), sampling_weights(model, int8=True):
        together = steps(hf, ids, mask, True, tokens)
        alone = steps(hf, ids[2:3], mask[2:3], True, tokens[2:3])
    for a, b in zip(together, alone):
        # the same grid for every row: only float32 roundings of another batch size (~1e-7) that move a value
        # across a rounding boundary, one step of the second pass (measured 9e-5); a grid that depends on the
        # batch (fbgemm's own range, or a first pass reaching -64 steps) is off by ~6e-3
        assert torch.allclose(a[2:3], b, atol=1e-3), (a[2:3] - b).abs().max()


def test_the_decode_records_each_tokens_log_prob_under_the_int8_sampler():
    model = uneven_lora_model()
    hf = unwrap(model)
    ids, mask = left_padded_prompts(4)  # [4, 6]
    T = 0.7
    eos = list(range(2, 14))  # an eighth of the vocabulary: rows end at different steps
    settings = DecodeSettings(max_new_tokens=8, eos_ids=eos, pad_id=0, knobs=SamplingKnobs(temperature=T))
    torch.manual_seed(0)
    with torch.no_grad(), sampling_weights(model, int8=True) as int8_head:
        decoded = decode(hf, ids, mask, settings, repeats=2, head_matmul=int8_head, int8=True, with_logprobs=True)
        completions, recorded = decoded.completion_ids, decoded.logprobs  # [8, C] each
        is_eos = torch.isin(completions, torch.tensor(eos)).long()  # [8, C]
        sampled = is_eos.cumsum(1) - is_eos == 0  # [8, C]: up to and including the first EOS
        assert (~sampled).any() and sampled[:, -1].any(), "rows end at different steps, some never"
        assert torch.equal(recorded.isnan(), ~sampled)  # NaN exactly where no token was sampled
        # Again, teacher-forced: the prompts read as the decode reads them (once, then copied), every row fed its
        # sampled tokens through int8 steps to the end (the decode drops finished rows: int8 steps are per row)
        C = completions.shape[1]
        cache = preallocated_cache(hf.config, ids.shape[1] + C)
        first = hf.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                              past_key_values=cache).last_hidden_state[:, -1]  # [4, H]
        copies = torch.arange(4).repeat_interleave(2)  # [8]
        cache.reorder_cache(copies)
        step = fused_decoder(hf.base_model, cache, int8=True)
        full_mask = torch.cat([mask[copies], mask.new_ones(8, C)], 1)  # [8, 6+C]
        position_ids, hidden = positions(mask)[copies, -1:], [first[copies]]  # [8, 1], [8, H]
        for t in range(C - 1):
            position_ids = position_ids + 1
            hidden.append(step(completions[:, t:t + 1], full_mask[:, :ids.shape[1] + t + 1], position_ids))
        head = hf.get_output_embeddings()
        for t, h in enumerate(hidden):
            token = completions[:, t:t + 1]  # [8, 1]
            int8 = (int8_head(h) / T).log_softmax(-1).gather(1, token)[:, 0]  # [8]
            plain = (head(h) / T).log_softmax(-1).gather(1, token)[:, 0]  # [8]
            on = sampled[:, t]
            # the same operations on the same rows: float32 roundings (~1e-6). A missing temperature, a token off
            # by one step, or the float32 head's log-probs: off by 1e-3 to 1
            assert torch.allclose(recorded[on, t], int8[on], atol=1e-5), (t, recorded[on, t] - int8[on])
            assert not torch.allclose(recorded[on, t], plain[on], atol=1e-5), t


def test_int8_is_off_by_default_and_corrected_as_trl_corrects_a_servers_samples():
    assert Config().int8_sampling_weights is False
    plan = RunPlan.resolve(Config(int8_sampling_weights=True), world_size=1)
    assert plan.sampling.int8 and plan.generation.old_logprobs  # the correction compares the policy's old log-probs
    assert dict(plan.generation.sampling_correction) == dict(mode="sequence_mask", clip_min=None, clip_max=3.0)
    assert RunPlan.resolve(Config(), world_size=1).generation.sampling_correction is None
    off = RunPlan.resolve(Config(int8_sampling_weights=True, vllm_importance_sampling_correction=False), 1)
    assert off.generation.sampling_correction is None and off.sampling.int8


def varied(completions, **kwargs) -> list[float]:
    """A reward that differs between almost any two texts: every group has advantages, every step trains."""
    return [sum(map(ord, c)) % 97 / 97 for c in completions]


def test_a_run_with_int8_sampling_weights_logs_trls_correction_metrics(tmp_path):
    tokenizer = tiny_tokenizer()
    config = Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                    max_prompt_length=16, max_completion_length=8, int8_sampling_weights=True, use_lora=True,
                    lora_r=4, lora_alpha=8, vllm_importance_sampling_mode="token_truncate", logging_steps=1)
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[varied],
                      train_dataset=digit_prompts(8))
    trainer.train()
    lines = logged(trainer)
    assert len(lines) == 2
    for line in lines:
        difference = line["sampling/sampling_logp_difference/mean"]
        # the int8 sampler's log-probs against the policy's: its rounding (measured 4e-4); 0 if none were kept
        assert 0 < difference < 0.01 and line["sampling/sampling_logp_difference/max"] >= difference
        ratios = [line[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
        assert 0.9 < ratios[0] < ratios[1] < ratios[2] <= 3.0, ratios  # token_truncate at TRL's clip_max


@pytest.mark.parametrize("settings,says", [
    (dict(use_vllm=True, vllm_mode="server", use_lora=True), "use_vllm=True"),
    (dict(bf16=True), "bf16=True"),
    (dict(use_lora=True, load_in_4bit=True), "load_in_4bit=True"),
    (dict(loss_type="vespo"), "vespo"),
])
def test_int8_with_settings_it_cannot_serve_is_refused_in_one_line(settings, says):
    with pytest.raises(ConfigError, match=says) as refused:
        Config(int8_sampling_weights=True, **settings)
    assert "\n" not in str(refused.value)


def test_a_model_whose_steps_do_not_run_fused_is_refused_in_one_line():
    model = tiny_family("gemma")  # a scaled embedding: transformers' forward, not the fused step
    ids, mask = left_padded_prompts(4)
    with pytest.raises(ConfigError, match="int8_sampling_weights=True needs decoding steps that run fused") as e:
        with torch.no_grad(), sampling_weights(model, int8=True) as head:
            decode(model, ids, mask, DecodeSettings(max_new_tokens=2, eos_ids=[1], pad_id=0), head_matmul=head,
                   int8=True)
    assert "\n" not in str(e.value)


def test_a_torch_without_fbgemm_is_refused_in_one_line():
    """Through the Trainer, before loading: tests/unit/test_engine_choice.py."""
    previous = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "qnnpack"
        assert "fbgemm" in int8_refusal() and "'qnnpack'" in int8_refusal()
    finally:
        torch.backends.quantized.engine = previous
    assert int8_refusal() is None


def test_a_frozen_heads_int8_copy_is_made_once_and_again_when_its_weight_changes():
    head = torch.nn.Linear(16, 32).requires_grad_(False)
    first = int8_copy(head)
    assert int8_copy(head) is first
    with torch.no_grad():
        head.weight.mul_(2)  # an in-place write: the copy is stale
    second = int8_copy(head)
    assert second is not first and int8_copy(head) is second
    x = torch.randn(3, 16)
    assert torch.allclose(second(x), head(x), rtol=0.02, atol=0.02)
    head.weight.requires_grad_(True)  # trained: a new copy at every use
    assert int8_copy(head) is not int8_copy(head)
