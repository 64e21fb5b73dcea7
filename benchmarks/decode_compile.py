"""Whether `torch.compile` of the decoding step pays on a CPU: the main job's decode (SmolLM2-135M-Instruct, LoRA
r16 folded, 2 prompts x 8 rows, `--steps` decoding steps after a ~200-token prompt) with policy/decoder's step run
eagerly and compiled (inductor, dynamic shapes: the keys grow by one position a step), one thread. Prints the
compile time (the first compiled steps) and the ms per step of each after it.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/decode_compile.py --steps 64
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import decode_floor
    from grpo.policy.decoder import fused_decoder
    from grpo.policy.folding import sampling_weights
    from grpo.policy.head import positions
    from grpo.policy.models import unwrap
    from grpo.rollout.engines.kv_cache import preallocated_cache
    from grpo.rollout.engines.sampling import PromptEncoder

    load_args = argparse.Namespace(model="smollm2-135m-instruct", lora_r=16, max_new=args.steps, generations=8,
                                   bf16=None)  # Config's default precision plan, as the main job's
    model, tokenizer = decode_floor.load(load_args)
    model.eval()
    ids, mask = PromptEncoder(tokenizer, 256)(decode_floor.prompts(2))
    ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)  # [16, P]
    hf = unwrap(model)
    results = {}
    with torch.no_grad(), sampling_weights(model):
        for mode in ("eager", "compiled"):
            cache = preallocated_cache(hf.config, ids.shape[1] + args.steps + 1)
            hf.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache)
            step = fused_decoder(hf.base_model, cache)
            run = step if mode == "eager" else torch.compile(step.__call__, dynamic=True)
            full = torch.cat([mask, mask.new_ones(16, args.steps)], 1)
            position = positions(mask)[:, -1:]
            token = ids[:, -1:]
            times = []
            for t in range(args.steps):
                position = position + 1
                start = time.perf_counter()
                run(token, full[:, :ids.shape[1] + t + 1], position)
                times.append(time.perf_counter() - start)
            settled = sorted(times[len(times) // 2:])
            results[mode] = dict(first_s=sum(times[:3]), median_ms=settled[len(settled) // 2] * 1e3)
            print(mode, results[mode], flush=True)
    print(f"compiled / eager, ms per step: {results['compiled']['median_ms'] / results['eager']['median_ms']:.2f}; "
          f"the first 3 compiled steps took {results['compiled']['first_s']:.1f} s")


if __name__ == "__main__":
    main()
