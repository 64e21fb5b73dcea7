"""Checks of settings that are each valid but cannot work together, run when a Config is made (checks.py), each
failure one sentence naming the settings."""
from __future__ import annotations

from ..errors import ConfigError


def check_combinations(config) -> None:
    """ConfigError on settings that are each valid but cannot work together. Those that depend on the run
    (a model passed in, the datasets, FSDP's ranks) are checked where the run knows them."""
    if config.load_in_4bit and not config.use_lora:
        raise ConfigError("load_in_4bit=True needs use_lora=True: 4-bit weights are frozen, QLoRA trains "
                          "LoRA adapters on top of them")
    if config.bf16_weights and (config.use_lora or config.fsdp):
        raise ConfigError("bf16_weights=True is for full fine-tuning without FSDP: set use_lora=false and "
                          "fsdp=false (LoRA keeps a bf16 base on CUDA already; FSDP keeps float32 shards)")
    if config.cast_lm_head_to_fp32 and config.fsdp:
        raise ConfigError("cast_lm_head_to_fp32=True with fsdp=True is not supported yet: FSDP gathers the LM head "
                          "in its compute dtype")
    if config.use_adaptive_entropy and config.top_entropy_quantile < 1:
        raise ConfigError("use_adaptive_entropy=True with top_entropy_quantile < 1 is not supported yet: the control "
                          "reads the entropy of every loss token, TRL's of the high-entropy ones only")
    if config.sync_ref_model and (config.beta == 0 or config.use_lora or config.fsdp or config.async_generation):
        raise ConfigError("sync_ref_model=True mixes the policy into the reference copy that full fine-tuning keeps "
                          "for beta > 0 (beta=0.0 uses no reference model; under LoRA the reference is the policy "
                          "with its adapter off: as in TRL), and not with fsdp or async_generation here: set "
                          "sync_ref_model=False")
    if config.use_vllm:
        check_vllm(config)
    if config.int8_sampling_weights:
        check_int8(config)
    if config.warmup_ratio and config.warmup_steps:
        raise ConfigError(f"set warmup_steps or warmup_ratio, not both (got {config.warmup_steps:g} and "
                          f"{config.warmup_ratio:g})")


def check_int8(config) -> None:
    """int8_sampling_weights=True: our decode loop on float32 weights (policy/int8 checks the CPU, policy/decoder
    the model)."""
    other = ("use_vllm=True (the server samples)" if config.use_vllm else
             "load_in_4bit=True (4-bit weights)" if config.load_in_4bit else
             "bf16=True (a bf16 base)" if config.bf16 else "bf16_weights=True" if config.bf16_weights else None)
    if other is not None:
        raise ConfigError(f"int8_sampling_weights=True makes int8 copies of float32 weights for our own decode "
                          f"loop on a CPU, which {other} does not have: set one of them off")
    if config.loss_type == "vespo" and config.vllm_importance_sampling_correction:
        raise ConfigError('loss_type="vespo" with int8_sampling_weights=True corrects the int8 samples '
                          "(vllm_importance_sampling_correction=True), which is not supported yet for VESPO: set "
                          "vllm_importance_sampling_correction=False")


def check_vllm(config) -> None:
    """use_vllm=True: server mode, the settings a server sampler can honour (docs/inference-engines.md)."""
    if config.vllm_mode != "server":
        raise ConfigError('vllm_mode="colocate" is not supported: vLLM runs in its own environment (it pins its own '
                          'torch and transformers) and is never imported by grpo; start a server and set '
                          'vllm_mode="server"')
    if not config.use_lora:
        raise ConfigError("use_vllm=True needs use_lora=True: the server samples with the run's LoRA adapter, "
                          "loaded after each optimizer step; vLLM 0.32's server has no weight-update endpoint for "
                          "full fine-tuning without NCCL (TRL's vllm-serve)")
    if config.async_generation:
        raise ConfigError("use_vllm=True with async_generation=True is not supported yet: set async_generation=False")
    if config.loss_type == "vespo" and config.vllm_importance_sampling_correction:
        raise ConfigError('loss_type="vespo" with vllm_importance_sampling_correction=True is not supported yet: '
                          "TRL folds the correction into VESPO's own weight; set "
                          "vllm_importance_sampling_correction=False")
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        raise ConfigError(f"vllm_importance_sampling_clip_min ({low:g}) must not exceed "
                          f"vllm_importance_sampling_clip_max ({high:g})")
