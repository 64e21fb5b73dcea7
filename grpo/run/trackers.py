"""Experiment trackers (`report_to`: TensorBoard, Trackio, W&B, each imported only when named; rank 0 alone
reports) and the console's sample of completions (docs/recipes-and-settings.md, "Watching a run")."""
from __future__ import annotations

import importlib.util
import json
import netrc
import os
import sys
import time
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import ConfigError
from ..settings.choices import tracker_names
from ..settings.components import TrackerSettings

TRACKER_RUNS = "trackers.json"  # the tracker runs a resumed run continues
PROJECT = "grpo"  # the W&B / Trackio project (WANDB_PROJECT overrides it for W&B)


class TensorBoard:
    """Scalars under their metrics.jsonl keys, the config and completions as text; in output_dir/tensorboard."""
    package = "tensorboard"

    def __init__(self, output_dir: Path, run: dict):
        self.log_dir = output_dir / "tensorboard"

    def start(self, config: dict, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        # purge_step hides the steps a crashed run logged after its checkpoint: they are logged again.
        self.writer = SummaryWriter(str(self.log_dir), purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is None:
            self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```", 0)
        print(f"tensorboard: tensorboard --logdir {self.log_dir}", file=sys.stderr)

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # watched live: do not wait for the writer's 2-minute flush

    def log_completions(self, step: int, rows: list[dict]) -> None:
        columns = list(rows[0])
        table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        table += ["| " + " | ".join(_cell(row[c]).replace("\n", "<br>").replace("|", "\\|") for c in columns) + " |"
                  for row in rows]
        self.writer.add_text("completions", "\n".join(table), step)

    def finish(self, failed: bool) -> None:
        self.writer.close()


class Trackio:
    """Trackio's local store (`trackio show` opens its dashboard): the project `grpo`, the run named in
    trackers.json; completions as a table."""
    package = "trackio"

    def __init__(self, output_dir: Path, run: dict):
        self.name = run["name"]

    def start(self, config: dict, resume_step: int | None) -> None:
        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        self.trackio = trackio
        # Trackio cannot delete what it holds: a resumed run skips the (step, key) pairs already there
        # (resuming is exact: they hold the same values) and logs the rest.
        held = [] if resume_step is None else SQLiteStorage.get_logs(PROJECT, self.name)
        self.held = {(log["step"], key) for log in held for key in log}
        trackio.init(project=PROJECT, name=self.name, config=config, embed=False,
                     resume="never" if resume_step is None else "allow")

    def log(self, step: int, metrics: dict) -> None:
        metrics = {k: v for k, v in metrics.items() if (step, k) not in self.held}
        if metrics:
            self.trackio.log(metrics, step=step)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        self.log(step, {"completions": self.trackio.Table(*_table(rows))})

    def finish(self, failed: bool) -> None:
        self.trackio.finish()


class WandB:
    """W&B, offline unless logged in (WANDB_MODE wins), in output_dir/wandb; a resumed run continues its run id."""
    package = "wandb"

    def __init__(self, output_dir: Path, run: dict):
        self.output_dir, self.run_state = output_dir, run

    def start(self, config: dict, resume_step: int | None) -> None:
        import wandb
        run_id = self.run_state.setdefault("wandb_id", uuid.uuid4().hex[:8])  # W&B ids: [a-z0-9]
        mode = os.environ.get("WANDB_MODE") or (None if _wandb_logged_in() else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=self.run_state["name"],
                              id=run_id, resume="allow", config=config, dir=str(self.output_dir), mode=mode)
        self.wandb = wandb
        # A run resumed online holds its earlier steps and refuses them again (with a warning each): skip
        # them. Offline, `wandb sync` leaves them to the server, which keeps the first of each step.
        self.next_step = self.run.step
        if mode == "offline":
            print(f"wandb: offline (not logged in); upload with `wandb sync {self.run.dir.rsplit('/', 1)[0]}`",
                  file=sys.stderr)

    def log(self, step: int, metrics: dict) -> None:
        if step >= self.next_step:
            self.run.log(metrics, step=step)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        self.log(step, {"completions": self.wandb.Table(*_table(rows))})

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


TRACKER_CLASSES = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}


class Trackers:
    """The run's trackers and the console's sample of completions (rank 0's), a context manager around the
    training loop, which finishes the trackers however it ends."""

    def __init__(self, settings: TrackerSettings, is_main: bool):
        self.names, self.settings, self.is_main = tracker_names(settings.report_to), settings, is_main
        for name in self.names:
            if importlib.util.find_spec(package := TRACKER_CLASSES[name].package) is None:
                raise ConfigError(f"report_to={name} needs `pip install {package}` (or grpo[{name}])")
        self.trackers: list = []

    def start(self, output_dir: Path, config_dict: dict, step: int) -> None:
        """Open the trackers in the run's `output_dir`; a run resuming (`config_dict`'s resume_from_checkpoint, the
        run's own, here at `step`) continues their runs."""
        if not self.is_main or not self.names:
            return
        path = output_dir / TRACKER_RUNS
        resume_step = step if config_dict["resume_from_checkpoint"] and path.exists() else None
        run = json.loads(path.read_text()) if resume_step is not None else {}
        run.setdefault("name", f"{output_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.trackers = [TRACKER_CLASSES[name](output_dir, run) for name in self.names]
        for tracker in self.trackers:
            tracker.start(config_dict, resume_step)
        path.write_text(json.dumps(run, indent=2) + "\n")

    def log(self, step: int, line: dict) -> None:
        """A metrics.jsonl line (its `step` key is the step) to every tracker."""
        metrics = {k: v for k, v in line.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """With `log_completions`: print a sample of completions.jsonl's rows and send it to the trackers."""
        if not self.settings.log_completions or not self.is_main or not rows:
            return
        sample = rows[:self.settings.num_completions_to_print]  # None: all of them
        print_completions(step, sample)
        for tracker in self.trackers:
            tracker.log_completions(step, sample)

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        for tracker in self.trackers:
            tracker.finish(failed=error_type is not None)
        self.trackers = []


def print_completions(step: int, rows: list[dict]) -> None:
    """The sample as a table: rich's when it is installed, plain text otherwise. Chat prompts and completions
    show as their turns, one `role: content` line each (a tool call as `name(arguments)`)."""
    columns = [c for c in rows[0] if c != "step"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        lines = [f"completions at step {step}:"]
        for row in rows:
            lines += ["  " + "  ".join(f"{c}={_cell(row[c])}" for c in columns if not _is_chat(row[c]))]
            lines += [f"    {c}:\n" + "\n".join(f"      {t}" for t in _cell(row[c]).splitlines())
                      for c in columns if _is_chat(row[c])]
        tqdm.write("\n".join(lines))
        return
    texts = [c for c in columns if c in ("prompt", "completion")]
    table = Table(title=f"completions at step {step}", show_lines=True, expand=True)
    for c in texts:  # the texts take the width; the scores, one per line, keep theirs
        table.add_column(c, ratio=1, overflow="fold")
    table.add_column("scores", no_wrap=True)
    for row in rows:
        table.add_row(*(_cell(row[c]) for c in texts),
                      "\n".join(f"{c} {_cell(row[c])}" for c in columns if c not in texts))
    with tqdm.external_write_mode():  # keeps the progress bar below the table
        Console().print(table)


def _table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, data) for a tracker's table: numbers stay numbers, chat prompts become their JSON text."""
    data = [[v if isinstance(v, (int, float, str)) or v is None else json.dumps(v) for v in row.values()]
            for row in rows]
    return list(rows[0]), data


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if _is_chat(value):
        return "\n".join(_turn(message) for message in value)
    return "-" if value is None else str(value)


def _is_chat(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _turn(message: dict) -> str:
    """One chat message as a line: `role: content`, its tool calls as `name(arguments)`."""
    calls = [c.get("function", c) for c in message.get("tool_calls") or []]
    said = [str(message.get("content") or "")] + [f"{c.get('name')}({json.dumps(c.get('arguments'))})"
                                                   for c in calls]
    return f"{message['role']}: " + " ".join(part for part in said if part)


def _wandb_logged_in() -> bool:
    """An API key in the environment or in ~/.netrc (where `wandb login` puts it); no network call."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False
