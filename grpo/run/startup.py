"""What a run decides and checks before it loads anything: every setting that depends on what the caller passed
(datasets, reward functions, a model object, a sampler) or on the machine (the output folder, the ranks, the
device), so that a mistake costs a line, not a model load; and the run plan finished with the decode sizes the
memory planner reads from the architecture (`prepare`). Settings alone are checked when the Config is made
(settings/checks.py)."""
from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..memory.fit import decode_sizes
from ..memory.known_models import architecture_of
from ..policy.models import check_load_options, device_of
from ..policy.parallel import check_settings as check_parallel_settings
from ..policy.precision import Precision
from ..rollout.evaluate import check_eval_setup
from ..rollout.prompts import check_dataset
from ..rollout.rewards import check_reward_columns, check_reward_weights, reward_func_names
from ..settings.plan import RunPlan
from . import checkpoint, lock


def check_before_loading(config, dist, train_dataset, eval_dataset, reward_funcs: list, *, model_given: bool,
                         columns_known: bool = True) -> None:
    """ConfigError (or the dataset's, reward's error) for a run of `config` that cannot start; `dist`:
    infra/distributed's, whose rank 0 looks at the output folder's lock. `columns_known`: the reward functions
    get the dataset's columns only (a rollout_func's or sampler's fields may add some)."""
    check_dataset(train_dataset)
    check_reward_weights(config.reward_weights, reward_func_names(reward_funcs))
    if columns_known:
        check_reward_columns(reward_funcs, train_dataset)  # not after the first generation batch
    check_eval_setup(config, eval_dataset, reward_funcs)
    check_load_options(config, model_given=model_given)
    checkpoint.check_output_dir(config.output_dir)
    lock.check_free(config.output_dir, dist)  # taken when training starts
    check_parallel_settings(dist.world_size, config.fsdp, config.optim, config.use_lora)


def check_async(world_size: int, device_type: str, own_sampler: bool) -> None:
    """ConfigError where async_generation cannot run: the sampler is a fork of the one trainer process, which
    CUDA does not survive, running our own decoder."""
    if world_size > 1:
        raise ConfigError(f"async_generation=True runs one trainer process and its sampler; under torchrun "
                          f"({world_size} ranks) set async_generation=False")
    if device_type != "cpu":
        raise ConfigError(f"async_generation=True samples in a forked process, which runs on the CPU only; the "
                          f"model is on {device_type}: set async_generation=False")
    if not own_sampler:
        raise ConfigError("async_generation=True samples with our own decoder: it cannot run a rollout_func or a "
                          "sampler passed to the Trainer; set async_generation=False")


def prepare(config, world_size: int, num_prompts: int, model=None,
            own_sampler: bool = True) -> tuple[RunPlan, Precision]:
    """The run plan of `config` on `world_size` ranks over `num_prompts` training prompts, with its length and
    decode sizes, and the precision plan, both before the model (`model`: the caller's, or None) loads;
    ConfigError for a plan that cannot run."""
    precision = Precision.plan(config.bf16, config.use_lora, device_of(model) if model is not None else None,
                               config.bf16_weights)
    if config.async_generation:
        check_async(world_size, precision.device_type, own_sampler)
    plan = RunPlan.resolve(config, world_size)
    total_steps = plan.schedule.total_steps(num_prompts, config.num_train_epochs, config.max_steps)
    decode = decode_sizes(plan.memory, architecture_of(config.model, model), precision)
    return dataclasses.replace(plan, total_steps=total_steps, decode=decode), precision
