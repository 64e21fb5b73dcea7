"""The prompt stream (a reshuffled pass over the dataset per epoch, resumable from (epoch, position)); an
eval_dataset's sets; the checks of a dataset before training (its prompts, and a chat template for chat ones)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ConfigError, DatasetError, setting


def is_stream(dataset) -> bool:
    """Whether `dataset` is a streaming datasets.IterableDataset: rows in order, no length, none by index."""
    return dataset is not None and not hasattr(dataset, "__len__") and hasattr(dataset, "set_epoch")


def first_rows(dataset, limit: int | None = None):
    """The first `limit` rows of `dataset` (all when None) as a datasets.Dataset; a stream's read into memory."""
    if not is_stream(dataset):
        return dataset if limit is None else dataset.select(range(min(limit, len(dataset))))
    from datasets import Dataset

    return Dataset.from_list(list(dataset if limit is None else dataset.take(limit)), features=dataset.features)


def checked_rows(dataset):
    """What the checks before training read of `dataset`: a stream's first row (read once, for them all), else it."""
    return first_rows(dataset, 1) if is_stream(dataset) else dataset


def check_dataset(dataset, name: str = "train_dataset", environments: bool = False) -> None:
    """Fail early, in one line, on datasets the trainer cannot use (the first prompt's type is every prompt's). With
    `environments` (reset() writes the prompts) the prompt column may be missing; a stream is checked on a row."""
    dataset = checked_rows(dataset)
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        raise DatasetError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}")
    if len(dataset) == 0:  # before the columns: a Dataset made from no rows has none
        raise DatasetError(f"{name} is empty (no rows)")
    if environments and "prompt" not in columns:
        return
    if "prompt" not in columns:
        raise DatasetError(f"{name} has no 'prompt' column (columns: {', '.join(columns) or 'none'})")
    column = dataset.with_format("arrow")["prompt"]
    missing = column.null_count
    if missing:
        raise DatasetError(f"{name} has {missing} missing (None) prompts out of {len(dataset)}")
    first = dataset[0]["prompt"]
    if not isinstance(first, (str, list)) or (isinstance(first, list) and not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in first)):
        raise DatasetError(f"{name}['prompt'] must hold strings or lists of {{'role', 'content'}} messages, "
                           f"got {type(first).__name__} {str(first)[:200]!r}")
    import pyarrow.compute as pc

    # An empty prompt has nothing to sample after: with no BOS token it is no tokens at all.
    chat = isinstance(first, list)
    lengths = (pc.list_value_length(column) if chat else pc.utf8_length(column)).to_pylist()
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        what, needs = (("chat prompts (no messages)", "at least one {'role', 'content'} message") if chat else
                       ("prompts ('')", "some text"))
        raise DatasetError(f"{name} has {len(empty)} empty {what} out of {len(dataset)}, first at row {empty[0]}: "
                           f"each needs {needs}; drop them with {name}.filter(lambda row: len(row['prompt']) > 0)")


class PromptTooLong(DatasetError):
    """A prompt of more tokens than the model's context, said by its text, then by its dataset row once the caller
    names the dataset (`in_dataset`). `room`: the longest prompt that leaves room for a whole completion."""

    def __init__(self, prompt, tokens: int, context: int, max_prompt_length: int | None, room: int,
                 where: str | None = None):
        super().__init__(prompt, tokens, context, max_prompt_length, room, where)
        self.prompt, self.tokens, self.context, self.max_prompt_length, self.room, self.where = self.args

    def __str__(self) -> str:
        where = self.where or f"the prompt {str(self.prompt)[:80]!r}..."
        whole = ", and max_prompt_length=None keeps prompts whole" if self.max_prompt_length is None else ""
        return (f"{where} is {self.tokens:,} tokens, more than the model's context of {self.context:,} positions "
                f"(its max_position_embeddings){whole}: set {setting('max_prompt_length', self.room)} to cut prompts "
                f"from the left and leave room for the completion, or drop the row")

    def in_dataset(self, dataset, name: str) -> PromptTooLong:
        """The same error naming the first row of `dataset` (called `name`) that holds the prompt (else itself)."""
        prompts = dataset["prompt"] if not is_stream(dataset) and "prompt" in dataset.column_names else []
        if self.prompt not in prompts:
            return self
        where = f"{name} row {prompts.index(self.prompt)}: its prompt"
        return PromptTooLong(*self.args[:-1], where)


def eval_sets(dataset) -> dict:
    """{key suffix: dataset} of an eval_dataset: {"": it}, or for several (a dict or a DatasetDict) {"_<name>": each},
    evaluated apart under the metric key prefix `eval_<name>`, as in transformers."""
    return {f"_{name}": d for name, d in dataset.items()} if isinstance(dataset, Mapping) else {"": dataset}


def check_chat_template(tokenizer, train_rows, eval_rows: dict) -> None:
    """ConfigError, before anything is sampled, where a dataset holds chat prompts and the tokenizer no template."""
    named = {"train_dataset": train_rows, **{f"eval_dataset{k}": d for k, d in eval_rows.items()}}
    for name, dataset in named.items():  # a dataset without prompts has an environment's: chat ones (TRL's)
        first = first_rows(dataset, 1) if dataset is not None else []
        if len(first) and isinstance(first[0].get("prompt", []), list) and not tokenizer.chat_template:
            raise ConfigError(f"{name} holds chat prompts (lists of messages), but the tokenizer has no chat "
                              f"template to render them: pass an instruct model's tokenizer, set "
                              f"tokenizer.chat_template, or give the prompts as text")


class PromptStream:
    """Yields batches of dataset rows in a seeded order, a new permutation every epoch (`shuffle` False: in order);
    a stream (`is_stream`) as TRL reads one, through datasets' buffered shuffle seeded with `seed` + epoch.
    `run_rows`: the rows the run draws, a stream's epoch as transformers counts it (`epoch_rows`)."""

    def __init__(self, dataset, seed: int, shuffle: bool = True, run_rows: float | None = None):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.stream = is_stream(dataset)
        self.length = None if self.stream else len(dataset)  # rows per epoch: a stream's once it has ended
        # transformers' state.epoch of a dataset without a length is steps / max_steps: an epoch is the run
        self.epoch_rows = run_rows if self.stream else self.length
        self.epoch, self.position = 0, 0
        self.reader, self.reader_at = None, None  # a stream's open iterator and the (epoch, position) it is at
        self.order = self._permutation()

    def _permutation(self) -> list[int]:
        if self.stream:
            return []
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    @property
    def drawn(self) -> int:
        """Rows drawn so far, over every epoch: the place in the run's stream of the next one."""
        return self.epoch * (self.length or 0) + self.position

    def next(self, n: int) -> dict[str, list]:
        """The next `n` rows as columns ({"prompt": [...], "answer": [...], ...}), wrapping epochs."""
        if self.stream:
            rows = self._read(n)
            return {k: [row[k] for row in rows] for k in rows[0]}
        indices = []
        while len(indices) < n:
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self._permutation()
            take = min(n - len(indices), len(self.order) - self.position)
            indices += self.order[self.position:self.position + take]
            self.position += take
        return self.dataset[indices]

    def _read(self, n: int) -> list[dict]:
        """A stream's next `n` rows, read on by its open iterator, or by one opened at (epoch, position) when that
        was set elsewhere (a checkpoint, a redraw on resume, the sampler process)."""
        rows = []
        while len(rows) < n:
            if self.reader_at != (self.epoch, self.position):
                ordered = self.dataset.shuffle(seed=self.seed) if self.shuffle else self.dataset
                ordered = ordered.skip(self.position)
                ordered.set_epoch(self.epoch)  # the shuffle's seed is seed + epoch, as transformers' epochs set it
                self.reader, self.reader_at = iter(ordered), (self.epoch, self.position)
            row = next(self.reader, None)
            if row is None and self.position == 0:
                raise DatasetError("train_dataset is a stream that yields no rows")
            if row is None:  # the end of an epoch: read again from the start
                self.length, self.epoch, self.position = self.position, self.epoch + 1, 0
                continue
            rows.append(row)
            self.position += 1
            self.reader_at = (self.epoch, self.position)
        return rows

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, **({"length": self.length} if self.stream else {})}

    def load_state_dict(self, state: dict, redraw: int = 0) -> None:
        """The inverse of `state_dict`, then `redraw` rows before that position (into earlier epochs) drawn again."""
        self.epoch, self.position = state["epoch"], state["position"]
        self.length = state.get("length") if self.stream else self.length
        while redraw > self.position and self.epoch > 0:
            redraw, self.epoch, self.position = redraw - self.position, self.epoch - 1, self.length
        self.position = max(0, self.position - redraw)
        self.order = self._permutation()


def per_completion(columns: dict[str, list], num_generations: int) -> dict[str, list]:
    """Each prompt's row repeated for its `num_generations` completions: completion i belongs to prompt i // G."""
    return {k: [v for v in values for _ in range(num_generations)] for k, values in columns.items()}
