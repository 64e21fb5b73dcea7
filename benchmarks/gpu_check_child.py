"""The checks of benchmarks/gpu_check.py, each run in its own process (`python benchmarks/gpu_check_child.py
CHECK [ARGS] [--tiny]`), printing one JSON line of raw measurements; gpu_check.py judges them. Models are random
weights built from the planner's architectures (grpo.memory.known_models), saved once as bf16 directories where the
trainer must load them itself (4-bit quantizes on load); `--tiny` swaps in a small architecture and short sequences
so that the whole script can be rehearsed on CPU."""
from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from gpu_memory import TINY, hf_config  # noqa: E402

from grpo import Config, Trainer  # noqa: E402
from grpo.memory.parts import Architecture  # noqa: E402
from grpo.memory.known_models import ARTICLE_CONFIG, KNOWN, TABLE_COLUMNS, TABLE_MODELS  # noqa: E402
from grpo.policy.precision import Precision  # noqa: E402
from grpo.rollout.batches import Rollout  # noqa: E402
from grpo.tasks.tiny import wide_tokenizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLAMA_1B = "meta-llama/Llama-3.2-1B-Instruct"
QWEN_05B = "Qwen/Qwen2.5-0.5B-Instruct"


def architecture(name: str, tiny: bool) -> Architecture:
    return dataclasses.replace(TINY, name=name) if tiny else KNOWN[name]


def lengths(tiny: bool) -> dict:
    """The write-up's prompt and completion lengths, or short ones for the CPU rehearsal."""
    return dict(max_prompt_length=16, max_completion_length=16) if tiny else {}


def random_model(arch: Architecture, dtype: torch.dtype, seed: int = 0):
    """A random-weight model of `arch` on the device, its pad / EOS ids those of `wide_tokenizer`."""
    from transformers import AutoModelForCausalLM

    tokenizer = wide_tokenizer(arch.vocab_size)
    config = hf_config(arch)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model, tokenizer


def model_dir(arch: Architecture, root: str, num_layers: int | None = None) -> str:
    """A bf16 directory of a random `arch` (optionally fewer layers) and its tokenizer, written once per root."""
    if num_layers:
        arch = dataclasses.replace(arch, num_layers=num_layers)
    path = Path(root) / f"{arch.name.replace('/', '--')}-{arch.num_layers}"
    if not (path / "done").exists():
        model, tokenizer = random_model(arch, torch.bfloat16)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        (path / "done").write_text("")
        del model
    return str(path)


def prompts(config: Config, n: int = 64) -> Dataset:
    return Dataset.from_list([{"prompt": "x" * config.max_prompt_length}] * n)  # one byte, one token: full length


def checksum(completions, **_):
    """A reward that differs between almost any two texts, so that every group has advantages to learn from."""
    return [zlib.crc32(c.encode()) / 2**32 for c in completions]


def moved_fraction(trainer: Trainer, before: dict) -> float:
    """The share of trainable tensors an optimizer step changed. LoRA's A matrices are left out after one step:
    B starts at zero, so A's first gradient is exactly zero."""
    moved = [not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters()
             if n in before and not (trainer.step == 1 and "lora_A" in n)]
    return sum(moved) / len(moved)


def trainer_for(config: Config, model=None, tokenizer=None) -> Trainer:
    return Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[checksum],
                   train_dataset=prompts(config))


def full_length_sample(model, tokenizer, encode, prompts, *, num_generations, max_completion_length, int8=False,
                       bf16=False, **_):
    """Stands in for sampling in the memory rows: random full-length completions (generation is never the
    planner's peak moment at these settings, and it is most of the time; the `step` check samples for real).
    Sampling on other weights (`int8`, `bf16`: the CPU's bf16 plan) keeps log-probs for the importance-sampling
    correction, as sample_completions does: NaN here, none sampled, so the correction weighs every row 1."""
    prompt_ids, prompt_mask = encode(prompts)  # [B, P]
    n, device = len(prompts) * num_generations, next(model.parameters()).device
    ids = torch.randint(300, len(tokenizer), (n, max_completion_length), device=device)  # [N, C]: not special
    rollout = Rollout(prompt_ids.repeat_interleave(num_generations, 0).to(device),
                      prompt_mask.repeat_interleave(num_generations, 0).to(device), ids, torch.ones_like(ids),
                      tokenizer.batch_decode(ids), torch.ones(n, dtype=torch.bool))
    if int8 or bf16:
        rollout.sampling_logprobs = torch.full(ids.shape, torch.nan, device=device)  # [N, C]
    return rollout


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else None


def fresh_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def dtype_problems(trainer: Trainer) -> list[str]:
    """Where the model's tensors differ from the run's dtype plan (policy/precision.py)."""
    import bitsandbytes as bnb

    plan, problems = trainer.precision, []
    params = dict(trainer.model.named_parameters())
    packed = {id(m.weight) for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)}
    for m in trainer.model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and m.compute_dtype != plan.base_dtype:
            problems.append(f"4-bit compute dtype {m.compute_dtype}, not {plan.base_dtype}")
            break
    trained = [n for n, p in params.items() if p.requires_grad and p.dtype != torch.float32]
    frozen = [n for n, p in params.items()
              if not p.requires_grad and id(p) not in packed and p.dtype != plan.base_dtype]
    problems += [f"trained {n} is not float32" for n in trained[:3]] + [f"frozen {n} is not {plan.base_dtype}"
                                                                      for n in frozen[:3]]
    if trainer.policy.reference is not None:
        ref = {p.dtype for p in trainer.policy.reference.parameters()}
        if ref != {plan.reference_dtype}:
            problems.append(f"reference copy in {sorted(map(str, ref))}, not {plan.reference_dtype}")
    return problems


# --- the checks ---------------------------------------------------------------------------------------------


def memory(size: str, *columns: str, tiny: bool = False, root: str = "") -> dict:
    """The planner's rows (the write-up's settings, full-length completions), 2 optimizer steps each: the peak
    at the last optimizer step's end, as benchmarks/gpu_memory.py measures it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import grpo.rollout.engines.sampling
    from grpo.memory.fit import needed_gb, predicted_gb

    grpo.rollout.engines.sampling.sample_completions = full_length_sample
    name, rows = TABLE_MODELS[size], []
    arch = architecture(name, tiny)
    for column in columns:
        config = dataclasses.replace(ARTICLE_CONFIG, model=name, stop_at_eos=False, max_steps=2, output_dir=root,
                                     save_steps=10**9, logging_steps=10**9, **TABLE_COLUMNS[column], **lengths(tiny))
        row = {"model": size, "column": column, "predicted_gb": predicted_gb(arch, config, "cuda")}
        card = torch.cuda.get_device_properties(0).total_memory / 1e9 if DEVICE == "cuda" else math.inf
        if needed_gb(arch, config) > card:
            rows.append({**row, "skipped": f"needs {needed_gb(arch, config):.0f} GB, the card has {card:.0f}"})
            continue
        peaks, hook = [], None
        try:
            model = tokenizer = None
            if config.load_in_4bit:  # the trainer quantizes what it loads itself
                config = dataclasses.replace(config, model=model_dir(arch, root))
            else:
                model, tokenizer = random_model(arch, Precision.plan(config.bf16, config.use_lora, DEVICE).base_dtype)
            fresh_memory()
            hook = register_optimizer_step_post_hook(lambda *_: peaks.append(peak_gb()))
            trainer = trainer_for(dataclasses.replace(config, output_dir=tempfile.mkdtemp(dir=root)), model, tokenizer)
            trainer.save = lambda **_: None  # no multi-GB checkpoint at the end: only the peak matters
            start = time.perf_counter()
            trainer.train()
            row.update(measured_gb=peaks[-1], seconds=time.perf_counter() - start)
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0][:120]}"
        finally:
            if hook is not None:
                hook.remove()
        trainer = model = None
        fresh_memory()
        rows.append(row)
    return {"rows": rows}


def step(tiny: bool = False, root: str = "") -> dict:
    """One real GRPO step of the gsm8k_lora recipe (Llama-3.2-1B, LoRA, 8-bit AdamW, checkpointing, G=4,
    256 + 786 tokens, 4 micro-batches), EOS off, timed stage by stage."""
    from grpo.memory.estimate import GB, estimate
    from grpo.settings.recipe import load_recipe

    arch = architecture(LLAMA_1B, tiny)
    recipe = load_recipe(str(ROOT / "recipes" / "gsm8k_lora.py"))
    config = dataclasses.replace(recipe.config, model=model_dir(arch, root),
                                 output_dir=tempfile.mkdtemp(dir=root), stop_at_eos=False, max_steps=1,
                                 warmup_ratio=0.0, **lengths(tiny))  # no warmup: a 1-step warmup has lr 0
    trainer = trainer_for(config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    seconds = {"generate": 0.0, "reference log-probs": 0.0, "log-probs": 0.0, "backward": 0.0, "optimizer": 0.0}
    generation_peak = []

    def timed(stage, fn, after=None):
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            seconds[stage] += time.perf_counter() - start
            if after:
                after()
            return out
        return run

    policy = trainer.policy
    source = trainer.pipeline.source
    source.engine = timed("generate", source.engine, after=lambda: generation_peak.append(peak_gb()))
    policy.reference_logprobs = timed("reference log-probs", policy.reference_logprobs)
    policy.logprobs = timed("log-probs", policy.logprobs)
    policy.parallel.backward = timed("backward", policy.parallel.backward)
    trainer.updates.apply = timed("optimizer", trainer.updates.apply)
    trainer.save = lambda **_: None
    fresh_memory()
    trainer.train()
    line = trainer.state.log_history[0]  # the one step's metrics line
    planned = estimate(arch, config, "cuda")
    return {"seconds": seconds, "step_s": line["step_time"], "tokens_per_s": line["perf/tokens_per_s"],
            "generated_tokens": line["completions/mean_length"] * config.per_device_train_batch_size
            * config.gradient_accumulation_steps, "loss": line["loss"],
            "changed_fraction": moved_fraction(trainer, before),
            "dtype_problems": dtype_problems(trainer), "peak_gb": peak_gb(),
            "generation_peak_gb": generation_peak[-1] if generation_peak else None,
            "predicted_gb": planned.peak / GB, "predicted_generation_gb": planned.total("generation") / GB}


def one_step(mode: str, tiny: bool = False, root: str = "") -> dict:
    """One real step (sampling included, 128-token completions) of QLoRA or of full fine-tuning with 8-bit AdamW
    and a bf16 reference copy, on the Qwen2.5-0.5B architecture loaded by the trainer."""
    arch = architecture(QWEN_05B, tiny)
    settings = dict(use_lora=True, load_in_4bit=True) if mode == "qlora" else dict(use_lora=False)
    config = Config(model=model_dir(arch, root), output_dir=tempfile.mkdtemp(dir=root), max_steps=1, num_generations=4,
                    per_device_train_batch_size=4, max_prompt_length=16 if tiny else 256,
                    max_completion_length=16 if tiny else 128,
                    stop_at_eos=False, learning_rate=1e-5, beta=0.04, optim="adamw_8bit", gradient_checkpointing=True,
                    save_steps=10**9, **settings)
    trainer = trainer_for(config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    line = trainer.state.log_history[0]  # the one step's metrics line
    states = [s["state1"].dtype for s in trainer.optimizer.state.values() if "state1" in s]
    return {"loss": line["loss"], "kl": line["kl"], "step_s": line["step_time"],
            "tokens_per_s": line["perf/tokens_per_s"],
            "changed_fraction": moved_fraction(trainer, before), "dtype_problems": dtype_problems(trainer),
            "int8_states": sum(d == torch.uint8 for d in states), "peak_gb": peak_gb()}


def resume(mode: str, tiny: bool = False, root: str = "") -> dict:
    """2 steps straight vs 1 step, a crash, and a resumed step 2, under deterministic algorithms: the weights,
    metrics and completions must be bit-identical (CUDA RNG states, 8-bit optimizer state, bf16 plan)."""
    torch.use_deterministic_algorithms(True)
    arch = architecture(QWEN_05B, tiny)
    settings = dict(use_lora=True, lora_dropout=0.05) if mode == "lora" else dict(use_lora=False)
    base = Config(model=model_dir(arch, root, num_layers=2), max_steps=2, save_steps=1, num_generations=4,
                  per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_prompt_length=16 if tiny else 64, max_completion_length=32,
                  learning_rate=1e-4, beta=0.04, optim="adamw_8bit", gradient_checkpointing=True, seed=0, **settings)
    runs = {}
    for name in ("straight", "resumed"):
        config = dataclasses.replace(base, output_dir=os.path.join(root, f"resume-{mode}-{name}"))
        trainer = trainer_for(config)
        if name == "resumed":
            original = trainer.run_step
            trainer.run_step = lambda signals: original(signals) if trainer.step == 0 else crash()
            try:
                trainer.train()
            except Crash:
                pass
            trainer = trainer_for(dataclasses.replace(config, resume_from_checkpoint="latest"))
        trainer.train()
        runs[name] = trainer, Path(config.output_dir)
    (a, out_a), (b, out_b) = runs["straight"], runs["resumed"]
    differing = [n for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()) if not torch.equal(p, q)]
    return {"differing_tensors": len(differing), "first_differing": differing[:3],
            "metrics_equal": stable(out_a) == stable(out_b), "steps": [m["step"] for m in stable(out_b)],
            "completions_equal": (out_a / "completions.jsonl").read_text() == (out_b / "completions.jsonl").read_text(),
            "loss_finite": all(math.isfinite(m["loss"]) for m in stable(out_b))}


def stable(out: Path) -> list[dict]:
    """metrics.jsonl without timings and memory, which differ between any two runs."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("perf/", "memory/", "step_time"))}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


class Crash(BaseException):
    """Stands in for the process dying after checkpoint-1: nothing catches it, nothing more is saved."""


def shared(tiny: bool = False, root: str = "") -> dict:
    """The shared-prompt forward (grpo/policy/prefix.py) against whole rows on the Qwen2.5-0.5B architecture in
    float32 (TF32 off), LoRA with a trained-looking adapter: for each attention implementation the card has (sdpa,
    flash-attention when installed) and each layout it allows (padded rows; one packed row), the largest log-prob
    and gradient differences, and the seconds and peak memory of a forward and backward of each."""
    from grpo.policy.models import completion_logprobs, prepare_for_training, unwrap
    from grpo.policy.packing import packing_refusal
    from grpo.policy.prefix import shared_prompt_logprobs

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    arch = architecture(QWEN_05B, tiny)
    (p, lo, hi), groups, generations = ((8, 4, 16) if tiny else (256, 100, 786)), 2, 4
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(300, arch.vocab_size, (groups, p), generator=g)  # [B, P]
    prompt_ids = prompt.repeat_interleave(generations, 0).to(DEVICE)  # [N, P]
    prompt_mask = torch.ones_like(prompt_ids)
    length = torch.randint(lo, hi + 1, (groups * generations,), generator=g)  # [N]
    completion_ids = torch.randint(300, arch.vocab_size, (len(length), int(length.max())), generator=g).to(DEVICE)
    completion_mask = (torch.arange(completion_ids.shape[1])[None] < length[:, None]).long().to(DEVICE)  # [N, C]
    weights = torch.randn(completion_ids.shape, generator=g).to(DEVICE)  # [N, C]: a loss weighing every token
    implementations = ["sdpa"]
    if DEVICE == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        implementations.append("flash_attention_2")
    rows = []
    for implementation in implementations:
        model, _ = random_model(arch, torch.float32)
        model.config._attn_implementation = implementation
        model = prepare_for_training(model, Config(use_lora=True, lora_r=16, gradient_checkpointing=True,
                                                   disable_dropout=True))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)

        def run(layout, model=model):
            fresh_memory()
            model.zero_grad()
            sync()
            t = time.perf_counter()
            if layout == "whole":
                lp = completion_logprobs(model, torch.cat([prompt_ids, completion_ids], 1),
                                         torch.cat([prompt_mask, completion_mask], 1), p, temperature=0.7,
                                         chunk_size=1024)
            else:
                lp = shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                            temperature=0.7, chunk_size=1024, pack=layout == "packed")
            (lp * weights * completion_mask).sum().backward()
            sync()
            grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
            return (lp.detach() * completion_mask, grads, time.perf_counter() - t, peak_gb())

        whole = run("whole")
        layouts = ["padded"] + (["packed"] if packing_refusal(unwrap(model)) is None else [])
        for layout in layouts:
            lp, grads, seconds, peak = run(layout)
            grad_error = max(((grads[n] - whole[1][n]).abs().max() / whole[1][n].abs().max().clamp(min=1e-30)).item()
                             for n in whole[1])
            rows.append({"attention": implementation, "layout": layout, "tokens": int(completion_mask.sum()),
                         "logprob_error": (lp - whole[0]).abs().max().item(), "grad_error": grad_error,
                         "seconds": seconds, "whole_seconds": whole[2], "peak_gb": peak, "whole_peak_gb": whole[3]})
        del model
    return {"rows": rows}


def crash():
    raise Crash


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


CHECKS = {"memory": memory, "step": step, "one_step": one_step, "resume": resume, "shared": shared}


def main(argv: list[str]) -> None:
    tiny = "--tiny" in argv
    check, *args = [a for a in argv if a != "--tiny"]
    root = os.environ.get("GPU_CHECK_DIR") or tempfile.mkdtemp()
    try:
        result = CHECKS[check](*args, tiny=tiny, root=root)
    except Exception as e:  # noqa: BLE001 -- reported as the check's failure, with where it happened
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                  "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
