"""Weights after 2 optimizer steps here and in TRL 1.16's GRPOTrainer, from the same tiny model, on the same
fixed completions (a `rollout_func` on both sides), for each loss_type with TRL's defaults (bias-corrected KL
included, beta=0.04 so that it counts); prints loss_type x {max weight difference, loss, kl} per side.

    python benchmarks/parity_trl.py [--loss_types dapo,grpo,...] [--steps 2] [--json FILE]

Needs trl (pip install -e ".[bench]"); tests/system/test_parity_trl.py runs it on two loss types."""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import zlib

import torch
from datasets import Dataset

from grpo import Config, Trainer
from grpo.tasks.tiny import model_for, train_tokenizer

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo")
CORPUS = [f"Write {k} digits: " + "0123456789"[:k] for k in range(1, 10)] * 20
# Both sides get the same batch shape: 2 prompts x 4 completions per micro-batch, 2 micro-batches per step.
SHARED = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4, learning_rate=1e-2,
              beta=0.04, max_completion_length=8, seed=0, max_grad_norm=1.0)
PROMPT = "Write 5 digits:"  # every row the same prompt: the two sides' data orders cannot differ


def fixed_rollout_func(tokenizer, max_len: int):
    """TRL's rollout_func contract; the k-th completion asked for is the same on both sides, however many
    each call asks for (a generation batch's worth on both sides)."""
    rows = [0]
    eos = tokenizer.eos_token_id

    def rollout_func(prompts, trainer):
        completion_ids = []
        for _ in prompts:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{rows[0]}".encode()))
            rows[0] += 1
            length = int(torch.randint(1, max_len + 1, (), generator=gen))
            ids = torch.randint(4, len(tokenizer), (length,), generator=gen).tolist()
            completion_ids.append(ids[:-1] + [eos] if length < max_len else ids)  # some end early, some run out
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}
    return rollout_func


def digit_share(completions, **kwargs):
    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]


def run_ours(model, tokenizer, loss_type: str, steps: int, out: str, shared: dict):
    config = Config(output_dir=out, max_steps=steps, loss_type=loss_type, optim="adamw", bf16=False,
                    save_steps=10**6, **shared)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 64),
                      rollout_func=fixed_rollout_func(tokenizer, SHARED["max_completion_length"]))
    trainer.train()
    return trainer.model, [{"loss": h["loss"], "kl": h["kl"]} for h in trainer.state.log_history if "loss" in h]


def run_trl(model_dir: str, tokenizer, loss_type: str, steps: int, out: str, shared: dict):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl.trainer.grpo_trainer
    from trl import GRPOConfig, GRPOTrainer

    # TRL shuffles a generation batch before cutting it into micro-batches; we keep its order. Only the
    # per-micro-batch normalizations (bnpo) see the cut, so TRL's shuffle is turned off to compare the math.
    trl.trainer.grpo_trainer.shuffle_sequence_dict = lambda batch: batch

    args = GRPOConfig(output_dir=out, max_steps=steps, loss_type=loss_type, optim="adamw_torch", bf16=False,
                      use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                      dataloader_num_workers=0, **shared)
    # A path, not the model object: with beta > 0 TRL loads its reference model from the same path.
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[digit_share], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 64),
                          rollout_func=fixed_rollout_func(tokenizer, SHARED["max_completion_length"]))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer.model, [{"loss": h["loss"], "kl": h.get("kl", 0.0)} for h in logs]


def compare(loss_type: str, steps: int = 2, **settings) -> dict:
    """One loss type on both sides; `settings` override SHARED (e.g. steps_per_generation)."""
    shared = {**SHARED, **settings}
    tokenizer = train_tokenizer(CORPUS, vocab_size=200)
    model = model_for(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(os.path.join(out, "model"))
        ours, our_logs = run_ours(copy.deepcopy(model), tokenizer, loss_type, steps, os.path.join(out, "ours"), shared)
        theirs, trl_logs = run_trl(os.path.join(out, "model"), tokenizer, loss_type, steps, os.path.join(out, "trl"),
                                   shared)
    theirs_by_name = dict(theirs.named_parameters())
    diff = max((p - theirs_by_name[n]).abs().max().item() for n, p in ours.named_parameters())
    moved = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), model.parameters()))
    return {"loss_type": loss_type, "max_weight_diff": diff, "max_weight_change": moved,
            "ours": our_logs, "trl": trl_logs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss_types", default=",".join(LOSS_TYPES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--steps_per_generation", type=int, default=None,
                        help="e.g. 2 with --gradient_accumulation_steps=1: one generation batch feeds 2 steps")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=SHARED["gradient_accumulation_steps"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    settings = dict(gradient_accumulation_steps=args.gradient_accumulation_steps,
                    steps_per_generation=args.steps_per_generation)
    rows = [compare(t, args.steps, **settings) for t in args.loss_types.split(",")]
    print(f"{'loss_type':<10}{'max |dw|':>12}{'max change':>12}  loss ours / TRL per step, kl ours / TRL per step")
    for r in rows:
        losses = " ".join(f"{a['loss']:.6f}/{b['loss']:.6f}" for a, b in zip(r["ours"], r["trl"]))
        kls = " ".join(f"{a['kl']:.6f}/{b['kl']:.6f}" for a, b in zip(r["ours"], r["trl"]))
        print(f"{r['loss_type']:<10}{r['max_weight_diff']:>12.2e}{r['max_weight_change']:>12.2e}  {losses}  kl {kls}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
