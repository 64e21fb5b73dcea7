"""Where one GRPO step's time and memory go, by phase: sampling, rewards, old / reference log-probs, the
forward and the backward of each micro-batch, the optimizer step, and the rest.

The run is vs_trl.py's (the same random-weight Qwen2 model directory and Trainer settings), in a child process.
Each phase is a wrapper around the function that does it; per phase it records wall and CPU seconds and the
resident memory at entry and its peak inside the phase (Linux: VmHWM is reset at entry by writing 5 to
/proc/self/clear_refs, so each phase's peak is its own). "rest" is what the step spends outside the phases.
Step 1 is reported apart (start-up, the log-prob self-check); the table is the median of the later steps.

    OMP_NUM_THREADS=1 python benchmarks/profile_step.py --mode lora --gradient-checkpointing
    OMP_NUM_THREADS=1 python benchmarks/profile_step.py --mode full --optim adamw_8bit --bf16-weights
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from vs_trl import add_workload_arguments, rss_bytes  # noqa: E402 -- on the path from the line above

PHASES = ("sampling", "rewards", "old_logprobs", "ref_logprobs", "forward", "backward", "optimizer")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Recorder:
    """Per step, per phase: wall / CPU seconds, RSS at entry, peak RSS inside (VmHWM since the reset)."""

    def __init__(self):
        from grpo.run.logs import peak_rss_bytes

        self.peak_rss_bytes = peak_rss_bytes
        self.steps: list[dict] = [{}]
        self.step_start = (time.perf_counter(), time.process_time())
        self.active = None

    def wrap(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            if self.active is not None:  # nested (a forward inside a phase): counted in the outer one
                return fn(*args, **kwargs)
            self.active = phase
            entry = rss_bytes()
            reset_peak()
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = self.steps[-1].setdefault(phase, {"wall_s": 0.0, "cpu_s": 0.0, "entry_gb": entry / 1e9,
                                                        "peak_gb": 0.0, "calls": 0})
                row["wall_s"] += time.perf_counter() - t
                row["cpu_s"] += time.process_time() - c
                row["peak_gb"] = max(row["peak_gb"], self.peak_rss_bytes() / 1e9)
                row["calls"] += 1
                self.active = None
        return wrapper

    def end_step(self) -> None:
        wall, cpu = time.perf_counter() - self.step_start[0], time.process_time() - self.step_start[1]
        step = self.steps[-1]
        step["rest"] = {"wall_s": wall - sum(p["wall_s"] for p in step.values()),
                        "cpu_s": cpu - sum(p["cpu_s"] for p in step.values())}
        step["total"] = {"wall_s": wall, "cpu_s": cpu, "end_gb": rss_bytes() / 1e9}
        self.steps.append({})
        self.step_start = (time.perf_counter(), time.process_time())


def instrument(rec: Recorder) -> None:
    """Wrap the functions the Trainer calls for each phase (looked up at call time, so patching works)."""
    import grpo.rollout.source as source
    from grpo.policy.optim import Updates
    from grpo.policy.parallel import ParallelPolicy
    from grpo.policy.forwards import Policy
    from grpo.rollout.engines.sampling import Decoder

    sample, logprobs, reference = Decoder.__call__, Policy.logprobs, Policy.reference_logprobs
    Decoder.__call__ = rec.wrap("sampling", sample)
    Policy.reference_logprobs = rec.wrap("ref_logprobs", reference)

    def logprobs_by_caller(self, rollout, with_entropy=False):  # generate(): old log-probs; accumulate(): forward
        phase = "forward" if with_entropy else "old_logprobs"
        return rec.wrap(phase, logprobs)(self, rollout, with_entropy)
    Policy.logprobs = logprobs_by_caller
    ParallelPolicy.backward = rec.wrap("backward", ParallelPolicy.backward)
    source.compute_rewards = rec.wrap("rewards", source.compute_rewards)
    apply = Updates.apply

    def apply_and_mark(*args, **kwargs):
        out = rec.wrap("optimizer", apply)(*args, **kwargs)
        rec.end_step()
        return out
    Updates.apply = apply_and_mark


def child(spec: dict) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(spec["threads"])
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401

    import grpo.trainer  # noqa: F401
    from vs_trl import run_ours

    baseline = rss_bytes()
    rec = Recorder()
    instrument(rec)
    with tempfile.TemporaryDirectory() as output_dir:
        rec.step_start = (time.perf_counter(), time.process_time())
        run_ours(spec, output_dir)  # vs_trl.py's run of this trainer, unchanged
    return {"baseline_gb": baseline / 1e9, "steps": rec.steps[:-1]}


def summarize(steps: list[dict]) -> dict:
    later = steps[1:] or steps
    out = {}
    for phase in (*PHASES, "rest", "total"):
        rows = [s[phase] for s in later if phase in s]
        if rows:
            out[phase] = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "calls"}
    return out


def print_table(result: dict) -> None:
    table, total = result["median"], result["median"]["total"]
    print(f"\n{result['label']}: median of steps 2..{len(result['steps'])} (baseline after imports "
          f"{result['baseline_gb']:.2f} GB; step 1: {result['steps'][0]['total']['wall_s']:.1f} s wall)")
    print(f"{'phase':<13} {'wall s':>7} {'cpu s':>7} {'cpu %':>6} {'entry GB':>9} {'peak GB':>8} {'phase adds':>10}")
    for phase, row in table.items():
        if phase == "total":
            continue
        entry, peak = row.get("entry_gb"), row.get("peak_gb")
        mem = f"{entry:>9.3f} {peak:>8.3f} {peak - entry:>10.3f}" if entry is not None else f"{'':>9} {'':>8} {'':>10}"
        share = 100 * row['cpu_s'] / total['cpu_s']
        print(f"{phase:<13} {row['wall_s']:>7.2f} {row['cpu_s']:>7.2f} {share:>5.0f}% {mem}")
    peak = max(r["peak_gb"] for r in table.values() if "peak_gb" in r)
    print(f"{'step':<13} {total['wall_s']:>7.2f} {total['cpu_s']:>7.2f}   100% {'':>9} {peak:>8.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="lora", choices=["full", "lora"])
    p.add_argument("--bf16-weights", action="store_true", help="full fine-tuning with bf16 weights")
    add_workload_arguments(p, steps=3)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from random_models import qwen2_config, save_model_dir

    arch = qwen2_config(args.vocab_size, args.hidden_size, args.num_layers)
    name = f"vs_trl_model_v{args.vocab_size}_h{args.hidden_size}_l{args.num_layers}"
    model_dir = save_model_dir(RESULTS / name, arch)
    spec = dict(model_dir=str(model_dir), steps=args.steps, num_generations=args.num_generations,
                completion_length=args.completion_length, beta=args.beta, optim=args.optim,
                bf16_weights=args.bf16_weights, gradient_checkpointing=args.gradient_checkpointing,
                threads=args.threads, lora=args.mode == "lora", cuda=False, prompts_per_step=1, num_prompts=args.steps)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        sys.exit(f"profiled run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    label = (f"{args.mode}{'-bf16' if args.bf16_weights else ''}_{args.optim}"
             f"{'_gc' if args.gradient_checkpointing else ''}")
    result.update(label=label, spec=spec, median=summarize(result["steps"]), load_average=os.getloadavg(),
                  created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print_table(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"profile_{label}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
