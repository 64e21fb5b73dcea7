"""The KV-cached sampling loop: token draws follow the softmax, filters keep what they should, and cached
decoding of left-padded prompts reproduces uncached greedy decoding."""
import math

import torch
from tiny_setup import tiny_model, tiny_tokenizer

from grpo.rollout.decoding import filter_logits, generate, sample_from_logits
from grpo.rollout.sampling import left_pad


def test_draws_follow_the_softmax_and_never_pick_minus_inf():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(40000, 5).clone()  # log(0) = -inf
    counts = torch.bincount(sample_from_logits(logits, torch.Generator().manual_seed(0)), minlength=5).float()
    freq = counts / counts.sum()
    assert counts[4] == 0
    # 40000 draws: the standard error of a frequency is at most 0.0025.
    assert torch.allclose(freq, probs, atol=0.01), freq


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
    out = generate(model, ids, mask, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=1, eos_ids=[10**6],
                   pad_id=tokenizer.pad_token_id)
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
    out = generate(model, ids, mask, max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=1, eos_ids=[first],
                   pad_id=tokenizer.pad_token_id)
    assert out.tolist() == [[first]] * 4
    full = generate(model, ids, mask, max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=0, eos_ids=[first],
                    pad_id=tokenizer.pad_token_id, stop_at_eos=False)
    assert full.shape == (4, 5) and not (full == first).any()
    assert math.isfinite(float(full.float().mean()))
