"""A transformers causal LM written as one GGUF file (llama.cpp, Ollama, LM Studio; transformers' `gguf_file=`):
what it writes, and what it refuses, is docs/inference-engines.md's. Llama- and Qwen2-style models: llama.cpp's
tensor names (gguf's own name map), the query and key rows of a llama permuted as llama.cpp stores them, the
hyper-parameters under llama.cpp's keys. The tokenizer: the source GGUF's own, or written from a byte-level BPE
tokenizer under the first of `PRE_TOKENIZERS` whose split transformers' GGUF loader rebuilds identically."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import ConfigError

# --gguf-type -> (gguf's GGMLQuantizationType name, LlamaFileType name)
GGUF_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
              "q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
              "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "MOSTLY_Q4_0")}
ARCHITECTURES = ("llama", "mistral", "qwen2")
# llama.cpp pre-tokenizer names transformers' GGUF loader knows, tried in this order ("default": GPT-2's split).
PRE_TOKENIZERS = ("default", "qwen2", "llama-bpe", "gpt-4o", "tekken")
CHECK_TEXT = ("Hello world! It's 2024: 12345 + 678 = 13023.\n\n  Tabs\tand  spaces, naïve café, 数学, "
              "<reasoning>x</reasoning> <answer> 42 </answer> def f(x):\n    return x**2  # ok")
CONTROL, NORMAL, USER_DEFINED = 3, 1, 4  # llama.cpp's token types
CONVERT = "export --merged and convert that folder with llama.cpp's convert_hf_to_gguf.py"


def gguf_module():
    try:
        import gguf
    except ImportError:
        raise ConfigError("writing GGUF needs the gguf package: pip install gguf (or pip install -e \".[gguf]\")")
    return gguf


def check_gguf_type(name: str) -> None:
    if name not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type={name!r}: one of {', '.join(GGUF_TYPES)}")


def check_exportable(config) -> None:
    """A ConfigError (one line) for a model this writer cannot express."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        raise ConfigError(f"GGUF export writes {', '.join(ARCHITECTURES)} models; this one is {kind!r}: {CONVERT}")
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if rope_type not in (None, "default"):
        raise ConfigError(f"GGUF export does not write rope scaling ({rope_type!r}): {CONVERT}")


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a query / key projection's rows [heads * head_dim, in]: each head's two rotary
    halves interleaved (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(gguf, model, arch: str) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp name, float32 tensor) for each weight of `model` (llama.cpp's architecture `arch`), in the state
    dict's order; a tied LM head is left out (its absence is how a reader knows it is tied)."""
    config = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    out = []
    for hf_name, w in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        stem, _, suffix = hf_name.rpartition(".")
        name = names.get_name(stem)
        if name is None:
            if "rotary_emb" in hf_name:
                continue
            raise ConfigError(f"GGUF export: no llama.cpp name for the weight {hf_name}")
        w = w.detach().to("cpu", torch.float32)
        if arch == "llama" and name.endswith(".attn_q"):
            w = llama_permute(w, config.num_attention_heads)
        elif arch == "llama" and name.endswith(".attn_k"):
            w = llama_permute(w, config.num_key_value_heads)
        out.append((f"{name}.{suffix}", w))
    return out


def tensor_type(gguf, w: torch.Tensor, wanted):
    """The type a tensor is stored in: `wanted`, but float32 for 1-D tensors, float16 for rows it cannot cut."""
    if w.dim() == 1:
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if w.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return wanted


def encoded(gguf, w: torch.Tensor, qtype):
    import numpy as np

    array = w.numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(array), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(model, tokenizer, path: Path, type_name: str = "f16", source_gguf: Path | None = None,
               name: str | None = None) -> Path:
    """Write `model` (a transformers causal LM, adapters already merged) and its tokenizer to `path` (written
    beside and renamed into place: never half a file under that name)."""
    gguf = gguf_module()
    check_gguf_type(type_name)
    config = model.config
    check_exportable(config)
    arch = "llama" if config.model_type in ("llama", "mistral") else config.model_type
    qtype_name, file_type = GGUF_TYPES[type_name]
    wanted = getattr(gguf.GGMLQuantizationType, qtype_name)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        write_metadata(writer, gguf, config, arch, name, getattr(gguf.LlamaFileType, file_type))
        if source_gguf is not None:
            copy_tokenizer(writer, gguf, source_gguf)
        else:
            write_tokenizer(writer, tokenizer, pre_tokenizer(tokenizer, arch), config.vocab_size)
        for tensor_name, w in gguf_tensors(gguf, model, arch):
            data, raw = encoded(gguf, w, tensor_type(gguf, w, wanted))
            writer.add_tensor(tensor_name, data, raw_dtype=raw)
        finish(writer)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def finish(writer) -> None:
    """Write what was added to `writer` and close its file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_metadata(writer, gguf, config, arch: str, name: str | None, file_type) -> None:
    heads, rope = config.num_attention_heads, getattr(config, "rope_parameters", None) or {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name or config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def copy_tokenizer(writer, gguf, source: Path) -> None:
    """Every `tokenizer.*` field of the source GGUF, as it is there."""
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)


def is_byte_level(spec: dict) -> bool:
    def named(part):
        if not part:
            return []
        inner = part.get("pretokenizers") or part.get("processors") or part.get("decoders") or []
        return [part.get("type")] + [n for p in inner for n in named(p)]
    return "ByteLevel" in named(spec.get("pre_tokenizer")) + named(spec.get("decoder"))


def write_tokenizer(writer, tokenizer, pre: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as a GGUF says it: its tokens by id (padded to the model's vocabulary), their
    types, the merges, the special ids, whether a BOS is added, the chat template."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if hasattr(tokenizer, "backend_tokenizer") else {}
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not is_byte_level(spec):
        raise ConfigError(f"GGUF export writes byte-level BPE tokenizers; this one is {model.get('type')!r}: "
                          f"{CONVERT}")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(max(vocab_size, max(by_id) + 1))]
    special = {a["content"]: a.get("special", False) for a in spec.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    bos = tokenizer.bos_token_id
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([NORMAL if t not in special else CONTROL if special[t] else USER_DEFINED for t in tokens])
    if merges:
        writer.add_token_merges(merges)
    else:  # transformers' loader then derives merges from the scores (none here: every token is one symbol)
        writer.add_token_scores([0.0] * len(tokens))
    for add, token_id in ((writer.add_bos_token_id, bos), (writer.add_eos_token_id, tokenizer.eos_token_id),
                          (writer.add_pad_token_id, tokenizer.pad_token_id)):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(bos is not None and tokenizer("a")["input_ids"][:1] == [bos])
    if isinstance(tokenizer.chat_template, str) and tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def pre_tokenizer(tokenizer, arch: str) -> str:
    """The first of PRE_TOKENIZERS under which transformers' GGUF loader rebuilds a tokenizer that encodes
    CHECK_TEXT (and the special tokens) as `tokenizer` does; a ConfigError when none does."""
    gguf = gguf_module()
    from transformers import AutoTokenizer

    specials = "".join(t for t in tokenizer.all_special_tokens if t)
    text = CHECK_TEXT + specials + " x"
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    with tempfile.TemporaryDirectory() as folder:
        for pre in PRE_TOKENIZERS:
            probe = Path(folder) / f"{pre}.gguf"
            writer = gguf.GGUFWriter(str(probe), arch)
            write_tokenizer(writer, tokenizer, pre, len(tokenizer))
            finish(writer)
            rebuilt = AutoTokenizer.from_pretrained(folder, gguf_file=probe.name)
            if rebuilt(text, add_special_tokens=False)["input_ids"] == want:
                return pre
    raise ConfigError("GGUF export: no llama.cpp pre-tokenizer name rebuilds this tokenizer's split "
                      f"(tried {', '.join(PRE_TOKENIZERS)}): {CONVERT}")
