"""How to read the metrics.jsonl of a run written before the metrics took TRL 1.16's names (`trl_names`).
Imports nothing heavy: `python -m grpo.plot` reads old runs through it without loading torch."""
from __future__ import annotations

# metrics.jsonl keys of runs written before the metrics took TRL's names -> TRL's name (`trl_names`)
RENAMED = {"reward/mean": "reward", "reward/std": "reward_std", "lr": "learning_rate", "perf/step_s": "step_time"}


def trl_names(line: dict) -> dict:
    """A metrics.jsonl line of an older run under today's keys, TRL's: RENAMED, and `reward/<f>(_std)` as
    `rewards/<f>/mean` (`/std`: those old stds were population stds, ddof 0). Today's lines stay as they are."""
    out = {}
    for key, value in line.items():
        if key in RENAMED:
            key = RENAMED[key]
        elif key.startswith("reward/"):
            name = key[len("reward/"):]
            key = f"rewards/{name[:-4]}/std" if name.endswith("_std") else f"rewards/{name}/mean"
        out[key] = value
    return out
