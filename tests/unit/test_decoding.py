"""The KV-cached sampling loop: token draws follow the softmax, filters keep what they should, cached
decoding of left-padded prompts reproduces uncached greedy decoding, and min_p and repetition_penalty are
transformers' (its processors, its order, its `generate`)."""
import math

import pytest
import torch
from tiny_setup import decode_settings, tiny_model, tiny_tokenizer

from grpo.rollout.engines.kv_cache import DecodingRows
from grpo.rollout.engines.decoding import (decode, filter_logits, penalize_repetitions, sample_from_logits,
                                   seen_tokens)
from grpo.rollout.engines.sampling import decoded_rows, left_pad


def test_draws_follow_the_softmax_and_never_pick_minus_inf():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(40000, 5).clone()  # log(0) = -inf
    u = torch.rand(40000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # [40000, 1]
    counts = torch.bincount(sample_from_logits(logits, u), minlength=5).float()
    freq = counts / counts.sum()
    assert counts[4] == 0
    # 40000 draws: the standard error of a frequency is at most 0.0025.
    assert torch.allclose(freq, probs, atol=0.01), freq


@pytest.mark.parametrize("V", [5, 256, 1000, 49152])  # within one block, exactly blocks, a part block, SmolLM2's
def test_the_two_level_inverse_cdf_draws_the_one_level_ones(V):
    generator = torch.Generator().manual_seed(V)
    logits = torch.randn(64, V, generator=generator) * 3  # [64, V]
    logits[:, ::7] = -torch.inf  # never drawn, also at a block's first or last entry
    u = torch.rand(64, 1, dtype=torch.float64, generator=generator)  # [64, 1]
    u[:4] = torch.tensor([[0.0], [1 - 2 ** -53], [0.5], [1e-300]], dtype=torch.float64)  # the ends, a midpoint
    cdf = torch.cumsum(logits.softmax(-1), dim=-1, dtype=torch.float64)  # [64, V]: over the whole vocabulary
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=V - 1).squeeze(1)  # [64]
    got = sample_from_logits(logits, u=u)  # [64]
    assert torch.equal(got, want) and torch.isfinite(logits.gather(1, got[:, None])).all()


def test_top_k_and_top_p_keep_the_expected_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits.clone(), **kw)).squeeze(0).tolist()  # noqa: E731
    assert kept(temperature=1.0, top_k=2, top_p=1.0) == [True, True, False, False]
    assert kept(temperature=1.0, top_k=0, top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(temperature=1.0, top_k=0, top_p=0.81) == [True, True, True, False]
    assert kept(temperature=1.0, top_k=0, top_p=0.1) == [True, False, False, False]  # always the top token
    hot = filter_logits(logits.clone(), temperature=2.0, top_k=0, top_p=1.0)
    assert torch.allclose(hot, logits / 2.0)


def test_cached_decoding_of_padded_prompts_matches_uncached_greedy():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    rows = [tokenizer("Write 3 digits:")["input_ids"], tokenizer("Write 12345 digits: 0")["input_ids"]]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    out = decode(model, ids, mask, decode_settings(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=1,
                                                  eos_ids=[10**6], pad_id=tokenizer.pad_token_id)).completion_ids
    for row, completion in zip(rows, out.tolist()):
        seq = list(row)
        for _ in range(6):  # the whole sequence, no cache, no padding
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert completion == seq[len(row):]


def test_rows_stop_at_eos_and_are_padded_after_it():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids, mask = left_pad([tokenizer("Write 3 digits:")["input_ids"]] * 4, tokenizer.pad_token_id)
    with torch.no_grad():
        first = int(model(ids[:1]).logits[0, -1].argmax())
    # Greedy decoding whose first token is declared EOS: every row ends at once, and the loop with it.
    out = decode(model, ids, mask, decode_settings(max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=1,
                                                  eos_ids=[first], pad_id=tokenizer.pad_token_id)).completion_ids
    assert out.tolist() == [[first]] * 4
    full = decode(model, ids, mask, decode_settings(max_new_tokens=5, eos_ids=[first], pad_id=tokenizer.pad_token_id,
                                                   stop_at_eos=False)).completion_ids
    assert full.shape == (4, 5) and not (full == first).any()
    assert math.isfinite(float(full.float().mean()))


# --- min_p and repetition_penalty, against transformers' own processors ---------------------------------------


def test_min_p_after_temperature_matches_transformers():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 3  # [N, V]
    for temperature, top_k, min_p in [(1.0, 0, 0.1), (0.5, 0, 0.1), (1.7, 0, 0.3), (0.7, 20, 0.05), (1.0, 0, 0.0),
                                      (1.0, 0, 1.0)]:
        theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
        theirs = TopKLogitsWarper(top_k)(None, theirs) if top_k else theirs
        theirs = MinPLogitsWarper(min_p)(None, theirs)
        ours = filter_logits(logits.clone(), temperature=temperature, top_k=top_k, top_p=1.0, min_p=min_p)
        assert torch.equal(ours, theirs), (temperature, top_k, min_p)
    # Temperature first: at 0.5 a min_p of 0.1 keeps fewer tokens than at 1.0 (a hotter bound is looser).
    kept = [int(filter_logits(logits.clone(), t, 0, 1.0, 0.1).isfinite().sum()) for t in (0.5, 1.0)]
    assert kept[0] < kept[1]
    assert torch.equal(filter_logits(logits.clone(), 1.0, 0, 1.0, None), logits)  # None: off


def test_repetition_penalty_matches_transformers_over_padded_prompts():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    vocab = 50
    ids = torch.randint(0, vocab + 5, (6, 12), generator=g)  # [N, P]; ids past the head's vocabulary are skipped
    mask = torch.ones_like(ids)
    mask[1, :4], mask[3, :11] = 0, 0  # left padding: not counted
    logits = torch.randn(6, vocab, generator=g) * 2  # [N, V]
    pad_lengths = (mask != 0).int().argmax(dim=1)  # [N], as generate computes them
    seen = seen_tokens(ids, mask, vocab)
    for penalty in (1.3, 0.7, 2.0):
        theirs = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pad_lengths)(ids, logits.clone())
        ours = penalize_repetitions(logits.clone(), seen, penalty)
        assert torch.equal(ours, theirs), penalty
        assert not torch.equal(ours, logits)
    assert seen[3].sum() == int(ids[3, 11] < vocab)  # row 3's one real token


def decode_inputs(tokenizer):
    rows = [tokenizer("Write 3 digits: 0")["input_ids"], tokenizer("Write 12345 digits: 012")["input_ids"]]
    return left_pad(rows, tokenizer.pad_token_id)


def test_greedy_with_a_repetition_penalty_matches_model_generate():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids, mask = decode_inputs(tokenizer)
    kwargs = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "eos_ids": [10**6],
              "pad_id": tokenizer.pad_token_id, "greedy": True}
    plain = decode(model, ids, mask, decode_settings(**kwargs)).completion_ids
    ours = decode(model, ids, mask, decode_settings(repetition_penalty=3.0, **kwargs)).completion_ids
    assert not torch.equal(ours, plain), "the penalty should change this greedy decode"
    theirs = model.generate(ids, attention_mask=mask, do_sample=False, repetition_penalty=3.0, max_new_tokens=10,
                            min_new_tokens=10, pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    assert torch.equal(ours, theirs)


def test_sampling_draws_from_the_distribution_model_generate_would(monkeypatch):
    """At every step of our loop (temperature, min_p and a repetition penalty set), the logits we sample from are
    the scores transformers' `generate` computes for the same prefix, its processors in its own order."""
    from grpo.rollout.engines import decoding

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids, mask = decode_inputs(tokenizer)
    recorded = []
    draw = decoding.sample_from_logits
    monkeypatch.setattr(decoding, "sample_from_logits",
                        lambda logits, **kw: recorded.append(logits.clone()) or draw(logits, **kw))
    # A random tiny model's logits are close together: a low temperature and a high min_p make min_p bite.
    settings = {"temperature": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.6, "repetition_penalty": 1.5}
    torch.manual_seed(0)
    out = decode(model, ids, mask, decode_settings(max_new_tokens=6, eos_ids=[10**6], pad_id=tokenizer.pad_token_id,
                                                  **settings)).completion_ids
    for t, ours in enumerate(recorded):
        prefix = torch.cat([ids, out[:, :t]], dim=1)  # [N, P+t]
        prefix_mask = torch.cat([mask, torch.ones_like(out[:, :t])], dim=1)  # [N, P+t]
        theirs = model.generate(prefix, attention_mask=prefix_mask, do_sample=True, max_new_tokens=1,
                                output_scores=True, return_dict_in_generate=True,
                                pad_token_id=tokenizer.pad_token_id, **settings).scores[0]  # [N, V]
        assert torch.equal(ours.isinf(), theirs.isinf()), t
        assert ours.isinf().any(), "min_p should drop tokens"
        # the same processors on float32 logits of ~1, in their order: a few roundings (2**-24) each, measured
        # 2.4e-7; a processor left out or applied twice moves them by >= 1e-1 (temperature 0.5, penalty 1.5)
        torch.testing.assert_close(ours[ours.isfinite()], theirs[theirs.isfinite()], atol=1e-5, rtol=1e-5)


PROMPTS = ["Write 3 digits:", "Write 12345 digits: 0", "<reasoning> think", "Write 7 digits: 01", "Write 1 digits:",
           "<answer>", "Write 9 digits: 0123", "think </reasoning>"]


def lively_model(tokenizer):
    """The tiny model with larger random weights: its greedy continuations vary (the default's repeat one token)."""
    model = tiny_model(tokenizer).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def decode_prompts(model, tokenizer, eos_ids, batch_sizes=None, **kwargs):
    ids, mask = left_pad([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id)
    hook = model.get_input_embeddings().register_forward_pre_hook(  # every forward, fused steps too, embeds its ids
        lambda _, args: batch_sizes.append(args[0].shape[0]) if batch_sizes is not None else None)
    try:
        return decode(model, ids, mask, decode_settings(max_new_tokens=12, eos_ids=eos_ids,
                                                       pad_id=tokenizer.pad_token_id, **kwargs)).completion_ids
    finally:
        hook.remove()


def uncompacted(monkeypatch):
    monkeypatch.setattr(DecodingRows, "compact", lambda self, cache, *tensors: tensors)


def finish_steps(out: torch.Tensor, eos: int) -> list:
    return [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in out]


@pytest.mark.parametrize("penalty", [1.0, 1.5])  # with a repetition penalty, its tokens seen leave with the rows
def test_finished_rows_leave_the_batch_and_greedy_decoding_is_unchanged(monkeypatch, penalty):
    tokenizer = tiny_tokenizer()
    model = lively_model(tokenizer)
    kwargs = {"greedy": True, "repetition_penalty": penalty}
    free = decode_prompts(model, tokenizer, [10**6], **kwargs)  # [8, 12]: no EOS, every row runs to the end
    eos = max(free.unique().tolist(), key=lambda t: len(set(finish_steps(free, t))))  # rows end one after another
    assert len(set(finish_steps(free, eos))) >= 4, finish_steps(free, eos)
    sizes = []
    out = decode_prompts(model, tokenizer, [eos], sizes, **kwargs)
    assert sizes[0] == 8 and sizes == sorted(sizes, reverse=True) and len(set(sizes)) >= 3, sizes  # compacted twice
    uncompacted(monkeypatch)
    full_sizes = []
    reference = decode_prompts(model, tokenizer, [eos], full_sizes, **kwargs)
    assert set(full_sizes) == {8} and len(full_sizes) == len(sizes)
    assert torch.equal(out, reference)
    for row, step in zip(out.tolist(), finish_steps(out, eos)):  # padded after EOS, and as the free run up to it
        if step is not None:
            assert set(row[step + 1:]) <= {tokenizer.pad_token_id}
    assert torch.equal(torch.where(out == tokenizer.pad_token_id, free, out), free)


def test_sampling_with_compaction_draws_what_the_uncompacted_loop_draws(monkeypatch):
    # Every step draws one uniform per original row, so a row's tokens do not depend on which rows have left.
    tokenizer = tiny_tokenizer()
    model = lively_model(tokenizer)
    torch.manual_seed(1)
    sizes = []
    out = decode_prompts(model, tokenizer, list(range(4, 60)), sizes)  # a fifth of the vocabulary ends a completion
    assert sizes[-1] < 8 and (out == tokenizer.pad_token_id).any()
    uncompacted(monkeypatch)
    torch.manual_seed(1)
    assert torch.equal(decode_prompts(model, tokenizer, list(range(4, 60))), out)
    torch.manual_seed(2)
    assert not torch.equal(decode_prompts(model, tokenizer, list(range(4, 60))), out)


def test_a_row_ends_at_its_first_eos_as_rows_made_elsewhere_do():
    """The decode's lengths: each row up to and including its first EOS (the whole row without one), the rule
    rollout/engines/sampling.decoded_rows applies to a server's or a rollout_func's tokens; nothing fed without
    tools."""
    tokenizer = tiny_tokenizer()
    model = lively_model(tokenizer)
    ids, mask = left_pad([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id)
    eos = list(range(4, 40))  # rows end at 5 different steps, and one runs to the end
    torch.manual_seed(1)
    decoded = decode(model, ids, mask, decode_settings(max_new_tokens=12, eos_ids=eos, pad_id=tokenizer.pad_token_id))
    made_elsewhere = decoded_rows(decoded.completion_ids.tolist(), tokenizer.pad_token_id, eos)
    assert decoded.lengths.tolist() == made_elsewhere.lengths.tolist()
    assert len(set(decoded.lengths.tolist())) >= 3 and 12 in decoded.lengths.tolist(), decoded.lengths
    assert decoded.fed.shape == decoded.completion_ids.shape and not decoded.fed.any()


@pytest.mark.parametrize("penalty", [1.0, 1.5])  # the tokens seen are repeated with the rows
def test_a_shared_prefill_samples_what_repeated_prompts_sample(penalty):
    # 3 prompts x 4 copies: one prefill of 3 rows, its cache repeated to 12, then 12 rows decode; the same seed
    # must draw the same tokens as 12 pre-repeated prompts prefilled one by one.
    tokenizer = tiny_tokenizer()
    model = lively_model(tokenizer)
    ids, mask = left_pad([tokenizer(p)["input_ids"] for p in PROMPTS[:3]], tokenizer.pad_token_id)  # [3, P]
    settings = decode_settings(max_new_tokens=10, temperature=1.0, top_p=1.0, top_k=0, eos_ids=[10**6],
                              pad_id=tokenizer.pad_token_id, repetition_penalty=penalty)
    sizes = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _, args: sizes.append(args[0].shape))
    torch.manual_seed(0)
    shared = decode(model, ids, mask, settings, repeats=4).completion_ids  # [12, 10]
    assert sizes[0] == ids.shape and sizes[1] == (12, 1), sizes[:2]  # the prompts are read once
    torch.manual_seed(0)
    repeated = decode(model, ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0), settings).completion_ids
    assert shared.shape == (12, 10) and torch.equal(shared, repeated)
    assert len({tuple(r) for r in shared.tolist()}) > 3  # the copies drew different completions


def test_the_shared_prefix_leaves_every_prompt_a_token_of_its_own():
    from grpo.rollout.engines.decoding import shared_prefix_length, suffixes

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 9], [0, 5, 6, 7, 8, 1]])  # [3, 6], left-padded
    mask = (ids != 0).long()
    assert shared_prefix_length(ids, mask) == 3  # 5 6 7
    rest, own = suffixes(ids, mask, 3)
    assert rest.tolist() == [[6, 7, 8], [9, 9, 9], [7, 8, 1]] and own.tolist() == [[0, 0, 1], [1, 1, 1], [0, 1, 1]]
    same = torch.tensor([[4, 5, 6], [4, 5, 6]])
    assert shared_prefix_length(same, torch.ones_like(same)) == 2  # the last token stays each row's own
    assert shared_prefix_length(same[:1], torch.ones_like(same[:1])) == 0  # one prompt: nothing to share
    assert shared_prefix_length(torch.tensor([[1, 2], [3, 2]]), torch.ones(2, 2, dtype=torch.long)) == 0
