"""Generated tokens per CPU second, sampling and greedy evaluation, on the main job's shapes (recipes/word_problems.py:
SmolLM2-135M-Instruct with LoRA r16 on every linear, chat prompts of ~200 tokens): this tree against a baseline tree
(another commit's grpo, extracted with `git archive`) and against transformers' `generate` with a static cache.

    git archive 604ae52 | tar -x -C /tmp/base604
    git archive HEAD | tar -x -C /tmp/new     # (optional) a frozen copy of this tree, to edit it while this runs
    python benchmarks/fast_rollouts.py --baseline /tmp/base604 --new /tmp/new --core 0

- sampling: 2 prompts x 8 completions (16 rows) of exactly `--max-new` tokens (no EOS: equal work), the trainer's
  way (this tree: its Decoder over the memory plan's decodes; a tree without one: a decode per micro-batch of
  1 prompt x 8, as its trainer sampled), temperature 0.7;
- evaluation: greedy, `--eval-prompts` held-out prompts of up to 128 tokens each, each tree's `evaluate` with the
  batch size its trainer uses (the recipe's 50 where a tree has no memory-planned one).

Every measurement is its own subprocess, pinned to one core with OMP_NUM_THREADS=1, baseline and this tree
alternating; the figure is CPU seconds (process_time) of the timed region, with wall seconds beside, page faults
(ru_minflt) per decoding step (body forward) and the process's peak RSS. Writes a JSON file and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def settings(max_new: int) -> dict:
    return dict(model=MODEL, use_lora=True, lora_r=16, lora_alpha=32, max_prompt_length=256,
                max_completion_length=max_new, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                num_generations=8, temperature=0.7, gradient_checkpointing=False, stop_at_eos=False, seed=0)


def load(max_new: int):
    import torch

    from grpo import Config
    from grpo.policy.models import load_model, load_tokenizer, prepare_for_training

    torch.manual_seed(0)
    config = Config(**settings(max_new))
    model = prepare_for_training(load_model(config), config)
    return config, model, load_tokenizer(MODEL)


def count_steps(model) -> list:
    """Body forwards (one per decoding step, the prefill included), counted by a hook."""
    from grpo.policy.models import unwrap

    steps = []
    unwrap(model).base_model.register_forward_hook(lambda *_: steps.append(1))
    return steps


def worker(kind: str, max_new: int, eval_prompts: int) -> dict:
    import torch

    from grpo.infra.allocator import return_freed_memory
    from grpo.tasks import word_problems

    torch.set_num_threads(1)
    return_freed_memory()  # glibc's mmap threshold as the trainer sets it on a CPU
    config, model, tokenizer = load(max_new)
    train, held_out = word_problems.split(num_train=10_000, num_eval=500, seed=0)
    steps = count_steps(model)
    if kind == "sampling":
        prompts = [r["prompt"] for r in word_problems.rows(train[:2])]
        run, tokens = sampling_run(config, model, tokenizer, prompts), 16 * max_new
    elif kind == "eval":
        run, tokens = eval_run(config, model, tokenizer, held_out, eval_prompts), None
    else:  # transformers' generate, static cache
        run, tokens = hf_run(kind, config, model, tokenizer, train, held_out, eval_prompts, max_new)
    model.eval()
    flt0, t0, w0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    generated = run()
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0
    tokens = tokens if tokens is not None else generated
    return dict(cpu_s=cpu, wall_s=wall, tokens=tokens, tokens_per_cpu_s=tokens / cpu, steps=len(steps),
                faults_per_step=faults / max(1, len(steps)),
                peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)


def sampling_run(config, model, tokenizer, prompts):
    try:
        import grpo.rollout.engines.sampling as sampling
    except ImportError:  # earlier trees: rollout/sampling.py
        import grpo.rollout.sampling as sampling

    if hasattr(sampling, "Decoder") or hasattr(sampling, "Sampler"):  # the trainer's engine: the memory plan's decodes
        from types import SimpleNamespace

        from grpo.memory.fit import decode_sizes

        try:  # the planner's own settings (this tree)
            from grpo.memory.estimate import settings_of
            from grpo.memory.known_models import architecture_of

            m, precision = settings_of(config, "cpu")
            decode = decode_sizes(m, architecture_of(config.model, model), precision).sampling
        except ImportError:  # earlier trees read the Config
            decode = decode_sizes(config, model, "cpu").sampling
        policy = SimpleNamespace(parallel=SimpleNamespace(unsharded=lambda fn: fn(model)))
        from grpo.settings.plan import RunPlan

        settings = RunPlan.resolve(config, 1).sampling  # the trainer's sampling settings, on one rank
        engine = (sampling.Decoder(policy, tokenizer, sampling.prompt_encoder(model, tokenizer, settings), settings,
                                   decode) if hasattr(sampling, "Decoder") else
                  sampling.Sampler(policy, tokenizer, settings, decode))
        return lambda: engine(prompts) and None
    encode = sampling.PromptEncoder(tokenizer, config.max_prompt_length)  # one decode per micro-batch (1 prompt)
    knobs = dict(num_generations=8, max_completion_length=config.max_completion_length, temperature=0.7, top_p=1.0,
                 top_k=0, stop_at_eos=False)
    return lambda: [sampling.sample(model, tokenizer, encode, [p], **knobs) for p in prompts] and None


def eval_run(config, model, tokenizer, held_out, n: int):
    import inspect
    import dataclasses

    from datasets import Dataset

    from grpo.rollout.evaluate import evaluate
    from grpo.tasks import word_problems
    from grpo.tasks.gsm8k import answer_accuracy_reward, xml_format_reward

    dataset = Dataset.from_list(word_problems.rows(held_out[:n]))
    try:  # this tree: the memory plan's batch size (per_device_eval_batch_size=None)
        from grpo.memory.fit import eval_batch_size

        batch = eval_batch_size(dataclasses.replace(config, max_completion_length=128), model, "cpu")
    except ImportError:
        batch = 50  # the recipe's
    options = dict(accuracy_func="answer_accuracy_reward", format_func="xml_format_reward", max_prompt_length=256,
                   max_completion_length=128, batch_size=batch, progress=False)
    settings = ()
    if "settings" in inspect.signature(evaluate).parameters:  # this tree: the settings as the run plan has them
        try:
            from grpo.settings.components import EvalSettings
        except ImportError:  # earlier trees: settings/plan.py
            from grpo.settings.plan import EvalSettings

        settings = (EvalSettings.of(dataclasses.replace(
            config, eval_accuracy_func=options.pop("accuracy_func"), eval_format_func=options.pop("format_func"),
            max_prompt_length=options.pop("max_prompt_length"),
            max_completion_length=options.pop("max_completion_length"))),)
    options = {k: v for k, v in options.items() if k in inspect.signature(evaluate).parameters}

    def run():
        metrics, _ = evaluate(model, tokenizer, dataset, [xml_format_reward, answer_accuracy_reward], *settings,
                              **options)
        return metrics["eval/length_mean"] * metrics["eval/num_examples"]
    return run


def hf_run(kind, config, model, tokenizer, train, held_out, n, max_new):
    import torch

    from grpo.rollout.engines.sampling import PromptEncoder
    from grpo.tasks import word_problems

    encode = PromptEncoder(tokenizer, config.max_prompt_length)
    eos = tokenizer.eos_token_id
    if kind == "hf_sampling":
        ids, mask = encode([r["prompt"] for r in word_problems.rows(train[:2])])
        ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)
        knobs = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=max_new,
                     min_new_tokens=max_new)
        def sample():
            model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static",
                           pad_token_id=tokenizer.pad_token_id, **knobs)
        return sample, 16 * max_new
    ids, mask = encode([r["prompt"] for r in word_problems.rows(held_out[:n])])

    def run():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=128,
                             cache_implementation="static", pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
        ended = torch.cumsum((out == eos).long(), 1) - (out == eos).long()  # EOS counts, tokens after it do not
        return int((ended == 0).sum())
    return run, None


def measure(tree: Path, kind: str, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    cmd = ["taskset", "-c", str(args.core), sys.executable, str(Path(__file__).resolve()), "--worker", kind,
           "--max-new", str(args.max_new), "--eval-prompts", str(args.n)]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{kind} in {tree} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{kind} ({args.n} prompts) in {tree}: {result}", file=sys.stderr, flush=True)  # as they come
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, default=Path("/tmp/base604"))
    parser.add_argument("--new", type=Path, default=ROOT, help="the tree measured against the baseline")
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, nargs="+", default=[50])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "fast_rollouts.json")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.max_new, args.eval_prompts[0])))
        return
    rows = []
    jobs = [("sampling", None)] + [("eval", n) for n in args.eval_prompts]
    for kind, n in jobs:
        args.n = n or 50
        label = "sampling 16 rows" if kind == "sampling" else f"eval {n} prompts"
        # baseline, this tree: alternating, one subprocess each
        pair = {"baseline": measure(args.baseline, kind, args), "new": measure(args.new, kind, args)}
        if not args.skip_hf:
            pair["hf_static"] = measure(args.new, "hf_sampling" if kind == "sampling" else "hf_eval", args)
        rows.append(dict(job=label, **pair, cpu_ratio=pair["new"]["cpu_s"] / pair["baseline"]["cpu_s"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(max_new=args.max_new, baseline=str(args.baseline), new=str(args.new),
                                           rows=rows), indent=1))
    head = f"{'job':<18} {'side':<9} {'CPU s':>7} {'wall s':>7} {'tok/CPU s':>9} {'faults/step':>11} {'peak RSS':>8}"
    print(head)
    for row in rows:
        for side in ("baseline", "new", "hf_static"):
            if side in row:
                r = row[side]
                print(f"{row['job']:<18} {side:<9} {r['cpu_s']:7.1f} {r['wall_s']:7.1f} {r['tokens_per_cpu_s']:9.1f} "
                      f"{r['faults_per_step']:11.0f} {r['peak_rss_gb']:6.2f}GB")
        print(f"{row['job']:<18} new/baseline CPU s: {row['cpu_ratio']:.2f}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
