"""How a generation batch is sampled (rollout/engines/sampling.Decoder, then rollout/batches.Rollout.micro_batches): our
decoder as many of its prompts per call as the memory plan allows (all of them when they fit), in decodes of a
micro-batch's worth of whole prompts, the rows then cut into micro-batches."""
import dataclasses
from types import SimpleNamespace

import torch

import grpo.rollout.engines.sampling
from grpo import Config
from grpo.settings.components import SamplingSettings
from grpo.settings.schedule import Schedule
from grpo.rollout.batches import Cut, Rollout
from grpo.rollout.engines.sampling import Decoder

G, PAD = 4, 0


def sample_batch(monkeypatch, calls: list, prompts: list, per_device: int,
                 prompts_per_decode: int | None = None) -> tuple[list[Rollout], dict]:
    """Our Decoder over a stand-in for the decoder (completion j of prompt p is the token p * 10 + j), cut into
    micro-batches of `per_device` completions as the trainer does."""
    def sample_completions(model, tokenizer, encode, prompts, *, num_generations, **_) -> Rollout:
        calls.append(list(prompts))
        n = len(prompts) * num_generations
        completion_ids = torch.tensor([[p * 10 + j] for p in prompts for j in range(num_generations)])  # [N, 1]
        return Rollout(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long), completion_ids,
                       torch.ones(n, 1, dtype=torch.long), [str(t) for t in completion_ids[:, 0].tolist()],
                       torch.zeros(n, dtype=torch.bool))

    monkeypatch.setattr(grpo.rollout.engines.sampling, "sample_completions", sample_completions)
    policy = SimpleNamespace(parallel=SimpleNamespace(unsharded=lambda fn: fn(None)))
    # A generation batch of `prompts`: as many micro-batches as their completions fill.
    config = Config(per_device_train_batch_size=per_device, num_generations=G,
                    steps_per_generation=len(prompts) * G // per_device)
    tokenizer = SimpleNamespace(pad_token_id=PAD)
    settings = SamplingSettings.of(config, Schedule.resolve(config))
    decoder = Decoder(policy, tokenizer, None, settings, prompts_per_decode)
    rollout, fields = decoder(prompts)
    return [m.rollout for m in rollout.micro_batches(Cut(per_device, False, False))], fields


def test_our_decoder_samples_the_whole_generation_batch_in_one_call_when_it_fits(monkeypatch):
    calls = []
    rollouts, fields = sample_batch(monkeypatch, calls, [1, 2, 3, 4, 5, 6], per_device=8, prompts_per_decode=6)
    assert calls == [[1, 2, 3, 4, 5, 6]] and fields == {}
    assert [r.completions for r in rollouts] == [[str(p * 10 + j) for p in pair for j in range(G)]
                                                 for pair in ((1, 2), (3, 4), (5, 6))]


def test_a_micro_batch_smaller_than_a_group_still_samples_whole_prompts(monkeypatch):
    calls = []
    rollouts, _ = sample_batch(monkeypatch, calls, [1, 2, 3], per_device=6, prompts_per_decode=3)
    assert calls == [[1, 2, 3]]
    flat = [c for r in rollouts for c in r.completions]
    assert [len(r.completions) for r in rollouts] == [6, 6] and flat == [str(p * 10 + j) for p in (1, 2, 3)
                                                                          for j in range(G)]


def test_decodes_take_whole_micro_batches_of_prompts_as_the_memory_plan_allows(monkeypatch):
    calls = []
    rollouts, _ = sample_batch(monkeypatch, calls, [1, 2, 3, 4, 5, 6], per_device=8, prompts_per_decode=5)
    assert calls == [[1, 2, 3, 4], [5, 6]], "rounded down to whole micro-batches' prompts"
    assert [r.completions for r in rollouts] == [[str(p * 10 + j) for p in pair for j in range(G)]
                                                 for pair in ((1, 2), (3, 4), (5, 6))]
    calls.clear()
    sample_batch(monkeypatch, calls, [1, 2, 3, 4, 5, 6], per_device=8)  # no plan: a micro-batch's at a time
    assert calls == [[1, 2], [3, 4], [5, 6]]


def test_the_memory_plan_decodes_the_generation_batch_at_once_only_within_the_training_peak():
    from grpo.memory.estimate import estimate
    from grpo.memory.parts import Architecture

    a = Architecture(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128,
                     vocab_size=1000, tie_word_embeddings=True)
    config = Config(per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=4,
                    max_prompt_length=64, max_completion_length=64, use_lora=True,
                    shared_prompt_forward=False)  # whole rows: a training peak the whole batch's KV cache fits in
    whole = estimate(a, config, "cpu")
    assert whole.decode_prompts == 8  # 4 micro-batches of 2 prompts: all at once
    assert whole.total("generation") <= max(whole.total(m) for m in whole.moments if m != "generation")
    # Checkpointing keeps little, and 8 micro-batches' KV cache is more than the rest of the peak: whole
    # micro-batches' worth of prompts (2 each) at a time, as many as fit.
    lean = estimate(a, dataclasses.replace(config, gradient_checkpointing=True, gradient_accumulation_steps=8), "cpu")
    assert 2 <= lean.decode_prompts < 16 and lean.decode_prompts % 2 == 0
    assert lean.total("generation") <= max(lean.total(m) for m in lean.moments if m != "generation")


def test_chunks_keep_only_their_own_padding_as_a_decode_per_chunk_gives_them():
    """One decode pads every prompt to the longest of the batch and every completion to the longest: each
    chunk of a micro-batch's prompts gets back the widths a decode of its own prompts would have had."""
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])  # [4, 4]
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])  # [4, 3]
    whole = Rollout(prompt_mask * 5, prompt_mask, completion_mask * 7, completion_mask, list("abcd"),
                    torch.tensor([False, False, True, False]))
    first, second = (whole.select(torch.arange(i, i + 2)) for i in (0, 2))
    assert first.prompt_ids.tolist() == [[5, 5], [5, 5]] and first.completion_mask.tolist() == [[1, 1], [1, 0]]
    assert second.prompt_ids.shape == (2, 4) and second.completion_ids.shape == (2, 3)
    assert second.completions == ["c", "d"] and second.truncated.tolist() == [True, False]
