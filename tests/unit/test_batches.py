"""How a generation batch is sampled (rollout/batches.sample_batch): our decoder a micro-batch's worth of whole
prompts at a time, so that its KV cache stays a micro-batch's, then the rows cut into micro-batches."""
import torch

from grpo.rollout.batches import sample_batch
from grpo.rollout.sampling import Rollout

G, PAD = 4, 0


def fake_sample(calls: list):
    """Our decoder's signature: prompts in, G completions each; completion j of prompt p is the token p * 10 + j."""
    def sample(prompts: list) -> Rollout:
        calls.append(list(prompts))
        n = len(prompts) * G
        completion_ids = torch.tensor([[p * 10 + j] for p in prompts for j in range(G)])  # [N, 1]
        return Rollout(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long), completion_ids,
                       torch.ones(n, 1, dtype=torch.long), [str(t) for t in completion_ids[:, 0].tolist()],
                       torch.zeros(n, dtype=torch.bool))
    return sample


def test_our_decoder_samples_a_micro_batch_of_whole_prompts_at_a_time():
    calls = []
    rollouts, fields = sample_batch(fake_sample(calls), [1, 2, 3, 4, 5, 6], per_device=8, num_generations=G,
                                    pad_id=PAD)
    assert calls == [[1, 2], [3, 4], [5, 6]] and fields == {}
    assert [r.completions for r in rollouts] == [[str(p * 10 + j) for p in pair for j in range(G)]
                                                 for pair in ((1, 2), (3, 4), (5, 6))]


def test_a_micro_batch_smaller_than_a_group_still_samples_whole_prompts():
    calls = []
    rollouts, _ = sample_batch(fake_sample(calls), [1, 2, 3], per_device=6, num_generations=G, pad_id=PAD)
    assert calls == [[1], [2], [3]], "at least one whole prompt per call"
    flat = [c for r in rollouts for c in r.completions]
    assert [len(r.completions) for r in rollouts] == [6, 6] and flat == [str(p * 10 + j) for p in (1, 2, 3)
                                                                          for j in range(G)]
