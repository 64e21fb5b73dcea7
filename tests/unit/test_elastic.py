"""Resuming on another number of ranks, piece by piece (the torchrun runs are in tests/system/test_distributed.py):
the prompt stream steps back across epochs, sampling seeds depend on (seed, rank, step) alone, what the resume
says about the global batch, and the one rank change it refuses."""
import random

import pytest
import torch
from datasets import Dataset

from grpo.errors import ConfigError
from grpo.rollout.prompts import PromptStream
from grpo.run import elastic

# The batch settings of a saved config (grpo_config.json holds every field).
CONFIG = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "num_generations": 4, "fsdp": False,
          "steps_per_generation": None, "generation_batch_size": None, "num_iterations": 1}


def state(ranks: int, prompts_per_rank_in_generation: int = 0) -> dict:
    """A Trainer.state_dict of `ranks` ranks, at step 5, each holding a generation batch of that many prompts."""
    batch = {"batch": {"prompts": ["p"] * prompts_per_rank_in_generation * CONFIG["num_generations"]}}
    own = {"rng": None, "batches": {"generation": batch if prompts_per_rank_in_generation else None}}
    return {"step": 5, **(own if ranks == 1 else {"ranks": [own] * ranks})}


def test_a_prompt_stream_loaded_with_rows_to_redraw_draws_them_again_across_epochs():
    stream = PromptStream(Dataset.from_dict({"prompt": [str(i) for i in range(5)]}), seed=3)
    stream.next(3)
    drawn = stream.next(6)["prompt"]  # 2 rows of epoch 0, 4 of epoch 1
    saved = stream.state_dict()
    assert saved == {"epoch": 1, "position": 4}
    stream.load_state_dict(saved, redraw=6)
    assert stream.state_dict() == {"epoch": 0, "position": 3}
    assert stream.next(6)["prompt"] == drawn
    stream.load_state_dict(saved, redraw=0)
    assert stream.state_dict() == saved


def test_rank_state_and_the_prompts_of_an_unfinished_generation_batch():
    two = state(2, prompts_per_rank_in_generation=4)
    assert elastic.rank_state(two, 1, 2) is two["ranks"][1]
    assert elastic.rank_state(two, 0, 1) is None and elastic.rank_state(state(1), 0, 2) is None
    assert elastic.unfinished_prompts(two, CONFIG["num_generations"]) == 8  # both ranks' 4
    assert elastic.unfinished_prompts(state(1, 8), CONFIG["num_generations"]) == 8
    assert elastic.unfinished_prompts(state(2), CONFIG["num_generations"]) == 0


def test_sampling_seeds_depend_on_seed_rank_and_step_alone():
    def draws(seed, rank, step):
        elastic.seed_rank(seed, rank, step)
        return torch.rand(2).tolist(), random.random()

    assert draws(0, 1, 5) == draws(0, 1, 5)
    assert len({str(draws(0, r, s)) for r, s in [(0, 5), (1, 5), (0, 6)]} | {str(draws(1, 0, 5))}) == 4


def test_what_a_rank_change_says_about_the_global_batch():
    two = state(2, prompts_per_rank_in_generation=8)  # saved by 2 ranks x 8 x 4 = 64 completions (16 prompts) per step
    assert elastic.rank_change_notes(CONFIG, two, CONFIG, 2) == []
    kept = elastic.rank_change_notes(CONFIG, two, {**CONFIG, "gradient_accumulation_steps": 8}, 1)
    assert kept == ["resuming on 1 rank(s) a checkpoint of 2: weights, optimizer, schedule, data position and step "
                    "are as saved; sampling is seeded anew from (seed, rank, step)",
                    "the generation batch that step 6 would reuse was sampled by 2 rank(s): its 16 prompts are drawn "
                    "again and sampled on 1"]
    halved = elastic.rank_change_notes(CONFIG, state(2), CONFIG, 1)
    assert halved[-1] == ("warning: the global batch changes from 64 to 32 completions per step "
                          "(per_device_train_batch_size x gradient_accumulation_steps x ranks); "
                          "--gradient_accumulation_steps=8 keeps it")
    odd = elastic.rank_change_notes(CONFIG, state(2), {**CONFIG, "per_device_train_batch_size": 12}, 4)
    assert odd[-1].endswith("per_device_train_batch_size x gradient_accumulation_steps = 16 keeps it")


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_fsdp_does_not_change_between_one_process_and_several(before, after):
    fsdp = {**CONFIG, "fsdp": True}
    with pytest.raises(ConfigError, match="FSDP \\(several ranks\\) and one process store the optimizer state"):
        elastic.rank_change_notes(fsdp, state(before), fsdp, after)
    assert len(elastic.rank_change_notes(fsdp, state(2), fsdp, 4)) == 2  # several to several: the note, the batch
