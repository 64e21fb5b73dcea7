"""Checkpoints, which hold everything a run needs to continue exactly where it stopped: written whole or not at
all (`save_checkpoint`), into a rescue folder when the output folder cannot take them (`save_or_rescue`), and
recognised as damaged before anything loads (`damage`); docs/checkpoints-and-failures.md says what each holds."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

from ..errors import ConfigError, resume_hint, setting
from ..infra.progress import quiet_library_bars
from ..policy.lora import save_options
from .lock import LOCK

COMPLETE = "COMPLETE"
STATE = "trainer_state.pt"
CHECKSUMS = "checksums.sha256"  # `sha256sum -c checksums.sha256` checks them too
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
    with quiet_library_bars():  # transformers' own, on a log file
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state, **save_options(model))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "grpo_config.json").write_text(json.dumps(config_dict, indent=2))
    torch.save(state, tmp / STATE)
    files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    (tmp / CHECKSUMS).write_text("".join(f"{_sha256(tmp / name)}  {name}\n" for name in files))
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


def save_or_rescue(output_dir: str, step: int, *args, **kwargs) -> tuple[Path | None, str | None]:
    """`save_checkpoint` into `output_dir`, or when that fails into the first rescue folder that takes it (one
    beside it, for a folder turned read-only; then one in TMPDIR, for a full disk): (the checkpoint written or
    None, None or the line that says what happened and where the state went)."""
    gone = not Path(output_dir).is_dir()  # made again, it would hold the run's last checkpoint without the rest
    if gone:
        cause = "it was deleted while the run was going"
    else:
        try:
            return save_checkpoint(output_dir, step, *args, **kwargs), None
        except Exception as error:  # noqa: BLE001 -- OSError, and what torch or safetensors raise for a failed write
            cause = write_failure(error)
            shutil.rmtree(Path(output_dir) / f".checkpoint-{step}.tmp", ignore_errors=True)  # the space it took
    failed = f"checkpoint-{step} cannot be written into {output_dir} ({cause})"
    unwritable = f"make {output_dir} writable (or free space)"
    fix = "" if gone else f"{unwritable}, then "
    root = Path(output_dir).absolute()
    for rescue in (root.with_name(f"{root.name}.rescue"), Path(tempfile.gettempdir()) / f"grpo-rescue-{root.name}"):
        try:
            path = save_checkpoint(str(rescue), step, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 -- as above; the next folder is tried
            failed += f", nor into {rescue} ({write_failure(error)})"
            shutil.rmtree(rescue / f".checkpoint-{step}.tmp", ignore_errors=True)
            continue
        return path, (f"{failed}: the state after step {step} is saved in {path} instead; {fix}resume with "
                      f"{setting('resume_from_checkpoint', str(path))}")
    newest = complete_checkpoints(output_dir)
    return None, (f"{failed}: the steps after {newest[-1] if newest else 'the start'} are lost; "
                  f"{'' if gone else f'{unwritable} and '}run again")


def write_failure(error: BaseException) -> str:
    """What made a write fail, in a few words (an OSError's reason and file)."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}{f': {error.filename}' if error.filename else ''}"
    return " ".join(str(error).split())[:200] or type(error).__name__


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


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


EARLIER = "previous-run-"  # OUTPUT_DIR/previous-run-N: an earlier run's files, moved there by a fresh run


def move_earlier_run(output_dir: str) -> str | None:
    """Every entry of `output_dir` that holds an earlier run (its checkpoints or logs) moved into the next
    OUTPUT_DIR/previous-run-N (docs/checkpoints-and-failures.md): the line that says so, or None."""
    root = Path(output_dir)
    earlier = [p.name for p in complete_checkpoints(output_dir)]
    earlier += [p.name for p in root.glob("*.jsonl") if p.stat().st_size]
    if not earlier:
        return None
    n = 1 + max((int(p.name[len(EARLIER):]) for p in root.glob(f"{EARLIER}*") if p.name[len(EARLIER):].isdigit()),
                default=0)
    moved_to = root / f"{EARLIER}{n}"
    try:
        moved_to.mkdir()
        for entry in root.iterdir():
            if entry.name != LOCK and not entry.name.startswith(EARLIER):
                entry.rename(moved_to / entry.name)
    except OSError as e:
        raise ConfigError(f"{output_dir} holds an earlier run ({', '.join(earlier)}), which could not be moved to "
                          f"{moved_to} ({e.strerror}): continue it with {resume_hint()}, or pick another "
                          f"{setting('output_dir')}") from None
    return (f"{output_dir} held an earlier run ({', '.join(earlier)}): moved it to {moved_to} for this fresh run; "
            f"{resume_hint()} continues a run instead")


def find_checkpoint(spec: str | bool, output_dir: str) -> tuple[Path | None, list[str]]:
    """The checkpoint folder `spec` names, or for "latest" the newest loadable one in `output_dir` (None if
    there is none yet; for True, transformers' spelling, ConfigError then), and a line for each newer one passed
    over as damaged. ConfigError if `spec` is not a loadable checkpoint, if every checkpoint of `output_dir` is
    damaged, or if `output_dir` holds loadable newer ones: continuing the older one there would mix two runs."""
    found = complete_checkpoints(output_dir)
    if spec is True and not found:
        raise ConfigError(f"{setting('resume_from_checkpoint', True)}: no checkpoint in {output_dir} to resume from "
                          f"(\"latest\" would start from step 0 when there is none)")
    if spec in ("latest", True):
        damaged = []
        for path in reversed(found):
            problem = damage(path)
            if problem is None:
                return path, [f"{bad} cannot be loaded ({why}): resuming from {path}, the newest loadable "
                              f"checkpoint" for bad, why in damaged]
            damaged.append((path, problem))
        if damaged:
            problems = "; ".join(f"{p.name}: {why}" for p, why in damaged)
            raise ConfigError(f"no checkpoint in {output_dir} can be loaded ({problems}): move them away to "
                              f"start again from step 0")
        return None, []
    path = _checked_folder(spec)
    newer = [p.name for p in found if _step_of(p) > _step_of(path) and damage(p) is None]
    if newer:
        raise ConfigError(f"{output_dir} holds checkpoints newer than {spec} ({', '.join(newer)}): continuing "
                          f"from it there would mix two runs; move them away or pick another {setting('output_dir')}")
    return path, []


def damage(checkpoint: Path, weights_only: bool = False) -> str | None:
    """Why `checkpoint` cannot be loaded, or None when it looks whole: its files present, each as long as its own
    header says (a file cut short: a full disk, a lost node), then each file's sha256 against the one its save
    wrote (a changed byte). `weights_only`: the model folder alone (what grpo.eval loads)."""
    needed = [] if weights_only else [COMPLETE, "grpo_config.json", STATE]
    adapter = (checkpoint / "adapter_config.json").exists()
    needed.append("adapter_model.safetensors" if adapter else "config.json")
    index = checkpoint / "model.safetensors.index.json"  # a sharded model: every shard it lists
    try:
        needed += sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    except (ValueError, KeyError, AttributeError):
        return f"{index.name} is damaged"
    missing = [name for name in needed if not (checkpoint / name).is_file()]
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights and not adapter:
        missing.append("model.safetensors")
    if missing:
        return f"no {', '.join(missing)}"
    for path in weights:
        if (problem := _safetensors_damage(path)) is not None:
            return f"{path.name} {problem}"
    if not weights_only:
        try:
            json.loads((checkpoint / "grpo_config.json").read_text())
        except ValueError:
            return "grpo_config.json is not valid JSON"
        try:
            zipfile.ZipFile(checkpoint / STATE).close()
        except (zipfile.BadZipFile, OSError):
            size = (checkpoint / STATE).stat().st_size
            return f"{STATE} is cut short or damaged ({size:,} bytes, no zip directory at its end)"
    return _checksum_damage(checkpoint, weights_only)


def _checksum_damage(checkpoint: Path, weights_only: bool) -> str | None:
    """The first file whose sha256 is not the one `checksums.sha256` lists (checkpoints saved before they were
    written have none to check); `weights_only`: the weights and the model's own files alone."""
    listed = checkpoint / CHECKSUMS
    if not listed.is_file():
        return None
    for line in listed.read_text().splitlines():
        expected, _, name = line.partition("  ")
        if weights_only and name in (STATE, "grpo_config.json"):
            continue
        if not (checkpoint / name).is_file():
            return f"no {name} (its {CHECKSUMS} lists it)"
        if _sha256(checkpoint / name) != expected:
            return f"{name} does not match its sha256 in {CHECKSUMS} (its bytes changed after it was saved)"
    return None


def _safetensors_damage(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, the JSON header, then the tensors' bytes, whose offsets
    the header lists: its size must be exactly their sum."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + header_size > size:
            return f"is cut short ({size:,} bytes, not even its header)"
        try:
            header = json.loads(f.read(header_size))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has a damaged header"
    expected = 8 + header_size + end
    if size != expected:
        how = "cut short" if size < expected else "too long"
        return f"is {how} ({size:,} bytes, its header says {expected:,})"
    return None


def check_model_folder(path: Path, option: str) -> None:
    """ConfigError unless `path` (named by `option`) holds loadable model weights: full ones or a LoRA adapter."""
    if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
        raise ConfigError(f"{path} is not a checkpoint folder (no config.json or adapter_config.json)")
    problem = damage(path, weights_only=True)
    if problem is not None:
        raise unloadable(option, path, problem, weights_only=True)


def unloadable(option: str, path: Path, problem: str, weights_only: bool = False) -> ConfigError:
    """The error for an explicitly named damaged checkpoint: the file, and the checkpoint that would work;
    `option` is the setting that named it, as the caller writes it."""
    other = next((p for p in reversed(complete_checkpoints(str(path.parent)))  # the newest loadable one beside
                  if p.resolve() != path.resolve() and damage(p, weights_only) is None), None)
    fix = (f"the newest loadable checkpoint beside it is {other}: {option}={other}" if other is not None
           else "no checkpoint beside it can be loaded")
    return ConfigError(f"{option}={path} cannot be loaded: {problem}; {fix}")


def _step_of(checkpoint: Path) -> int:
    return int((checkpoint / COMPLETE).read_text())


def _checked_folder(spec: str) -> Path:
    path, option = Path(spec), setting("resume_from_checkpoint")
    inside = complete_checkpoints(spec)
    if inside:
        raise ConfigError(f"{option}={spec} is a run folder, not a checkpoint: pass one of its checkpoints "
                          f"(newest: {inside[-1]}) or {resume_hint()}")
    if not path.is_dir():
        raise ConfigError(f"{option}: no such folder: {spec}")
    if not (path / COMPLETE).exists():
        started = [p.name for p in path.iterdir() if p.name in (STATE, "config.json", "adapter_config.json")
                   or p.suffix == ".safetensors"]  # what a save writes before its marker
        what = (f"is not a complete checkpoint (no {COMPLETE} marker: its save was interrupted)" if started else
                "holds no checkpoint: it is empty" if not any(path.iterdir()) else
                f"holds no checkpoint (no weights, {STATE} or {COMPLETE} marker)")
        raise ConfigError(f"{option}={spec} {what}; {resume_hint()} picks the newest complete one")
    problem = damage(path)
    if problem is not None:
        raise unloadable(option, path, problem)
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
    """The trainer state a checkpoint holds (run/session.Session.state_dict), in today's layout: one written
    before the batch supply kept its own entry ("generation" and "ahead" beside "rng") is read into "batches"."""
    state = torch.load(checkpoint / STATE, map_location="cpu", weights_only=True)
    for own in state.get("ranks", [state]):
        if "batches" not in own:
            own["batches"] = {"generation": own.pop("generation"), "ahead": own.pop("ahead", None)}
    return state
