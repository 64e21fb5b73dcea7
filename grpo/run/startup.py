"""What a run decides and checks before it loads anything: every setting that depends on what the caller passed
(datasets, reward functions, a model object, a sampler) or on the machine (the output folder, the ranks, the device),
so that a mistake costs a line, not a model load; and the run plan finished with the decode sizes the memory planner
reads from the architecture (`prepare`). Settings alone are checked when the Config is made (settings/checks.py)."""
from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import torch

from ..algo.loss import loss_warnings
from ..infra.distributed import Distributed
from ..infra.distributed import setup as setup_distributed
from ..memory.fit import decode_sizes
from ..memory.known_models import architecture_of
from ..policy.models import device_of
from ..policy.parallel import check_settings as check_parallel_settings
from ..policy.precision import Precision, default_device
from ..rollout.engines.choice import check_engine
from ..rollout.environments import training_rows
from ..rollout.evaluate import check_eval_setup
from ..rollout.prompts import PromptStream, check_dataset, checked_rows, eval_sets
from ..rollout.reward_models import reward_callables
from ..rollout.rewards import check_reward_columns, check_reward_weights, reward_func_names
from ..settings.plan import RunPlan
from . import lock

logger = logging.getLogger(__name__)


class Prepared(NamedTuple):
    """What a run knows before its model loads: its ranks, plan (finished), dtype plan, reward callables, prompts."""

    dist: Distributed
    plan: RunPlan
    precision: Precision
    reward_funcs: list  # rollout/reward_models.reward_callables: reward models wrapped, the environments' after
    prompts: PromptStream  # over the caller's train_dataset, or the rows drawn when an environment owns the data
    rows: tuple  # the train_dataset's checked_rows (rollout/prompts), and each eval set's by its eval_sets suffix


def prepare(config, train_dataset, eval_dataset, reward_funcs, reward_processing_classes=None, model=None,
            sampler: bool = False, rollout_func: bool = False, tools=None) -> Prepared:
    """The run of `config` set up on its ranks (infra/distributed: world size 1 without torchrun; torch seeded by
    rank: dropout differs by rank, sampling has its own streams), checked and planned before its model (`model`: the
    caller's, or None) loads; ConfigError (or the dataset's, a reward's error) for a run that cannot start. `sampler`,
    `rollout_func`: whether the caller passed one (with neither, the reward functions get the dataset's columns only:
    theirs may add some). `tools` (rollout/tools.Tools, or None): the run's; an environment may own the reward
    (`reward_sources`) and, when its reset() returns the prompt, the data (rollout/environments.training_rows)."""
    dist = setup_distributed()
    lock.check_output_dir(config.output_dir)
    lock.check_free(config.output_dir, dist)  # taken when training starts
    device = device_of(model) if model is not None else default_device()  # where the policy runs
    funcs, weighted = reward_sources(config, reward_funcs, reward_processing_classes, tools)
    precision = Precision.of(config, device)
    # bf16 sampling in our own decode only: a rollout_func or a sampler samples its own way
    plan = RunPlan.resolve(weighted, dist.world_size, precision.bf16_sampling and not (sampler or rollout_func),
                           tools=tools.names if tools is not None else None)  # recorded: grpo.export reads them
    train_dataset = training_rows(train_dataset, tools, config.max_steps, plan.schedule.prompts_per_generation)
    train_rows = checked_rows(train_dataset)  # a stream's first row, read once: every check reads it
    check_dataset(train_rows, environments=tools is not None and bool(tools.environments))
    if not (sampler or rollout_func):
        check_reward_columns(funcs, train_dataset)  # not after the first generation batch
    eval_rows = {k: checked_rows(d) for k, d in eval_sets(eval_dataset).items()}  # each set's, as train_rows
    check_eval_setup(plan.evaluation, plan.cadence, eval_dataset, funcs, eval_rows)
    check_parallel_settings(dist.world_size, config.fsdp, config.optim, config.use_lora)
    check_engine(plan, dist.world_size, device.type, sampler=sampler, rollout_func=rollout_func)
    g = plan.generation
    prompts = PromptStream(train_dataset, g.data_seed, g.shuffle_dataset, plan.schedule.prompts_of(config.max_steps))
    total_steps = plan.schedule.total_steps(prompts.epoch_rows, config.num_train_epochs, config.max_steps)
    decode = decode_sizes(plan.memory, architecture_of(plan.loading.model, model), precision)  # the plan's alone
    for line in loss_warnings(plan.loss["loss_type"], plan.loss["importance_sampling_level"]) if dist.is_main else []:
        logger.warning(line)  # as TRL's GRPOTrainer warns, on its logger
    torch.manual_seed(config.seed + dist.rank)  # last: reward models loaded above draw from it
    plan = dataclasses.replace(plan, total_steps=total_steps, decode=decode)
    return Prepared(dist, plan, precision, funcs, prompts, (train_rows, eval_rows))


def reward_sources(config, reward_funcs, reward_processing_classes=None, tools=None) -> tuple[list, object]:
    """The run's reward callables and `config` with reward_weights for them all: the caller's (reward models
    wrapped), then, as in TRL, the reward of each environment class of `tools` (rollout/tools.Tools, or None)
    that defines `get_reward`, weight 1 (config's reward_weights weigh the caller's alone). ConfigError for no
    reward at all, or weights that do not match the caller's functions."""
    owned = tools.rewards() if tools is not None else []
    funcs = reward_callables(reward_funcs, reward_processing_classes, config.chat_template_kwargs, not owned)
    check_reward_weights(config.reward_weights, reward_func_names(funcs))
    weighted = config if not owned or config.reward_weights is None else dataclasses.replace(
        config, reward_weights=[*config.reward_weights, *[1.0] * len(owned)])
    return funcs + owned, weighted
