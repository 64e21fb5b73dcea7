"""GSM8K: the write-up's system prompt, its XML format and answer accuracy rewards, and the dataset mapped
to chat prompts with the reference answer in an `answer` column."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import DatasetError
from ..infra import hub

SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the content of a chat's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return completion[-1]["content"]
    raise TypeError(f"expected a string or a list of chat messages, got {completion!r:.100}")


def extract_xml_answer(text: str) -> str | None:
    """The stripped content of the last <answer>...</answer> block, or None if there is none.
    The block opens at the last <answer> before the last </answer> and closes at the first
    </answer> after that, so with nested tags the innermost block wins."""
    start = text.rfind("<answer>", 0, max(text.rfind("</answer>"), 0))
    if start < 0:
        return None
    start += len("<answer>")
    return text[start:text.find("</answer>", start)].strip()


def extract_hash_answer(text: str) -> str | None:
    """GSM8K's reference answer: the part after `####`, stripped, commas removed (None if absent)."""
    return text.split("####")[-1].strip().replace(",", "") if "####" in text else None


# A number, optionally negative (a minus right after a word is a hyphen or subtraction: "5-3" is 5
# and 3), with an optional decimal part ("5.", "5.0", ".5") and an optional "/denominator".
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d+(?:\.\d*)?|(?<!\d)\.\d+)(?:/\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def parse_number(text: str) -> float | None:
    """The last number in `text` as a float, or None if there is none. Tolerates thousands commas
    ("1,000"), currency ("$5", "-$5"), percent signs, trailing periods and fractions ("1/2")."""
    text = _THOUSANDS.sub("", text.replace("$", ""))
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    numerator, _, denominator = matches[-1].partition("/")
    if not denominator:
        return float(numerator)
    return float(numerator) / float(denominator) if float(denominator) else None


# Content free of any reasoning/answer tag, so that stray or repeated tags break the format.
_TAG_FREE = r"(?:(?!</?(?:reasoning|answer)>).)*"
_XML_FORMAT = re.compile(
    rf"\s*<reasoning>{_TAG_FREE}</reasoning>\s*<answer>(?P<answer>{_TAG_FREE})</answer>\s*", re.DOTALL
)


def xml_format_reward(completions, **kwargs) -> list[float]:
    """Format reward on a 0 / 0.5 / 1 scale.
    1.0: exactly `<reasoning>...</reasoning><answer>...</answer>` with any whitespace around and
         between the blocks, nothing else outside them, no repeated tags, and a non-empty answer;
    0.5: otherwise, a single non-empty <answer>...</answer> block anywhere;
    0.0: anything else."""
    return [_format_score(completion_text(c)) for c in completions]


def _format_score(text: str) -> float:
    match = _XML_FORMAT.fullmatch(text)
    if match and match["answer"].strip():
        return 1.0
    if text.count("<answer>") == 1 and text.count("</answer>") == 1 and extract_xml_answer(text):
        return 0.5
    return 0.0


def answer_accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the number in a completion's last <answer> block equals the reference numerically
    (|diff| < 1e-6), else 0.0; without an <answer> block it is 0.0. A reference that is not a
    number raises (it is a data bug, not the model's fault). The reference may be the extracted
    GSM8K answer or the full GSM8K solution, whose last number is the one after `####`."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        content = extract_xml_answer(completion_text(completion))
        rewards.append(_score(parse_number(content) if content is not None else None, reference))
    return rewards


def last_number_accuracy(completions, answer, **kwargs) -> list[float]:
    """Format-free accuracy: 1.0 when the last number anywhere in a completion, tags or no tags, equals
    the reference numerically, else 0.0 (also without any number). Tolerant as parse_number is ("$1,200",
    "12.0", "-5", "14 apples."). It tells arithmetic learned apart from a format learned."""
    return [_score(parse_number(completion_text(c)), reference)
            for c, reference in zip(completions, answer, strict=True)]


def _score(got: float | None, reference) -> float:
    """1.0 when `got` equals the reference's number (|diff| < 1e-6); a reference without one raises."""
    expected = parse_number(str(reference))
    if expected is None:
        raise ValueError(f"reference answer {reference!r} is not a number")
    return 1.0 if got is not None and abs(got - expected) < 1e-6 else 0.0


def chat_prompt(question: str) -> list[dict]:
    """The write-up's prompt: its system prompt, then the question as the user's turn."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


HUB_ID = "openai/gsm8k"
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
LOCAL_COPY = ("a folder holding its split files (train and test: .parquet, .jsonl, .json or .csv with `question` "
              "and `answer` columns, e.g. the Hub repository's main/train-00000-of-00001.parquet), or the train "
              "file itself")


def load_gsm8k(split: str, path: str | None = None):
    """GSM8K as chat prompts; the reference answer (after '####') becomes the `answer` column. From `path`
    when given (LOCAL_COPY: a folder or a file, `split_file` finds the split), else from the Hub, or its copy in
    the Hugging Face cache when the Hub cannot be reached; DatasetError, within seconds, when neither is there."""
    from datasets import load_dataset

    if path is None:
        if (problem := hub.unreachable()) is None:
            return _as_prompts(load_dataset(HUB_ID, "main", split=split))
        path = hub.cached(HUB_ID, repo_type="dataset")
        if path is None:
            raise DatasetError(f"GSM8K ({HUB_ID} on the Hugging Face Hub) is not in the Hugging Face cache (HF_HOME) "
                               f"and {problem}: set GSM8K_PATH to a local copy, {LOCAL_COPY}")
    file = split_file(Path(path).expanduser(), split)
    data = load_dataset(FORMATS[file.suffix], data_files=str(file), split="train")
    missing = {"question", "answer"} - set(data.column_names)
    if missing:
        raise DatasetError(f"{file} has no {' or '.join(sorted(missing))} column (columns: "
                           f"{', '.join(data.column_names)}): GSM8K's files have `question` and `answer`")
    return _as_prompts(data)


def split_file(path: Path, split: str) -> Path:
    """The file of `split` in a local copy of GSM8K: in a folder (or its `main/`), the first file whose name
    starts with the split; for a file, the file itself for "train" and for another split the file beside it
    named alike (train.jsonl -> test.jsonl). DatasetError naming what was looked for."""
    if path.is_file():
        if path.suffix not in FORMATS:
            raise DatasetError(f"GSM8K_PATH={path}: not a {', '.join(FORMATS)} file")
        if split == "train":
            return path
        beside = path.with_name(path.name.replace("train", split))
        if "train" in path.name and beside.is_file():
            return beside
        raise DatasetError(f"GSM8K_PATH={path} is one file, read as the train split, and there is no {split} file "
                           f"beside it named alike ({beside.name}): put one there, or point GSM8K_PATH at a folder "
                           f"holding both")
    if not path.is_dir():
        raise DatasetError(f"GSM8K_PATH={path}: no such file or folder; point it at {LOCAL_COPY}")
    found = sorted(f for folder in (path, path / "main") for f in folder.glob(f"{split}*") if f.suffix in FORMATS)
    if not found:
        raise DatasetError(f"GSM8K_PATH={path} holds no {split} file ({split}*{'/'.join(FORMATS)}, in it or in "
                           f"its main/): point it at {LOCAL_COPY}")
    return found[0]


def _as_prompts(data):
    return data.map(lambda row: {"prompt": chat_prompt(row["question"]), "answer": extract_hash_answer(row["answer"])},
                    remove_columns=data.column_names)
