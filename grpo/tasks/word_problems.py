"""GSM8K-style word problems generated in code: one or two operations (add, subtract, multiply, share
equally), small numbers, whole-number answers; train / held-out splits disjoint by problem (template and
numbers), not only by wording; chat prompts with the GSM8K system prompt and one worked example turn."""
from __future__ import annotations

import random
from dataclasses import dataclass

from .gsm8k import SYSTEM_PROMPT

NAMES = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lena", "Omar", "Julia", "Ravi", "Emma", "Noah", "Chloe"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "cards", "books", "flowers", "eggs", "coins"]


@dataclass(frozen=True)
class Problem:
    template: int  # index into TEMPLATES
    numbers: tuple[int, ...]
    name: str
    item: str
    question: str
    answer: int
    operations: int  # 1 or 2

    @property
    def key(self) -> tuple:
        """What makes two problems the same problem (the splits are disjoint by it)."""
        return (self.template, self.numbers)


# Each template: (operations, draw(rng) -> numbers, text, answer(numbers)). Texts use {n}, {i} (name, item)
# and {a}, {b}, {c}; every answer is a whole number >= 0 by construction of the draws.
TEMPLATES = [
    (1, lambda r: (r.randint(2, 60), r.randint(2, 60)),
     "{n} has {a} {i}. {n} buys {b} more. How many {i} does {n} have now?", lambda a, b: a + b),
    (1, lambda r: (r.randint(2, 60), r.randint(2, 60)),
     "A shop sold {a} {i} in the morning and {b} {i} in the afternoon. How many {i} did it sell in total?",
     lambda a, b: a + b),
    (1, lambda r: (lambda b, d: (b + d, b))(r.randint(2, 40), r.randint(1, 40)),
     "{n} had {a} {i} and gave {b} of them to a friend. How many {i} does {n} have left?", lambda a, b: a - b),
    (1, lambda r: (lambda b, d: (b + d, b))(r.randint(2, 40), r.randint(1, 40)),
     "There are {a} {i} in a box. {n} takes {b} {i} out of the box. How many {i} are left in the box?",
     lambda a, b: a - b),
    (1, lambda r: (r.randint(2, 12), r.randint(2, 12)),
     "{n} buys {a} bags of {i}. Each bag holds {b} {i}. How many {i} does {n} buy?", lambda a, b: a * b),
    (1, lambda r: (r.randint(2, 12), r.randint(2, 12)),
     "One of {n}'s {i} costs {a} dollars. How many dollars do {b} of them cost?", lambda a, b: a * b),
    (1, lambda r: (lambda q, b: (q * b, b))(r.randint(2, 12), r.randint(2, 9)),
     "{n} shares {a} {i} equally among {b} friends. How many {i} does each friend get?", lambda a, b: a // b),
    (1, lambda r: (lambda q, b: (q * b, b))(r.randint(2, 12), r.randint(2, 9)),
     "{n} packs {a} {i} into boxes of {b}. How many boxes does {n} fill?", lambda a, b: a // b),
    (2, lambda r: (lambda a, b: (a, b, r.randint(1, a + b - 1)))(r.randint(2, 40), r.randint(2, 40)),
     "{n} has {a} {i}, buys {b} more and then gives {c} away. How many {i} does {n} have now?",
     lambda a, b, c: a + b - c),
    (2, lambda r: (r.randint(2, 9), r.randint(2, 9), r.randint(1, 30)),
     "{n} buys {a} bags with {b} {i} in each and already had {c} {i}. How many {i} does {n} have now?",
     lambda a, b, c: a * b + c),
    (2, lambda r: (lambda b, c, d: (b * c + d, b, c))(r.randint(2, 9), r.randint(2, 9), r.randint(0, 30)),
     "{n} had {a} dollars and bought {b} {i} at {c} dollars each. How many dollars does {n} have left?",
     lambda a, b, c: a - b * c),
    (2, lambda r: (lambda q, b, c: (q * b, b, c))(r.randint(2, 10), r.randint(2, 6), r.randint(1, 20)),
     "{n} shares {a} {i} equally among {b} friends. Then each friend finds {c} more. How many {i} does each "
     "friend have now?", lambda a, b, c: a // b + c),
]

# Short on purpose: every prompt carries it, and on a CPU the prompt tokens are most of a step's work.
EXAMPLE_QUESTION = "Tom has 12 marbles, buys 7 more and gives 5 away. How many marbles does Tom have now?"
EXAMPLE_ANSWER = "<reasoning>\n12 + 7 = 19\n19 - 5 = 14\n</reasoning>\n<answer>\n14\n</answer>"

EXAMPLE_KEY = (8, (12, 7, 5))


def make_problem(rng: random.Random, two_step_share: float = 0.3) -> Problem:
    """One random problem; two-operation templates are drawn with probability `two_step_share`."""
    ops = 2 if rng.random() < two_step_share else 1
    template = rng.choice([k for k, t in enumerate(TEMPLATES) if t[0] == ops])
    operations, draw, text, answer = TEMPLATES[template]
    numbers = tuple(draw(rng))
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    values = dict(zip("abc", numbers))
    return Problem(template, numbers, name, item, text.format(n=name, i=item, **values), answer(*numbers),
                   operations)


def split(num_train: int = 10_000, num_eval: int = 500, seed: int = 0, two_step_share: float = 0.3,
          train_two_step_share: float | None = None) -> tuple[list[Problem], list[Problem]]:
    """Disjoint (train, held_out) lists of distinct problems, the same for the same arguments. The held-out
    problems are drawn first, so `train_two_step_share` (None: `two_step_share`) changes the training mix
    without changing the held-out set."""
    rng = random.Random(seed)
    train_share = two_step_share if train_two_step_share is None else train_two_step_share
    held_out, train, seen = [], [], {EXAMPLE_KEY}  # the prompt's worked example is in neither split
    while len(held_out) < num_eval or len(train) < num_train:
        p = make_problem(rng, two_step_share=two_step_share if len(held_out) < num_eval else train_share)
        if p.key in seen:
            continue
        seen.add(p.key)
        (held_out if len(held_out) < num_eval else train).append(p)
    return train, held_out


def prompt(question: str, worked_example: bool = True, example_answer: str = EXAMPLE_ANSWER) -> list[dict]:
    """The chat prompt: the GSM8K system prompt, a worked example turn (without it a small instruct model
    hardly ever uses the tags, so every group's rewards are equal and GRPO learns nothing; `example_answer`:
    its answer), the question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if worked_example:
        messages += [{"role": "user", "content": EXAMPLE_QUESTION}, {"role": "assistant", "content": example_answer}]
    return messages + [{"role": "user", "content": question}]


def rows(problems: list[Problem], worked_example: bool = True, example_answer: str = EXAMPLE_ANSWER) -> list[dict]:
    """Dataset rows: `prompt` (chat), `answer` (the number, as a string, for answer_accuracy_reward),
    `question` and `operations`."""
    return [{"prompt": prompt(p.question, worked_example, example_answer), "answer": str(p.answer),
             "question": p.question, "operations": p.operations} for p in problems]
