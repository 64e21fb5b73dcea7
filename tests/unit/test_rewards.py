import functools
import math

import numpy as np
import pytest
import torch

from grpo.errors import ConfigError
from grpo.rollout.rewards import (
    RewardContext,
    RewardError,
    compute_rewards,
    reward_func_name,
    reward_func_names,
    reward_metrics,
)
from grpo.run.state import TrainerState
from grpo.tasks.gsm8k import (
    SYSTEM_PROMPT,
    answer_accuracy_reward,
    completion_text,
    extract_hash_answer,
    extract_xml_answer,
    parse_number,
    xml_format_reward,
)


def wrap(answer_text, reasoning="Some steps."):
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer_text}\n</answer>\n"


# --- parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("42", 42.0),
    ("1,000", 1000.0),
    ("1,234,567.5", 1234567.5),
    ("$5", 5.0),
    ("-$5", -5.0),
    ("5.0", 5.0),
    ("5.", 5.0),
    (".5", 0.5),
    ("-3", -3.0),
    ("x = -3", -3.0),
    ("5-3", 3.0),  # a minus glued to a word is subtraction, not a sign
    ("50%", 50.0),
    ("1/2", 0.5),
    ("3/0", None),
    ("The answer is 42 apples.", 42.0),
    ("18 - 3 = 15, so she has 15.", 15.0),  # the last number wins
    ("1,2,3", 3.0),  # not thousands separators
    ("no number here", None),
    ("", None),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    (wrap("42"), "42"),
    ("<answer> 7 </answer>", "7"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last block
    ("<answer><answer>3</answer></answer>", "3"),  # nested: the innermost
    ("<answer>1</answer><answer>unclosed", "1"),
    ("<answer>unclosed", None),
    ("</answer><answer>", None),
    ("no tags", None),
])
def test_extract_xml_answer(text, expected):
    assert extract_xml_answer(text) == expected


def test_extract_hash_answer():
    assert extract_hash_answer("She pays 2 * 3 = <<2*3=6>>6.\n#### 1,600 ") == "1600"
    assert extract_hash_answer("no marker") is None


def test_completion_text():
    assert completion_text("hi") == "hi"
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"
    with pytest.raises(TypeError):
        completion_text(42)


def test_system_prompt_names_the_format():
    for tag in ("<reasoning>", "</reasoning>", "<answer>", "</answer>"):
        assert tag in SYSTEM_PROMPT


# --- GSM8K rewards -------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, expected", [
    (wrap("42"), 1.0),
    ("<reasoning>a</reasoning><answer>42</answer>", 1.0),  # no newlines needed
    ("  \n<reasoning>\n\na\n</reasoning>\n\n<answer>42</answer>\n\n", 1.0),
    ("<reasoning></reasoning><answer>42</answer>", 1.0),  # empty reasoning is still the format
    ("<reasoning>a</reasoning><answer> </answer>", 0.0),  # empty answer
    ("<answer>42</answer><reasoning>a</reasoning>", 0.5),  # wrong order: answer block only
    ("Let me think. <answer>42</answer>", 0.5),
    (wrap("42") + "trailing chatter", 0.5),
    ("<reasoning>a</reasoning><answer>1</answer><answer>2</answer>", 0.0),  # duplicate answers
    ("<reasoning>a<answer>1</answer></reasoning><answer>2</answer>", 0.0),
    ("<reasoning>a</reasoning>\n<answer>42", 0.0),  # unclosed
    ("42", 0.0),
])
def test_xml_format_reward(completion, expected):
    assert xml_format_reward([completion]) == [expected]
    chat = [{"role": "assistant", "content": completion}]
    assert xml_format_reward(completions=[chat], answer=["x"]) == [expected]


@pytest.mark.parametrize("completion, reference, expected", [
    (wrap("42"), "42", 1.0),
    (wrap("1,000"), "1000", 1.0),
    (wrap("$18"), "18", 1.0),
    (wrap("18."), "18", 1.0),
    (wrap("5.0"), "5", 1.0),
    (wrap("-3"), "-3", 1.0),
    (wrap("She has 15 apples."), "15", 1.0),
    (wrap("3 + 12 = 15"), "15", 1.0),
    (wrap("15 or 16"), "15", 0.0),  # the last number counts
    (wrap("41"), "42", 0.0),
    (wrap("forty-two"), "42", 0.0),
    ("The answer is 42.", "42", 0.0),  # no answer tag: no fallback to the text
    ("<answer>1</answer><answer>42</answer>", "42", 1.0),  # the last block
    (wrap("42"), "Long solution ... 6 * 7 = 42\n#### 42", 1.0),  # a full GSM8K solution works too
    (wrap("42"), 42, 1.0),  # numeric reference column
])
def test_answer_accuracy_reward(completion, reference, expected):
    assert answer_accuracy_reward([completion], answer=[reference]) == [expected]
    chat = [{"role": "assistant", "content": completion}]
    assert answer_accuracy_reward(completions=[chat], answer=[reference], prompts=["p"]) == [expected]


def test_answer_accuracy_rejects_non_numeric_reference():
    with pytest.raises(ValueError, match="not a number"):
        answer_accuracy_reward([wrap("1")], answer=["n/a"])


# --- compute_rewards -----------------------------------------------------------------------------

def always(value):
    def reward(completions, **kwargs):
        return [value] * len(completions)
    reward.__name__ = f"always_{value}"
    return reward


def test_compute_rewards_weights_and_nones():
    def first(completions, **kwargs):
        return [1.0, None, 3.0, None]

    def second(completions, **kwargs):
        return [10.0, 20.0, None, None]

    prompts, completions = ["p"] * 4, ["c"] * 4
    rewards, per_func = compute_rewards([first, second], prompts, completions, {}, weights=[1.0, 0.5])
    metrics = reward_metrics(rewards, per_func, ["first", "second"])
    # Hand-computed: row 0 = 1 + 0.5*10, row 1 = 0.5*20, row 2 = 3, row 3: nothing applies -> 0.
    assert rewards.dtype == per_func.dtype == torch.float32
    assert rewards.tolist() == [6.0, 10.0, 3.0, 0.0]
    assert per_func.shape == (4, 2)
    assert per_func[:, 0].isnan().tolist() == [False, True, False, True]
    assert per_func[0].tolist() == [1.0, 10.0]
    # TRL's names; stds with Bessel's correction, as TRL's nanstd
    assert metrics["rewards/first/mean"] == pytest.approx(2.0)  # mean of 1 and 3, Nones left out
    assert metrics["rewards/first/std"] == pytest.approx(2 ** 0.5)
    assert metrics["rewards/second/mean"] == pytest.approx(15.0)
    assert metrics["rewards/second/std"] == pytest.approx(50 ** 0.5)
    # row 3, which no function scored, is left out of the combined reward's metrics (as in TRL)
    assert metrics["reward"] == pytest.approx(19.0 / 3)
    assert metrics["reward_std"] == pytest.approx(float(np.std([6.0, 10.0, 3.0], ddof=1)))


def test_compute_rewards_default_weights_and_number_types():
    def mixed(completions, **kwargs):
        return [np.float32(0.5), torch.tensor(2.0), True, 3]

    rewards, per_func = compute_rewards([mixed, always(1.0)], ["p"] * 4, ["c"] * 4, {})
    metrics = reward_metrics(rewards, per_func, reward_func_names([mixed, always(1.0)]))
    assert rewards.tolist() == [1.5, 3.0, 2.0, 4.0]
    assert set(metrics) == {"rewards/mixed/mean", "rewards/mixed/std", "rewards/always_1.0/mean",
                            "rewards/always_1.0/std", "reward", "reward_std"}


def test_function_that_never_applies_has_no_metric():
    rewards, per_func = compute_rewards([always(None)], ["p"] * 2, ["c"] * 2, {})
    metrics = reward_metrics(rewards, per_func, ["always_None"])
    assert rewards.tolist() == [0.0, 0.0]
    assert "rewards/always_None/mean" not in metrics
    assert "reward" not in metrics and "reward_std" not in metrics, "none scored: no 0.0 to misread"


def test_trl_style_function_with_chat_completions_and_answer_column():
    def correctness_reward_func(prompts, completions, answer, **kwargs):
        responses = [completion[0]["content"] for completion in completions]
        extracted = [extract_xml_answer(r) for r in responses]
        return [2.0 if r == a else 0.0 for r, a in zip(extracted, answer)]

    prompts = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "6*7?"}]] * 2
    completions = [[{"role": "assistant", "content": wrap("42")}],
                   [{"role": "assistant", "content": wrap("41")}]]
    columns = {"answer": ["42", "42"], "question": ["6*7?", "6*7?"]}
    funcs = [correctness_reward_func, xml_format_reward, answer_accuracy_reward]
    rewards, per_func = compute_rewards(funcs, prompts, completions, columns)
    metrics = reward_metrics(rewards, per_func, reward_func_names(funcs))
    assert per_func.tolist() == [[2.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert rewards.tolist() == [4.0, 1.0]
    assert metrics["rewards/correctness_reward_func/mean"] == 1.0


def test_reward_func_names():
    class LengthPenalty:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    def scaled(completions, scale, **kwargs):
        return [scale] * len(completions)

    assert reward_func_name(LengthPenalty()) == "LengthPenalty"
    assert reward_func_name(functools.partial(scaled, scale=2.0)) == "scaled"
    assert reward_func_name(lambda completions, **kw: []) == "lambda"
    assert reward_func_names([scaled, scaled, LengthPenalty(), scaled]) == [
        "scaled", "scaled_2", "LengthPenalty", "scaled_3"]


def test_duplicate_functions_get_separate_metrics():
    funcs = [always(1.0), always(1.0)]
    metrics = reward_metrics(*compute_rewards(funcs, ["p"], ["c"], {}, weights=[1, 2]), reward_func_names(funcs))
    assert "rewards/always_1.0/mean" in metrics and "rewards/always_1.0_2/mean" in metrics


# --- errors --------------------------------------------------------------------------------------

def test_weights_length_mismatch():
    with pytest.raises(ConfigError, match="reward_weights has 3 values but there are 2"):
        compute_rewards([always(1.0), always(0.0)], ["p"], ["c"], {}, weights=[1, 1, 1])


def test_raising_function_names_the_failing_item():
    def picky(completions, **kwargs):
        return [1.0 / len(c) for c in completions]  # ZeroDivisionError on an empty completion

    with pytest.raises(RewardError) as info:
        compute_rewards([picky], ["p0", "p1", "p2"], ["ok", "", "ok"], {})
    message = str(info.value)
    assert "'picky' raised ZeroDivisionError" in message
    assert "prompt 1: 'p1'" in message and "completion 1: ''" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_raising_function_cuts_long_texts_and_shows_chat_content():
    def broken(completions, **kwargs):
        raise KeyError("answer")

    prompt = [{"role": "user", "content": "q" * 1000}]
    completion = [{"role": "assistant", "content": "c" * 1000}]
    with pytest.raises(RewardError) as info:
        compute_rewards([broken], [prompt], [completion], {})
    message = str(info.value)
    assert "'broken' raised KeyError: 'answer'" in message
    assert "qqq..." in message and "ccc..." in message and len(message) < 600


def test_function_failing_only_on_the_whole_batch_shows_first_item():
    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too large")
        return [0.0]

    with pytest.raises(RewardError, match="whole batch only") as info:
        compute_rewards([batch_only], ["p0", "p1"], ["c0", "c1"], {})
    assert "completion 0: 'c0'" in str(info.value)


def test_wrong_number_of_values():
    with pytest.raises(RewardError, match="returned 1 values; expected 3"):
        compute_rewards([lambda completions, **kw: [1.0]], ["p"] * 3, ["c"] * 3, {})


@pytest.mark.parametrize("returned", [1.0, "1.0", None])
def test_not_a_list(returned):
    with pytest.raises(RewardError, match="expected a list of 1 floats"):
        compute_rewards([lambda completions, **kw: returned], ["p"], ["c"], {})


def test_non_number_value():
    with pytest.raises(RewardError, match=r"non-number at position 1: '0\.5' \(str\)"):
        compute_rewards([lambda completions, **kw: [1.0, "0.5"]], ["p"] * 2, ["c"] * 2, {})


def test_nan_and_inf_values():
    def bad(completions, **kwargs):
        return [1.0, math.nan, 0.0, -math.inf]

    with pytest.raises(RewardError, match=r"'bad' returned NaN or inf at positions \[1, 3\]"):
        compute_rewards([bad], ["p"] * 4, ["c"] * 4, {})


def test_column_length_mismatch_is_a_caller_bug():
    with pytest.raises(ValueError, match="one entry per completion"):
        compute_rewards([always(1.0)], ["p"] * 2, ["c"] * 2, {"answer": ["1"]})


# --- TRL 1.16's full reward contract ---------------------------------------------------------------

def test_trl_soft_overlong_punishment_runs_unchanged():
    trl_rewards = pytest.importorskip("trl.rewards", reason="trl (a test peer) is not installed")
    punish = trl_rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    ids = [[1] * 5, [1] * 8, [1] * 10]  # within, 2 into the cache (-0.5), at the limit (-1)
    _, per_func = compute_rewards([punish], ["p"] * 3, ["c"] * 3, {}, completion_ids=ids)
    assert per_func[:, 0].tolist() == pytest.approx([0.0, -0.5, -1.0])


def test_every_function_gets_trls_arguments_and_logs_through_them():
    seen = {}

    def logging_reward(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
        seen.update(step=trainer_state.global_step, ids=completion_ids, columns=set(kwargs))
        log_metric("my/length", sum(map(len, completion_ids)) / len(completion_ids))
        log_extra("parsed", [c.upper() for c in completions])
        return [1.0] * len(completions)

    context = RewardContext(TrainerState(global_step=7, max_steps=10))
    compute_rewards([logging_reward], ["p", "q"], ["a", "b"], {"answer": ["1", "2"]},
                    completion_ids=[[5, 6], [7]], context=context)
    assert seen == {"step": 7, "ids": [[5, 6], [7]], "columns": {"answer"}}
    assert context.metrics_over(None) == {"my/length": 1.5} and context.extras == {"parsed": ["A", "B"]}


def test_a_function_without_kwargs_gets_only_what_it_names():
    def plain(completions, answer):  # no **kwargs: TRL would pass it everything and fail
        return [float(c == a) for c, a in zip(completions, answer)]

    _, per_func = compute_rewards([plain], ["p"] * 2, ["1", "3"], {"answer": ["1", "2"], "other": [0, 0]})
    assert per_func[:, 0].tolist() == [1.0, 0.0]


def test_async_rewards_run_concurrently():
    import asyncio
    import time

    def slow(value):
        async def reward(completions, **kwargs):
            await asyncio.sleep(0.3)
            return [value] * len(completions)
        reward.__name__ = f"slow_{value}"
        return reward

    t0 = time.perf_counter()
    rewards, per_func = compute_rewards([slow(1.0), always(10.0), slow(2.0)], ["p"] * 2, ["c"] * 2, {})
    assert per_func.tolist() == [[1.0, 10.0, 2.0]] * 2 and rewards.tolist() == [13.0, 13.0]
    assert time.perf_counter() - t0 < 0.55, "the two 0.3 s functions were awaited one after the other"


def test_an_async_reward_that_raises_names_its_item():
    async def picky(completions, **kwargs):
        if "bad" in completions:
            raise ValueError("no")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'picky' raised ValueError: no\n.*\n  prompt 1: 'q'"):
        compute_rewards([picky], ["p", "q"], ["good", "bad"], {})
