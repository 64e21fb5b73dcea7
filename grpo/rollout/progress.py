"""Progress a person can see during long sampling and evaluation: a tqdm counter of generated tokens (with
tokens/s), advanced from the decoding loop after every new token, instead of a bar that sits at 0 until a
whole step or evaluation batch is done."""
from __future__ import annotations

from tqdm.auto import tqdm


class TokenProgress:
    """`progress(n)` adds n generated tokens; `progress.prompts_done(k, total)` shows k/total in the postfix.
    Use as a context manager; disabled, it does nothing."""

    def __init__(self, desc: str, enabled: bool = True):
        self.bar = tqdm(desc=desc, unit="tok", leave=False, dynamic_ncols=True, disable=not enabled, mininterval=1.0)

    def __call__(self, new_tokens: int) -> None:
        self.bar.update(int(new_tokens))

    def prompts_done(self, done: int, total: int) -> None:
        self.bar.set_postfix_str(f"prompts {done}/{total}", refresh=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
