"""Completion masks, prompt padding and truncation, and sampling from a tiny model."""
import pytest
import torch
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
