"""Does GRPO learn? The offline arithmetic recipe on several seeds: held-out greedy pass@1 right after the
supervised warm start (GRPO step 0) and after GRPO, per seed, with each run's wall time.

    python benchmarks/learning.py                       # seeds 0 1 2, the recipe as shipped
    python benchmarks/learning.py --seeds 3 --max_steps=100

Each seed runs `python -m grpo.train recipes/arithmetic_tiny.py --seed=S` in a subprocess (extra `--key=value`
arguments are passed on); the table and benchmarks/results/learning.json report before, after and the gain.
Target: after >= before + 0.20 on every seed."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TARGET_GAIN = 0.20


def run_seed(recipe: str, seed: int, overrides: list[str]) -> dict:
    out = RESULTS / "learning" / f"seed-{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run refuses a folder holding an earlier run
    cmd = [sys.executable, "-m", "grpo.train", recipe, f"--seed={seed}", f"--output_dir={out}", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall_s = time.perf_counter() - t0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval/accuracy" in line]
    if len(evals) < 2 or evals[0]["step"] != 0:
        raise RuntimeError(f"seed {seed}: expected eval lines at step 0 and later in {out}/metrics.jsonl")
    first, last = evals[0], evals[-1]
    return {"seed": seed, "before": first["eval/accuracy"], "after": last["eval/accuracy"],
            "gain": last["eval/accuracy"] - first["eval/accuracy"], "format_before": first.get("eval/format"),
            "format_after": last.get("eval/format"), "grpo_steps": last["step"],
            "eval_prompts": int(last["eval/num_examples"]), "wall_s": wall_s, "output_dir": str(out)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/arithmetic_tiny.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args, overrides = parser.parse_known_args()
    rows = [run_seed(args.recipe, seed, overrides) for seed in args.seeds]
    print(f"\nheld-out greedy pass@1 at GRPO step 0 (right after the warm start) and at the end, {args.recipe}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} now")
    print(f"{'seed':>4} {'before':>7} {'after':>7} {'gain':>7} {'format':>13} {'wall':>7}")
    for r in rows:
        fmt = f"{r['format_before']:.2f}->{r['format_after']:.2f}" if r["format_before"] is not None else "-"
        print(f"{r['seed']:>4} {r['before']:>7.3f} {r['after']:>7.3f} {r['gain']:>+7.3f} {fmt:>13} "
              f"{r['wall_s']:>6.0f}s")
    passed = all(r["gain"] >= TARGET_GAIN for r in rows)
    print(f"target: gain >= {TARGET_GAIN:+.2f} on every seed: {'met' if passed else 'NOT met'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "learning.json"
    out.write_text(json.dumps({"recipe": args.recipe, "overrides": overrides, "decoding": "greedy",
                               "target_gain": TARGET_GAIN, "passed": passed, "runs": rows,
                               "load_average": os.getloadavg()}, indent=2))
    print(f"wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
