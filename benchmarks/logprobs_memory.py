"""Peak extra RSS of one forward + backward of per-token log-probs: chunked vs full logits.

Each measurement runs in a fresh subprocess so peaks do not leak between runs:
extra = peak RSS (VmHWM) after forward+backward - current RSS just before it (inputs already
allocated, so they are not counted; the [V, H] weight gradient is). Times are wall-clock
and noisy on a shared CPU; the memory figures are the point.

    python benchmarks/logprobs_memory.py                      # B=8, T=1024, V=151936, H=256
    python benchmarks/logprobs_memory.py --unchunked-batches 1 2 4   # full logits at B=1,2,4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "logprobs_memory.json"

CHILD = r"""
import json, resource, sys, time
import torch
sys.path.insert(0, {root!r})
from grpo.algo.logprobs import token_logprobs
from grpo.run.logs import peak_rss_bytes

def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

torch.manual_seed(0)
torch.set_num_threads({threads})
B, T, V, H, mode, chunk = {B}, {T}, {V}, {H}, {mode!r}, {chunk}
hidden = torch.randn(B, T, H, requires_grad=True)
weight = (torch.randn(V, H) * 0.05).requires_grad_({train_weight})
targets = torch.randint(0, V, (B, T))
before = rss_now()
t0 = time.perf_counter()
if mode == "chunked":
    logprobs = token_logprobs(hidden, weight, targets, chunk_size=chunk)
else:
    logits = hidden @ weight.T
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
logprobs.sum().backward()
seconds = time.perf_counter() - t0
peak = peak_rss_bytes()  # VmHWM: ru_maxrss would keep this parent's RSS from before exec
print(json.dumps({{"extra_bytes": peak - before, "seconds": seconds}}))
"""


def measure(mode: str, B: int, T: int, V: int, H: int, chunk: int = 512,
            train_weight: bool = True, threads: int = 2) -> dict:
    """Run one forward+backward in a subprocess; return its peak extra RSS and time."""
    code = CHILD.format(root=str(ROOT), B=B, T=T, V=V, H=H, mode=mode, chunk=chunk,
                        train_weight=train_weight, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(mode=mode, B=B, T=T, V=V, H=H, chunk_size=chunk if mode == "chunked" else None,
                  train_weight=train_weight)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--H", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--unchunked-batches", type=int, nargs="*", default=[1, 2],
                   help="batch sizes at which full logits are measured; extrapolated linearly to --B")
    args = p.parse_args()
    size = dict(T=args.T, V=args.V, H=args.H)
    rows = [
        measure("chunked", args.B, chunk=args.chunk_size, **size),
        measure("chunked", args.B, chunk=args.chunk_size, train_weight=False, **size),
    ]
    rows += [measure("unchunked", b, **size) for b in args.unchunked_batches]
    extrapolated = None
    full = [r for r in rows if r["mode"] == "unchunked"]
    if args.B in args.unchunked_batches:
        extrapolated = next(r["extra_bytes"] for r in full if r["B"] == args.B)
    elif len(full) >= 2:
        # Through the two largest measured batches: the most logits-dominated points.
        (b0, m0), (b1, m1) = sorted((r["B"], r["extra_bytes"]) for r in full)[-2:]
        extrapolated = m0 + (m1 - m0) / (b1 - b0) * (args.B - b0)
    print(f"{'mode':<10} {'B':>3} {'T':>5} {'V':>7} {'H':>4} {'chunk':>5} {'W grad':>6} {'extra GB':>9} {'s':>6}")
    for r in rows:
        print(f"{r['mode']:<10} {r['B']:>3} {r['T']:>5} {r['V']:>7} {r['H']:>4} {str(r['chunk_size'] or '-'):>5} "
              f"{str(r['train_weight']):>6} {r['extra_bytes'] / 1e9:>9.3f} {r['seconds']:>6.1f}")
    if extrapolated is not None:
        print(f"unchunked at B={args.B} (linear in B from {args.unchunked_batches}): {extrapolated / 1e9:.2f} GB")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "unchunked_extrapolated_bytes": extrapolated,
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
