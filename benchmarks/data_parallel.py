"""Data parallel vs one process: the same 2 GRPO steps (fixed rollout, same global batch) trained by 1 process
and by N ranks under torchrun with DDP and with FSDP2; prints the largest weight difference to the 1-process
run, the step time and the peak memory of the largest rank.

    python benchmarks/data_parallel.py                                   # CPU, gloo, the tests' tiny model
    python benchmarks/data_parallel.py --device cuda --model 1024x16     # N GPUs, NCCL (the GPU check)

The runs are tests/distributed_worker.py's (float32 unless --bf16). The ranks sum the same gradients in another
order, and AdamW magnifies that rounding where a gradient nearly cancels: on CPU expect ~1e-5 (8.1e-6 on a Xeon),
within tests/tolerances.adamw_rounding's 2e-4 for these 2 steps at lr 1e-2; more under bf16."""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"
RESULTS = ROOT / "benchmarks" / "results" / "data_parallel.json"


def run(command: list[str], env: dict, timeout: int) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def summary(run_dir: Path, reference: dict | None) -> dict:
    (path,) = glob.glob(str(run_dir / "checkpoint-2" / "*.safetensors"))
    weights = load_file(path)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    diff = None if reference is None else max((weights[k] - reference[k]).abs().max().item() for k in reference)
    return {"max_abs_weight_diff": diff, "step_s": last["step_time"], "peak_gb": last["memory/peak_gb"],
            "grad_norm": last["grad_norm"], "loss": last["loss"], "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks for torchrun")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--model", default="", help="HIDDENxLAYERS of a random Qwen2 model (default: tiny)")
    parser.add_argument("--bf16", action="store_true",
                        help="the bf16 plan (autocast, FSDP mixed precision; on CPU too)")
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp(prefix="grpo_dp_"))
    overrides = f"--bf16={str(args.bf16).lower()}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           "GRPO_WORKER_DEVICE": args.device, "GRPO_WORKER_MODEL": args.model, "GRPO_WORKER_OVERRIDES": overrides}
    # The 1-process reference takes the global batch: per_device_train_batch_size=4 (1 prompt x 4) on each of N ranks.
    single_env = {**env, "GRPO_WORKER_OVERRIDES": f"{overrides} --per_device_train_batch_size={4 * args.nproc}"}
    run([sys.executable, str(WORKER), str(out), "fixed_single"], single_env, args.timeout)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
         str(WORKER), str(out), "fixed_ddp", "fixed_fsdp"], env, args.timeout)

    single = summary(out / "fixed_single", None)
    rows = {"1 process": single}
    for name, label in (("fixed_ddp", f"{args.nproc} ranks DDP"), ("fixed_fsdp", f"{args.nproc} ranks FSDP2")):
        rows[label] = summary(out / name, single["weights"])
    print(f"device={args.device} model={args.model or 'tiny'} bf16={args.bf16} (2 steps, global batch "
          f"{2 * args.nproc} prompts x 4 completions)")
    print(f"{'run':<18} {'max |dw| vs 1 proc':>19} {'step s':>8} {'peak GB':>8} {'grad_norm':>10}")
    for label, r in rows.items():
        diff = "-" if r["max_abs_weight_diff"] is None else f"{r['max_abs_weight_diff']:.2e}"
        print(f"{label:<18} {diff:>19} {r['step_s']:>8.3f} {r['peak_gb']:>8.3f} {r['grad_norm']:>10.6f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "runs": {label: {k: v for k, v in r.items() if k != "weights"}
                                                                for label, r in rows.items()}}, indent=2))
    print(f"wrote {RESULTS}")
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
