"""What only a GPU can show, in one command and at most 8 minutes on one CUDA GPU, with nothing downloaded
(random-weight models of the architectures the planner knows, the offline `wide_tokenizer`):

  memory    the planner's rows for 0.5B and 1B (every column) and 3B LoRA at the write-up's settings:
            predicted vs measured `torch.cuda.max_memory_allocated`, 2 optimizer steps each (sampling replaced by
            random full-length completions: generation is never the peak there);
  step      one real GRPO step of recipes/gsm8k_lora.py (Llama-3.2-1B, LoRA, 8-bit AdamW, checkpointing, G=4,
            256 + 786 tokens, 4 micro-batches, EOS off): seconds of generate / reference log-probs / log-probs /
            backward / optimizer, decode tokens per second, peak memory while sampling and overall vs the planner;
  qlora, full-8bit   one real step each (0.5B, 128-token completions): finite loss, every trainable tensor
            updated, every tensor in the dtype of the bf16 plan (policy/precision.py), 8-bit optimizer states;
  resume    2 steps straight vs 1 + crash + resume + 1 under torch.use_deterministic_algorithms: bit-identical
            weights, metrics and completions (LoRA and full fine-tuning);
  oom       `python -m grpo.train` with an impossible micro-batch: the planner's advice, exit 1, no traceback;
  shared    the shared-prompt forward (each prompt once; completions padded or packed into one row) against whole
            rows, float32, Qwen2.5-0.5B architecture with LoRA, 2 prompts of 256 x 4 completions of 100..786 tokens,
            under sdpa and flash-attention (when installed): log-prob and gradient differences, seconds, peak.

    python benchmarks/gpu_check.py                       # everything; benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --only resume oom     # some checks
    python benchmarks/gpu_check.py --device cpu --tiny   # rehearse the script itself on CPU (small models)

It prints a table and exits 1 if any check fails. Without CUDA (and without --device cpu) it says so in one
line and exits 0. Each check runs in its own process (a clean peak-memory counter; one crash fails one check).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "benchmarks" / "gpu_check_child.py"
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
MEMORY_TOLERANCE = 0.15  # |predicted - measured| / measured, as benchmarks/gpu_memory.py targets
# float32 on a GPU: the layouts run different attention kernels (masked or not), which round differently
SHARED_LOGPROB_TOLERANCE = 1e-3  # largest absolute log-prob difference from whole rows
SHARED_GRAD_TOLERANCE = 1e-3  # largest gradient difference, relative to the tensor's largest gradient
# name: (child arguments, seconds it may take on one GPU); the budget shrinks each later one.
CHECKS = {  # the timed step first: its figures matter most; the memory rows last: a late one can be cut
    "step": [(["step"], 150)],
    "resume": [(["resume", "lora"], 45), (["resume", "full"], 45)],
    "oom": [(None, 45)],
    "shared": [(["shared"], 60)],
    "qlora": [(["one_step", "qlora"], 60)],
    "full-8bit": [(["one_step", "full"], 60)],
    "memory": [(["memory", "0.5B", "full", "+8-bit", "+ckpt", "LoRA", "QLoRA"], 90),
               (["memory", "1B", "full", "+8-bit", "+ckpt", "LoRA", "QLoRA"], 120), (["memory", "3B", "LoRA"], 60)],
}
OOM_RECIPE = '''
import sys
sys.path.insert(0, {bench!r})
import torch
from datasets import Dataset
from grpo import Config
from gpu_check_child import LLAMA_1B, architecture, checksum, random_model

config = Config(model=LLAMA_1B, output_dir={out!r}, use_lora=True, gradient_checkpointing=True, stop_at_eos=False,
                num_generations=4, max_prompt_length=256, max_completion_length=786, per_device_train_batch_size=16384)
reward_funcs = [checksum]
train_dataset = Dataset.from_list([{{"prompt": "x" * 256}}] * 4096)


def build_model(config):
    model, tokenizer = random_model(architecture(LLAMA_1B, {tiny}), torch.bfloat16)
    if not torch.cuda.is_available():  # the CPU rehearsal: no allocator limit to hit, so stand in for CUDA's error
        def out_of_memory(*_):
            raise torch.OutOfMemoryError("CUDA out of memory (CPU stand-in). Tried to allocate 512.00 GiB")
        model.model.register_forward_pre_hook(out_of_memory)
    return model, tokenizer
'''


# --- judging recorded results (pure: tests/unit/test_gpu_check.py) ---------------------------------------------


def judge(name: str, result: dict, device: str = "cuda") -> list[str]:
    """Why the check `name` failed on `result` (a child's measurements); empty when it passed."""
    if "error" in result:
        return [result["error"]]
    cuda = device == "cuda"
    if name == "memory":
        return [f"{r['model']} {r['column']}: {why}" for r in result["rows"] for why in judge_memory_row(r, cuda)]
    problems = list(result.get("dtype_problems", []))
    if "loss" in result and not math.isfinite(result["loss"]):
        problems.append(f"loss {result['loss']}")
    if "changed_fraction" in result and result["changed_fraction"] < 1:
        problems.append(f"only {result['changed_fraction']:.0%} of the trainable tensors were updated")
    if name == "step" and cuda:
        for key, predicted in (("peak_gb", "predicted_gb"), ("generation_peak_gb", "predicted_generation_gb")):
            off = off_by(result[predicted], result[key])
            if off is None or abs(off) > MEMORY_TOLERANCE:
                problems.append(f"{key} {result[key]} GB vs predicted {result[predicted]:.2f} GB")
    if name == "full-8bit" and cuda and result["int8_states"] == 0:
        problems.append("no 8-bit optimizer state")
    if name == "resume":
        problems += [f"{result['differing_tensors']} tensors differ, e.g. {result['first_differing']}"] \
            if result["differing_tensors"] else []
        problems += [] if result["metrics_equal"] else ["metrics.jsonl lines differ"]
        problems += [] if result["completions_equal"] else ["completions.jsonl differs"]
        problems += [] if result["steps"] == [1, 2] else [f"logged steps {result['steps']}"]
    if name == "oom":
        problems += judge_oom(result)
    if name == "shared":
        problems += [f"{r['attention']} {r['layout']}: {what} {r[key]:.2g} > {bound:g}" for r in result["rows"]
                     for what, key, bound in (("log-prob error", "logprob_error", SHARED_LOGPROB_TOLERANCE),
                                              ("gradient error", "grad_error", SHARED_GRAD_TOLERANCE))
                     if not r[key] <= bound]
    return problems


def judge_memory_row(row: dict, cuda: bool) -> list[str]:
    if row.get("skipped"):
        return []
    if row.get("error"):
        return [row["error"]]
    if not cuda:
        return []  # the CPU rehearsal has no CUDA peak to compare
    off = off_by(row["predicted_gb"], row.get("measured_gb"))
    return [] if off is not None and abs(off) <= MEMORY_TOLERANCE else [f"predicted {off:+.0%} off the measured peak"
                                                                         if off is not None else "nothing measured"]


def judge_oom(result: dict) -> list[str]:
    err, problems = result["stderr"], []
    if result["returncode"] != 1:
        problems.append(f"exit status {result['returncode']}, not 1")
    for needed in ("error: out of GPU memory", "settings that need less memory:",
                   "memory plan for this configuration:"):
        if needed not in err:
            problems.append(f"no {needed!r} line")
    if "Traceback" in err:
        problems.append("a traceback")
    return problems


def off_by(predicted: float, measured: float | None) -> float | None:
    """(predicted - measured) / measured."""
    return None if not measured else (predicted - measured) / measured


def summary(name: str, result: dict) -> str:
    """The check's figures in one line."""
    if "error" in result:
        return ""
    if name == "shared":
        rows = (f"{r['attention']} {r['layout']} err {r['logprob_error']:.1g}/{r['grad_error']:.1g}, "
                f"{r['seconds']:.2f}/{r['whole_seconds']:.2f} s, {fmt(r['peak_gb'])}/{fmt(r['whole_peak_gb'])} GB"
                for r in result["rows"])
        return "; ".join(rows) + " (vs whole rows)"
    if name == "memory":
        return "; ".join(f"{r['model']} {r['column']} {r['predicted_gb']:.2f}/{fmt(r.get('measured_gb'))}"
                         for r in result["rows"]) + " GB (predicted/measured)"
    if name == "step":
        s = result["seconds"]
        split = ", ".join(f"{k} {v:.1f}" for k, v in s.items())
        return (f"step {result['step_s']:.1f} s ({split}); decode {result['tokens_per_s']:.0f} tokens/s; peak "
                f"{fmt(result['peak_gb'])} GB (predicted {result['predicted_gb']:.2f}), while sampling "
                f"{fmt(result['generation_peak_gb'])} (predicted {result['predicted_generation_gb']:.2f})")
    if name in ("qlora", "full-8bit"):
        return (f"loss {result['loss']:.4g}, kl {result['kl']:.3g}, step {result['step_s']:.1f} s, "
                f"{result['tokens_per_s']:.0f} tokens/s, peak {fmt(result['peak_gb'])} GB")
    if name == "resume":
        return f"{result['differing_tensors']} differing tensors, metrics equal: {result['metrics_equal']}"
    if name == "oom":
        lines = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
        return lines[0][:110] if lines else "(no error line)"
    return ""


def fmt(gb: float | None) -> str:
    return "-" if gb is None else f"{gb:.2f}"


def table(checks: list[dict]) -> str:
    """One row per check run: name, PASS / FAIL, figures, and why it failed."""
    lines = [f"{'check':<16} {'result':<6} figures", "-" * 100]
    for c in checks:
        lines.append(f"{c['name']:<16} {'PASS' if c['passed'] else 'FAIL':<6} {c['summary']}")
        lines += [f"{'':<23}! {why}" for why in c["problems"]]
    return "\n".join(lines)


# --- running ----------------------------------------------------------------------------------------------------


def run_child(args: list[str], timeout: float, env: dict) -> dict:
    try:
        proc = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}", "stderr": proc.stderr[-3000:]}


def run_oom(tiny: bool, work: str, timeout: float, env: dict) -> dict:
    recipe = Path(work) / "oom_recipe.py"
    recipe.write_text(OOM_RECIPE.format(bench=str(ROOT / "benchmarks"), out=str(Path(work) / "oom-run"), tiny=tiny))
    try:
        proc = subprocess.run([sys.executable, "-m", "grpo.train", str(recipe)], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    return {"returncode": proc.returncode, "stderr": proc.stderr[-4000:]}


def merge(parts: list[dict]) -> dict:
    """One check's result from its parts (memory rows of several models; resume in two modes)."""
    errors = [p for p in parts if "error" in p]
    if errors:
        return errors[0]
    if "rows" in parts[0]:
        return {"rows": [r for p in parts for r in p["rows"]]}
    if len(parts) == 1:
        return parts[0]
    merged = {**parts[0], "differing_tensors": sum(p["differing_tensors"] for p in parts),
              "first_differing": [n for p in parts for n in p["first_differing"]]}
    for key in ("metrics_equal", "completions_equal", "loss_finite"):
        merged[key] = all(p[key] for p in parts)
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small models and sequences (the CPU rehearsal)")
    p.add_argument("--budget", type=float, default=480, help="seconds for all checks (default 8 minutes)")
    p.add_argument("--output", default=str(RESULTS))
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device, nothing checked (python benchmarks/gpu_check.py on a GPU; "
              "--device cpu --tiny rehearses it)")
        return 0
    start, work = time.perf_counter(), tempfile.mkdtemp(prefix="gpu_check_")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GPU_CHECK_DIR=work,
               CUBLAS_WORKSPACE_CONFIG=":4096:8",  # deterministic cuBLAS (resume); set before CUDA starts
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0") if args.device == "cuda" else "")
    checks = []
    try:
        for name in args.only:
            parts = []
            for child_args, seconds in CHECKS[name]:
                left = args.budget - (time.perf_counter() - start)
                if left < 10:
                    parts.append({"error": f"not run: the {args.budget:.0f}-second budget is spent"})
                    break
                timeout = min(left, seconds * (10 if args.tiny else 1.5))  # CPU runs take longer than a GPU's
                extra = ["--tiny"] if args.tiny else []
                parts.append(run_oom(args.tiny, work, timeout, env) if child_args is None
                             else run_child(child_args + extra, timeout, env))
            result = merge(parts)
            problems = judge(name, result, args.device)
            checks.append({"name": name, "passed": not problems, "problems": problems,
                           "summary": summary(name, result), "result": result})
            print("\n".join(table(checks[-1:]).splitlines()[2:]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {"device": card, "tiny": args.tiny, "seconds": time.perf_counter() - start,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "checks": checks}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{card}, {report['seconds']:.0f} s\n{table(checks)}\nwrote {args.output}")
    return 0 if all(c["passed"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
