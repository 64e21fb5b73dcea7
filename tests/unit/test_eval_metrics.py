"""What an evaluation reports beside the strict accuracy: the format-free accuracy (the last number of the
completion) and every metric broken down by a dataset column, by hand, through the evaluate API."""
import math
from statistics import stdev

import pytest
import torch
from datasets import Dataset
from tiny_setup import digit_share, tiny_tokenizer

from grpo.settings.components import EvalSettings
from grpo.settings.plan import RunPlan
from grpo import Config
from grpo.errors import ConfigError
from grpo.plot import panels
from grpo.rollout.batches import Rollout
from grpo.rollout.evaluate import (breakdown, check_breakdown_column, check_eval_setup, eval_funcs, evaluate,
                                   summarize, summary_lines)
from grpo.tasks.gsm8k import answer_accuracy_reward, last_number_accuracy, xml_format_reward

FREE = "grpo.tasks.gsm8k.last_number_accuracy"


@pytest.mark.parametrize("completion, answer, expected", [
    ("12 + 7 = 19, so Tom has 19 marbles.", "19", 1.0),  # trailing unit and period
    ("She pays $1,200 in total.", "1200", 1.0),  # currency and a thousands comma
    ("That is 1,000,000 dollars", "1000000", 1.0),
    ("The answer is 12.0", "12", 1.0),  # a decimal equal to the whole-number answer
    ("The answer is 12.5", "12", 0.0),
    ("It fell to -5 degrees.", "-5", 1.0),
    ("She owes -$5.", "-5", 1.0),
    ("10-3", "-3", 0.0),  # a minus glued to a number is subtraction: the last number is 3
    ("<reasoning>\n</reasoning>\n<answer>\n14\n</answer>", "14", 1.0),  # a number only inside the tags
    ("<answer>14</answer> Then 3 more.", "14", 0.0),  # the last number, wherever it is: 3
    ("I do not know.", "0", 0.0),  # no number at all
    ("", "0", 0.0),
    ("12 + 7 = 19", "19", 1.0),  # no tags: the strict accuracy gives it 0 (below)
])
def test_last_number_accuracy(completion, answer, expected):
    assert last_number_accuracy([completion], answer=[answer]) == [expected]
    chat = [{"role": "assistant", "content": completion}]
    assert last_number_accuracy(completions=[chat], answer=[answer], prompts=["p"]) == [expected]


def test_format_free_and_strict_accuracy_differ_on_untagged_answers():
    completions = ["12 + 7 = 19", "<answer>19</answer>", "<answer>19</answer> or 20"]
    assert answer_accuracy_reward(completions, answer=["19"] * 3) == [0.0, 1.0, 1.0]
    assert last_number_accuracy(completions, answer=["19"] * 3) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="'many' is not a number"):
        last_number_accuracy(["5"], answer=["many"])


# Five rows: (accuracy, free accuracy, format, operations, length).
SCORES = {"accuracy": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]),
          "free_accuracy": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),
          "format": torch.tensor([1.0, 0.5, math.nan, 1.0, 1.0])}  # NaN: the function did not apply
OPERATIONS = [1, 1, 2, 1, 2]
LENGTHS = torch.tensor([10, 20, 30, 40, 50])


def test_summarize_and_breakdown_by_hand():
    assert summarize(SCORES, LENGTHS) == pytest.approx({
        "eval/accuracy": 3 / 5, "eval/free_accuracy": 4 / 5,
        "eval/format": 3 / 4,  # the NaN row counts neither way; 0.5 is not full marks
        "eval/length_mean": 30.0, "eval/num_examples": 5.0})
    # operations=1: rows 0, 1, 3; operations=2: rows 2, 4.
    assert breakdown(SCORES, LENGTHS, "operations", OPERATIONS) == pytest.approx({
        "eval/operations=1/accuracy": 2 / 3, "eval/operations=1/free_accuracy": 3 / 3,
        "eval/operations=1/format": 2 / 3, "eval/operations=1/length_mean": (10 + 20 + 40) / 3,
        "eval/operations=1/num_examples": 3.0,
        "eval/operations=2/accuracy": 1 / 2, "eval/operations=2/free_accuracy": 1 / 2,
        "eval/operations=2/format": 1 / 1, "eval/operations=2/length_mean": (30 + 50) / 2,
        "eval/operations=2/num_examples": 2.0})
    first = list(breakdown(SCORES, LENGTHS, "op", [10, 9, 10, 9, 10]))[0]
    assert first == "eval/op=9/accuracy", "values in numeric order"


def test_summary_lines():
    metrics = {**summarize(SCORES, LENGTHS), **breakdown(SCORES, LENGTHS, "operations", OPERATIONS)}
    assert summary_lines(metrics) == [
        "accuracy 0.600, format-free accuracy 0.800, format 0.750, mean length 30.0 tokens",
        "  operations=1 (3 prompts): accuracy 0.667, format-free accuracy 1.000, format 0.667, "
        "mean length 23.3 tokens",
        "  operations=2 (2 prompts): accuracy 0.500, format-free accuracy 0.500, format 1.000, "
        "mean length 40.0 tokens"]
    strict_only = summarize({"accuracy": SCORES["accuracy"]}, LENGTHS)
    assert summary_lines(strict_only) == ["accuracy 0.600, mean length 30.0 tokens"]


# Completions of the rows below, two a batch, each with (strict, format-free, format) worked out by hand.
COMPLETIONS = [
    "<reasoning>12 + 7 = 19</reasoning><answer>19</answer>",  # 19: 1, 1, 1
    "I think it is $8.",  # 8: 0, 1, 0 (no tags)
    "<reasoning>12 + 7 = 19</reasoning><answer>19</answer>",  # 14: 0, 0, 1
    "The total is 1,200 apples",  # 1200: 0, 1, 0
    "no idea",  # 5: 0, 0, 0
]
ANSWERS = [("19", 1), ("8", 1), ("14", 2), ("1200", 2), ("5", 1)]  # (answer, operations)
ROWS = Dataset.from_list([{"prompt": f"question {i}", "answer": a, "operations": o}
                          for i, (a, o) in enumerate(ANSWERS)])


def scripted(completions: list[str]):
    """A `generate` that returns the next batch of `completions`, completion i being i + 1 tokens long."""
    batches, done = iter([completions[0:2], completions[2:4], completions[4:]]), [0]

    def generate(fn):
        texts = next(batches)
        lengths = torch.arange(done[0] + 1, done[0] + 1 + len(texts))  # [b]
        done[0] += len(texts)
        mask = (torch.arange(8)[None, :] < lengths[:, None]).long()  # [b, 8]
        b = len(texts)
        return Rollout(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1),
                       completion_ids=torch.zeros(b, 8, dtype=torch.long), completion_mask=mask,
                       completions=texts, truncated=torch.zeros(b, dtype=torch.bool))
    return generate


def eval_settings(**settings) -> EvalSettings:
    return EvalSettings.of(Config(max_prompt_length=16, max_completion_length=8, **settings))


def test_evaluate_reports_format_free_accuracy_and_the_breakdown():
    settings = eval_settings(eval_accuracy_func="answer_accuracy_reward", eval_free_accuracy_func=FREE,
                             eval_format_func="xml_format_reward", eval_breakdown_column="operations")
    metrics, samples = evaluate(None, tiny_tokenizer(), ROWS, [xml_format_reward, answer_accuracy_reward], settings,
                                batch_size=2, progress=False, unsharded=scripted(COMPLETIONS))
    expected = {
        "eval/accuracy": 1 / 5, "eval/free_accuracy": 3 / 5, "eval/format": 2 / 5,
        "eval/length_mean": 3.0, "eval/num_examples": 5.0,  # lengths 1..5
        "eval/operations=1/accuracy": 1 / 3, "eval/operations=1/free_accuracy": 2 / 3,  # rows 0, 1, 4
        "eval/operations=1/format": 1 / 3, "eval/operations=1/length_mean": (1 + 2 + 5) / 3,
        "eval/operations=1/num_examples": 3.0,
        "eval/operations=2/accuracy": 0.0, "eval/operations=2/free_accuracy": 1 / 2,  # rows 2, 3
        "eval/operations=2/format": 1 / 2, "eval/operations=2/length_mean": (3 + 4) / 2,
        "eval/operations=2/num_examples": 2.0,
        "eval_rewards/xml_format_reward/mean": 2 / 5, "eval_rewards/answer_accuracy_reward/mean": 1 / 5,
        "eval_reward": 3 / 5,  # the rows' sums: 2, 0, 1, 0, 0
        # TRL's stds, with Bessel's correction: of 1, 0, 1, 0, 0; of 1, 0, 0, 0, 0; of the sums
        "eval_rewards/xml_format_reward/std": stdev([1, 0, 1, 0, 0]),
        "eval_rewards/answer_accuracy_reward/std": stdev([1, 0, 0, 0, 0]), "eval_reward_std": stdev([2, 0, 1, 0, 0]),
    }
    assert {k: v for k, v in metrics.items() if k != "eval/seconds"} == pytest.approx(expected)
    assert [s["free_accuracy"] for s in samples] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert [s["operations"] for s in samples] == [1, 1, 2, 2, 1]

    # A reward function may serve as the format-free one too (its scores are not repeated in the samples);
    # without a breakdown column there are no per-value metrics.
    settings = eval_settings(eval_accuracy_func="answer_accuracy_reward",
                             eval_free_accuracy_func="answer_accuracy_reward")
    metrics, samples = evaluate(None, tiny_tokenizer(), ROWS, [answer_accuracy_reward], settings, batch_size=2,
                                progress=False, unsharded=scripted(COMPLETIONS))
    assert metrics["eval/free_accuracy"] == metrics["eval/accuracy"] == pytest.approx(1 / 5)
    assert "free_accuracy" not in samples[0]
    assert not any("=" in k for k in metrics)


def test_without_eval_functions_an_evaluation_logs_the_rewards_as_trl_names_them():
    # No eval_*_func (the defaults): each reward function's mean and the weighted reward's, TRL's eval keys.
    metrics, _ = evaluate(None, tiny_tokenizer(), ROWS, [xml_format_reward, answer_accuracy_reward],
                          eval_settings(reward_weights=[0.5, 2.0]), batch_size=2, progress=False,
                          unsharded=scripted(COMPLETIONS))
    assert {k: v for k, v in metrics.items() if k != "eval/seconds"} == pytest.approx({
        "eval_rewards/xml_format_reward/mean": 2 / 5, "eval_rewards/answer_accuracy_reward/mean": 1 / 5,
        "eval_reward": (0.5 + 2.0 + 0.5) / 5, "eval/length_mean": 3.0, "eval/num_examples": 5.0,
        "eval_rewards/xml_format_reward/std": stdev([1, 0, 1, 0, 0]),
        "eval_rewards/answer_accuracy_reward/std": stdev([1, 0, 0, 0, 0]),
        "eval_reward_std": stdev([0.5 + 2.0, 0, 0.5, 0, 0])})
    assert summary_lines(metrics) == ["reward 0.600, mean length 3.0 tokens"]


def test_eval_funcs_find_functions_and_their_columns():
    funcs = eval_funcs([xml_format_reward, answer_accuracy_reward], "answer_accuracy_reward", FREE,
                       "xml_format_reward", ["prompt", "answer"])
    assert funcs == {"accuracy": ("answer_accuracy_reward", answer_accuracy_reward),
                     "free_accuracy": (FREE, last_number_accuracy),
                     "format": ("xml_format_reward", xml_format_reward)}
    with pytest.raises(ConfigError, match=r"eval_free_accuracy_func='grpo.tasks.gsm8k.last_number_accuracy' "
                                          r"needs the eval dataset column\(s\) answer.*prompt, num_digits"):
        eval_funcs([digit_share], "digit_share", FREE, None, ["prompt", "num_digits"])
    with pytest.raises(ConfigError, match="func='grpo.tasks.gsm8k.nothing' cannot be imported"):
        eval_funcs([digit_share], "digit_share", "grpo.tasks.gsm8k.nothing", None)
    with pytest.raises(ConfigError, match="'last_number_accuracy' is not one of the reward functions: "
                                          "digit_share or an importable module.function"):
        eval_funcs([digit_share], "digit_share", "last_number_accuracy", None)


def test_a_run_checks_its_eval_settings_before_training():
    data = Dataset.from_list([{"prompt": "p", "num_digits": 1, "ids": [1]}])

    def check(**settings):  # as the Trainer checks it, from its run plan
        plan = RunPlan.resolve(Config(eval_on_start=True, eval_accuracy_func="digit_share", eval_format_func=None,
                                      **settings), 1)
        check_eval_setup(plan.evaluation, plan.cadence, data, [digit_share], {"": data})
    with pytest.raises(ConfigError, match="needs the eval dataset column"):
        check(eval_free_accuracy_func="grpo.tasks.gsm8k.last_number_accuracy")
    check()
    with pytest.raises(ConfigError, match="eval_breakdown_column='digits' is not a column of the eval "
                                          "dataset: num_digits, ids"):
        check(eval_breakdown_column="digits")
    with pytest.raises(ConfigError, match="holds lists or dicts"):
        check_breakdown_column(data, "ids")
    many = Dataset.from_list([{"prompt": "p", "k": k} for k in range(51)])
    with pytest.raises(ConfigError, match="'k' has 51 distinct values"):
        check_breakdown_column(many, "k")
    assert check_breakdown_column(many.select(range(50)), "k") == list(range(50))


def test_plot_draws_the_format_free_accuracy_and_the_breakdown():
    line = {"step": 0, **summarize(SCORES, LENGTHS), **breakdown(SCORES, LENGTHS, "operations", OPERATIONS)}
    found = {name: keys for name, _, _, keys, _ in panels([line])}
    assert [title for name, title, *_ in panels([line]) if name == "eval_breakdown.png"] == [
        "held-out greedy pass@1 by operations"]
    assert found["eval.png"] == ["eval/accuracy", "eval/free_accuracy", "eval/format"]
    assert found["eval_breakdown.png"] == ["eval/operations=1/accuracy", "eval/operations=1/free_accuracy",
                                           "eval/operations=2/accuracy", "eval/operations=2/free_accuracy"]
    assert "eval_breakdown.png" not in {name for name, *_ in panels([{"step": 0, "eval/accuracy": 0.5}])}
