"""Bad input and failed runs, as `python -m grpo.train` reports them: one short `error:` message, no
traceback, a non-zero exit, and nothing half-written. `main()` runs in-process (a subprocess per case would
cost seconds of imports each); test_cli.py checks the real command once."""
import json
import math
import textwrap

import pytest
import torch

from grpo.eval import main as eval_main
from grpo.train import main

RECIPE = """
from datasets import Dataset
from grpo import Config
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

config = Config(output_dir={out!r}, max_steps=3, per_device_train_batch_size=4, num_generations=2,
                max_prompt_length=16, max_completion_length=4, optim="adamw", save_steps=1,
                gradient_checkpointing=False, {config})
{body}

def build_model(config):
    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer), tokenizer
"""
GOOD_BODY = "reward_funcs = [digit_share]\ntrain_dataset = digit_prompts"


def run(tmp_path, capsys, *overrides, body=GOOD_BODY, config=""):
    """Write a recipe with `body` and `config` settings, run the CLI on it; (exit code, stderr)."""
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE.format(out=str(out), config=config, body=textwrap.dedent(body)))
    code = main([str(recipe), *overrides])
    return code, capsys.readouterr().err


def assert_short_error(code, err, expected_code, *fragments):
    assert code == expected_code, err
    assert "Traceback" not in err and "error: " in err
    for fragment in fragments:
        assert fragment in err, err


# --- recipes and settings: exit 2, before anything is loaded or written ---

@pytest.mark.parametrize("body, config, overrides, fragments", [
    ("reward_funcs = [digit_share]", "", [], ["does not define train_dataset"]),
    ("reward_funcs = digit_share\ntrain_dataset = [{'prompt': 'hi'}]", "", [],
     ["`train_dataset` must be a datasets.Dataset or a function returning one, got list"]),
    ("reward_funcs = ['digit_share']\ntrain_dataset = digit_prompts", "", [], ["reward_funcs[0] is not callable"]),
    (GOOD_BODY, "num_iterations=0", [], ["recipe.py:6: num_iterations must be >= 1, got 0"]),
    (GOOD_BODY, "learning_rate='1e-5'", [], ["learning_rate must be a float, got str '1e-5'"]),
    (GOOD_BODY, "", ["--num_generation=4"], ["unknown setting 'num_generation' (did you mean 'num_generations'?)"]),
    (GOOD_BODY, "", ["--max_steps=ten"], ["--max_steps: expected an integer, got 'ten'"]),
    (GOOD_BODY, "", ["--num_generations=1"], ["--num_generations=1: num_generations must be >= 2"]),
    (GOOD_BODY, "", ["--max_completion_length=0"], ["max_completion_length must be >= 1, got 0"]),
    (GOOD_BODY, "", ["--per_device_train_batch_size=0"], ["per_device_train_batch_size must be >= 1"]),
    (GOOD_BODY, "", ["--optim=adam"],
     ["optim must be one of adamw_8bit, adamw (or transformers' adamw_torch", "got 'adam'"]),
    (GOOD_BODY, "", ["--load_in_4bit=true", "--use_lora=false"], ["load_in_4bit=True needs use_lora=True"]),
    (GOOD_BODY, "", ["--load_in_4bit=true", "--use_lora=true"],
     ["load_in_4bit applies when the trainer loads config.model itself; a model passed in is used as built"]),
], ids=["no-dataset", "dataset-type", "reward-type", "config-in-recipe", "config-type", "unknown-key",
        "override-type", "one-generation", "no-completion", "no-batch", "unknown-optim", "4bit-without-lora",
        "4bit-with-a-built-model"])
def test_recipe_and_setting_errors(tmp_path, capsys, body, config, overrides, fragments):
    code, err = run(tmp_path, capsys, *overrides, body=body, config=config)
    assert_short_error(code, err, 2, *fragments)
    assert not (tmp_path / "run").exists()


def test_missing_recipe_file(tmp_path, capsys):
    assert main([str(tmp_path / "nope.py")]) == 2
    assert capsys.readouterr().err == f"error: recipe not found: {tmp_path / 'nope.py'}\n"


def test_a_bug_in_the_recipe_keeps_its_traceback(tmp_path, capsys):
    with pytest.raises(ZeroDivisionError):
        run(tmp_path, capsys, body=GOOD_BODY + "\nscale = 1 / 0")


# --- datasets: exit 1 ---

@pytest.mark.parametrize("rows, fragment", [
    ("[{'question': 'hi'}]", "train_dataset has no 'prompt' column (columns: question)"),
    ("[]", "train_dataset is empty (no rows)"),  # an empty list has no columns either
    ("{'prompt': []}", "train_dataset is empty (no rows)"),
    ("[{'prompt': 7}]", "train_dataset['prompt'] must hold strings or lists of {'role', 'content'} messages, got int"),
    ("[{'prompt': 'a'}, {'prompt': None}]", "train_dataset has 1 missing (None) prompts out of 2"),
])
def test_dataset_errors(tmp_path, capsys, rows, fragment):
    make = "from_dict" if rows.startswith("{") else "from_list"
    code, err = run(tmp_path, capsys, body=f"reward_funcs = [digit_share]\ntrain_dataset = Dataset.{make}({rows})")
    assert_short_error(code, err, 1, fragment)
    assert not (tmp_path / "run").exists()


# --- reward functions: exit 1, naming the function and showing what it was given ---

@pytest.mark.parametrize("returns, fragments", [
    ("[1.0 / (len(c) - len(c)) for c in completions]",
     ["reward function 'judge' raised ZeroDivisionError: float division by zero", "at recipe.py:10", "prompt 0: 'Write",
      "completion 0: "]),
    ("[1.0]", ["reward function 'judge' returned 1 values; expected 4, one per completion"]),
    ("['good'] * len(completions)", ["reward function 'judge' returned a non-number at position 0: 'good' (str)"]),
    ("[float('nan')] * len(completions)", ["reward function 'judge' returned NaN or inf at positions [0, 1, 2, 3]"]),
], ids=["raises", "count", "type", "nan"])
def test_reward_function_errors(tmp_path, capsys, returns, fragments):
    body = (f"def judge(completions, **kwargs):\n    return {returns}\n"
            "reward_funcs = [judge]\ntrain_dataset = digit_prompts")
    code, err = run(tmp_path, capsys, body=body)
    assert_short_error(code, err, 1, *fragments)
    assert len(err) < 1000
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_reward_function_taking_a_column_the_dataset_lacks_names_both(tmp_path, capsys):
    body = ("def judge(completions, answer, **kwargs):\n    return [0.0] * len(completions)\n"
            "reward_funcs = [judge]\ntrain_dataset = digit_prompts")
    code, err = run(tmp_path, capsys, body=body)
    assert_short_error(code, err, 1)
    assert err.splitlines()[-1] == ("error: reward function 'judge' takes a column the dataset does not have: "
                                    "answer (its columns: prompt, num_digits)")


def test_a_reward_failing_later_keeps_the_steps_before_it(tmp_path, capsys):
    body = """
        calls = []
        def judge(completions, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyError("answer")
            return [0.5] * len(completions)
        reward_funcs = [judge]
        train_dataset = digit_prompts
    """
    code, err = run(tmp_path, capsys, "--save_steps=10", body=body)
    assert_short_error(code, err, 1, "reward function 'judge' raised KeyError: 'answer'",
                       f"step 3 failed; {tmp_path / 'run' / 'checkpoint-2'} holds the state after step 2",
                       "resume with: python -m grpo.train", "--resume_from_checkpoint=")


# --- non-finite loss: skipped, logged, stopped after max_nonfinite_steps in a row ---

# With a KL term every step runs its training forwards, whatever the rewards (groups that all score alike
# have no policy gradient, and without one are not forwarded).
EVERY_STEP = "--beta=0.04"


def nan_loss(first_bad_step: int, last_bad_step: int = 10**9) -> str:
    """A recipe body whose callback makes the loss NaN in steps first..last (tiny_setup.NanLoss)."""
    return GOOD_BODY + f"\nfrom tiny_setup import NanLoss\ncallbacks = [NanLoss({first_bad_step}, {last_bad_step})]"


def test_nonfinite_loss_stops_after_n_in_a_row_keeping_the_last_good_checkpoint(tmp_path, capsys):
    code, err = run(tmp_path, capsys, "--max_steps=10", "--save_steps=2", "--max_nonfinite_steps=2", EVERY_STEP,
                    body=nan_loss(3))
    assert_short_error(code, err, 1, "step 3: loss nan, grad norm nan: update skipped (1 in a row; stopping at 2)",
                       "error: stopped at step 4: the loss or gradient norm was NaN/inf for 2 steps in a row "
                       "(max_nonfinite_steps=2); their updates were skipped, so the weights are those of step 2. "
                       f"Newest checkpoint: {tmp_path / 'run' / 'checkpoint-2'}.")
    lines = [eval(line, {"NaN": math.nan}) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["skipped/nonfinite"]) for line in lines] == [(1, 0), (2, 0), (3, 1), (4, 2)]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    from tiny_setup import NanLoss
    for name, p in NanLoss.made[-1].model.named_parameters():
        assert torch.equal(p, saved.get(name, p)), f"{name} moved on a skipped step"


def test_one_nonfinite_step_is_skipped_and_training_goes_on(tmp_path, capsys):
    code, err = run(tmp_path, capsys, EVERY_STEP, body=nan_loss(2, 2))
    assert code == 0, err
    assert "step 2: loss nan, grad norm nan: update skipped (1 in a row; stopping at 3)" in err


# --- out of memory: what to lower, the planner's estimate where there is one, the steps kept ---

OUT_OF_MEMORY_IN_STEP_2 = GOOD_BODY + """
import torch
from transformers import TrainerCallback

class OutOfMemoryInStep2(TrainerCallback):  # the fault, injected through TRL's callbacks=
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\\nmore detail")

callbacks = [OutOfMemoryInStep2()]
"""


@pytest.mark.parametrize("model, plan", [
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct: 0.49B parameters, full fine-tuning, adamw, beta=0"),
    ("no/such-model", "cannot read the config of 'no/such-model' (OSError), so no memory plan"),
], ids=["planned", "unplanned"])
def test_out_of_memory_says_what_to_lower(tmp_path, capsys, model, plan):
    code, err = run(tmp_path, capsys, body=OUT_OF_MEMORY_IN_STEP_2, config=f"model={model!r}")
    assert_short_error(code, err, 1,
                       "error: out of GPU memory in step 2: CUDA out of memory. Tried to allocate 20.00 GiB",
                       "--gradient_checkpointing=true (recompute activations in backward)",
                       "--use_lora=true (train adapters",
                       f"the last checkpoint is {tmp_path / 'run' / 'checkpoint-1'}")
    assert "more detail" not in err
    # The planner's own breakdown for this configuration, or why there is none; never in place of the above.
    assert f"memory plan for this configuration:\n  {plan}" in err, err


# --- small things a user runs into: one line, the right exit code, or what they expect ---

def test_reward_weights_of_the_wrong_length_are_a_settings_error(tmp_path, capsys):
    code, err = run(tmp_path, capsys, "--reward_weights=1,0.5")
    assert_short_error(code, err, 2, "error: reward_weights has 2 values but there are 1 reward functions "
                                     "(digit_share): give one weight per function")
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_step_where_no_completion_was_scored_logs_no_reward_mean(tmp_path, capsys):
    body = ("def never(completions, **kwargs):\n    return [None] * len(completions)\n"
            "reward_funcs = [never]\ntrain_dataset = digit_prompts")
    code, err = run(tmp_path, capsys, "--max_steps=1", body=body)
    assert code == 0, err
    (line,) = [json.loads(text) for text in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not {"reward", "reward_std", "rewards/never/mean"} & line.keys()
    assert line["frac_reward_zero_std"] == 1.0
    assert "reward=none scored" in err


def test_help_on_a_recipe_that_builds_its_model_says_model_is_not_used(tmp_path, capsys):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE.format(out=str(tmp_path / "run"), config="", body=GOOD_BODY))
    assert main([str(recipe), "--help"]) == 0
    out = capsys.readouterr().out
    assert "  --model: not used: the recipe's build_model builds the model\n" in out and "--model=" not in out


EVAL_BODY = "reward_funcs = [digit_share]\ntrain_dataset = digit_prompts\neval_dataset = digit_prompts"


@pytest.mark.parametrize("body, args, line", [
    (EVAL_BODY, ["--limit", "0"], "error: --limit must be a positive integer, got '0'"),
    (EVAL_BODY, ["--output={tmp}/recipe.py/eval.json"],
     "error: output={tmp}/recipe.py cannot be created: {tmp}/recipe.py is a file, not a folder; pick another "
     "--output"),
    (EVAL_BODY, ["--output={tmp}"],
     "error: --output={tmp} is a folder: name a file in it, such as {tmp}/eval.json"),
    # No eval data: said before anything about the functions that would score it.
    (GOOD_BODY, [], "error: recipe {tmp}/recipe.py defines no eval_dataset: grpo.eval evaluates on it"),
], ids=["limit-0", "output-under-a-file", "output-a-folder", "no-eval-data"])
def test_eval_mistakes(tmp_path, capsys, body, args, line):
    (tmp_path / "recipe.py").write_text(RECIPE.format(out=str(tmp_path / "run"), config="", body=body))
    scoring = ["--eval_accuracy_func=digit_share", "--eval_format_func=none"] if body == EVAL_BODY else []
    code = eval_main([str(tmp_path / "recipe.py"), *(a.format(tmp=tmp_path) for a in args), *scoring])
    assert capsys.readouterr().err == line.format(tmp=tmp_path) + "\n" and code == 2


def test_eval_help_describes_its_options(tmp_path, capsys):
    assert eval_main(["--help"]) == 0
    out = capsys.readouterr().out
    options = ("checkpoint DIR", "limit N", "output FILE", "key=value")
    assert all(f"  --{option} " in out for option in options)
    (tmp_path / "recipe.py").write_text(RECIPE.format(out=str(tmp_path / "run"), config="", body=EVAL_BODY))
    assert eval_main([str(tmp_path / "recipe.py"), "--help"]) == 0
    assert "settings of" in capsys.readouterr().out
