"""Loading the policy and tokenizer, LoRA and checkpointing, the reference policy, and per-token
log-probs of completions taken from hidden states (the model's full logits are never built)."""
from __future__ import annotations

import contextlib
import copy

import torch

from ..algo.logprobs import token_logprobs
from ..errors import ConfigError
from ..rollout.decoding import positions
from . import reference_kind


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def train_dtype(use_lora: bool, bf16: bool, bf16_weights: bool = False) -> torch.dtype:
    """Frozen LoRA bases can live in bf16; fully trained weights stay float32 under bf16 autocast, since
    bf16 weights would round away updates of lr ~1e-6, unless `bf16_weights` (the optimizer then rounds
    stochastically; on CPU too)."""
    if (use_lora and bf16 and torch.cuda.is_available()) or (bf16_weights and not use_lora):
        return torch.bfloat16
    return torch.float32


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_load_options(config, model_given: bool) -> None:
    """Settings about how `config.model` is loaded that cannot work as asked: fail before any loading."""
    if config.load_in_4bit and not config.use_lora:
        raise ConfigError("load_in_4bit=True needs use_lora=True: 4-bit weights are frozen, QLoRA trains LoRA "
                         "adapters on top of them")
    if config.bf16_weights and (config.use_lora or config.fsdp):
        raise ConfigError("bf16_weights=True is for full fine-tuning without FSDP: set use_lora=false and "
                          "fsdp=false (LoRA keeps a bf16 base on CUDA already; FSDP keeps float32 shards)")
    if config.load_in_4bit and model_given:
        raise ConfigError("load_in_4bit applies when the trainer loads config.model itself; a model passed in is "
                         "used as built (load it with a transformers BitsAndBytesConfig, or pass config.model)")


def load_model(config):
    """The policy from `config.model` (hub id or local path), on the GPU when there is one; with
    `load_in_4bit`, its decoder's linear layers are stored as 4-bit NF4 (QLoRA)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = train_dtype(config.use_lora, config.bf16, config.bf16_weights)
    if not config.load_in_4bit:
        return AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype).to(device)
    from transformers import BitsAndBytesConfig

    # Embeddings, norms and the LM head stay in `dtype` (bf16 on CUDA); peft's prepare_model_for_kbit_training
    # is skipped on purpose: it would upcast them to float32, and non-reentrant checkpointing needs no input grads.
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, quantization_config=quantization,
                                                device_map={"": device})


def prepare_for_training(model, config, world_size: int = 1):
    """bf16 weights when asked for, gradient checkpointing, then LoRA adapters when asked for. Returns the
    model to train."""
    if config.bf16_weights:  # a model built or passed in float32, as load_model would have loaded it
        model = model.to(torch.bfloat16)
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing lets gradients reach LoRA weights without input grads.
        kwargs = {"use_reentrant": False}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not config.use_lora and world_size == 1:  # DDP and FSDP reduce dense gradients only
        sparse_tied_embedding_gradient(model)
    if config.use_lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=config.lora_target_modules or "all-linear", task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.train()
    return model


def sparse_tied_embedding_gradient(model) -> None:
    """When the input embedding is the LM head (tied), make the lookup's backward sparse (rows of the batch's
    tokens). Autograd adds it in place into the head's dense gradient, which the loss produces first, so the
    weight's gradient stays dense and the [V, H] float32 temporary of a dense embedding backward never exists
    (1.2 GB for Qwen2.5-3B, at the end of every backward)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, torch.nn.Embedding) and head is not None and embedding.weight is head.weight:
        embedding.sparse = True


def unwrap(model):
    """The transformers model under a peft wrapper (peft injects adapters in place, so its modules
    are the ones being trained)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def make_reference(model, use_lora: bool, beta: float):
    """A frozen copy for full fine-tuning; None when the adapter-disabled policy serves (LoRA) or no
    reference is needed (beta == 0)."""
    if reference_kind(use_lora, beta) != "copy":
        return None
    reference = copy.deepcopy(unwrap(model)).eval().requires_grad_(False)
    if torch.cuda.is_available() and device_of(reference).type == "cuda":
        reference = reference.to(torch.bfloat16)  # forward-only: bf16 halves its memory
    return reference


def reference_context(model, reference):
    """Where the reference forward runs: the separate copy, or the policy with its adapter off."""
    if reference is not None:
        return reference, contextlib.nullcontext()
    return model, model.disable_adapter()


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, *,
                        temperature: float, chunk_size: int, return_entropy: bool = False):
    """Log-probs `[N, C]` of the completion tokens (positions >= prompt_length) under `model`."""
    hf = unwrap(model)
    body, head = hf.base_model, hf.get_output_embeddings()
    # Left padding shifts where each sequence starts; positions must count real tokens only, as in generation.
    position_ids = positions(attention_mask)  # [N, P+C]
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=False).last_hidden_state  # [N, P+C, H]
    hidden = hidden[:, prompt_length - 1:-1]  # [N, C, H]: the state before each completion token
    targets = input_ids[:, prompt_length:]  # [N, C]
    return token_logprobs(hidden, head.weight, targets, temperature=temperature, bias=head.bias,
                          chunk_size=chunk_size, return_entropy=return_entropy)
