"""Supervised warm start (a "cold start", as DeepSeek-R1 calls it): next-token training on worked examples,
so that a model built from scratch earns some reward before GRPO begins. Loss on completion tokens only."""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..policy.optim import build_scheduler, warmup_of


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
    bar = tqdm(range(steps), desc="warm start", dynamic_ncols=True)
    for _ in bar:
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
    bar.close()
    tail = losses[-max(1, steps // 10):]
    return {"warm_start/steps": steps, "warm_start/loss_first": losses[0],
            "warm_start/loss_last": sum(tail) / len(tail), "warm_start/seconds": time.perf_counter() - t0}
