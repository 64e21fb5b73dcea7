"""The main job's step with its completions sampled on a vLLM server against our decode loop, side by side.

    bash .ci/vllm_venv.sh serve ~/.cache/grpo/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> 8000 /tmp/vllm-venv  # PID
    python benchmarks/vllm_step.py --url http://127.0.0.1:8000 --server-pid PID [--steps 2] [--out FILE.json]

Runs `recipes/word_problems.py` (SmolLM2-135M-Instruct, LoRA) for `--steps` optimizer steps through
`python -m grpo.train`, every completion forced to max_completion_length (128) tokens and no dynamic sampling,
so that both sides do the same work: first with `--use_vllm=true --vllm_mode=server` (the trainer pinned to
core 0 with one thread, the server's processes to core 1), then with our decode loop (pinned to both cores, two
threads): two cores each. Prints per configuration the mean step and sampling seconds (after the first step) and
the CPU seconds of the trainer and of the server's processes (/proc), and writes them as JSON."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the processes in process group `pgid` (a server started with setsid)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def pin_group(pgid: int, cores: str) -> None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    subprocess.run(["taskset", "-a", "-p", "-c", cores, entry.name], capture_output=True)
            except OSError:
                continue


def run(args: list[str], cores: str, threads: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["taskset", "-c", cores, sys.executable, "-m", "grpo.train", "recipes/word_problems.py",
                    f"--output_dir={out}", "--eval_on_start=false", "--eval_strategy=no", "--save_strategy=no",
                    *args], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = lines[1:] or lines
    return {"wall_s": wall, "trainer_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "step_s": sum(line["step_time"] for line in later) / len(later),
            "sampling_s": sum(line["perf/generate_s"] for line in later) / len(later),
            "logp_difference_mean": max(line.get("sampling/sampling_logp_difference/mean", 0.0) for line in lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--server-pid", type=int, required=True, help="the server's PID (its process group)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="vllm_step.json")
    a = parser.parse_args()
    steps = [f"--max_steps={a.steps}", "--stop_at_eos=false", "--dynamic_sampling=false"]
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        pin_group(a.server_pid, "1")
        server_before = group_cpu_seconds(a.server_pid)
        results["vllm server"] = run([*steps, "--use_vllm=true", "--vllm_mode=server",
                                      f"--vllm_server_base_url={a.url}"], "0", 1, Path(scratch) / "server")
        results["vllm server"]["server_cpu_s"] = group_cpu_seconds(a.server_pid) - server_before
        pin_group(a.server_pid, "0,1")
        results["decode loop"] = run(steps, "0,1", 2, Path(scratch) / "decode")
        results["decode loop"]["server_cpu_s"] = 0.0
    print(f"{'sampler':<12} {'step s':>8} {'sampling s':>11} {'trainer CPU s':>14} {'server CPU s':>13} {'wall s':>8}")
    for name, r in results.items():
        print(f"{name:<12} {r['step_s']:>8.1f} {r['sampling_s']:>11.1f} {r['trainer_cpu_s']:>14.1f} "
              f"{r['server_cpu_s']:>13.1f} {r['wall_s']:>8.1f}")
    ratio = results["vllm server"]["step_s"] / results["decode loop"]["step_s"]
    print(f"step time, server / decode loop: {ratio:.2f}x")
    Path(a.out).write_text(json.dumps({"steps": a.steps, "results": results, "step_ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
