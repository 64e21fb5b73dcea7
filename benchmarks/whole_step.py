"""Whole steps of the README's main job (recipes/word_problems.py) in two trees at once, at the shapes of a trained
model: a word-problems checkpoint's adapter is merged into the base model first, so that the completions already
have the format (30-60 tokens) and the step's prompt share is the trained job's. Both trees run the baseline tree's
recipe file (the same settings and data) on that model (`--model=`), one pinned core each, OMP_NUM_THREADS=1, the
same seed.

    git archive 604ae52 | tar -x -C /tmp/base604; git archive HEAD | tar -x -C /tmp/new
    python benchmarks/whole_step.py --checkpoint runs/word_problems/checkpoint-60 --trees /tmp/base604 /tmp/new

Sampled completions and so rewards differ between trees: a step whose groups all have equal rewards trains no
row (it only samples), one with half of them trains half. The table sorts the steps by that share, so that
steps of equal work are compared; step 1 (first-step checks, warm-up) is left out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def merge(checkpoint: Path, out: Path) -> None:
    """The checkpoint's LoRA adapter merged into the recipe's base model, saved with its tokenizer."""
    from grpo.eval import load_checkpoint
    from grpo.settings.recipe import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "word_problems.py"))
    model, tokenizer = load_checkpoint(checkpoint, lambda: recipe.resolve_model(recipe.config), recipe.config)
    model.merge_and_unload().save_pretrained(out)
    tokenizer.save_pretrained(out)


def run(tree: Path, recipe: Path, core: int, model: Path, steps: int, out: Path) -> subprocess.Popen:
    command = ["/usr/bin/time", "-f", "cpu_s %U %S rss_kb %M", "taskset", "-c", str(core), sys.executable, "-m",
               "grpo.train", str(recipe), f"--model={model}", f"--max_steps={steps}",
               "--eval_on_start=false", "--eval_limit=1", f"--output_dir={out}", "--seed=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    with open(out / "log", "w") as log:  # the child writes through its own copy of the handle
        return subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)


def read(out: Path) -> dict:
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    usage = (out / "log").read_text().strip().splitlines()[-1].split()
    return {"cpu_s": float(usage[1]) + float(usage[2]), "peak_gb": int(usage[4]) * 1024 / 1e9,
            "steps": [{"step": m["step"], "step_s": m["step_time"], "generate_s": m["perf/generate_s"],
                       "skipped": m["skipped/zero_gradient"], "mean_length": m["completions/mean_length"]}
                      for m in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a word-problems run's checkpoint folder")
    parser.add_argument("--trees", type=Path, nargs=2, required=True, help="baseline tree, new tree")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "whole_step.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="whole_step_"))
    merge(args.checkpoint, work / "model")
    outs = [work / f"run{i}" for i in (0, 1)]
    for out in outs:
        out.mkdir()
    recipe = args.trees[0].resolve() / "recipes" / "word_problems.py"
    procs = [run(tree, recipe, core, work / "model", args.steps, out)
             for tree, core, out in zip(args.trees, args.cores, outs)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a run failed: see {work}/run*/log")
    results = {str(tree): read(out) for tree, out in zip(args.trees, outs)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"command": " ".join(sys.argv), "runs": results}, indent=1))
    base, new = results.values()
    print("| rows trained | baseline s/step (steps) | new s/step (steps) | ratio |\n|---|---|---|---|")
    for share in sorted({1 - s["skipped"] for r in (base, new) for s in r["steps"][1:]}, reverse=True):
        times = [[s["step_s"] for s in r["steps"][1:] if 1 - s["skipped"] == share] for r in (base, new)]
        if all(times):
            b, n = (statistics.median(t) for t in times)
            print(f"| {share:.0%} | {b:.1f} ({len(times[0])}) | {n:.1f} ({len(times[1])}) | {n / b:.2f}x |")
    print(f"| whole process CPU s | {base['cpu_s']:.1f} | {new['cpu_s']:.1f} | {new['cpu_s'] / base['cpu_s']:.2f}x |")
    print(f"| peak RSS GB | {base['peak_gb']:.2f} | {new['peak_gb']:.2f} | {new['peak_gb'] / base['peak_gb']:.2f}x |")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
