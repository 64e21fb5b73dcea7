"""Supervised warm start (a "cold start", as DeepSeek-R1 calls it): next-token training on worked examples,
so that a model built from scratch earns some reward before GRPO begins. Loss on completion tokens only."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from ..policy.optim import build_scheduler, warmup_of
from ..infra.progress import progress_bar, quiet_library_bars


def encode_examples(tokenizer, examples: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) per example. Prompt and completion are tokenized apart, as the
    trainer sees them: the prompt alone through the tokenizer, then the generated tokens after it."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; the warm start must teach the model to stop")
    return [(tokenizer(p)["input_ids"], tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            for p, c in examples]


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    width = max(len(p) + len(c) for p, c in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(ids)  # [B, T]
    labels = torch.full_like(ids, -100)  # [B, T]
    for i, (p, c) in enumerate(encoded):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(c)
    return ids, mask, labels


def supervised_warm_start(model, tokenizer, examples: list[tuple[str, str]], *, steps: int, lr: float,
                          batch_size: int, seed: int, warmup_ratio: float = 0.05) -> dict[str, float]:
    """Train `model` in place for `steps` AdamW steps on `(prompt, completion)` pairs, cross-entropy on the
    completion tokens and the EOS after them. Batches walk seeded permutations of the examples (a new one
    each epoch); the learning rate warms up, then follows a cosine to 0. Returns `warm_start/*` metrics."""
    if steps <= 0 or not examples:
        raise ValueError(f"a warm start needs steps > 0 and examples (got steps={steps}, {len(examples)} examples)")
    encoded = encode_examples(tokenizer, examples)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    scheduler = build_scheduler(optimizer, steps, warmup_of(steps, warmup_ratio, 0), "cosine")
    order, position, losses = torch.randperm(len(encoded), generator=generator).tolist(), 0, []
    model.train()
    t0 = time.perf_counter()
    bar = progress_bar("warm start", total=steps, unit="step")
    for _ in range(steps):
        if position + batch_size > len(order):
            order, position = torch.randperm(len(encoded), generator=generator).tolist(), 0
        batch = [encoded[i] for i in order[position:position + batch_size]]
        position += batch_size
        ids, mask, labels = (t.to(device) for t in collate(batch, tokenizer.pad_token_id))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.update(1)
    bar.close()
    tail = losses[-max(1, steps // 10):]
    return {"warm_start/steps": steps, "warm_start/loss_first": losses[0],
            "warm_start/loss_last": sum(tail) / len(tail), "warm_start/seconds": time.perf_counter() - t0}


def warm_start_once(folder: Path, settings: dict, warm_start) -> tuple:
    """`warm_start()`'s (model, tokenizer), written into `folder` and loaded from there later while `settings`
    (JSON data: whatever shapes the result) are the same: a run's warm start is done once, not again when the
    run is resumed or evaluated. Written whole or not at all, so ranks warming up together do not mix."""
    stamp = folder / "warm_start.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == settings:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"warm start: loaded from {folder} (done before, with the same settings)")
        with quiet_library_bars():
            return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    model, tokenizer = warm_start()
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    with quiet_library_bars():
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / stamp.name).write_text(json.dumps(settings))
    shutil.rmtree(folder, ignore_errors=True)  # another settings' warm start
    try:
        os.rename(tmp, folder)
    except OSError:  # another rank's, with the same settings, got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer
