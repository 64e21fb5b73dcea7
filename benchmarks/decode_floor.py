"""How far a decoding step is from the hardware's floor, and where it goes, for any model and batch size: the
weights' bytes (every linear the step reads, the LM head included), one core's streaming bandwidth (a `sum` over a
268 MB tensor), the floor (bytes / bandwidth, float32 and bf16), the step's ms measured, and each phase's ms per
step from torch.profiler (self CPU time of the step's ops, grouped). With `--trees`, the same sampling timed in
each tree (another commit's grpo, `git archive <commit> | tar -x -C dir`), the trees alternating, each run its own
subprocess pinned to `--core` with OMP_NUM_THREADS=1; wall and CPU seconds, min and median over `--repeats`.

    python benchmarks/decode_floor.py                                   # the main job's shapes, this tree
    python benchmarks/decode_floor.py --trees BASE . --repeats 3 --core 1 --no-profile
    python benchmarks/decode_floor.py --trees BASE . --repeats 2 --core 0 --no-profile --int8
    python benchmarks/decode_floor.py --trees BASE . --repeats 2 --core 1 --no-profile --bf16   # a bf16 CPU

Main job's shapes (the defaults): SmolLM2-135M-Instruct, LoRA r16 alpha 32 on every linear, 2 word-problem chat
prompts (~200 tokens) x 8 completions of exactly `--max-new` 128 tokens (EOS never sampled), temperature 0.7.
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
PHASES = {  # profiler op name -> phase; the rest is "other"
    "linear": ("mkldnn_linear", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
               "mkl_linear", "_mkl_linear", "aten::baddbmm"),
    "attention": ("scaled_dot_product", "flash_attention", "_softmax_backward", "aten::_efficient_attention"),
    "conversions": ("to_mkldnn", "_to_dense", "aten::to_dense"),
    "sampling": ("cumsum", "searchsorted", "softmax", "aten::topk", "aten::sort", "aten::rand", "aten::exponential",
                 "aten::argmax", "aten::div_", "aten::clamp"),
    "elementwise": ("aten::mul", "aten::add", "aten::copy_", "aten::silu", "aten::pow", "aten::neg", "aten::where",
                    "aten::cat", "aten::rsqrt", "aten::mean", "aten::sub", "aten::masked_fill", "aten::index",
                    "aten::embedding", "aten::index_select", "aten::fill_"),
}


def bandwidth_gb_s(mb: int = 268, repeats: int = 10) -> float:
    """One core's streaming read bandwidth: the best of `repeats` sums over an `mb` MB float32 tensor."""
    import torch

    x = torch.ones(mb * 2 ** 20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model) -> tuple[int, int]:
    """(parameters, float32 bytes) a decoding step reads: every linear's weight (LoRA adapters folded into theirs),
    the LM head included, once even when tied to the embeddings."""
    import torch

    seen, params = set(), 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name and id(module.weight) not in seen:
            seen.add(id(module.weight))
            params += module.weight.numel()
    return params, params * 4


def load(args):
    import torch

    from grpo import Config
    from grpo.policy.models import load_model, load_tokenizer, prepare_for_training

    torch.manual_seed(0)
    config = Config(model=args.model, bf16=args.bf16, use_lora=args.lora_r > 0, lora_r=max(args.lora_r, 1),
                    lora_alpha=2 * max(args.lora_r, 1), max_prompt_length=256, max_completion_length=args.max_new,
                    num_generations=args.generations, temperature=0.7, gradient_checkpointing=False,
                    stop_at_eos=False, seed=0)
    model = prepare_for_training(load_model(config), config)
    return model, load_tokenizer(args.model)


def prompts(n: int) -> list:
    from grpo.tasks import word_problems

    train, _ = word_problems.split(num_train=1000, num_eval=10, seed=0)
    return [r["prompt"] for r in word_problems.rows(train[:n])]


def sampler(args, model, tokenizer):
    """One decode of `prompts` x `generations` rows, as the trainer samples them (no EOS: equal work)."""
    import inspect

    try:
        import grpo.rollout.engines.sampling as sampling
    except ImportError:  # earlier trees: rollout/sampling.py
        import grpo.rollout.sampling as sampling

    encode = sampling.PromptEncoder(tokenizer, 256)
    batch = prompts(args.prompts)
    knobs = dict(temperature=0.7, top_p=1.0, top_k=0)
    if "knobs" in inspect.signature(sampling.sample_completions).parameters:  # this tree: the knobs as one value
        try:
            from grpo.settings.components import SamplingKnobs
        except ImportError:  # earlier trees: settings/plan.py
            from grpo.settings.plan import SamplingKnobs

        knobs = {"knobs": SamplingKnobs(**knobs)}
    if args.int8:  # a tree with int8_sampling_weights (policy/int8)
        knobs["int8"] = True
    if args.bf16:  # a tree whose precision plan samples in bf16 on a CPU (policy/precision), on the bf16 base
        knobs["bf16"] = True
    return lambda: sampling.sample_completions(
        model, tokenizer, encode, batch, num_generations=args.generations, max_completion_length=args.max_new,
        stop_at_eos=False, **knobs)


def count_steps(model) -> list:
    """Forwards (the prefill, then one per decoding step), counted where every forward, a fused decoding step
    (policy/decoder) too, embeds its tokens."""
    steps = []
    model.get_input_embeddings().register_forward_hook(lambda *_: steps.append(1))
    return steps


def timed(args) -> dict:
    """Wall and CPU seconds of one sampling run (after a warm-up run), and the decoding steps it took."""
    import torch

    torch.set_num_threads(1)
    model, tokenizer = load(args)
    run = sampler(args, model, tokenizer)
    run()  # warm-up: first-touch allocations, lazy imports
    steps = count_steps(model)
    t0, w0 = time.process_time(), time.perf_counter()
    run()
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    return dict(wall_s=wall, cpu_s=cpu, steps=len(steps), ms_per_step=wall / max(1, len(steps)) * 1e3)


def phase_of(name: str) -> str:
    for phase, keys in PHASES.items():
        if any(k in name for k in keys):
            return phase
    return "other"


def profiled(args) -> dict:
    """Each phase's self CPU ms per decoding step (torch.profiler over one sampling run), the ops' own names
    beside; "python and dispatch" is the step's wall time the ops' self time does not cover."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    model, tokenizer = load(args)
    run = sampler(args, model, tokenizer)
    run()
    steps = count_steps(model)
    w0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    wall = time.perf_counter() - w0
    n = max(1, len(steps))
    phases, ops = {}, {}
    for event in prof.key_averages():
        if event.self_cpu_time_total <= 0:
            continue
        ms = event.self_cpu_time_total / 1e3 / n
        phase = phase_of(event.key)
        phases[phase] = phases.get(phase, 0.0) + ms
        ops[event.key] = (ms, event.count / n)
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:15]
    return dict(profiled_ms_per_step=wall / n * 1e3, phases=phases,
                top_ops={k: dict(ms=round(v[0], 2), calls=round(v[1], 1)) for k, v in top})


def floor(args) -> dict:
    import torch

    torch.set_num_threads(1)
    model, _ = load(args)
    params, nbytes = weight_bytes(model)
    bw = bandwidth_gb_s()
    return dict(params=params, gb_float32=nbytes / 1e9, bandwidth_gb_s=bw, floor_ms_float32=nbytes / bw / 1e6,
                floor_ms_bf16=nbytes / 2 / bw / 1e6)


def worker_args(args) -> list[str]:
    return ["--model", args.model, "--lora-r", str(args.lora_r), "--prompts", str(args.prompts),
            "--generations", str(args.generations), "--max-new", str(args.max_new)]


def variants(args) -> list[tuple[Path, str]]:
    """(tree, weights) pairs to time: each tree in float32 (bf16=False), with `--int8` also on int8 weights where
    the tree has them (grpo/policy/int8.py), with `--bf16` also under the bf16 plan where the tree samples in
    bf16 on a CPU (grpo/policy/precision.py's CpuBf16)."""
    out = [(tree, "float32") for tree in args.trees]
    if args.int8:
        out += [(tree, "int8") for tree in args.trees if (tree / "grpo" / "policy" / "int8.py").exists()]
    if args.bf16:
        out += [(tree, "bf16") for tree in args.trees
                if "CpuBf16" in (tree / "grpo" / "policy" / "precision.py").read_text()]
    return out


def run_worker(tree: Path, job: str, args, weights: str = "float32") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(tree.resolve())}
    cmd = ["taskset", "-c", str(args.core), sys.executable, str(Path(__file__).resolve()), "--worker", job,
           *worker_args(args), *([f"--{weights}"] if weights != "float32" else [])]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{job} in {tree} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{job} in {tree} {weights}: {result}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lora-r", type=int, default=16, help="0: no adapters")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--trees", type=Path, nargs="+", default=[ROOT])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--int8", action="store_true",
                        help="also time each tree that has them with int8 sampling weights (int8_sampling_weights)")
    parser.add_argument("--bf16", action="store_true",
                        help="also time each tree that has it under the bf16 precision plan (bf16 sampling on a CPU)")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "decode_floor.json")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(dict(timed=timed, profiled=profiled, floor=floor)[args.worker](args)))
        return
    from async_step import cpu_description

    result = dict(shapes=worker_args(args), cpu=cpu_description(), floor=run_worker(args.trees[-1], "floor", args),
                  trees={})
    name = {(tree, weights): f"{tree} {weights}" for tree, weights in variants(args)}
    runs = {v: [] for v in name}
    for _ in range(args.repeats):  # the trees alternate, so a busy machine slows them alike
        for tree, weights in runs:
            runs[tree, weights].append(run_worker(tree, "timed", args, weights))
    for (tree, weights), rs in runs.items():
        entry = dict(runs=rs, **{f"{k}_{f.__name__}": f(r[k] for r in rs) for k in ("wall_s", "cpu_s")
                                 for f in (min, statistics.median)})
        if not args.no_profile:
            entry["profile"] = run_worker(tree, "profiled", args, weights)
        result["trees"][name[tree, weights]] = entry
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    report(result)
    print(f"wrote {args.output}")


def report(result: dict) -> None:
    f, cpu = result["floor"], result["cpu"]
    print(f"CPU: {cpu['model']}; flags {' '.join(cpu['flags'])}; native bf16: {cpu['native_bf16']} "
          f"({cpu['source']}); load average {os.getloadavg()[0]:.1f}")
    print(f"weights {f['params'] / 1e6:.1f} M parameters = {f['gb_float32']:.3f} GB float32; one core streams "
          f"{f['bandwidth_gb_s']:.1f} GB/s: floor {f['floor_ms_float32']:.1f} ms/step float32, "
          f"{f['floor_ms_bf16']:.1f} ms/step bf16")
    first = None
    for tree, e in result["trees"].items():
        ms = min(r["ms_per_step"] for r in e["runs"])
        first = first or e
        print(f"{tree}: wall min {e['wall_s_min']:.2f} s median {e['wall_s_median']:.2f} s, CPU min "
              f"{e['cpu_s_min']:.2f} s median {e['cpu_s_median']:.2f} s; {ms:.1f} ms/step = "
              f"{ms / f['floor_ms_float32']:.2f}x the float32 floor; wall min vs first tree "
              f"{e['wall_s_min'] / first['wall_s_min']:.2f}x, CPU {e['cpu_s_min'] / first['cpu_s_min']:.2f}x")
        if "profile" in e:
            p = e["profile"]
            print(f"  profiled {p['profiled_ms_per_step']:.1f} ms/step; self CPU ms/step by phase: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["phases"].items(), key=lambda kv: -kv[1])))
            print("  top ops: " + ", ".join(f"{k} {v['ms']} ms ({v['calls']} calls)" for k, v in p["top_ops"].items()))


if __name__ == "__main__":
    main()
