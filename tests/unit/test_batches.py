"""How a generation batch is sampled (rollout/sampling.Sampler, then rollout/batches.regroup): our decoder a
micro-batch's worth of whole prompts at a time, so that its KV cache stays a micro-batch's, then the rows cut
into micro-batches."""
from types import SimpleNamespace

import torch

import grpo.rollout.sampling
from grpo import Config
from grpo.rollout.batches import regroup
from grpo.rollout.sampling import Rollout, Sampler

G, PAD = 4, 0


def sample_batch(monkeypatch, calls: list, prompts: list, per_device: int) -> tuple[list[Rollout], dict]:
    """The Sampler over a stand-in for the decoder (completion j of prompt p is the token p * 10 + j), regrouped
    into micro-batches of `per_device` completions as the trainer does."""
    def sample_completions(model, tokenizer, encode, prompts, *, num_generations, **_) -> Rollout:
        calls.append(list(prompts))
        n = len(prompts) * num_generations
        completion_ids = torch.tensor([[p * 10 + j] for p in prompts for j in range(num_generations)])  # [N, 1]
        return Rollout(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long), completion_ids,
                       torch.ones(n, 1, dtype=torch.long), [str(t) for t in completion_ids[:, 0].tolist()],
                       torch.zeros(n, dtype=torch.bool))

    monkeypatch.setattr(grpo.rollout.sampling, "sample_completions", sample_completions)
    policy = SimpleNamespace(parallel=SimpleNamespace(unsharded=lambda fn: fn(None)))
    sampler = Sampler(policy, None, Config(per_device_train_batch_size=per_device, num_generations=G))
    rollouts, fields = sampler(prompts)
    return regroup(rollouts, per_device, PAD), fields


def test_our_decoder_samples_a_micro_batch_of_whole_prompts_at_a_time(monkeypatch):
    calls = []
    rollouts, fields = sample_batch(monkeypatch, calls, [1, 2, 3, 4, 5, 6], per_device=8)
    assert calls == [[1, 2], [3, 4], [5, 6]] and fields == {}
    assert [r.completions for r in rollouts] == [[str(p * 10 + j) for p in pair for j in range(G)]
                                                 for pair in ((1, 2), (3, 4), (5, 6))]


def test_a_micro_batch_smaller_than_a_group_still_samples_whole_prompts(monkeypatch):
    calls = []
    rollouts, _ = sample_batch(monkeypatch, calls, [1, 2, 3], per_device=6)
    assert calls == [[1], [2], [3]], "at least one whole prompt per call"
    flat = [c for r in rollouts for c in r.completions]
    assert [len(r.completions) for r in rollouts] == [6, 6] and flat == [str(p * 10 + j) for p in (1, 2, 3)
                                                                          for j in range(G)]
