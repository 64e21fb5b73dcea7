"""The main job's sampling side by side with vLLM's CPU backend on one core: the same 2 word-problem chat prompts x
8 completions of exactly 128 tokens (EOS ignored), temperature 0.7, LoRA r16 on every linear (a random adapter
with B != 0, so the adapter's path is taken), vLLM served from its own virtual environment (.ci/vllm_venv.sh;
never a dependency of grpo) pinned to `--core`, in each `--dtypes`; ours (benchmarks/decode_floor.py's timed
worker, this tree or `--tree`) on the same core, alternating with vLLM's requests. vLLM's time is one
`/v1/completions` request after a warm-up one (server start-up not counted), its CPU seconds those of the server's
process tree over the request.

    .ci/vllm_venv.sh install /tmp/vllm-venv            # once (flock-guarded)
    python benchmarks/vs_vllm_decode.py --core 1 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_floor  # noqa: E402


def prepare(out: Path) -> tuple[str, Path, list[list[int]]]:
    """The model folder, a saved LoRA adapter (r16 alpha 32 on every linear, B random) and the prompts' ids."""
    import torch

    from grpo.policy.gguf import resolve_model_path
    from grpo.rollout.engines.sampling import PromptEncoder

    args = argparse.Namespace(model="smollm2-135m-instruct", lora_r=16, max_new=128, generations=8,
                              bf16=None)  # Config's default precision plan
    model, tokenizer = decode_floor.load(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    adapter = out / "adapter"
    model.save_pretrained(adapter)
    ids, mask = PromptEncoder(tokenizer, 256)(decode_floor.prompts(2))
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return resolve_model_path("smollm2-135m-instruct"), adapter, prompts


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and every process below it."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
            except (OSError, IndexError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, (ppid, _) in parents.items():
            if ppid == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(parents[p][1] for p in tree if p in parents) / os.sysconf("SC_CLK_TCK")


def request(port: int, prompts: list[list[int]]) -> float:
    """One completions request for all prompts (n=8 each, exactly 128 tokens): its wall seconds."""
    body = json.dumps(dict(model="adapter", prompt=prompts, n=8, max_tokens=128, min_tokens=128, ignore_eos=True,
                           temperature=0.7, top_p=1.0)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as response:
        out = json.loads(response.read())
    assert len(out["choices"]) == 8 * len(prompts), out
    return time.perf_counter() - t


def serve(args, folder: str, adapter: Path, dtype: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(args.core),
           "VLLM_LOG": f"{args.out}/vllm-{dtype}.log"}
    cmd = ["taskset", "-c", str(args.core), "bash", str(ROOT / ".ci" / "vllm_venv.sh"), "serve", folder,
           str(args.port), args.venv, "--dtype", dtype, "--lora-modules", f"adapter={adapter}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"vLLM server ({dtype}) did not start:\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", default=os.environ.get("VLLM_VENV", "/tmp/vllm-venv"))
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--port", type=int, default=8253)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "vs_vllm_decode.json")
    args = parser.parse_args()
    args.out = Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    folder, adapter, prompts = prepare(args.out)
    ours_args = argparse.Namespace(model="smollm2-135m-instruct", lora_r=16, prompts=2, generations=8, max_new=128,
                                   core=args.core)
    result = dict(ours=[], vllm={})
    for dtype in args.dtypes:
        pid = serve(args, folder, adapter, dtype)
        try:
            request(args.port, prompts)  # warm-up
            runs = []
            for _ in range(args.repeats):  # ours and vLLM's alternate on the same core
                result["ours"].append(decode_floor.run_worker(args.tree, "timed", ours_args))
                cpu0 = tree_cpu_seconds(pid)
                wall = request(args.port, prompts)
                runs.append(dict(wall_s=wall, cpu_s=tree_cpu_seconds(pid) - cpu0))
                print(f"vLLM {dtype}: {runs[-1]}", file=sys.stderr, flush=True)
            result["vllm"][dtype] = runs
        finally:
            subprocess.run(["kill", "--", f"-{pid}"], capture_output=True)  # setsid: its own process group
            time.sleep(2)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    ours_wall = [r["wall_s"] for r in result["ours"]]
    ours_cpu = [r["cpu_s"] for r in result["ours"]]
    print(f"ours ({args.tree}): wall min {min(ours_wall):.2f} median {statistics.median(ours_wall):.2f} s, "
          f"CPU min {min(ours_cpu):.2f} s")
    for dtype, runs in result["vllm"].items():
        wall, cpu = [r["wall_s"] for r in runs], [r["cpu_s"] for r in runs]
        print(f"vLLM CPU {dtype}: wall min {min(wall):.2f} median {statistics.median(wall):.2f} s, CPU min "
              f"{min(cpu):.2f} s; ours/vLLM wall (min) {min(ours_wall) / min(wall):.2f}x, CPU "
              f"{min(ours_cpu) / min(cpu):.2f}x")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
