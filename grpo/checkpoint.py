"""Checkpoints: written into a temporary folder, fsynced, then renamed into place with a completion
marker, so a crash mid-save never leaves a checkpoint that looks complete."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

COMPLETE = "COMPLETE"
NAME = re.compile(r"^checkpoint-(\d+)$")


def fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(output_dir: str, step: int, model, tokenizer, config_dict: dict,
                    save_total_limit: int | None = None, state_dict: dict | None = None) -> Path:
    """Save weights (the LoRA adapter alone under peft) as safetensors, the tokenizer and the config.
    `state_dict` replaces the model's own (FSDP's gathered full weights)."""
    final = Path(output_dir) / f"checkpoint-{step}"
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "grpo_config.json").write_text(json.dumps(config_dict, indent=2))
    (tmp / COMPLETE).write_text(str(step))
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if save_total_limit:
        for old in complete_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Finished checkpoints, oldest first; half-written ones (no marker) are ignored."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := NAME.match(p.name)) and (p / COMPLETE).exists()]
    return [p for _, p in sorted(found)]
