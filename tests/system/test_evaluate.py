"""Greedy evaluation: the metrics, the Trainer's eval lines, `python -m grpo.eval` and `python -m grpo.plot`."""
import json
import math

import pytest
import torch
from tiny_setup import digit_prompts, tiny_model, tiny_tokenizer

from grpo.settings.components import EvalSettings
from grpo import Config, Trainer
from grpo.eval import main as eval_main
from grpo.plot import main as plot_main
from grpo.plot import moving_average, plot
from grpo.rollout.evaluate import eval_funcs, evaluate, full_marks_rate


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


def half(completions, **kwargs):
    return [0.5] * len(completions)


def first_is_digit(completions, **kwargs):
    return [float(c[:1].isdigit()) for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_full_marks_rate_by_hand():
    assert full_marks_rate(torch.tensor([1.0, 0.5, 0.0, 1.0])) == 0.5
    assert full_marks_rate(torch.tensor([1.0, math.nan, 0.0])) == 0.5, "None (NaN) does not count either way"
    assert math.isnan(full_marks_rate(torch.tensor([math.nan])))


def test_unknown_eval_func_names_the_reward_functions():
    with pytest.raises(ValueError, match="eval_format_func='xml_format_reward'.*always_one, half"):
        eval_funcs([always_one, half], "always_one", None, "xml_format_reward")


def test_evaluate_is_greedy_and_scores_every_prompt(tokenizer):
    model = tiny_model(tokenizer).train()
    settings = EvalSettings.of(Config(eval_accuracy_func="first_is_digit", eval_format_func="half",
                                      max_prompt_length=16, max_completion_length=6, eval_limit=7))
    metrics, samples = evaluate(model, tokenizer, digit_prompts(10), [half, first_is_digit], settings, batch_size=3,
                                progress=False)
    again, _ = evaluate(model, tokenizer, digit_prompts(10), [half, first_is_digit], settings, batch_size=3,
                        progress=False)
    assert model.training, "evaluate leaves the model in the mode it found it in"
    assert len(samples) == 7 and metrics["eval/num_examples"] == 7
    assert metrics["eval/accuracy"] == pytest.approx(sum(s["reward/first_is_digit"] for s in samples) / 7)
    assert metrics["eval/format"] == 0.0, "0.5 is not full marks"
    assert metrics["eval_rewards/half/mean"] == 0.5
    assert 1 <= metrics["eval/length_mean"] <= 6
    assert {k: v for k, v in again.items() if k != "eval/seconds"} == {
        k: v for k, v in metrics.items() if k != "eval/seconds"}, "greedy decoding is deterministic"


def test_trainer_evaluates_at_start_every_eval_steps_and_at_the_end(tmp_path, tokenizer):
    config = Config(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4,
                    num_generations=2, max_prompt_length=16, max_completion_length=6, learning_rate=1e-3,
                    optim="adamw", eval_strategy="steps", eval_steps=2, eval_on_start=True, eval_limit=4,
                    eval_accuracy_func="always_one", eval_format_func=None, eval_free_accuracy_func=None)
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[always_one],
                      train_dataset=digit_prompts(), eval_dataset=digit_prompts())
    trainer.train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval/accuracy" in line]
    assert [line["step"] for line in evals] == [0, 2, 3]
    assert all(line["eval/accuracy"] == 1.0 and line["eval/num_examples"] == 4 for line in evals)
    assert "eval/format" not in evals[0]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3]

    with pytest.raises(ValueError, match="need an eval_dataset"):
        Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[always_one],
                train_dataset=digit_prompts())


RECIPE = '''
from datasets import Dataset
from grpo import Config
from grpo.tasks.tiny import model_for
from tiny_setup import CORPUS, digit_prompts, tiny_tokenizer

config = Config(output_dir={out!r}, max_prompt_length=16, max_completion_length=6,
                 eval_accuracy_func="has_digit", eval_format_func=None, eval_free_accuracy_func=None)

def has_digit(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]

reward_funcs = [has_digit]
train_dataset = digit_prompts
eval_dataset = lambda: digit_prompts(6)

def build_model(config):
    tokenizer = tiny_tokenizer()
    return model_for(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0), tokenizer
'''


def test_eval_cli_on_the_recipe_model_and_on_a_checkpoint(tmp_path, tokenizer, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE.format(out=str(tmp_path / "out")))
    assert eval_main([str(recipe), "--limit", "4"]) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["decoding"] == "greedy" and result["metrics"]["eval/num_examples"] == 4
    assert len(result["samples"]) == 4 and "accuracy" in capsys.readouterr().out

    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                    num_generations=2, max_prompt_length=16, max_completion_length=6, optim="adamw")
    Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[always_one],
            train_dataset=digit_prompts()).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert eval_main([str(recipe), f"--checkpoint={checkpoint}", "--max_completion_length=3"]) == 0
    result = json.loads((checkpoint / "eval.json").read_text())
    assert result["metrics"]["eval/num_examples"] == 6 and result["metrics"]["eval/length_mean"] <= 3

    assert eval_main([str(recipe), "--checkpoint", str(tmp_path)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_plot_writes_pngs(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="grpo.plot needs the plot extra (matplotlib)")
    lines = [{"step": 0, "eval/accuracy": 0.1, "eval/format": 0.9, "eval/length_mean": 9.0}]
    lines += [{"step": s, "reward/mean": s / 30, "reward/acc": s / 30, "reward/acc_std": 0.1, "reward/std": 0.2,
               "kl": 0.01 * s, "completions/mean_length": 10 + s} for s in range(1, 31)]
    lines += [{"step": 30, "eval/accuracy": 0.8, "eval/format": 1.0, "eval/length_mean": 30.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    written = plot(tmp_path)
    assert sorted(p.name for p in written) == ["completion_length.png", "curves.png", "eval.png", "kl.png",
                                               "reward.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert plot_main([str(tmp_path)]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_moving_average_by_hand():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_eval_cli_evaluates_a_run_made_from_python_without_a_recipe(tmp_path, tokenizer, capsys, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(completions, **kwargs):\n"
        "    return [float(any(ch.isdigit() for ch in c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in digit_prompts(5)))
    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                    num_generations=2, max_prompt_length=16, max_completion_length=5, optim="adamw",
                    eval_accuracy_func="has_digit", eval_format_func=None, eval_free_accuracy_func=None)
    Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[always_one],
            train_dataset=digit_prompts()).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    run = ["--checkpoint", str(checkpoint), f"--eval_dataset={data}", "--reward_funcs=my_rewards.has_digit"]
    assert eval_main(run) == 0
    result = json.loads((checkpoint / "eval.json").read_text())
    metrics = result["metrics"]
    assert result["run"] == str(checkpoint) and metrics["eval/num_examples"] == 5
    assert "eval/accuracy" in metrics and 1 <= metrics["eval/length_mean"] <= 5  # the run's own settings
    assert eval_main([*run, "--max_completion_length=2", "--limit=3", f"--output={tmp_path / 'e.json'}"]) == 0
    metrics = json.loads((tmp_path / "e.json").read_text())["metrics"]
    assert metrics["eval/num_examples"] == 3 and metrics["eval/length_mean"] <= 2
    capsys.readouterr()

    assert eval_main(run[:3]) == 2
    assert "missing --reward_funcs" in capsys.readouterr().err
    assert eval_main([*run[:3], "--reward_funcs=my_rewards.nope"]) == 2
    assert "--reward_funcs='my_rewards.nope' cannot be imported" in capsys.readouterr().err
    assert eval_main(["--checkpoint", str(tmp_path), *run[2:]]) == 2
    assert "no grpo_config.json" in capsys.readouterr().err
