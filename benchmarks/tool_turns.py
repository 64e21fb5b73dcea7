"""What a tool round costs inside our decode loop: a generation batch whose rows are fed tool output (multi-turn)
against one whose rows sample every token (single-turn), with the same number of sampled plus tool tokens per
row, on a random-weight model with SmolLM2-135M's shapes. Tool output goes into the row's own KV cache, one
token per step beside the other rows' sampled ones, so no conversation is prefilled again: the figure is the
multi-turn batch's CPU time over the single-turn one's (issue: <= 1.2x).

A random model calls no tool on its own, so the rounds are scripted: every `--every` tokens a row samples, it is
fed `--fed` tokens, through the decode loop's ForcedTokens and with a real ToolLoop (the inline calculator, the
wide tokenizer) reading every sampled token as in training. Both kinds alternate in one process, one thread:

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/tool_turns.py      # prints a table, writes JSON
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.rollout.engines.decoding import DecodeSettings, decode
from grpo.rollout.engines.tool_loop import ToolLoop
from grpo.rollout.tools import Tools
from grpo.tasks.calculator import INLINE_CALCULATOR
from grpo.tasks.tiny import wide_tokenizer

ROOT = Path(__file__).resolve().parents[1]


class ScriptedRounds:
    """A ToolLoop (it reads every sampled token, as in training) whose rows are also fed `fed` tokens after every
    `every` tokens they sample: `loop` (what the decode is handed) answers through `after_tokens` here."""

    def __init__(self, loop: ToolLoop, every: int, fed: int, token: int):
        self.loop, self.every, self.fed, self.token = loop, every, fed, token
        self.own, loop.after_tokens = loop.after_tokens, self.after_tokens  # what the loop's row_ends asks
        self.sampled: dict[int, int] = {}
        self.rounds = 0

    def after_tokens(self, rows, tokens, room):
        reaction = self.own(rows, tokens, room)
        for r, space in zip(rows, room):
            self.sampled[r] = self.sampled.get(r, 0) + 1
            if self.sampled[r] % self.every == 0 and space > self.fed and r not in reaction:
                reaction[r] = [self.token] * self.fed
                self.rounds += 1
        return reaction


def smollm2_shapes(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def timed(fn) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rows decoding together (2 prompts x 8)")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row: sampled plus fed")
    parser.add_argument("--every", type=int, default=20, help="a round after every this many sampled tokens")
    parser.add_argument("--fed", type=int, default=12, help="tokens fed per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "tool_turns.json")
    args = parser.parse_args()
    tokenizer = wide_tokenizer(49152)
    model = smollm2_shapes(len(tokenizer))
    prompts = torch.randint(300, len(tokenizer), (2, args.prompt_tokens))  # [B, P]
    mask = torch.ones_like(prompts)  # [B, P]
    settings = DecodeSettings(args.tokens, [tokenizer.eos_token_id], tokenizer.pad_token_id, stop_at_eos=False)
    seeds = torch.arange(args.rows)  # [N]
    repeats = args.rows // len(prompts)
    tools = Tools.of([INLINE_CALCULATOR])
    fed_token = tokenizer.encode(" w1", add_special_tokens=False)[0]
    times = {"single-turn": [], "multi-turn": []}
    rounds = 0
    for _ in range(args.repeats):
        times["single-turn"].append(timed(lambda: decode(model, prompts, mask, settings, repeats=repeats,
                                                         seeds=seeds)))
        scripted = ScriptedRounds(ToolLoop(tools, tokenizer, ["x"] * args.rows), args.every, args.fed, fed_token)
        out = {}
        times["multi-turn"].append(timed(lambda: out.update(d=decode(
            model, prompts, mask, settings, repeats=repeats, seeds=seeds, tools=scripted.loop))))
        rounds = scripted.rounds
        fed = int(out["d"].fed.sum())
    best = {k: min(v) for k, v in times.items()}  # (cpu, wall) of the fastest repeat
    ratio = best["multi-turn"][0] / best["single-turn"][0]
    load = os.getloadavg()[0]
    print(f"{args.rows} rows x {args.tokens} tokens after {args.prompt_tokens}-token prompts; multi-turn: {rounds} "
          f"rounds, {fed} of {args.rows * args.tokens} tokens fed; load {load:.2f}")
    print("| kind | CPU s | wall s |\n|---|---|---|")
    for kind, (cpu, wall) in best.items():
        print(f"| {kind} | {cpu:.2f} | {wall:.2f} |")
    print(f"multi-turn / single-turn CPU time: {ratio:.3f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "times": times,
                                       "rounds": rounds, "fed_tokens": fed, "cpu_ratio": ratio, "load": load,
                                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
                                      indent=1))


if __name__ == "__main__":
    main()
