"""Measured against predicted peak GPU memory for the rows of `python -m grpo.plan --table`.

Each (model, column) trains a random-weight model of that architecture (built from the facts in
grpo/memory/known_models.py; nothing is downloaded) for a few optimizer steps at the write-up's settings, with
full-length completions (EOS disabled: the worst case the planner assumes), in its own subprocess.
Measured = `torch.cuda.max_memory_allocated` at the end of the last optimizer step (before the final
checkpoint). Targets: within 15% of the prediction; at most half the write-up's TRL figure; 1B LoRA <= 8 GB;
3B LoRA and 8B QLoRA within a 16 GB card (context included).

    python benchmarks/gpu_memory.py                                  # every row the card can hold
    python benchmarks/gpu_memory.py --models 0.5B 1B --columns LoRA QLoRA --accumulation 1
    python benchmarks/gpu_memory.py --tiny --device cpu              # smoke test of the script itself

Without CUDA (and without --device cpu) it says so and exits 0. QLoRA rows save the random model in bf16 to a
temporary directory first (the trainer quantizes what it loads from config.model): 16 GB of disk for 8B.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from grpo.settings import Config  # noqa: E402
from grpo.memory.estimate import GB  # noqa: E402
from grpo.memory.parts import Architecture  # noqa: E402
from grpo.memory.fit import needed_gb, predicted_gb  # noqa: E402
from grpo.memory.known_models import ARTICLE_CONFIG, ARTICLE_GB, KNOWN, TABLE_COLUMNS, TABLE_MODELS  # noqa: E402

TINY = Architecture(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=704,
                    vocab_size=32000, tie_word_embeddings=True, attention_bias=True, name="tiny")


def hf_config(arch: Architecture):
    """A transformers config with the architecture's numbers (Qwen2 when it has q/k/v biases, else Llama)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                  num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
                  num_key_value_heads=arch.num_kv_heads, tie_word_embeddings=arch.tie_word_embeddings,
                  max_position_embeddings=4096)
    if arch.attention_bias:
        return Qwen2Config(**common)
    return LlamaConfig(**common, head_dim=arch.head_dim or arch.hidden_size // arch.num_heads)


def run_config(args, arch: Architecture, column: dict, output_dir: str) -> Config:
    overrides = dict(column, stop_at_eos=False, max_steps=args.steps, output_dir=output_dir, save_steps=10**9,
                     logging_steps=10**9)
    if args.accumulation:
        overrides["gradient_accumulation_steps"] = args.accumulation
    if args.completion_length:
        overrides["max_completion_length"] = args.completion_length
    return dataclasses.replace(ARTICLE_CONFIG, model=arch.name, **overrides)


def child(args, arch: Architecture, column: dict) -> dict:
    """Train one row and return its measured peak (bytes)."""
    import torch
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers import AutoModelForCausalLM

    from grpo import Trainer
    from grpo.policy.precision import Precision
    from grpo.tasks.tiny import wide_tokenizer

    cuda = args.device == "cuda"
    peak = (lambda: torch.cuda.max_memory_allocated()) if cuda else (lambda: 0)  # noqa: E731
    peaks = []
    register_optimizer_step_post_hook(lambda *_: peaks.append(peak()))
    tokenizer = wide_tokenizer(arch.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        config = run_config(args, arch, column, os.path.join(tmp, "run"))
        data = Dataset.from_list([{"prompt": "x" * config.max_prompt_length} for _ in range(64)])  # 1 byte, 1 token
        model = None
        if config.load_in_4bit:  # the trainer quantizes what it loads from a path
            path = os.path.join(tmp, "model")
            AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.bfloat16).save_pretrained(path)
            tokenizer.save_pretrained(path)
            config = dataclasses.replace(config, model=path)
        else:
            dtype = Precision.plan(config.bf16, config.use_lora, args.device, config.bf16_weights).base_dtype
            with torch.device(args.device):
                model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=dtype)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(config, model=model, tokenizer=tokenizer, train_dataset=data,
                          reward_funcs=[lambda completions, **_: [float(len(set(c))) for c in completions]])
        trainer.train()
    return {"peak_bytes": peaks[-1] if peaks else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(TABLE_MODELS), choices=list(TABLE_MODELS))
    p.add_argument("--columns", nargs="+", default=list(TABLE_COLUMNS), choices=list(TABLE_COLUMNS))
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (>= 2: the second has optimizer states)")
    p.add_argument("--accumulation", type=int, help="micro-batches per step (default: the write-up's 4)")
    p.add_argument("--completion-length", type=int, help="default: the write-up's 786")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny architecture instead of the table's models")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per row")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, column = args.child
        arch = TINY if name == "tiny" else KNOWN[name]
        print(json.dumps(child(args, arch, TABLE_COLUMNS[column])))
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured (this benchmark needs a GPU; --device cpu --tiny checks the script)")
        return
    card_gb = torch.cuda.get_device_properties(0).total_memory / GB if args.device == "cuda" else None
    models = {"tiny": "tiny"} if args.tiny else {size: TABLE_MODELS[size] for size in args.models}
    rows = []
    for size, name in models.items():
        arch = TINY if args.tiny else KNOWN[name]
        for column in args.columns:
            config = run_config(args, arch, TABLE_COLUMNS[column], "unused")
            predicted = predicted_gb(arch, config, args.device)
            row = {"model": size, "name": name, "column": column, "predicted_gb": predicted,
                   "needed_gb": needed_gb(arch, config), "measured_gb": None}
            if card_gb is not None and row["needed_gb"] > card_gb:
                row["skipped"] = f"predicted {row['needed_gb']:.0f} GB > the card's {card_gb:.0f} GB"
            else:
                row.update(measure(args, name if not args.tiny else "tiny", column))
            rows.append(row)
            print(format_row(row), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "gpu_memory.json"
    out.write_text(json.dumps({"rows": rows, "device": args.device, "card_gb": card_gb,
                               "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


def measure(args, name: str, column: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, column, "--steps", str(args.steps), "--device", args.device]
    cmd += ["--accumulation", str(args.accumulation)] if args.accumulation else []
    cmd += ["--completion-length", str(args.completion_length)] if args.completion_length else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        oom = "OutOfMemoryError" in proc.stderr
        return {"error": "out of memory" if oom else proc.stderr.strip().splitlines()[-1][:200]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = result["peak_bytes"]
    return {"measured_gb": peak / GB if peak else None, "seconds": time.perf_counter() - start}


def format_row(row: dict) -> str:
    head = f"{row['model']:<5} {row['column']:<7} predicted {row['predicted_gb']:7.2f} GB"
    if row.get("skipped") or row.get("error"):
        return f"{head}  {row.get('skipped') or row.get('error')}"
    measured = row["measured_gb"]
    if not measured:
        return f"{head}  measured -"
    checks = [f"measured {measured:7.2f} GB", f"predicted/measured {row['predicted_gb'] / measured:.2f}"]
    article = ARTICLE_GB.get(row["model"])
    if article:
        ref = article[1] if row["column"] in ("LoRA", "QLoRA") else article[0]
        if ref:
            checks.append(f"{measured / ref:.2f} x the write-up's {ref} GB")
    return f"{head}  " + ", ".join(checks)


if __name__ == "__main__":
    main()
