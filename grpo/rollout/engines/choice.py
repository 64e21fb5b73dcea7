"""Every refusal of a run's generation engine, in one place, made before any model loads (called by
run/startup.prepare), so that a choice that cannot run costs a line, not a model load. Settings that contradict
each other alone are refused earlier, when the Config is made (settings/checks.py)."""
from __future__ import annotations

from ...errors import ConfigError
from ...policy.int8 import int8_refusal


def check_engine(plan, world_size: int, device_type: str, *, sampler: bool, rollout_func: bool) -> None:
    """ConfigError where the engine the run asks for cannot run (`sampler`, `rollout_func`: whether one was passed)."""
    given = "a sampler" if sampler else "a rollout_func" if rollout_func else None
    if plan.generation.max_staleness is not None:
        check_async(world_size, device_type, own_decoder=given is None)
    if plan.server is not None and given:
        raise ConfigError(f"use_vllm=True samples on the vLLM server: pass no sampler or rollout_func with it "
                          f"(got {given})")
    if plan.server is not None and world_size > 1:
        raise ConfigError("use_vllm=True runs one trainer process here: under torchrun set use_vllm=False")
    if plan.sampling.int8 and given:
        raise ConfigError(f"int8_sampling_weights=True samples with our own decode loop: pass no sampler or "
                          f"rollout_func with it (got {given})")
    if plan.sampling.int8 and (refusal := int8_refusal()) is not None:
        raise ConfigError(refusal)


def check_async(world_size: int, device_type: str, own_decoder: bool) -> None:
    """ConfigError where async_generation cannot run: the sampler is a fork of the one trainer process, which
    CUDA does not survive, running our own decoder."""
    if world_size > 1:
        raise ConfigError(f"async_generation=True runs one trainer process and its sampler; under torchrun "
                          f"({world_size} ranks) set async_generation=False")
    if device_type != "cpu":
        raise ConfigError(f"async_generation=True samples in a forked process, which runs on the CPU only; the "
                          f"model is on {device_type}: set async_generation=False")
    if not own_decoder:
        raise ConfigError("async_generation=True samples with our own decoder: it cannot run a rollout_func or a "
                          "sampler passed to the Trainer; set async_generation=False")
