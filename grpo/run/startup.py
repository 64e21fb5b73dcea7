"""What a run checks before it loads anything: every setting that depends on what the caller passed (datasets,
reward functions, a model object) or on the machine (the output folder, the ranks), so that a mistake costs a
line, not a model load. Settings alone are checked when the Config is made (settings/checks.py)."""
from __future__ import annotations

from ..policy.models import check_load_options
from ..policy.parallel import check_settings as check_parallel_settings
from ..rollout.evaluate import check_eval_setup
from ..rollout.prompts import check_dataset
from ..rollout.rewards import check_reward_weights, reward_func_names
from . import checkpoint, lock


def check_before_loading(config, dist, train_dataset, eval_dataset, reward_funcs: list, *, model_given: bool) -> None:
    """ConfigError (or the dataset's, reward's error) for a run of `config` that cannot start; `dist`:
    infra/distributed's, whose rank 0 looks at the output folder's lock."""
    check_dataset(train_dataset)
    check_reward_weights(config.reward_weights, reward_func_names(reward_funcs))
    check_eval_setup(config, eval_dataset, reward_funcs)
    check_load_options(config, model_given=model_given)
    checkpoint.check_output_dir(config.output_dir)
    lock.check_free(config.output_dir, dist)  # taken when training starts
    check_parallel_settings(dist.world_size, config.fsdp, config.optim, config.use_lora)
