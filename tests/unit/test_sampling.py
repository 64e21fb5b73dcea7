"""Completion masks, prompt padding and truncation, and sampling from a tiny model."""
import pytest
import torch
from stats import chi2_contingency_pvalue
from tiny_setup import tiny_model, tiny_tokenizer

from grpo.rollout.sampling import (
    PromptEncoder,
    completion_mask_after_eos,
    left_pad,
    sample_completions,
)

EOS = 9


def test_mask_keeps_tokens_through_the_first_eos():
    ids = torch.tensor([[5, 6, EOS, 7, EOS],   # EOS at 2: keep 0..2
                        [5, 6, 7, 8, 4],       # never ends: keep all, truncated
                        [EOS, 5, 5, 5, 5]])    # ends at once: keep only the EOS
    mask, truncated = completion_mask_after_eos(ids, [EOS])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_several_eos_ids():
    mask, _ = completion_mask_after_eos(torch.tensor([[1, 3, 2, 2]]), [2, 3])
    assert mask.tolist() == [[1, 1, 0, 0]]


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
                max_completion_length=6, temperature=1.0, top_p=1.0, top_k=0)
    assert ro.prompt_ids.shape[0] == 6 and ro.completion_ids.shape == (6, ro.completion_mask.shape[1])
    assert torch.equal(ro.prompt_ids[0], ro.prompt_ids[2]) and not torch.equal(ro.prompt_ids[0], ro.prompt_ids[3])
    assert all(c[0]["role"] == "assistant" for c in ro.completions)
    assert (ro.completion_ids[ro.completion_mask == 0] == tokenizer.pad_token_id).all()


def test_full_length_when_eos_is_disabled():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    ro = sample_completions(model, tokenizer, PromptEncoder(tokenizer, 64), ["Write 3 digits:"], num_generations=4,
                max_completion_length=5, temperature=1.0, top_p=1.0, top_k=0, stop_at_eos=False)
    assert ro.completion_mask.sum().item() == 4 * 5 and ro.truncated.all()


def test_one_decode_for_all_prompts_samples_what_a_decode_per_prompt_samples():
    """One decode for a generation batch draws each row's uniforms at other positions of the random stream than
    a decode per micro-batch (a decode's length depends on when its rows sample EOS, so the stream cannot be
    split ahead): the tokens differ for a seed, their distribution must not. Chi-square on the frequencies of
    (prompt, position, token) over 2 x 300 rows of 4 tokens each (p = 0.73 here; a temperature of 0.9 instead of
    1.0 on one side gives p = 6e-9)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    with torch.no_grad():  # logits 8x larger: a random model's next token is nearly uniform over 260
        model.model.norm.weight.mul_(8)
    encode, prompts = PromptEncoder(tokenizer, 64), ["Write 3 digits:", "Write 12 digits"]
    settings = dict(num_generations=300, max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0,
                    stop_at_eos=False)
    torch.manual_seed(0)
    one = sample_completions(model, tokenizer, encode, prompts, **settings).completion_ids  # [600, 4]
    torch.manual_seed(1)
    apart = torch.cat([sample_completions(model, tokenizer, encode, [p], **settings).completion_ids
                       for p in prompts])  # [600, 4]
    assert not torch.equal(one, apart)

    def cells(ids):  # one id per (prompt, position, token)
        prompt = torch.arange(2).repeat_interleave(300)[:, None]  # [600, 1]
        return ((prompt * 4 + torch.arange(4)) * len(tokenizer) + ids).flatten()  # [2400]

    a, b = cells(one), cells(apart)
    values, counts = torch.cat([a, b]).unique(return_counts=True)
    common = values[counts >= 10]  # rare cells pooled: the test needs expected counts of 5 or more
    table = [[int((x == v).sum()) for v in common] + [int((~torch.isin(x, common)).sum())] for x in (a, b)]
    p = chi2_contingency_pvalue(table)
    assert p > 1e-3, p
