"""TRL's `GRPOConfig` (TRL 1.16.0, transformers 5.24's TrainingArguments included) as this trainer takes it: each
setting `Config` lacks refused with why, or, where it changes nothing here, accepted with a warning saying why
(`check_keys`); TRL's and transformers' spellings of our values stored as ours (`as_ours`). The engine never imports
trl (tests/unit/test_config.py checks these lists against TRL when it is installed)."""
from __future__ import annotations

import dataclasses
import difflib
import json
import sys

from ..errors import ConfigError

TRL_ONLY = frozenset("""
    accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_epsilon auto_find_batch_size
    average_tokens_across_devices batch_eval_metrics bf16_full_eval cache_implementation dataloader_drop_last
    dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers dataloader_persistent_workers
    dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers ddp_bucket_cap_mb
    ddp_find_unused_parameters ddp_static_graph ddp_timeout debug deepspeed disable_tqdm do_eval do_predict do_train
    ds3_gather_for_generation enable_jit_checkpoint eval_accumulation_steps eval_delay eval_do_concat_batches
    eval_use_gather_object fp16 fp16_full_eval fsdp_config full_determinism gradient_checkpointing_kwargs
    greater_is_better hub_always_push hub_model_id hub_private_repo hub_revision hub_strategy hub_token
    ignore_data_skip include_for_metrics include_num_input_tokens_seen label_names label_smoothing_factor
    length_column_name liger_kernel_config load_best_model_at_end local_rank log_completions_hub_repo log_level
    log_level_replica log_multimodal log_on_each_node log_unique_prompts logging_first_step logging_nan_inf_filter
    logging_strategy metric_for_best_model neftune_noise_alpha num_generations_eval optim_args optim_target_modules
    parallelism_config prediction_loss_only project push_to_hub remove_unused_columns
    restore_callback_states_from_checkpoint run_name save_on_each_node save_only_model skip_memory_metrics tf32
    torch_compile torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id
    trackio_space_id trackio_static_space_id train_sampling_strategy transformers_continuous_batching_config
    trust_remote_code use_cache use_cpu use_liger_kernel use_transformers_continuous_batching use_transformers_paged
    vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port vllm_importance_sampling_cap
    vllm_max_model_length vllm_model_impl vllm_structured_outputs_regex vllm_tensor_parallel_size
""".split())

_GENERATION = "sampling runs on the policy itself (KV-cached decoding in grpo.rollout)"
_SERVER = "vllm_mode=\"server\" only: set it when you start the server (.ci/vllm_venv.sh, docs/inference-engines.md)"
_LOGGING = "metrics.jsonl and completions.jsonl in output_dir are the logs (python -m grpo.plot draws them)"
_DDP = "DDP is set up by the trainer under torchrun with its defaults (infra/distributed.py)"
_COMPILE = "torch.compile is not used: the step is eager PyTorch"
_BEST = "no best-checkpoint tracking: each checkpoint is kept by save_total_limit, newest first"
_SFT = "a supervised-training setting: GRPO's loss is the policy loss on sampled completions"
_EVAL_LOOP = ("evaluation is our own greedy decode over eval_dataset (per_device_eval_batch_size, eval_limit), not "
              "transformers' evaluation loop")
_TRACKIO_HUB = "report_to=trackio logs to the local Trackio store only (TRACKIO_DIR); no Space or bucket"
_NO_DATALOADER = "prompts are drawn in the trainer's own process: there is no DataLoader"

# Why a setting of TRL_ONLY is refused, or what to use instead (in the one line a refusal prints); one without an
# entry gets a generic line.
TRL_REASONS = {
    **{k: _GENERATION for k in TRL_ONLY if "continuous_batching" in k},
    **{k: _SERVER for k in TRL_ONLY if k.startswith("vllm_")},
    "vllm_importance_sampling_cap": "TRL's deprecated name of vllm_importance_sampling_clip_max",
    "use_transformers_paged": _GENERATION, "cache_implementation": _GENERATION,
    **dict.fromkeys(("ds3_gather_for_generation", "deepspeed"),
                    "DeepSpeed is not used here; torchrun with --fsdp=true shards the model"),
    "fsdp_config": "--fsdp=true under torchrun is the one FSDP (FSDP2) setting",
    "gradient_checkpointing_kwargs": "checkpointing is always non-reentrant here",
    "activation_checkpointing": "it is called gradient_checkpointing here (on by default, as in TRL)",
    "fp16": "bf16 (CUDA) or float32 only",
    "push_to_hub": "checkpoints are written to output_dir only",
    "ddp_find_unused_parameters": "every trainable parameter gets a gradient each step here (DDP's default)",
    **dict.fromkeys(("ddp_broadcast_buffers", "ddp_bucket_cap_mb", "ddp_static_graph", "ddp_timeout",
                     "local_rank", "average_tokens_across_devices"), _DDP),
    **dict.fromkeys(("torch_compile", "torch_compile_backend", "torch_compile_mode", "enable_jit_checkpoint"),
                    _COMPILE),
    **dict.fromkeys(("load_best_model_at_end", "metric_for_best_model", "greater_is_better"), _BEST),
    **dict.fromkeys(("label_names", "label_smoothing_factor", "neftune_noise_alpha", "length_column_name",
                     "train_sampling_strategy", "include_for_metrics"), _SFT),
    **dict.fromkeys(("batch_eval_metrics", "bf16_full_eval", "fp16_full_eval", "eval_accumulation_steps",
                     "eval_delay", "eval_do_concat_batches", "eval_use_gather_object", "prediction_loss_only"),
                    _EVAL_LOOP),
    "log_completions_hub_repo": "nothing is pushed to the Hub: logs and checkpoints stay in output_dir",
    **dict.fromkeys(("trackio_bucket_id", "trackio_space_id", "trackio_static_space_id", "project"), _TRACKIO_HUB),
    "parallelism_config": "one process per GPU under torchrun, each on its own device; no device mesh settings",
    "activation_checkpointing_kwargs": "checkpointing is always non-reentrant here (gradient_checkpointing)",
    "accelerator_config": "accelerate is not used: the trainer sets DDP up under torchrun, and each rank draws its "
                          "own prompts (no DataLoader to split or dispatch)",
    "adam_epsilon": "AdamW's eps is fixed at 1e-8 (transformers' default)",
    "auto_find_batch_size": "the memory plan sizes decodes and says what fits before loading (python -m grpo.plan)",
    **dict.fromkeys(("dataloader_in_order", "dataloader_multiprocessing_context"), _NO_DATALOADER),
    "debug": "transformers' debug options (underflow/overflow, TPU metrics) are not wired in",
    "full_determinism": "seed makes runs reproducible; torch.use_deterministic_algorithms is not set here",
    "ignore_data_skip": "a resumed run continues the data stream exactly where the checkpoint left it",
    "include_num_input_tokens_seen": "the running count of tokens seen is not kept",
    "log_multimodal": "text-only: images are not supported",
    "log_unique_prompts": "completions.jsonl and --log_completions show every prompt with its completions",
    "logging_nan_inf_filter": "NaN/inf losses are logged as they are and their updates skipped (max_nonfinite_steps)",
    "optim_args": "the optimizers are AdamW with adam_beta1, adam_beta2 and weight_decay",
    "optim_target_modules": "the optimizers are AdamW over every trainable parameter (GaLore is not supported)",
    "restore_callback_states_from_checkpoint": "callbacks are not saved in checkpoints",
    "save_on_each_node": "rank 0 writes every checkpoint; other nodes read it from a shared output_dir",
    "tf32": "left as PyTorch sets it (set torch.backends.cuda.matmul.allow_tf32 yourself)",
    "torch_empty_cache_steps": "torch.cuda.empty_cache() is not called on a schedule here",
    "trust_remote_code": 'set it through model_init_kwargs={"trust_remote_code": true}',
    "use_cache": "decoding here always uses its own KV cache, training forwards never",
}

# Our own settings that were renamed to TRL's: what to write now.
RENAMED = {
    "loss_aggregation": "use TRL's loss_type: 'token' is 'dapo', 'sequence' is 'grpo', 'constant' is 'dr_grpo'",
    "epsilon_low": "use TRL's epsilon (the lower clip bound; epsilon_high defaults to it)",
    "eval_batch_size": "use TRL's per_device_eval_batch_size (greedy evaluation: one completion per prompt)",
}

# TRL settings that change nothing here, whatever their value: accepted, with a warning saying why.
_NO_HUB = "nothing is pushed to the Hub (push_to_hub is not supported): checkpoints stay in output_dir"
NO_EFFECT = {
    "use_cpu": "the device is chosen automatically: the GPU when there is one (CUDA_VISIBLE_DEVICES= hides it)",
    "logging_strategy": "logging_steps sets when a metrics line is written",
    "logging_first_step": "logging_steps sets which steps are logged (every one by default)",
    "disable_tqdm": "progress shows on stderr; written to a file, it is a plain line every few seconds",
    "remove_unused_columns": "every dataset column reaches the reward functions",
    "run_name": "trackers name the run after output_dir and its start time",
    "log_level": _LOGGING, "log_level_replica": _LOGGING, "log_on_each_node": _LOGGING,
    "skip_memory_metrics": "memory/peak_gb is logged every step",
    "num_generations_eval": "an evaluation decodes one greedy completion per prompt (pass@1), not sampled groups",
    "save_only_model": "a checkpoint always holds the optimizer and RNG states, so that it resumes exactly; "
                       "trainer.save_model() writes the model alone",
    **{k: "Liger's kernels (layer kernels for the same math in TRL 1.16) are not applied: log-probs are chunked "
          "here (logprob_chunk_size)" for k in ("use_liger_kernel", "liger_kernel_config")},
    "ddp_backend": "the backend is chosen automatically: NCCL between GPUs, gloo between CPU processes",
    "do_train": "Trainer.train() trains; transformers leaves these to scripts too", "do_eval": "as do_train",
    "do_predict": "as do_train",
    **{k: _NO_DATALOADER for k in ("dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
                                   "dataloader_prefetch_factor", "dataloader_drop_last")},
    **{k: _NO_HUB for k in ("hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
                            "hub_revision")},
}

# TRL settings of features this trainer lacks, at the values that leave them off (TRL's defaults): accepted,
# with the same warning; any other value is refused as above.
OFF_VALUES = {
    "use_transformers_paged": (False,), "fp16": (False,), "push_to_hub": (False,), "deepspeed": (None,),
    "fsdp_config": (None,), "torch_compile": (False,), "tf32": (None,), "full_determinism": (False,),
    "ddp_find_unused_parameters": (None, False), "gradient_checkpointing_kwargs": (None, {"use_reentrant": False}),
}

# Keyword arguments of TRL's GRPOTrainer that this Trainer does not take, and what to do instead (its `args`
# and `processing_class` are taken, as `config` and `tokenizer`, and `peft_config` by trl_call.py).
TRAINER_ONLY = {"optimizers": "set optim, learning_rate, lr_scheduler_type and warmup_steps in the Config"}

# transformers' names (TRL configs use them) of our optimizers (settings/choices.OPTIMIZERS), stored as ours.
OPTIMIZER_ALIASES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit"}
# model_init_kwargs' dtypes -> bf16 (policy/precision.py plans each tensor's dtype from it); "auto": bf16's choice
DTYPES = {"bfloat16": True, "float32": False, "auto": None}


def check_keys(settings: dict, names: list[str]) -> dict[str, str]:
    """The keys of `settings` that are not `names` (Config's fields) but change nothing here, each warned about
    on stderr with why (TRL's NO_EFFECT settings, and OFF_VALUES at a value that leaves a feature off; a value
    may be given as command-line text). ConfigError naming every other key at once: TRL's settings we lack get
    their own message (why, or what to use instead), anything else the closest field's name."""
    accepted, problems = {}, []
    for key, value in settings.items():
        reason = TRL_REASONS.get(key, "this trainer does not implement it")
        if key in names:
            continue
        if key in NO_EFFECT:
            accepted[key] = f"TRL's `{key}` has no effect here: {NO_EFFECT[key]}"
        elif key in OFF_VALUES and any(value == v or _as_text(value) == _as_text(v) for v in OFF_VALUES[key]):
            accepted[key] = f"TRL's `{key}={_as_text(value)}` has no effect here: {reason}"
        elif key in RENAMED:
            problems.append(f"'{key}' is gone: {RENAMED[key]}")
        elif key in TRL_ONLY:
            problems.append(f"TRL's `{key}` is not supported here: {reason}")
        else:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else " (see --help for the settings)"
            problems.append(f"unknown setting '{key}'{hint}")
    if len(problems) > 1:
        raise ConfigError(f"{len(problems)} settings are not accepted: {'; '.join(problems)}")
    if problems:
        raise ConfigError(problems[0])
    for line in accepted.values():
        print(f"warning: {line}", file=sys.stderr)
    return accepted


class CheckedKeywords(type):
    """Config's metaclass: every construction (dataclasses.replace too) passes its keywords through `check_keys`
    before the generated __init__, which would answer an unknown one with a TypeError; those that change nothing
    here are dropped (warned about)."""

    def __call__(cls, *args, **settings):
        no_effect = check_keys(settings, [f.name for f in dataclasses.fields(cls)])
        return super().__call__(*args, **{k: v for k, v in settings.items() if k not in no_effect})


def _as_text(value) -> str:
    """A value as the command line writes it (`--use_vllm=false`), from a value or from such text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value.strip().lower()
    return "none" if value is None else json.dumps(value).lower()


def as_ours(name: str, value):
    """Field `name`'s `value` as the Config stores it, from TRL 1.16's bool scale_rewards, transformers' optimizer
    names, resume_from_checkpoint's True as text, pad_to_multiple_of's "auto" (TRL's default: pads on AWS Neuron
    only) and TRL's model_init_kwargs (`_init_kwargs`)."""
    if name == "pad_to_multiple_of" and value == "auto":
        return None
    if name == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if name == "optim" and isinstance(value, str):
        return OPTIMIZER_ALIASES.get(value, value)
    if name == "resume_from_checkpoint" and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return _init_kwargs(value) if name == "model_init_kwargs" and isinstance(value, dict) else value


def _init_kwargs(kwargs: dict) -> dict:
    """model_init_kwargs as stored: TRL's older torch_dtype named dtype (transformers 5's), a torch.dtype by
    its name (the config is saved as JSON); the loading keys the trainer sets itself refused."""
    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs:
        if "dtype" in kwargs:
            raise ConfigError("model_init_kwargs sets both dtype and torch_dtype: keep dtype (transformers 5's)")
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    if type(kwargs.get("dtype")).__name__ == "dtype":  # a torch.dtype, without importing torch here
        kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
    if kwargs.get("dtype", "auto") not in DTYPES:
        raise ConfigError(f"model_init_kwargs dtype must be one of {', '.join(DTYPES)} (fp16 is not supported "
                          f"here: bf16 or float32), got {kwargs['dtype']!r}")
    for key in ("quantization_config", "device_map"):
        if key in kwargs:
            raise ConfigError(f"model_init_kwargs {key} is set by the trainer: use load_in_4bit=True for 4-bit "
                              f"(QLoRA) loading; the device is the GPU when there is one")
    return kwargs


def bf16_of_dtype(kwargs: dict | None, bf16: bool | None) -> bool | None:
    """`bf16` as model_init_kwargs' dtype sets it; ConfigError when the two say different things."""
    wanted = DTYPES[(kwargs or {}).get("dtype", "auto")]
    if wanted is None or bf16 == wanted:
        return bf16
    if bf16 is not None:
        raise ConfigError(f"model_init_kwargs dtype={kwargs['dtype']!r} and bf16={bf16} disagree: set one of them")
    return wanted
