"""Checkpoints hold everything a run needs to continue exactly where it stopped: the weights (the LoRA
adapter alone under peft), and in `trainer_state.pt` the optimizer, the schedule, the RNG states, the data
position and the step. Each is written into a temporary folder, fsynced, and renamed into place with a
completion marker, so a crash mid-save never leaves a checkpoint that looks complete; half-written ones are
neither loaded nor counted by `save_total_limit`. Resuming drops the lines of the run's .jsonl logs written
after the checkpoint's step, so the metrics stream has no duplicated or missing lines."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

COMPLETE = "COMPLETE"
STATE = "trainer_state.pt"
NAME = re.compile(r"^checkpoint-(\d+)$")
# Settings that shape the saved tensors: a checkpoint only loads into a run with the same ones.
STATE_SHAPING = ("use_lora", "lora_r", "lora_target_modules", "optim", "fsdp", "bf16_weights")


def save_checkpoint(output_dir: str, step: int, model, tokenizer, config_dict: dict, state: dict,
                    save_total_limit: int | None = None, model_state: dict | None = None) -> Path:
    """Write checkpoint-`step` (weights, tokenizer, config, `state`) atomically; prune old ones.
    `model_state` replaces the model's own state dict (FSDP's full weights gathered from the shards)."""
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".checkpoint-{step}.tmp"
    for stale in root.glob(".checkpoint-*.tmp"):  # left by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "grpo_config.json").write_text(json.dumps(config_dict, indent=2))
    torch.save(state, tmp / STATE)
    for path in [*tmp.rglob("*"), *root.glob("*.jsonl")]:  # the logs too: lines up to `step` must survive
        if path.is_file():
            _fsync(path)
    (tmp / COMPLETE).write_text(str(step))
    _fsync(tmp / COMPLETE)
    replaced = root / f".checkpoint-{step}.replaced.tmp"
    if final.exists():  # saving a step again: move the old one aside, never delete it before
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync(root)  # the rename itself
    shutil.rmtree(replaced, ignore_errors=True)
    if save_total_limit:
        for old in complete_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Finished checkpoints, oldest first; half-written ones (no marker) are ignored."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := NAME.match(p.name)) and (p / COMPLETE).exists()]
    return [p for _, p in sorted(found)]


def check_no_earlier_run(output_dir: str) -> None:
    """A fresh run must not append to an earlier run's logs or write over its checkpoints."""
    earlier = [p.name for p in complete_checkpoints(output_dir)]
    earlier += [p.name for p in Path(output_dir).glob("*.jsonl") if p.stat().st_size]
    if earlier:
        raise ConfigError(f"{output_dir} already holds a run ({', '.join(earlier)}): continue it with "
                          f"--resume_from_checkpoint=latest, or pick another --output_dir")


def check_output_dir(output_dir: str) -> None:
    """Fail before any loading if `output_dir` cannot be created or written: a folder is made and removed
    again in its nearest existing parent (permissions alone say nothing for root, or on /proc)."""
    path = Path(output_dir).absolute()
    parent = next(p for p in (path, *path.parents) if p.exists())
    if not parent.is_dir():
        raise ConfigError(f"output_dir={output_dir} cannot be created: {parent} is a file, not a folder; "
                          f"pick another --output_dir")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".grpo-write-test-", dir=parent))
    except OSError as error:
        raise ConfigError(f"output_dir={output_dir} cannot be {'written' if parent == path else 'created'}: "
                          f"making a folder in {parent} fails ({error.strerror}); pick a writable --output_dir"
                          ) from None


def find_checkpoint(spec: str, output_dir: str) -> Path | None:
    """The checkpoint folder `spec` names, or for "latest" the newest complete one in `output_dir`
    (None if there is none yet). ConfigError if `spec` is not a complete checkpoint, or if `output_dir`
    holds newer ones: continuing the older one there would mix two runs."""
    found = complete_checkpoints(output_dir)
    if spec == "latest":
        return _checked_folder(str(found[-1])) if found else None
    path = _checked_folder(spec)
    newer = [p.name for p in found if _step_of(p) > _step_of(path)]
    if newer:
        raise ConfigError(f"{output_dir} holds checkpoints newer than {spec} ({', '.join(newer)}): continuing "
                          f"from it there would mix two runs; move them away or pick another --output_dir")
    return path


def _step_of(checkpoint: Path) -> int:
    return int((checkpoint / COMPLETE).read_text())


def _checked_folder(spec: str) -> Path:
    path = Path(spec)
    inside = complete_checkpoints(spec)
    if inside:
        raise ConfigError(f"resume_from_checkpoint={spec} is a run folder, not a checkpoint: pass one of its "
                          f"checkpoints (newest: {inside[-1]}) or --resume_from_checkpoint=latest")
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: no such folder: {spec}")
    if not (path / COMPLETE).exists():
        raise ConfigError(f"resume_from_checkpoint={spec} is not a complete checkpoint (no {COMPLETE} marker: "
                          f"its save was interrupted); --resume_from_checkpoint=latest picks the newest complete one")
    if not (path / STATE).exists():
        raise ConfigError(f"resume_from_checkpoint={spec} holds weights but no {STATE} to resume from")
    return path


def changed_settings(checkpoint: Path, config_dict: dict) -> list[str]:
    """The settings that differ from the ones `checkpoint` was saved with, as "key: old -> new".
    ConfigError if one of them shapes the saved tensors (LoRA vs full, rank, modules, optimizer)."""
    saved = saved_config(checkpoint)
    changed = {k: (saved[k], v) for k, v in config_dict.items()
               if k in saved and saved[k] != v and k != "resume_from_checkpoint"}
    clashes = [k for k in STATE_SHAPING if k in changed]
    if clashes:
        settings = ", ".join(f"{k}={json.dumps(changed[k][0])}" for k in clashes)
        raise ConfigError(f"{checkpoint} was saved with {settings}; resuming needs the same {', '.join(clashes)} "
                          f"(now {', '.join(f'{k}={json.dumps(changed[k][1])}' for k in clashes)})")
    return [f"{k}: {json.dumps(old)} -> {json.dumps(new)}" for k, (old, new) in changed.items()]


def saved_config(checkpoint: Path) -> dict:
    """The settings `checkpoint` was saved with."""
    return json.loads((checkpoint / "grpo_config.json").read_text())


def load_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / STATE, map_location="cpu", weights_only=True)


def drop_log_lines_after(output_dir: str, step: int) -> None:
    """Keep the lines of every .jsonl log in `output_dir` up to `step`: later ones were written after
    the checkpoint, and a torn last line by a crash mid-write."""
    for path in Path(output_dir).glob("*.jsonl"):
        tmp = path.with_name(path.name + ".tmp")
        with open(path) as src, open(tmp, "w") as dst:
            for line in src:
                try:
                    keep = json.loads(line).get("step", 0) <= step
                except (ValueError, AttributeError, TypeError):
                    keep = False
                if keep:
                    dst.write(line.rstrip("\n") + "\n")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)


# --- random number generators ---


def rng_state() -> dict:
    """Every generator sampling, dropout or a reward function may draw from."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
