"""This trainer against TRL's GRPOTrainer, side by side on the same work: peak memory, seconds per optimizer
step and generated tokens per second.

Both sides load the same random-weight model directory (Qwen2 architecture, the real 151,936-token vocabulary,
a shrunk body so that CPU runs finish), get the same prompts, sample `num_generations` full-length completions
each (EOS disabled on both), use the same beta, optimizer, gradient checkpointing and LoRA settings, and run
in their own subprocess. Both are measured the same way from inside the child: the end of every optimizer step
(a global optimizer hook) gives the step times and the peak memory up to the last step (peak RSS on CPU, before
any final save; `torch.cuda.max_memory_allocated` on CUDA); a wrapper around `generate` counts generated tokens
and their seconds. "baseline" is the child's RSS after its imports, before the model loads, so "training" =
peak - baseline is the memory the run itself added. Step times are wall-clock and, less sensitive to a shared
machine, the process's CPU time (both sides run single-threaded by default).

    python benchmarks/vs_trl.py                                   # full and LoRA, torch AdamW
    python benchmarks/vs_trl.py --modes lora --optim adamw_8bit --gradient-checkpointing
    python benchmarks/vs_trl.py --hidden-size 256 --num-layers 2 --steps 3   # quicker

Needs TRL (`pip install -e ".[bench]"`); without it the TRL side is skipped with a message.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def prompts(n: int) -> list[str]:
    return [f"Question {i}: continue this text with words of your own, as many as you like. Go:" for i in range(n)]


def distinct_words(completions, **kwargs):
    """Any reward that varies between completions serves: the share of distinct words."""
    return [len(set(c.split())) / max(1, len(c.split())) for c in completions]


# --- the child: one trainer, one configuration, measured from inside -----------------------------------------


def rss_bytes() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_bytes(cuda: bool) -> int:
    import torch

    from grpo.run.logs import peak_rss_bytes

    if cuda:
        return torch.cuda.max_memory_allocated()
    return peak_rss_bytes()  # VmHWM: ru_maxrss would keep the parent's RSS from before exec


def instrument(cuda: bool) -> dict:
    """Record optimizer-step ends (with the peak so far) and generate() calls, identically for both trainers."""
    import transformers

    marks = {"step_end": [], "step_end_cpu": [], "peak": [], "generate_s": 0.0, "generated_tokens": 0}

    def on_step(optimizer, args, kwargs):
        marks["step_end"].append(time.perf_counter())
        marks["step_end_cpu"].append(time.process_time())
        marks["peak"].append(peak_bytes(cuda))

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(on_step)

    def timed(generate, new_tokens):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            marks["generate_s"] += time.perf_counter() - start
            marks["generated_tokens"] += new_tokens(out, args, kwargs)
            return out
        return wrapper

    # TRL samples with transformers' generate (prompt + completion ids), this trainer with its own loop (completions).
    transformers.GenerationMixin.generate = timed(
        transformers.GenerationMixin.generate,
        lambda out, args, kwargs: (out.shape[1] - kwargs["input_ids"].shape[1]) * out.shape[0])
    import grpo.rollout.engines.sampling

    # The name our decoder calls (sampling.py imports decode from decoding.py).
    sampling = grpo.rollout.engines.sampling
    sampling.decode = timed(sampling.decode, lambda out, args, kwargs: out.completion_ids.numel())  # a Decoded
    return marks


def run_ours(spec: dict, output_dir: str) -> None:
    from grpo import Config, Trainer

    config = Config(
        model=spec["model_dir"], output_dir=output_dir, max_steps=spec["steps"], bf16=spec["cuda"],
        per_device_train_batch_size=spec["prompts_per_step"] * spec["num_generations"], gradient_accumulation_steps=1,
        num_generations=spec["num_generations"], max_completion_length=spec["completion_length"],
        stop_at_eos=False, temperature=1.0, beta=spec["beta"], learning_rate=1e-6, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, optim=spec["optim"], bf16_weights=spec["bf16_weights"],
        gradient_checkpointing=spec["gradient_checkpointing"],
        use_lora=spec["lora"], lora_r=16, lora_alpha=32, lora_dropout=0.05, save_steps=10**9, seed=0,
    )
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": p} for p in prompts(spec["num_prompts"])])
    Trainer(config, reward_funcs=[distinct_words], train_dataset=data).train()


def run_trl(spec: dict, output_dir: str) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=output_dir, max_steps=spec["steps"], bf16=spec["cuda"], use_cpu=not spec["cuda"],
        # Completions per device batch, as ours: prompts_per_step prompts x num_generations.
        per_device_train_batch_size=spec["prompts_per_step"] * spec["num_generations"],
        gradient_accumulation_steps=1, num_generations=spec["num_generations"],
        max_completion_length=spec["completion_length"],
        generation_kwargs={"min_new_tokens": spec["completion_length"]},  # no early EOS, as ours
        temperature=1.0, top_p=1.0, top_k=0, beta=spec["beta"], learning_rate=1e-6, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="linear",
        optim={"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit"}[spec["optim"]],
        gradient_checkpointing=spec["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False}, loss_type="dapo", scale_rewards="group",
        logging_steps=1, save_strategy="no", report_to="none", log_completions=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    peft_config = None
    if spec["lora"]:
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    data = Dataset.from_list([{"prompt": p} for p in prompts(spec["num_prompts"])])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=[distinct_words], args=args, train_dataset=data,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.train()


def child(side: str, spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    # Import everything this side needs before the baseline, so "training" counts the run, not the imports.
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401

    if side == "ours":
        import grpo.trainer  # noqa: F401
    else:
        import trl  # noqa: F401
        from trl import GRPOTrainer  # noqa: F401
    baseline = rss_bytes()
    marks = instrument(spec["cuda"])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir:
        (run_ours if side == "ours" else run_trl)(spec, output_dir)
    ends, cpu_ends = marks["step_end"], marks["step_end_cpu"]
    steps = [b - a for a, b in zip(ends, ends[1:])]  # step k (k >= 2) runs from the end of step k-1
    cpu_steps = [b - a for a, b in zip(cpu_ends, cpu_ends[1:])]
    return {
        "side": side, "steps_done": len(ends),
        "step_s": steps, "median_step_s": statistics.median(steps) if steps else None,
        "cpu_step_s": cpu_steps, "median_cpu_step_s": statistics.median(cpu_steps) if cpu_steps else None,
        "first_step_s": ends[0] - start if ends else None,
        "peak_bytes": marks["peak"][-1] if marks["peak"] else None, "baseline_bytes": baseline,
        "generated_tokens": marks["generated_tokens"], "generate_s": marks["generate_s"],
        "tokens_per_s": marks["generated_tokens"] / marks["generate_s"] if marks["generate_s"] else None,
    }


# --- the parent: build the model once, run each side in its own process, compare ---------------------------


def run_side(side: str, spec: dict, timeout: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    cmd = [sys.executable, __file__, "--child", side, "--spec", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


TARGETS = {"full": (0.40, 0.35), "lora": (0.30, 0.35)}  # the aims: peak and CPU seconds per step, ours / TRL


def print_table(rows: list[dict]) -> None:
    gb = lambda x: f"{x / 1e9:.2f}" if x is not None else "-"  # noqa: E731
    print(f"\n{'mode':<9} {'side':<6} {'peak GB':>8} {'baseline':>9} {'training':>9} {'s/step':>7} {'cpu s/step':>11} "
          f"{'gen tok/s':>10}")
    for r in rows:
        training = r["peak_bytes"] - r["baseline_bytes"] if r["peak_bytes"] is not None else None
        print(f"{r['mode']:<9} {r['side']:<6} {gb(r['peak_bytes']):>8} {gb(r['baseline_bytes']):>9} "
              f"{gb(training):>9} {r['median_step_s'] or 0:>7.2f} {r['median_cpu_step_s'] or 0:>11.2f} "
              f"{r['tokens_per_s'] or 0:>10.1f}")
    find = lambda mode, side: next((r for r in rows if r["mode"] == mode and r["side"] == side), None)  # noqa: E731
    for mode in dict.fromkeys(r["mode"] for r in rows):
        # bf16 weights have no TRL counterpart: against our own float32 full fine-tuning.
        ours, peer = find(mode, "ours"), find(mode, "trl") if mode != "full_bf16" else find("full", "ours")
        if ours and peer:
            t_ours, t_peer = (r["peak_bytes"] - r["baseline_bytes"] for r in (ours, peer))
            peak_target, cpu_target = TARGETS.get(mode, (None, None))
            targets = f"  (targets: peak <= {peak_target}, cpu <= {cpu_target})" if peak_target else ""
            print(f"{mode:<9} ours/{'TRL' if mode != 'full_bf16' else 'ours fp32'}: "
                  f"peak {ratio(ours['peak_bytes'], peer['peak_bytes'])}, "
                  f"training memory {ratio(t_ours, t_peer)}, "
                  f"s/step {ratio(ours['median_step_s'], peer['median_step_s'])} "
                  f"(cpu {ratio(ours['median_cpu_step_s'], peer['median_cpu_step_s'])}), "
                  f"gen tok/s {ratio(ours['tokens_per_s'], peer['tokens_per_s'])}{targets}")


def add_workload_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The model and the GRPO work measured (shared with profile_step.py)."""
    p.add_argument("--optim", default="adamw", choices=["adamw", "adamw_8bit"])
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=256)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps; the first is not timed")
    p.add_argument("--threads", type=int, default=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora", "full_bf16"],
                   help="full_bf16: full fine-tuning with --bf16_weights (ours only, against our float32 full run)")
    p.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    add_workload_arguments(p, steps=4)
    p.add_argument("--prompts-per-step", type=int, default=1)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per side")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.spec))))
        return

    import torch
    from random_models import qwen2_config, save_model_dir

    sides = list(args.sides)
    if "trl" in sides and importlib.util.find_spec("trl") is None:
        print("TRL is not installed (pip install -e '.[bench]'): running our side only")
        sides.remove("trl")
    arch = qwen2_config(args.vocab_size, args.hidden_size, args.num_layers)
    name = f"vs_trl_model_v{args.vocab_size}_h{args.hidden_size}_l{args.num_layers}"
    model_dir = save_model_dir(RESULTS / name, arch)
    base = dict(model_dir=str(model_dir), steps=args.steps, num_generations=args.num_generations,
                completion_length=args.completion_length, prompts_per_step=args.prompts_per_step,
                num_prompts=args.prompts_per_step * args.steps, beta=args.beta, optim=args.optim,
                gradient_checkpointing=args.gradient_checkpointing, threads=args.threads,
                cuda=torch.cuda.is_available())
    rows = []
    for mode in args.modes:
        spec = dict(base, lora=mode == "lora", bf16_weights=mode == "full_bf16")
        for side in (s for s in sides if s == "ours" or mode != "full_bf16"):  # TRL has no bf16-weights mode
            print(f"running {mode} / {side} ...", flush=True)
            rows.append(dict(run_side(side, spec, args.timeout), mode=mode, spec=spec))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "spec"}), flush=True)
    print_table(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"vs_trl_{args.optim}{'_checkpointing' if args.gradient_checkpointing else ''}.json"
    out.write_text(json.dumps({"rows": rows, "load_average": os.getloadavg(),
                               "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
