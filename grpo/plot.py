"""`python -m grpo.plot OUTPUT_DIR`: PNG curves from OUTPUT_DIR/metrics.jsonl, written next to it: one per panel
the run has data for (`panels`) and curves.png with all of them. Noisy per-step curves are drawn faint with a
moving average on top. Runs written before the metrics took TRL's names are read under those names
(run/metric_names.py). Needs matplotlib: `pip install -e ".[plot]"`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .run.metric_names import trl_names

USAGE = "usage: python -m grpo.plot OUTPUT_DIR"


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [trl_names(json.loads(line)) for line in f if line.strip()]


def series(lines: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the lines that have `key`."""
    points = [(line["step"], line[key]) for line in lines if key in line]
    return [s for s, _ in points], [v for _, v in points]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def panels(lines: list[dict]) -> list[tuple[str, str, str, list[str], bool]]:
    """(file name, title, y label, keys, smoothed) of each panel this run has data for; each becomes one
    PNG and one panel of curves.png."""
    logged = list(dict.fromkeys(k for line in lines for k in line))  # in the order the run logged them
    rewards = sorted(k for k in logged if k.startswith("rewards/") and k.endswith("/mean"))  # each function's mean
    by = [k for k in logged if k.startswith("eval/") and "=" in k  # eval/<column>=<value>/accuracy, free_accuracy
          and k.endswith(("/accuracy", "/free_accuracy"))]
    found = [
        ("reward.png", "reward (training samples)", "reward", ["reward", *rewards], True),
        ("kl.png", "KL to the reference", "k3 KL", ["kl"], True),
        ("completion_length.png", "completion length", "tokens", ["completions/mean_length", "eval/length_mean"], True),
        ("loss.png", "loss", "loss", ["loss", "loss/policy"], True),
        ("grad_norm.png", "gradient norm (before clipping)", "L2 norm", ["grad_norm"], True),
        ("entropy.png", "token entropy", "nats", ["entropy"], True),
        ("clip_ratio.png", "tokens clipped", "share of tokens",
         ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio"], True),
        ("frac_reward_zero_std.png", "groups whose rewards all agree (no signal)", "share of groups",
         ["frac_reward_zero_std"], True),
        ("learning_rate.png", "learning rate", "learning rate", ["learning_rate"], False),
        ("tools.png", "tool calls", "per completion / share failed",
         ["tools/call_frequency", "tools/failure_frequency"], True),
        ("eval.png", "held-out greedy pass@1", "share of prompts",
         ["eval/accuracy", "eval/free_accuracy", "eval/format"], False),
        ("eval_breakdown.png", f"held-out greedy pass@1 by {by[0][5:].partition('=')[0] if by else ''}",
         "share of prompts", by, False),
    ]
    drawn = [(name, title, ylabel, [k for k in keys if worth_drawing(lines, k)], smoothed)
             for name, title, ylabel, keys, smoothed in found]
    return [panel for panel in drawn if panel[3]]


def worth_drawing(lines: list[dict], key: str) -> bool:
    """Logged at all; and for the KL, not 0 throughout (beta = 0 runs have no reference)."""
    _, values = series(lines, key)
    return bool(values) and (key != "kl" or any(values))


def draw(ax, lines: list[dict], title: str, ylabel: str, keys: list[str], smoothed: bool) -> None:
    for key in keys:
        steps, values = series(lines, key)
        if smoothed and not key.startswith("eval/") and len(values) > 10:
            (line,) = ax.plot(steps, values, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(values, max(2, len(values) // 20)), color=line.get_color(), label=key)
        else:
            ax.plot(steps, values, marker="o", markersize=4, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot(output_dir: Path) -> list[Path]:
    """Write the PNGs for the run in `output_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    lines = read_metrics(output_dir / "metrics.jsonl")
    found, written = panels(lines), []
    for name, *spec in found:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, lines, *spec)
        fig.tight_layout()
        fig.savefig(output_dir / name, dpi=100)
        plt.close(fig)
        written.append(output_dir / name)
    cols = 2 if len(found) > 1 else 1
    rows = (len(found) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (_, *spec) in zip(axes.flat, found):
        draw(ax, lines, *spec)
    for ax in list(axes.flat)[len(found):]:
        ax.axis("off")
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    fig.savefig(output_dir / "curves.png", dpi=100)
    plt.close(fig)
    return written + [output_dir / "curves.png"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    metrics = Path(argv[0]) / "metrics.jsonl"
    if not metrics.exists():
        print(f"error: no metrics.jsonl in {argv[0]}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('error: grpo.plot needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)',
              file=sys.stderr)
        return 2
    for path in plot(Path(argv[0])):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
