"""The one interface every generation engine keeps (`Engine`), the defaults of its optional parts (`corrected`,
`close`), and the engine a run uses with its prompt encoder (`make_engine`)."""
from __future__ import annotations

from typing import Protocol

from ..batches import Rollout
from ..streams import PromptStreams
from .custom import RolloutFuncEngine
from .sampling import Decoder, PromptEncoder, prompt_encoder
from .server import ServerEngine


class Engine(Protocol):
    """What turns a generation batch's prompts into completions (docs/architecture.md): `engine(prompts, on_token,
    streams) -> (rollout, fields)`, `num_generations` completions of each of this rank's prompts as one Rollout of
    whole groups in order on the policy's device, and the extra reward columns it makes (ours: `{}`); with an
    environment_factory, `envs=` too. Optional: `corrected` and `close` (below)."""

    def __call__(self, prompts: list, on_token=None, streams: PromptStreams | None = None,
                 **envs) -> tuple[Rollout, dict[str, list]]: ...


def corrected(engine: Engine, generation, settings) -> dict[str, float]:
    """The importance-sampling correction and its metrics: the engine's own `corrected`, else Generation's."""
    own = getattr(engine, "corrected", None)
    return own(generation, settings) if own is not None else generation.correct_sampling(settings)


def close(engine: Engine) -> None:
    """The run has ended, however: what the engine keeps for it let go, where it keeps something."""
    getattr(engine, "close", lambda: None)()


def make_engine(sampler, rollout_func, trainer, plan, policy, tokenizer, tools) -> tuple[Engine, PromptEncoder]:
    """The run's engine and its one prompt encoder (its evaluation's too): a vLLM server (use_vllm; the run's adapter
    published each step into its output_dir), the caller's `sampler`, TRL's `rollout_func`, or our decoder with as many
    prompts per decode as the run plan (settings/plan.RunPlan) says. `policy`: policy/forwards.Policy; `tools`:
    rollout/tools.Tools or None; `trainer`, unread here, goes to the rollout_func (TRL's contract). Its refusals came
    before loading (engines/choice)."""
    encode = prompt_encoder(policy.model, tokenizer, plan.sampling, tools)
    if plan.server is not None:
        engine = ServerEngine(policy.model, tokenizer, encode, plan.sampling, plan.server,
                              plan.output_dir / "vllm-adapters")
    elif sampler is not None:
        engine = sampler
    elif rollout_func is not None:
        engine = RolloutFuncEngine(rollout_func, trainer, policy, tokenizer, plan.sampling)
    else:
        engine = Decoder(policy, tokenizer, encode, plan.sampling, plan.decode.sampling)
    return engine, encode
