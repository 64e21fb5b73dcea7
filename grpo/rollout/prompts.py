"""The prompt stream: a reshuffled pass over the dataset per epoch, resumable from (epoch, position); the checks
of a dataset before training (its prompts, and a chat template for chat ones)."""
from __future__ import annotations


import torch

from ..errors import ConfigError, DatasetError, setting


def check_not_streaming(dataset, name: str) -> None:
    """DatasetError for a streaming datasets.IterableDataset, which has no length and no rows by index."""
    if dataset is not None and not hasattr(dataset, "__len__") and hasattr(dataset, "column_names"):
        raise DatasetError(f"{name} is a streaming IterableDataset: prompts are read here by index (a seeded shuffle "
                           f"each epoch, a checkpoint resuming at its row), which a stream has not; load it as a "
                           f"Dataset (streaming=False), or take its first rows: Dataset.from_list(list(ds.take(N)))")


def check_dataset(dataset, name: str = "train_dataset", environments: bool = False) -> None:
    """Fail early, in one line, on datasets the trainer cannot use. A column has one Arrow type, so the
    first prompt's type is every prompt's type, apart from missing (None) ones, counted separately. With
    `environments` (an environment_factory's reset() writes the prompts) the prompt column may be missing, as
    in TRL."""
    check_not_streaming(dataset, name)
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        raise DatasetError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}")
    if len(dataset) == 0:  # before the columns: a Dataset made from no rows has none
        raise DatasetError(f"{name} is empty (no rows)")
    if environments and "prompt" not in columns:
        return
    if "prompt" not in columns:
        raise DatasetError(f"{name} has no 'prompt' column (columns: {', '.join(columns) or 'none'})")
    missing = dataset.with_format("arrow")["prompt"].null_count
    if missing:
        raise DatasetError(f"{name} has {missing} missing (None) prompts out of {len(dataset)}")
    first = dataset[0]["prompt"]
    if not isinstance(first, (str, list)) or (isinstance(first, list) and not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in first)):
        raise DatasetError(f"{name}['prompt'] must hold strings or lists of {{'role', 'content'}} messages, "
                           f"got {type(first).__name__} {str(first)[:200]!r}")
    import pyarrow.compute as pc

    # An empty prompt has nothing to sample after: with no BOS token it is no tokens at all.
    column = dataset.with_format("arrow")["prompt"]
    chat = isinstance(first, list)
    lengths = (pc.list_value_length(column) if chat else pc.utf8_length(column)).to_pylist()
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        what, needs = (("chat prompts (no messages)", "at least one {'role', 'content'} message") if chat else
                       ("prompts ('')", "some text"))
        raise DatasetError(f"{name} has {len(empty)} empty {what} out of {len(dataset)}, first at row {empty[0]}: "
                           f"each needs {needs}; drop them with {name}.filter(lambda row: len(row['prompt']) > 0)")


class PromptTooLong(DatasetError):
    """A prompt of more tokens than the model's context (`context`), found as it is encoded: said by its text,
    then by its dataset row once the caller that drew it names the dataset (`in_dataset`). `max_prompt_length`:
    the run's (None: prompts whole); `room`: the longest prompt that leaves room for a whole completion."""

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
        """The same error naming the first row of `dataset` (called `name`) that holds the prompt (itself when
        none does: a prompt an environment's reset made)."""
        prompts = dataset["prompt"] if "prompt" in dataset.column_names else []
        if self.prompt not in prompts:
            return self
        where = f"{name} row {prompts.index(self.prompt)}: its prompt"
        return PromptTooLong(*self.args[:-1], where)


def check_chat_template(tokenizer, datasets: dict) -> None:
    """ConfigError, before anything is sampled, when a dataset of `datasets` (name: dataset or None) holds chat
    prompts (its first row's type is every row's) and `tokenizer` has no chat template to render them."""
    for name, dataset in datasets.items():  # a dataset without prompts has an environment's: chat ones (TRL's)
        if dataset is not None and len(dataset) and isinstance(dataset[0].get("prompt", []), list) \
                and not tokenizer.chat_template:
            raise ConfigError(f"{name} holds chat prompts (lists of messages), but the tokenizer has no chat "
                              f"template to render them: pass an instruct model's tokenizer, set "
                              f"tokenizer.chat_template, or give the prompts as text")


class PromptStream:
    """Yields batches of dataset rows in a seeded order, a new permutation every epoch; with `shuffle` False, in
    the dataset's own order (TRL's shuffle_dataset=False)."""

    def __init__(self, dataset, seed: int, shuffle: bool = True):
        self.dataset = dataset
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.position = 0
        self.order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    @property
    def drawn(self) -> int:
        """Rows drawn so far, over every epoch: the place in the run's stream of the next one."""
        return self.epoch * len(self.order) + self.position

    def next(self, n: int) -> dict[str, list]:
        """The next `n` rows as columns ({"prompt": [...], "answer": [...], ...}), wrapping epochs."""
        indices = []
        while len(indices) < n:
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self._permutation()
            take = min(n - len(indices), len(self.order) - self.position)
            indices += self.order[self.position:self.position + take]
            self.position += take
        return self.dataset[indices]

    def rewind(self, n: int) -> None:
        """Step back `n` rows (into earlier epochs if need be), so that `next` draws them again."""
        while n > self.position and self.epoch > 0:
            n -= self.position
            self.epoch -= 1
            self.order = self._permutation()
            self.position = len(self.order)
        self.position = max(0, self.position - n)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.order = self._permutation()


def per_completion(columns: dict[str, list], num_generations: int) -> dict[str, list]:
    """Each prompt's row repeated for its `num_generations` completions: completion i belongs to prompt
    i // num_generations, everywhere in the trainer (sampling repeats the prompt ids the same way)."""
    return {k: [v for v in values for _ in range(num_generations)] for k, values in columns.items()}
