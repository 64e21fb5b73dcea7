"""Completion masks, prompt padding and truncation, and sampling from a tiny model: a seed's tokens do not depend
on how the prompts are grouped, and are drawn from the right distribution."""
from types import SimpleNamespace

import pytest
import torch
from stats import chi2_contingency_pvalue
from tiny_setup import tiny_model, tiny_tokenizer

from grpo import Config
from grpo.policy.models import prepare_for_training
from grpo.settings.components import SamplingSettings
from grpo.settings.schedule import Schedule
from grpo.rollout.engines.kv_cache import DecodingRows
from grpo.rollout.engines.decoding import Decoded
from grpo.rollout.engines.sampling import (
    PromptEncoder,
    Decoder,
    decoded_rows,
    left_pad,
    rollout_of,
    sample_completions,
)
from grpo.rollout.streams import PromptStreams

EOS = 9


def rows_rollout(decoded: Decoded, eos_ids=(EOS,)):
    tokenizer = tiny_tokenizer()
    N = len(decoded.completion_ids)
    prompt_ids, prompt_mask = torch.ones(N, 2, dtype=torch.long), torch.ones(N, 2, dtype=torch.long)  # [N, P]
    return rollout_of(prompt_ids, prompt_mask, decoded, tokenizer, list(eos_ids), chat=False)


def test_a_completion_made_elsewhere_runs_through_its_first_eos():
    rows = [[5, 6, EOS, 7, EOS],  # EOS at 2: keep 0..2
            [5, 6, 7, 8, 4],      # never ends: keep all, truncated
            [EOS, 5, 5, 5, 5],    # ends at once: keep only the EOS
            [5, 6]]               # shorter, no EOS: truncated
    rollout = rows_rollout(decoded_rows(rows, pad_id=0, eos_ids=[EOS]))
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert rollout.truncated.tolist() == [False, True, False, True]
    pad = tiny_tokenizer().pad_token_id
    assert rollout.completion_ids[0].tolist() == [5, 6, EOS, pad, pad]  # the ids after the end padded
    assert torch.equal(rollout.loss_mask, rollout.completion_mask)


def test_several_eos_ids():
    assert decoded_rows([[1, 3, 2, 2]], pad_id=0, eos_ids=[2, 3]).lengths.tolist() == [2]


def test_a_row_is_truncated_unless_its_own_eos_ended_it():
    """With tools, an EOS may be fed (a tool turn's header) or close a tool call mid-row: only the model's own
    EOS as the row's last token ends it; the fed tokens stay out of the loss mask."""
    ids = torch.tensor([[5, EOS, 7, EOS], [5, EOS, 7, EOS], [5, EOS, 7, 8], [5, 6, 7, 8]])  # [4, 4]
    fed = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]])  # [4, 4]
    rollout = rows_rollout(Decoded(ids, fed, torch.tensor([4, 4, 4, 0])))
    assert rollout.truncated.tolist() == [False, True, True, True]  # own EOS; a fed EOS; no EOS; empty
    assert rollout.loss_mask.tolist() == [[1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1] * 4] * 3 + [[0] * 4]


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_long_prompts_are_cut_from_the_left_with_one_warning():
    tokenizer = tiny_tokenizer()
    encode = PromptEncoder(tokenizer, max_prompt_length=3)
    full = tokenizer("Write 12345 digits:")["input_ids"]
    with pytest.warns(UserWarning, match="cut from the left"):
        ids, _ = encode(["Write 12345 digits:"])
    assert ids[0].tolist() == full[-3:]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode(["Write 12345 digits:"])  # no second warning


def test_sample_shapes_masks_and_chat_completions():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    torch.manual_seed(0)
    prompts = [[{"role": "user", "content": "Write 3 digits:"}], [{"role": "user", "content": "Write 1 digits:"}]]
    ro = sample_completions(model, tokenizer, PromptEncoder(tokenizer, 64), prompts, num_generations=3,
                max_completion_length=6)
    assert ro.prompt_ids.shape[0] == 6 and ro.completion_ids.shape == (6, ro.completion_mask.shape[1])
    assert torch.equal(ro.prompt_ids[0], ro.prompt_ids[2]) and not torch.equal(ro.prompt_ids[0], ro.prompt_ids[3])
    assert all(c[0]["role"] == "assistant" for c in ro.completions)
    assert (ro.completion_ids[ro.completion_mask == 0] == tokenizer.pad_token_id).all()


def test_full_length_when_eos_is_disabled():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    ro = sample_completions(model, tokenizer, PromptEncoder(tokenizer, 64), ["Write 3 digits:"], num_generations=4,
                max_completion_length=5, stop_at_eos=False)
    assert ro.completion_mask.sum().item() == 4 * 5 and ro.truncated.all()


def lively_sampler(prompts_per_decode: int, bf16: bool = False, **config):
    """Our Decoder over the tiny model, 1 prompt x 4 completions per micro-batch, where a fifth of the
    vocabulary ends a completion: rows finish at different steps and leave their decodes. `bf16`: as the bf16
    precision plan samples on a CPU, a bf16 base with float32 LoRA adapters (B not zero) unfolded."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    if bf16:
        model = prepare_for_training(model.to(torch.bfloat16), Config(use_lora=True, lora_r=4, lora_alpha=8))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    model.generation_config.eos_token_id = list(range(4, 44))
    policy = SimpleNamespace(parallel=SimpleNamespace(unsharded=lambda fn: fn(model)))
    config = Config(**{**dict(per_device_train_batch_size=4, num_generations=4, max_prompt_length=64,
                              max_completion_length=10, temperature=1.0, seed=0), **config})
    settings = SamplingSettings.of(config, Schedule.resolve(config), bf16)
    return Decoder(policy, tokenizer, PromptEncoder(tokenizer, 64), settings, prompts_per_decode)


def sampled(output: tuple) -> list[list[int]]:
    """Each completion's token ids, from a sampler's (rollout, fields)."""
    return output[0].completion_id_lists


PROMPTS = ["Write 3 digits:", "Write 12345 digits: 0", "<reasoning> think", "Write 7 digits: 01"]


def test_a_seed_samples_the_same_tokens_however_the_prompts_are_grouped():
    # Each prompt draws from its own stream (seed, step, place in the run's prompt stream): a decode of 1, 2 or
    # all 4 prompts (other padding, other rows leaving) and two ranks' shares sample the same tokens.
    streams = PromptStreams(seed=0, step=3, first=8)
    apart, pairs, whole = (sampled(lively_sampler(k)(PROMPTS, streams=streams)) for k in (1, 2, 4))
    assert apart == pairs == whole
    assert len({len(row) for row in whole}) > 3  # rows ended at different steps
    ranks = [sampled(lively_sampler(2)(PROMPTS[2 * r:2 * r + 2], streams=streams.after(2 * r))) for r in (0, 1)]
    assert ranks[0] + ranks[1] == whole
    for other in (PromptStreams(seed=1, step=3, first=8), PromptStreams(seed=0, step=4, first=8),
                  PromptStreams(seed=0, step=3, first=9)):
        assert sampled(lively_sampler(4)(PROMPTS, streams=other)) != whole
    assert sampled(lively_sampler(4)(PROMPTS)) == sampled(lively_sampler(2)(PROMPTS))  # default: step 0's


def test_under_the_bf16_plan_too_a_seed_samples_the_same_tokens_however_the_prompts_are_grouped():
    streams = PromptStreams(seed=0, step=3, first=8)
    outputs = [lively_sampler(k, bf16=True)(PROMPTS, streams=streams) for k in (1, 2, 4)]
    assert sampled(outputs[0]) == sampled(outputs[1]) == sampled(outputs[2])
    kept = outputs[2][0].sampling_logprobs  # [N, C]: each sampled token's, for TRL's correction
    assert torch.equal(kept.isfinite(), outputs[2][0].loss_mask.bool())


def test_each_rows_stream_draws_tokens_as_torchs_generator_does(monkeypatch):
    """The streams (rollout/streams) against uniforms from torch's generator, one per row and step (the sampler's
    draw before per-prompt streams): the tokens differ, their distribution must not. Chi-square on the
    frequencies of (prompt, position, token) over 2 x 300 rows of 4 tokens each (p = 0.16 here; a temperature
    of 0.9 instead of 1.0 on the streams' side gives p = 2e-17)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    with torch.no_grad():  # logits 8x larger: a random model's next token is nearly uniform over 260
        model.model.norm.weight.mul_(8)
    encode, prompts = PromptEncoder(tokenizer, 64), ["Write 3 digits:", "Write 12 digits"]
    settings = dict(num_generations=300, max_completion_length=4,
                    stop_at_eos=False)
    streams = sample_completions(model, tokenizer, encode, prompts, streams=PromptStreams(seed=0),
                                 **settings).completion_ids  # [600, 4]
    monkeypatch.setattr(DecodingRows, "uniforms",
                        lambda self, step: torch.rand(len(self.rows), 1, dtype=torch.float64))  # [n, 1]
    torch.manual_seed(1)
    generator = sample_completions(model, tokenizer, encode, prompts, **settings).completion_ids  # [600, 4]
    assert not torch.equal(streams, generator)

    def cells(ids):  # one id per (prompt, position, token)
        prompt = torch.arange(2).repeat_interleave(300)[:, None]  # [600, 1]
        return ((prompt * 4 + torch.arange(4)) * len(tokenizer) + ids).flatten()  # [2400]

    a, b = cells(streams), cells(generator)
    values, counts = torch.cat([a, b]).unique(return_counts=True)
    common = values[counts >= 10]  # rare cells pooled: the test needs expected counts of 5 or more
    table = [[int((x == v).sum()) for v in common] + [int((~torch.isin(x, common)).sum())] for x in (a, b)]
    p = chi2_contingency_pvalue(table)
    assert p > 1e-3, p
