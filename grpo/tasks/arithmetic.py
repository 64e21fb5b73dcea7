"""An offline arithmetic task for the runs-anywhere recipe: multi-digit addition in the GSM8K
`<reasoning>/<answer>` format, with *worked* demonstrations (column by column, each carry written out) and
*direct* ones (the sum alone) for a supervised warm start; why their mix leaves GRPO something to discover:
docs/shipped-recipes.md, "arithmetic_tiny"."""
from __future__ import annotations

import random


def problems(n: int, digits: int, seed: int, exclude: set | frozenset = frozenset()) -> list[tuple[int, int]]:
    """`n` distinct pairs (a, b) of `digits`-digit numbers, none of them in `exclude`."""
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    if n > (high - low + 1) ** 2 - len(exclude):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems")
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def split(num_train: int, num_eval: int, digits: int, seed: int = 0) -> tuple[list, list]:
    """Train and held-out problems that never overlap (the held-out ones are drawn first and excluded)."""
    held_out = problems(num_eval, digits, seed=seed + 1)
    return problems(num_train, digits, seed=seed, exclude=set(held_out)), held_out


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def reasoning(a: int, b: int) -> str:
    """Column-by-column addition from the right, one fixed-width line per column, `x+y+carry=ss` (the
    two-digit column sum: carry out, then the digit). The fixed layout puts every digit at the same
    position in every problem, which a tiny model learns to look up quickly."""
    lines, carry = [], 0
    for x, y in zip(str(a).zfill(len(str(b)))[::-1], str(b).zfill(len(str(a)))[::-1]):
        s = int(x) + int(y) + carry
        lines.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return "<reasoning>" + "\n".join(lines) + "</reasoning>"


def worked(a: int, b: int) -> str:
    """The column-by-column reasoning, then the sum in `<answer>` tags."""
    return f"{reasoning(a, b)}\n<answer>{a + b}</answer>"


def direct(a: int, b: int) -> str:
    """The sum with no working: the same format, an empty reasoning block."""
    return f"<reasoning></reasoning>\n<answer>{a + b}</answer>"


def demonstrations(pairs: list[tuple[int, int]], worked_share: float, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) pairs; a `worked_share` fraction of them (chosen at random) show the working."""
    rng = random.Random(seed)
    return [(prompt(a, b), worked(a, b) if rng.random() < worked_share else direct(a, b)) for a, b in pairs]


def rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """Dataset rows: the prompt and the reference answer (as text, like GSM8K's)."""
    return [{"prompt": prompt(a, b), "answer": str(a + b)} for a, b in pairs]
