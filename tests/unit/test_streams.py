"""Each prompt's own random stream (rollout/streams): SplitMix64 exactly, on a CPU and a GPU alike, uniform
draws without a pattern across rows or steps, and the trainer giving each rank the streams of its prompts."""
import pytest
import torch
from stats import chi2_contingency_pvalue
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.rollout.rewards import RewardContext
from grpo.rollout.streams import GAMMA, MULTIPLIERS, PromptStreams, int64, uniforms
from grpo.infra.distributed import Distributed

MASK = (1 << 64) - 1


def mix(z: int) -> int:  # SplitMix64's finalizer on Python integers, as Steele et al. write it
    z = (z ^ (z >> 30)) * MULTIPLIERS[0] & MASK
    z = (z ^ (z >> 27)) * MULTIPLIERS[1] & MASK
    return z ^ (z >> 31)


def reference(seed: int, step: int, prompt: int, copy: int, draws: list[int]) -> list[float]:
    key = 0
    for part in (seed, step, prompt, copy):
        key = mix(((key ^ (part & MASK)) + GAMMA) & MASK)
    return [(mix((key + (t + 1) * GAMMA) & MASK) >> 11) / 2 ** 53 for t in draws]


def test_each_row_draws_splitmix64_outputs_from_its_own_key():
    streams, draws = PromptStreams(seed=-3, step=5, first=1000), [0, 1, 63, 64, 10**6]
    seeds = streams.seeds(3, 4)  # [12]: 3 prompts x 4 rows
    u = uniforms(seeds, torch.tensor(draws))  # [12, 5]
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    assert u.tolist() == [reference(-3, 5, 1000 + i // 4, i % 4, draws) for i in range(12)]
    assert torch.equal(streams.after(2).seeds(1, 4), seeds[8:])  # a prompt's stream is its own, wherever it sits
    assert int64(2 ** 64 - 1) == -1 and int64(-1) == -1 and int64(2 ** 63) == -2 ** 63


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_a_gpu_draws_what_a_cpu_draws():
    streams, steps = PromptStreams(seed=7, step=2, first=3), torch.arange(200)
    cpu = uniforms(streams.seeds(16, 8), steps)  # [128, 200]
    assert torch.equal(uniforms(streams.seeds(16, 8, "cuda"), steps.cuda()).cpu(), cpu)


def test_draws_are_uniform_and_unrelated_across_rows_and_steps():
    # Pairs of draws (next step of a row, next row of a prompt, next prompt) binned 10 x 10, against pairs from
    # torch's generator: chi-square finds no difference.
    u = uniforms(PromptStreams(seed=0).seeds(100, 8), torch.arange(64)).view(100, 8, 64)  # [prompt, row, step]
    bins = (u * 10).long()
    generator = (torch.rand(200_000, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 10).long()
    for first, second in ((bins[..., :-1], bins[..., 1:]), (bins[:, :-1], bins[:, 1:]), (bins[:-1], bins[1:])):
        cells = (first * 10 + second).flatten()
        theirs = (generator[:len(cells), 0] * 10 + generator[:len(cells), 1])
        table = [torch.bincount(x, minlength=100).tolist() for x in (cells, theirs)]
        assert chi2_contingency_pvalue(table) > 1e-3


def test_the_trainer_gives_each_rank_the_streams_of_its_share(tmp_path):
    # 4 prompts over 2 ranks sample what 1 process samples: rank r's prompts are the generation batch's 2r, 2r+1.
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    model.generation_config.eos_token_id = list(range(4, 44))  # rows end at different steps
    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                    max_prompt_length=16, max_completion_length=8, optim="adamw", beta=0.0)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts(8))
    start, context = trainer.prompts.state_dict(), RewardContext(trainer.state)

    def sampled(rank: int, world_size: int) -> list[list[int]]:
        trainer.prompts.load_state_dict(start)
        trainer.pipeline.source.dist = Distributed(rank=rank, world_size=world_size)
        rollout, _ = trainer.pipeline.source.draw(4, trainer.step, context)
        return rollout.completion_id_lists

    one = sampled(0, 1)
    assert len(one) == 8 and len({len(ids) for ids in one}) > 1
    assert sampled(0, 2) + sampled(1, 2) == one
    trainer.step = 1
    assert sampled(0, 1) != one  # another step, other draws
