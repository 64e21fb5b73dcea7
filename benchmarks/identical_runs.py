"""Behaviour-preserving changes, checked: short runs of one grpo tree against those of another must
write the same metrics.jsonl (timings and memory aside: perf/*, memory/*, eval/seconds, async/wait_s), the same
completions.jsonl and, bit for bit, the same final weights and step.

    python benchmarks/identical_runs.py run --tree /work/baseline-tree --out /work/baseline-runs
    python benchmarks/identical_runs.py run --tree . --out /tmp/after-runs
    python benchmarks/identical_runs.py compare /work/baseline-runs /tmp/after-runs \
        --json benchmarks/results/identical_runs.json

With `run --fixed`, each run's recipe goes through benchmarks/fixed_completions.py (this script's copy, the same
for both trees): a rollout_func's fixed completions in place of sampling, for trees that sample otherwise.

The runs (each `python -m grpo.train` with PYTHONPATH and cwd the tree, so its grpo and recipes are used):
  full        recipes/tiny.py, full fine-tuning, 8 steps, KL (beta 0.04), 2 micro-batches per step
  lora        recipes/tiny.py, LoRA, 8 steps, num_iterations=2, 8-bit AdamW, KL (beta 0.04)
  arithmetic  recipes/arithmetic_tiny.py as it is (warm start, 60 steps, greedy eval every 10 steps)
  async       the lora run with async_generation=True (a sampler process one step ahead, max_staleness 1)
  ranks2      the full run on 2 ranks (torchrun, gloo; DDP), each rank half of each step's prompts
  server      benchmarks/server_recipe.py: sampled by a real vLLM server (GRPO_VLLM_URL, GRPO_VLLM_MODEL; skipped
              without them), LoRA, 8 steps
`--runs` picks some of them (default: all); `compare` compares the runs both folders hold.
Every process runs on one thread (OMP/MKL): float sums depend on the thread count, so both sides must
share it. Exit status of `compare`: 0 when every run is identical, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

TINY = ["--max_steps=8", "--save_steps=4", "--save_total_limit=1", "--logging_steps=1", "--beta=0.04"]
RUNS = {
    "full": ["recipes/tiny.py", *TINY, "--use_lora=false", "--per_device_train_batch_size=8",
             "--gradient_accumulation_steps=2"],
    "lora": ["recipes/tiny.py", *TINY, "--use_lora=true", "--num_iterations=2", "--optim=adamw_8bit"],
    "arithmetic": ["recipes/arithmetic_tiny.py"],
    "async": ["recipes/tiny.py", *TINY, "--use_lora=true", "--num_iterations=2", "--optim=adamw_8bit",
              "--async_generation=true"],
    "ranks2": ["recipes/tiny.py", *TINY, "--use_lora=false", "--per_device_train_batch_size=8"],
    "server": [str(Path(__file__).resolve().parent / "server_recipe.py"), *TINY],
}
NEEDS = {"server": ("GRPO_VLLM_URL", "GRPO_VLLM_MODEL")}  # a run skipped without these in the environment
LAUNCH = {"ranks2": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]}  # else one process
IGNORED = ("perf/", "memory/")
CLOCKS = {"eval/seconds", "step_time", "async/wait_s"}  # wall-clock values outside perf/ (step_time: TRL's name)


FIXED = Path(__file__).resolve().parent / "fixed_completions.py"


def run(tree: Path, out: Path, fixed: bool = False, names: list[str] | None = None) -> None:
    tree, out = tree.resolve(), out.resolve()
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    found = subprocess.run([sys.executable, "-c", "import grpo; print(grpo.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree):
        sys.exit(f"error: grpo imported from {found}, not from {tree}")
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    for name in names or RUNS:
        if not all(os.environ.get(key) for key in NEEDS.get(name, ())):
            print(f"{name}: skipped, set {' and '.join(NEEDS[name])}", flush=True)
            continue
        if fixed and name == "server":
            print(f"{name}: skipped with --fixed (the server samples)", flush=True)
            continue
        recipe, *args = RUNS[name]
        if fixed:
            env["GRPO_BASE_RECIPE"], recipe = recipe, str(FIXED)
        cmd = [sys.executable, *LAUNCH.get(name, []), "-m", "grpo.train", recipe, *args, f"--output_dir={out / name}"]
        print(f"{name}: {' '.join(cmd[1:])}", flush=True)
        cpu0, t0 = _children_cpu(), time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
        timings[name] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit": rc, "command": cmd[1:]}
        print(f"  {timings[name]['wall_s']} s wall, {timings[name]['cpu_s']} s CPU, exit {rc}", flush=True)
        if rc:
            sys.exit(f"error: run {name} failed, see {out / f'{name}.log'}")
    (out / "timings.json").write_text(json.dumps({"tree": str(tree), "runs": timings}, indent=2))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def metrics_lines(path: Path) -> list[str]:
    """Each line as canonical JSON without timings and memory (NaN compares equal to NaN as text)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [{k: v for k, v in line.items() if not (k.startswith(IGNORED) or k in CLOCKS)} for line in lines]
    return [json.dumps(line, sort_keys=True) for line in kept]


def final_checkpoint(run_dir: Path) -> Path:
    done = [p for p in run_dir.glob("checkpoint-*") if (p / "COMPLETE").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]))


def tensors(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state.update({f"{shard.name}:{k}": v for k, v in load_file(shard).items()})
    return state


def compare_run(a: Path, b: Path) -> dict:
    import torch

    ma, mb = metrics_lines(a / "metrics.jsonl"), metrics_lines(b / "metrics.jsonl")
    first = next((i for i, (x, y) in enumerate(zip(ma, mb)) if x != y), None)
    if first is None and len(ma) != len(mb):
        first = min(len(ma), len(mb))
    ca, cb = (p.read_bytes() for p in (a / "completions.jsonl", b / "completions.jsonl"))
    ka, kb = final_checkpoint(a), final_checkpoint(b)
    ta, tb = tensors(ka), tensors(kb)
    differing = sorted(set(ta) ^ set(tb))
    differing += [k for k in sorted(set(ta) & set(tb))  # torch.equal: same shape and values, exactly
                  if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    steps = [torch.load(k / "trainer_state.pt", weights_only=False)["step"] for k in (ka, kb)]
    result = {
        "metrics_lines": [len(ma), len(mb)], "metrics_first_difference": first,
        "metrics_equal": first is None,
        "completions_lines": [ca.count(b"\n"), cb.count(b"\n")], "completions_equal": ca == cb,
        "checkpoints": [ka.name, kb.name], "tensors": len(ta), "tensors_differing": differing,
        "steps": steps, "steps_equal": steps[0] == steps[1] and ka.name == kb.name,
    }
    if not result["metrics_equal"] and first < min(len(ma), len(mb)):
        result["metrics_first_pair"] = [json.loads(ma[first]), json.loads(mb[first])]
    result["identical"] = (result["metrics_equal"] and result["completions_equal"] and not differing
                           and result["steps_equal"] and len(ta) > 0)
    return result


def compare(a: Path, b: Path, json_path: Path | None) -> int:
    results = {name: compare_run(a / name, b / name) for name in RUNS if (a / name).is_dir() and (b / name).is_dir()}
    print(f"{'run':<11} {'metrics lines':<15} {'completions':<14} {'tensors':<16} {'step':<8} verdict")
    for name, r in results.items():
        metrics = f"{r['metrics_lines'][0]} " + ("equal" if r["metrics_equal"]
                                                 else f"diff@{r['metrics_first_difference']}")
        completions = f"{r['completions_lines'][0]} " + ("equal" if r["completions_equal"] else "DIFFER")
        weights = f"{r['tensors'] - len(r['tensors_differing'])}/{r['tensors']} equal"
        step = str(r["steps"][0]) if r["steps_equal"] else f"{r['steps'][0]}!={r['steps'][1]}"
        print(f"{name:<11} {metrics:<15} {completions:<14} {weights:<16} {step:<8} "
              f"{'identical' if r['identical'] else 'DIFFERENT'}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"a": str(a), "b": str(b), "runs": results}, indent=2))
    return 0 if all(r["identical"] for r in results.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="the runs with the grpo of --tree, into --out/RUN")
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fixed", action="store_true", help="fixed completions (a rollout_func) instead of sampling")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), help="some of the runs (default: all)")
    p = sub.add_parser("compare", help="compare two --out folders; exit 1 on any difference")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--json", type=Path, help="also write the comparison here (benchmarks/results/: ignored)")
    args = parser.parse_args()
    if args.command == "run":
        run(args.tree, args.out, args.fixed, args.runs)
        return 0
    return compare(args.a, args.b, args.json)


if __name__ == "__main__":
    sys.exit(main())
