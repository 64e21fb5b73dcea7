"""GSM8K: the write-up's system prompt, its XML format and answer accuracy rewards, and the dataset mapped
to chat prompts with the reference answer in an `answer` column."""
from __future__ import annotations

import re

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
    if "####" not in text:
        return None
    return text.split("####")[-1].strip().replace(",", "")


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


def load_gsm8k(split: str):
    """GSM8K (from the hub) as chat prompts; the reference answer (after '####') becomes the `answer` column."""
    from datasets import load_dataset

    data = load_dataset("openai/gsm8k", "main", split=split)
    return data.map(lambda row: {"prompt": chat_prompt(row["question"]), "answer": extract_hash_answer(row["answer"])},
                    remove_columns=data.column_names)
