"""A run's logs in its output_dir: metrics.jsonl (a line per logged step and per evaluation) and
completions.jsonl (every completion of a logged generation batch), each also passed on to the run's `Trackers`.
Under torchrun every rank calls these (they gather across ranks) and rank 0 alone writes."""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import TrainingStopped
from ..rollout.evaluate import summary_lines
from .checkpoint import write_failure
from .metric_names import trl_names

METRICS = "metrics.jsonl"
COMPLETIONS = "completions.jsonl"


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return peak_rss_bytes() / 1e9


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, not getrusage's ru_maxrss, which keeps the RSS the
    process had before exec (its parent's at fork)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def log_metrics(output_dir: Path, step: int, metrics: dict, dist, trackers) -> dict:
    """The step's metrics.jsonl line, as floats; timings and memory are the slowest / largest rank's."""
    timings = dist.reduce({k: v for k, v in metrics.items() if k.startswith(("perf/", "memory/", "step_time"))},
                          "max")
    line = {"step": step, **{k: float(v) for k, v in sorted({**metrics, **timings}.items())}}
    if dist.is_main:
        _append_line(output_dir / METRICS, line)
        trackers.log(step, line)
    return line


def log_eval(output_dir: Path, step: int, metrics: dict, is_main: bool, trackers, key_prefix: str = "eval") -> dict:
    """Print an evaluation's summary and write its metrics.jsonl line (`eval/*` keys, `eval` as `key_prefix`)."""
    line = {"step": step, **metrics}
    if is_main:
        first, *groups = summary_lines(metrics, key_prefix)
        tqdm.write("\n".join([f"{key_prefix} at step {step}: {first}", *groups]))
        _append_line(output_dir / METRICS, line)
        trackers.log(step, line)
    return line


def logged_lines(output_dir: Path, up_to: int) -> list[dict]:
    """metrics.jsonl's lines up to step `up_to`, where the log_history of a run resumed at that step starts;
    none without the file (a rank on a filesystem of its own), and never a line torn by a crash."""
    path = output_dir / METRICS
    return [trl_names(line) for _, line in _up_to(path.read_text().splitlines() if path.exists() else [], up_to)]


def _up_to(texts, step: int):
    """(text, line) of each log line up to `step`, never one torn by a crash mid-write."""
    for text in texts:
        try:
            line = json.loads(text)
            kept = line.get("step", 0) <= step
        except (ValueError, AttributeError, TypeError):
            continue
        if kept:
            yield text, line


def log_completions(output_dir: Path, step: int, batch, reward_names: list[str], dist, trackers) -> None:
    """Every completion of a generation batch (`batch`: rollout/batches.Rollout, this rank's; every rank's
    written) with its prompt, rewards and advantage."""
    prompts, completions = dist.gather_objects(batch.prompts), dist.gather_objects(batch.completions)
    rewards, per_func = dist.gather(batch.rewards), dist.gather(batch.per_func)  # [W*N], [W*N, F]
    advantages = dist.gather(batch.advantages)  # [W*N]
    # Reward functions' log_extra columns, one value per completion (None where a rank logged none).
    names = sorted(set(dist.gather_objects(list(batch.extras))))
    extras = {c: dist.gather_objects(list(batch.extras.get(c, [None] * len(batch.completions)))) for c in names}
    if not dist.is_main:
        return
    rows = []
    with appending(output_dir / COMPLETIONS) as f:
        for i in range(len(completions)):
            row = {"step": step, "prompt": prompts[i], "completion": completions[i],
                   "reward": rewards[i].item(), "advantage": advantages[i].item()}
            for j, name in enumerate(reward_names):
                value = per_func[i, j].item()
                row[f"reward/{name}"] = None if math.isnan(value) else value  # NaN: the function returned None
            row.update({c: values[i] if i < len(values) else None for c, values in extras.items()})
            f.write(json.dumps(row) + "\n")
            rows.append(row)
    trackers.log_completions(step, rows)


class LogNotWritten(TrainingStopped):
    """A log line output_dir cannot take (the folder deleted or turned read-only mid-run, a full disk): the run
    stops with its state saved (run/session.Session.saved_when_logs_fail)."""


@contextlib.contextmanager
def appending(path: Path):
    """`path` open for appending; LogNotWritten, naming the file and the cause, when that or a write fails."""
    try:
        with open(path, "a") as f:
            yield f
    except OSError as error:
        raise LogNotWritten(f"{path.name} cannot be written into {path.parent} ({write_failure(error)})") from None


def _append_line(path: Path, line: dict) -> None:
    with appending(path) as f:
        f.write(json.dumps(line) + "\n")


def drop_log_lines_after(output_dir: str, step: int) -> None:
    """Keep the lines of every .jsonl log in `output_dir` up to `step`: later ones were written after
    the checkpoint, and a torn last line by a crash mid-write."""
    for path in Path(output_dir).glob("*.jsonl"):
        tmp = path.with_name(path.name + ".tmp")
        with open(path) as src, open(tmp, "w") as dst:
            for text, _ in _up_to(src, step):
                dst.write(text.rstrip("\n") + "\n")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
