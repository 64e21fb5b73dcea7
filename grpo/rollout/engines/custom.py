"""TRL's `rollout_func`: generation replaced by the user's own, with TRL 1.16's contract
(docs/recipes-and-settings.md, "Replacing generation"): `rollout_func(prompts, trainer) -> dict`, once per
generation batch on each rank's share, each prompt num_generations times in a row."""
from __future__ import annotations

import torch

from ...errors import UserError
from ..batches import Rollout
from ..rewards import REWARD_ARGUMENTS
from .chat import is_chat
from .sampling import decoded_rows, eos_token_ids, left_pad, rollout_of

REQUIRED = ("prompt_ids", "completion_ids")
USED = (*REQUIRED, "logprobs", "env_mask")  # TRL's own keys; every other one is a field for the reward functions
# The reward functions' own arguments (rollout/rewards.py) and the dataset's prompt: a field of that name would
# collide with them (TRL: a TypeError, or the field silently dropped), so it is refused.
RESERVED = (*REWARD_ARGUMENTS, "prompt", "completion")


class RolloutFuncError(UserError):
    """A rollout_func returned something the trainer cannot train on."""


class RolloutFuncEngine:
    """The engine on TRL's rollout_func (engines/engine.Engine). `trainer`: what TRL hands the rollout_func, passed
    on unread; `policy`: policy/forwards.Policy, whose device the rows go to."""

    def __init__(self, rollout_func, trainer, policy, tokenizer, settings):
        self.rollout_func, self.trainer, self.tokenizer = rollout_func, trainer, tokenizer
        self.eos_ids, self.device = eos_token_ids(tokenizer, policy.model), policy.device
        self.num_generations, self.max_completion_length = settings.num_generations, settings.max_completion_length
        self.name = getattr(rollout_func, "__name__", type(rollout_func).__name__)

    def __call__(self, prompts: list, on_token=None, streams=None) -> tuple[Rollout, dict[str, list]]:
        """One call for the whole generation batch, as TRL makes it (the rollout_func draws its own random numbers)."""
        repeated = [p for p in prompts for _ in range(self.num_generations)]
        output = self.rollout_func(repeated, self.trainer)  # the trainer, as TRL passes it
        if not isinstance(output, dict) or any(k not in output for k in REQUIRED):
            raise RolloutFuncError(f"rollout_func '{self.name}' must return a dict with {', '.join(REQUIRED)} "
                                   f"(and optionally logprobs), got {type(output).__name__}"
                                   f"{' with keys ' + ', '.join(output) if isinstance(output, dict) else ''}")
        prompt_rows, completion_rows = output["prompt_ids"], output["completion_ids"]
        if len(prompt_rows) != len(repeated) or len(completion_rows) != len(repeated):
            raise RolloutFuncError(f"rollout_func '{self.name}' returned {len(prompt_rows)} prompt_ids and "
                                   f"{len(completion_rows)} completion_ids for {len(repeated)} prompts (one "
                                   f"completion per prompt entry: each prompt comes num_generations times)")
        too_long = max(len(r) for r in completion_rows)
        if too_long > self.max_completion_length:
            raise RolloutFuncError(f"rollout_func '{self.name}' returned a completion of {too_long} tokens, more "
                                   f"than max_completion_length={self.max_completion_length}")
        fields = self.reward_fields({k: v for k, v in output.items() if k not in USED}, len(repeated))
        env_mask = output.get("env_mask")
        if env_mask is not None and [len(m) for m in env_mask] != [len(r) for r in completion_rows]:
            raise RolloutFuncError(f"rollout_func '{self.name}' returned an env_mask whose rows are not as long as "
                                   f"their completion_ids (one 0/1 per completion token)")
        return self.rollout(prompts, [list(map(int, r)) for r in prompt_rows],
                            [list(map(int, r)) for r in completion_rows], env_mask), fields

    def reward_fields(self, extra: dict, n: int) -> dict[str, list]:
        """The extra fields as reward columns of `n` values: as in TRL, a list holds one value per completion and
        anything else is every completion's value (a list of another length: an error here, not later as in TRL)."""
        for key in extra:
            if key in RESERVED:
                raise RolloutFuncError(f"rollout_func '{self.name}' returned a field '{key}', a name the reward "
                                       f"functions' own arguments use ({', '.join(RESERVED)}): rename it")
        wrong = [f"{len(v)} values of '{k}'" for k, v in extra.items() if isinstance(v, list) and len(v) != n]
        if wrong:
            raise RolloutFuncError(f"rollout_func '{self.name}' returned {', '.join(wrong)} for {n} completions: "
                                   f"a list field holds one value per completion (anything else is every "
                                   f"completion's value)")
        return {k: v if isinstance(v, list) else [v] * n for k, v in extra.items()}

    def rollout(self, prompts: list, prompt_rows: list[list[int]], completion_rows: list[list[int]],
                env_mask: list[list[int]] | None) -> Rollout:
        """The rows as our own samples are made; TRL's `env_mask` (1 on the model's tokens, 0 on what an
        environment wrote) takes the tokens it marks 0 out of the loss mask, which attention still sees."""
        prompt_ids, prompt_mask = left_pad(prompt_rows, self.tokenizer.pad_token_id)  # [N, P]
        decoded = decoded_rows(completion_rows, self.tokenizer.pad_token_id, self.eos_ids)  # as our decode's
        rollout = rollout_of(prompt_ids, prompt_mask, decoded, self.tokenizer, self.eos_ids, chat=is_chat(prompts[0]))
        if env_mask is not None:
            own = torch.ones_like(decoded.completion_ids)  # [N, C]: 0 where an environment wrote the token
            for i, m in enumerate(env_mask):
                own[i, :len(m)] = torch.tensor([int(bool(v)) for v in m], dtype=torch.long)
            rollout.loss_mask = rollout.completion_mask * own  # [N, C]
        return rollout.to(self.device)  # on the policy's device, as our decoder returns them
