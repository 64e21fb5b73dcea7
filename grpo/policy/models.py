"""Loading the policy and tokenizer, LoRA and checkpointing, the reference policy, and per-token
log-probs of completions taken from hidden states (the model's full logits are never built)."""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch

from ..algo.logprobs import token_logprobs
from ..errors import ConfigError
from ..settings import Config
from .head import head_logits, head_transform, positions
from .lora import with_adapter
from .precision import Precision
from .sources import adapter_base, loading, model_folder, portable_name


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def load_tokenizer(name_or_path: str):
    """The tokenizer of `name_or_path` (Config.model: a hub id, a folder, a .gguf file, or a short name of a
    model shipped for offline use), padding with EOS when it has no pad token."""
    from transformers import AutoTokenizer

    name = model_folder(name_or_path)
    with loading(name):  # a missing model: one line saying whether it was read as a path or a hub id
        tokenizer = AutoTokenizer.from_pretrained(name)
    return with_pad_token(tokenizer)


def with_pad_token(tokenizer):
    """`tokenizer`, padding with its EOS token when it has no pad token (TRL's choice, made on the object itself);
    ConfigError when it has neither."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an EOS token: "
                              f"set tokenizer.pad_token (completions end at its EOS token, so set that too)")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def default_tokenizer(name: str, model):
    """The tokenizer when none is given: that of `name` (Config.model), or for a model object the one of the
    folder or hub id its config names (TRL's choice; a model built in code names none)."""
    if model is None:
        return load_tokenizer(name)
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not source:
        raise ConfigError("a model passed to Trainer needs its tokenizer: pass processing_class=tokenizer "
                          "(TRL's name; tokenizer= works too); its config names no folder or hub id to load "
                          "one from")
    try:
        return load_tokenizer(source)
    except ConfigError as error:
        raise ConfigError(f"a model passed to Trainer without its tokenizer: loading one from {source}, "
                          f"where its config says it comes from, fails ({error}); pass "
                          f"processing_class=tokenizer") from None


def load_model(settings, precision: Precision | None = None):
    """The policy from `settings.model` (`settings`: settings/components.LoadSettings, a Config or a model's name) on
    `precision`'s device (default: the GPU when there is one), in its base dtype; with `load_in_4bit`, its
    decoder's linear layers are stored as 4-bit NF4 (QLoRA). `model_init_kwargs` go to from_pretrained."""
    from transformers import AutoModelForCausalLM

    settings = Config(model=settings) if isinstance(settings, str) else settings  # grpo.load_model("a name")
    precision = precision or Precision.plan(settings.bf16, settings.use_lora, bf16_weights=settings.bf16_weights)
    device, dtype = precision.device_type, precision.base_dtype
    name = model_folder(settings.model)
    kwargs = {k: v for k, v in (settings.model_init_kwargs or {}).items() if k != "dtype"}  # trl_names.bf16_of_dtype
    quantized = {}
    if settings.load_in_4bit:
        from transformers import BitsAndBytesConfig

        # Embeddings, norms and the LM head stay in `dtype` (bf16 under bf16); peft's prepare_model_for_kbit_training
        # is skipped on purpose: it would upcast them to float32, and non-reentrant checkpointing needs no input grads.
        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        quantized = {"quantization_config": nf4, "device_map": {"": device}}
    with loading(name):
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **quantized, **kwargs)
    if settings.load_in_4bit:
        keep_4bit_layout(model)  # grpo.eval loads through here too: the same numbers as evaluation during training
    else:
        model = model.to(device)
    model.name_or_path = adapter_base(settings.model)  # what a saved LoRA adapter records as its base
    model.config._name_or_path = portable_name(settings.model)  # what peft's model card says: never a local path
    return model


def keep_4bit_layout(model) -> None:
    """Keep every bitsandbytes 4-bit weight in the layout its training forward reads, on every CPU: on a CPU with
    AVX512-BF16, bitsandbytes 0.50 repacks a `Linear4bit` weight for a bf16 inference kernel the first time the
    layer runs in eval mode without grad (our sampling), a layout with no backward that changes the base when
    saved (docs/memory-planner.md)."""
    for name, module in model.named_modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):  # not a bitsandbytes.nn.Linear4bit
            continue
        if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            raise ConfigError(f"the 4-bit layer {name} was repacked for bitsandbytes' CPU inference kernel by an "
                              "eval-mode forward without grad, and cannot be trained in that layout: pass the "
                              "model before running it, or let the trainer load it (config.model, load_in_4bit)")
        module.support_avx512bf16_for_cpu = False


def prepare_for_training(model, config, world_size: int = 1):
    """The model to train, as `config` (settings/components.LoadSettings, or a Config) says; dropout off after
    LoRA (policy/lora.py), so its lora_dropout too."""
    keep_4bit_layout(model)  # a 4-bit model passed in, too
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
    if config.cast_lm_head_to_fp32:
        float32_head(model)
    if not config.use_lora and world_size == 1:  # DDP and FSDP reduce dense gradients only
        sparse_tied_embedding_gradient(model)
    if config.use_lora:
        model = with_adapter(model, config)  # a PeftModel passed in keeps its own
    if config.disable_dropout:  # TRL's: p = 0 in every nn.Dropout (a rate an attention kernel takes is no module)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    model.train()
    return model


def float32_head(model) -> None:
    """TRL's cast_lm_head_to_fp32: the LM head's weights in float32, so that its logits are computed in float32
    (log-probs and sampling multiply in the weight's dtype), the model's own forward too: its hidden states go
    in as float32. A tied input embedding's output is cast back to the dtype the layers had, as TRL does."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    dtype = head.weight.dtype
    head.float().register_forward_pre_hook(lambda module, args: tuple(a.float() for a in args))
    if embedding.weight is head.weight and dtype != torch.float32:
        embedding.register_forward_hook(lambda module, args, output: output.to(dtype))


def sparse_tied_embedding_gradient(model) -> None:
    """When the input embedding is the LM head (tied), make the lookup's backward sparse (rows of the batch's
    tokens). Autograd adds it in place into the head's dense gradient, which the loss produces first, so the
    weight's gradient stays dense and the [V, H] float32 temporary of a dense embedding backward never exists
    (1.2 GB for Qwen2.5-3B, at the end of every backward)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, torch.nn.Embedding) and head is not None and embedding.weight is head.weight:
        embedding.sparse = True


def unwrap(model):
    """The transformers model under a peft wrapper (peft injects adapters in place: its modules train)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def context_length(model) -> int | None:
    """The most positions `model` was made for (its config's max_position_embeddings; GPT-2's n_positions), or
    None when its config does not say."""
    config = getattr(unwrap(model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def reference_context(model, reference):
    """Where the reference forward runs: the separate copy, or the policy with its adapter off."""
    return (reference, contextlib.nullcontext()) if reference is not None else (model, model.disable_adapter())


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, *,
                        temperature: float, chunk_size: int, return_entropy: bool = False,
                        router_aux: bool = False):
    """Log-probs `[N, C]` of the completion tokens (positions >= prompt_length) under `model`, with
    `return_entropy` their entropies `[N, C]`; with `router_aux`, last, a mixture-of-experts model's load-balancing
    loss over the whole rows (policy/router.py)."""
    hf = unwrap(model)
    body, head, transform = hf.base_model, hf.get_output_embeddings(), head_transform(hf.config)
    # Left padding shifts where each sequence starts; positions must count real tokens only, as in generation.
    position_ids = positions(attention_mask)  # [N, P+C]
    router = {"output_router_logits": True} if router_aux else {}
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
               **router)
    hidden = out.last_hidden_state[:, prompt_length - 1:-1]  # [N, C, H]: the state before each completion token
    targets = input_ids[:, prompt_length:]  # [N, C]
    result = token_logprobs(hidden, head.weight, targets, temperature=temperature, bias=head.bias,
                            chunk_size=chunk_size, return_entropy=return_entropy, logit_scale=transform.scale,
                            softcap=transform.softcap)
    if not router_aux:
        return result
    # the family's loss over the real tokens, what its causal LM returns as `aux_loss` (router logits [N*T, E] a layer)
    aux = sys.modules[type(hf).__module__].load_balancing_loss_func(out.router_logits, hf.num_experts,
                                                                    hf.num_experts_per_tok, attention_mask)
    return (*result, aux) if return_entropy else (result, aux)


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode within (no dropout; under gradient checkpointing, the KV cache on), and back in the
    mode it was in after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def agreement_tolerance(hf_model, largest: float) -> float:
    """How far two computations of the same log-probs or logits may differ, the `largest` of them in magnitude:
    with a 16-bit LM head their 8 significant bits let two paths (other batch shapes, other kernels) round apart
    in the last places of the largest."""
    low_precision = hf_model.get_output_embeddings().weight.dtype not in (torch.float32, torch.float64)
    return 1e-3 + (2**-5 * largest if low_precision else 0.0)


@torch.no_grad()
def check_logprobs_match_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, *,
                                 temperature: float, chunk_size: int, rows: int = 2, tokens: int = 16,
                                 agree=lambda excess: excess) -> float:
    """The start-up check: log-probs of the first `tokens` completion tokens of `rows` sequences, and the sampling
    logits there, against the model's own `log_softmax(model(...).logits / temperature)`; the largest difference.
    A mismatch means this family's forward does something to its logits that policy/head does not know:
    ConfigError. `agree` makes this rank's error / tolerance the largest over ranks: all ranks stop together."""
    hf = unwrap(model)
    ids, mask = input_ids[:rows, :prompt_length + tokens], attention_mask[:rows, :prompt_length + tokens]  # [r, P+k]
    if ids.shape[1] == prompt_length:
        agree(0.0)
        return 0.0
    with eval_mode(model), torch.autocast(ids.device.type, enabled=False):
        ours = completion_logprobs(model, ids, mask, prompt_length, temperature=temperature,
                                   chunk_size=chunk_size)  # [r, k]
        hidden = hf.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                               use_cache=False).last_hidden_state[:, prompt_length - 1:-1]  # [r, k, H]
        sampling = head_logits(hf)(hidden.flatten(0, 1)).view(*hidden.shape[:2], -1)  # [r, k, V]: as generate
        k = ids.shape[1] - prompt_length
        keep = {"logits_to_keep": k + 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False,
                    **keep).logits[:, -k - 1:-1].float()  # [r, k, V]
    reference = torch.log_softmax(logits / temperature, dim=-1)  # [r, k, V]
    padding = mask[:, prompt_length:] == 0  # [r, k]: after EOS, not scored
    logprob_error = (ours - reference.gather(-1, ids[:, prompt_length:, None]).squeeze(-1)).abs()  # [r, k]
    sampling_error = (torch.log_softmax(sampling / temperature, dim=-1) - reference).abs().amax(-1)  # [r, k]
    logprob_error, sampling_error = (e.masked_fill(padding, 0).max().item() for e in (logprob_error, sampling_error))
    tolerance = agreement_tolerance(hf, logits.abs().max().item())
    excess = agree(max(logprob_error, sampling_error) / tolerance)
    if excess > 1:
        raise ConfigError(
            f"log-probs here differ from {type(hf).__name__}'s own forward by up to {logprob_error:.3g} "
            f"(sampling logits: {sampling_error:.3g}; tolerance {tolerance:.3g}; {excess:.3g}x the tolerance on the "
            f"worst rank): its forward makes its logits in a way grpo/policy/head.py does not know (read here: "
            f"{head_transform(hf.config)}), so training would optimize the wrong distribution")
    return max(logprob_error, sampling_error)
