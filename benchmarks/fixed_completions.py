"""A recipe with fixed completions, for benchmarks/identical_runs.py --fixed: the recipe named by the
environment's GRPO_BASE_RECIPE as it is, its sampling replaced by a TRL `rollout_func` whose tokens depend on each
prompt's text and its place in its group alone. Two trees whose sampling draws differently (other random
streams) then train on the same completions, and everything downstream of sampling (rewards, advantages, loss,
optimizer, logs, checkpoints) can be compared bit for bit.

    GRPO_BASE_RECIPE=recipes/tiny.py python -m grpo.train benchmarks/fixed_completions.py
"""
import os
import runpy
import zlib

import torch

globals().update({k: v for k, v in runpy.run_path(os.environ["GRPO_BASE_RECIPE"]).items()
                  if not k.startswith("__")})


def rollout_func(prompts: list, trainer) -> dict:
    """Each prompt (repeated num_generations times in a row, TRL's contract) gets completions of random tokens
    and lengths seeded by its text and its place in the group; an EOS ends those shorter than the limit."""
    tokenizer, config = trainer.tokenizer, trainer.config
    G, C = config.num_generations, config.max_completion_length
    eos = tokenizer.eos_token_id
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(prompt, tokenize=False,
                                                                                   add_generation_prompt=True)
        prompt_ids.append(tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"])
        generator = torch.Generator().manual_seed(zlib.crc32(f"{i % G}:{text}".encode()))
        length = int(torch.randint(1, C + 1, (), generator=generator))
        tokens = torch.randint(4, len(tokenizer), (length,), generator=generator).tolist()
        completion_ids.append(tokens if length == C else tokens[:length - 1] + [eos])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
