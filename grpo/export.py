"""`python -m grpo.export CHECKPOINT [--merged DIR] [--gguf FILE [--gguf-type TYPE]] [--base MODEL]`: the trained
model out of grpo, for transformers, vLLM, llama.cpp, Ollama or LM Studio (OPTIONS; docs/inference-engines.md).
CHECKPOINT is a checkpoint-STEP folder or a folder Trainer.save_model wrote."""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, UserError
from .settings.cli import split_options

USAGE = ("usage: python -m grpo.export CHECKPOINT [--merged DIR] [--gguf FILE] [--gguf-type TYPE] [--base MODEL] "
         "[--help]")
OPTIONS = """Export a trained model: a LoRA adapter merged into its base model, in float32.

  --merged DIR      a transformers folder: model, tokenizer, README naming the base model (DIR must not exist
                    or be empty)
  --gguf FILE       one GGUF file for llama.cpp, Ollama, LM Studio (llama- and qwen2-style models)
  --gguf-type TYPE  f32, f16 (default), bf16, q8_0, q5_1, q5_0, q4_1 or q4_0
  --base MODEL      the base model of a LoRA checkpoint (default: the run's `model`, from grpo_config.json)"""
OWN_OPTIONS = ("merged", "gguf", "gguf-type", "base")


@dataclass
class Trained:
    model: object  # a transformers causal LM, adapters merged, float32, eval mode
    tokenizer: object
    base_name: str  # portable: a hub id or a file name, never a path of this machine
    source_gguf: Path | None  # the GGUF the base model came from


def parse(argv: list[str]) -> tuple[Path, dict[str, str]]:
    own, rest = split_options(argv, OWN_OPTIONS)
    unknown = next((arg[2:].partition("=")[0] for arg in rest if arg.startswith("--")), None)
    if unknown is not None:
        raise ConfigError(f"unknown option --{unknown}: {', '.join('--' + o for o in OWN_OPTIONS)}")
    if len(rest) > 1:
        raise ConfigError(f"one CHECKPOINT only, got {Path(rest[0])} and {rest[1]}")
    if not rest:
        raise ConfigError("name the CHECKPOINT folder to export")
    if "merged" not in own and "gguf" not in own:
        raise ConfigError("nothing to write: pass --merged DIR, --gguf FILE or both")
    return Path(rest[0]), own


def source_gguf(model: str) -> Path | None:
    from .policy.gguf import OFFLINE_MODELS, packaged_gguf

    if model.lower() in OFFLINE_MODELS:
        return packaged_gguf(model.lower())
    return Path(model).expanduser() if model.lower().endswith(".gguf") else None


def saved_setting(checkpoint: Path, key: str):
    """What the run recorded under `key` in the checkpoint's grpo_config.json (None without one)."""
    saved = checkpoint / "grpo_config.json"
    return json.loads(saved.read_text()).get(key) if saved.exists() else None


def tools_note(checkpoint: Path) -> str | None:
    """One line when the run called tools (grpo_config.json's `tools`): nothing outside grpo runs them."""
    tools = saved_setting(checkpoint, "tools")
    if not tools:
        return None
    return (f"note: this model was trained calling tools ({', '.join(tools)}), which only grpo's decode loop runs "
            f"(try it: python -m grpo.generate --checkpoint {checkpoint} --recipe RECIPE --prompt TEXT); in "
            f"transformers, vLLM, llama.cpp or Ollama nothing answers its calls and it guesses the results "
            f"(docs/tools.md)")


def load_trained(checkpoint: Path, base: str | None = None) -> Trained:
    """The trained model of `checkpoint`, its LoRA adapter (if any) merged into the base, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .policy.sources import checkpoint_base, loading, model_folder, portable_name
    from .run.checkpoint import check_model_folder

    if not checkpoint.is_dir():
        raise ConfigError(f"no such checkpoint folder: {checkpoint}")
    check_model_folder(checkpoint, "CHECKPOINT")
    if (checkpoint / "adapter_config.json").exists():
        from peft import PeftModel

        name = base or checkpoint_base(checkpoint, "--base")
        with loading(model_folder(name)):
            model = AutoModelForCausalLM.from_pretrained(model_folder(name), dtype=torch.float32)
        model = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
    else:
        name = base or saved_setting(checkpoint, "model") or checkpoint.name
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    has_tokenizer = (checkpoint / "tokenizer_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint if has_tokenizer else model_folder(name))
    return Trained(model.eval(), tokenizer, portable_name(name), source_gguf(name))


def write_merged(trained: Trained, folder: Path) -> Path:
    """A transformers folder (written beside and renamed into place), whose README names the base model."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"--merged={folder} exists and is not an empty folder: name a new one")
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        trained.model.config._name_or_path = trained.base_name
        trained.model.save_pretrained(tmp, safe_serialization=True)
        trained.tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():  # transformers writes the weights through a private (0600) temporary file
            path.chmod((tmp / "config.json").stat().st_mode & 0o777)
        (tmp / "README.md").write_text(
            f"---\nbase_model: {trained.base_name}\nlibrary_name: transformers\ntags:\n- grpo\n---\n\n"
            f"{trained.base_name} trained with GRPO (grpo); the LoRA adapter, if any, merged into the weights.\n")
        if folder.exists():
            folder.rmdir()
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def export(checkpoint: Path, merged: Path | None = None, gguf: Path | None = None, gguf_type: str = "f16",
           base: str | None = None) -> list[Path]:
    """What `python -m grpo.export` does, from Python: the paths written."""
    from .policy.gguf_export import check_exportable, check_gguf_type, write_gguf

    if gguf is not None:
        check_gguf_type(gguf_type)
    trained = load_trained(checkpoint, base)
    if gguf is not None:  # before writing anything: a model the GGUF writer cannot express fails first
        check_exportable(trained.model.config)
    written = []
    if merged is not None:
        written.append(write_merged(trained, merged))
    if gguf is not None:
        written.append(write_gguf(trained.model, trained.tokenizer, gguf, gguf_type, trained.source_gguf,
                                  name=trained.base_name))
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{OPTIONS}" if argv else USAGE)
        return 0 if argv else 2
    from .infra.progress import quiet_library_bars

    try:
        checkpoint, own = parse(argv)
        with quiet_library_bars():
            written = export(checkpoint, Path(own["merged"]) if "merged" in own else None,
                             Path(own["gguf"]) if "gguf" in own else None, own.get("gguf-type", "f16"),
                             own.get("base"))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    for path in written:
        print(f"wrote {path}")
    note = tools_note(checkpoint)
    if note is not None:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
