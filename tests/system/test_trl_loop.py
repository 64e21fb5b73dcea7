"""The loop as a TRL script drives it, its import lines changed: what `train()` returns (transformers'
TrainOutput), `trainer.state.log_history`, `callbacks=` and `eval_strategy`."""
import json
import math

import pytest
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config as GRPOConfig  # was: from trl import GRPOConfig, GRPOTrainer
from grpo import Trainer as GRPOTrainer

TINY = dict(per_device_train_batch_size=4, num_generations=2, max_prompt_length=16, max_completion_length=4,
            optim="adamw", learning_rate=1e-2, report_to="none")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def metrics_lines(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_returns_a_train_output_and_the_state_keeps_every_logged_line(tmp_path, tokenizer):
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=3, save_steps=3, **TINY)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(8))
    result = trainer.train()
    global_step, training_loss, metrics = result  # a NamedTuple, as transformers' TrainOutput
    assert global_step == result.global_step == trainer.state.global_step == 3
    lines = metrics_lines(tmp_path / "run")
    assert [line["step"] for line in lines] == [1, 2, 3]
    # transformers' train_loss: the mean of the steps' losses; its speed metrics, a sample being a completion.
    assert training_loss == metrics["train_loss"] == pytest.approx(sum(line["loss"] for line in lines) / 3)
    assert set(metrics) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
                            "epoch"}
    assert metrics["train_steps_per_second"] == pytest.approx(3 / metrics["train_runtime"], rel=0.01, abs=1e-3)
    assert metrics["train_samples_per_second"] == pytest.approx(4 * 3 / metrics["train_runtime"], rel=0.01)
    # 3 steps of 2 prompts (4 completions) over 8 prompts: 0.75 of an epoch.
    assert metrics["epoch"] == trainer.state.epoch == 0.75 and trainer.state.max_steps == 3
    # log_history: the metrics.jsonl lines, then the TrainOutput's metrics, as transformers appends them, with the
    # last step's metrics (TRL's last entry holds those logged since its last log).
    assert trainer.state.log_history == [*lines, {**lines[-1], **metrics, "step": 3}]

    # Resumed (a longer run), the log_history holds the lines before the checkpoint too.
    longer = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=4, save_steps=3, **TINY)
    resumed = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=longer, train_dataset=digit_prompts(8))
    again = resumed.train(resume_from_checkpoint=True)
    lines = metrics_lines(tmp_path / "run")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert resumed.state.log_history == [*lines, {**lines[-1], **again.metrics, "step": 4}]
    assert again.training_loss == pytest.approx(lines[-1]["loss"]), "this call's one step"
    assert math.isfinite(again.metrics["train_runtime"]) and resumed.args is longer


def test_callbacks_are_called_as_transformers_calls_them_and_steer_the_loop(tmp_path, tokenizer):
    from transformers import TrainerCallback

    class Steering(TrainerCallback):
        """Saves after step 1 without logging it, stops after step 2."""

        def __init__(self):
            self.events, self.seen = [], {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append(("train_begin", state.global_step))
            self.seen = {"args": args, "state": state, **kwargs}

        def on_step_begin(self, args, state, control, **kwargs):
            self.events.append(("step_begin", state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            self.events.append(("step_end", state.global_step, control.should_log, control.should_save))
            control.should_log, control.should_save = state.global_step != 1, state.global_step == 1
            control.should_training_stop = state.global_step == 2

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.events.append(("log", state.global_step, "loss" in logs, "train_loss" in logs, "step" in logs))

        def on_save(self, args, state, control, **kwargs):
            self.events.append(("save", state.global_step, sorted(p.name for p in tmp_path.glob("run/checkpoint-*"))))

        def on_train_end(self, args, state, control, **kwargs):
            self.events.append(("train_end", state.global_step))

    class Counting:  # not a TrainerCallback: only some of its method names, passed as a class (made once)
        logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            Counting.logs.append(state.global_step)
            return control

    steering = Steering()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=4, save_steps=10, **TINY)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(8), callbacks=[steering, Counting])
    result = trainer.train()
    assert result.global_step == trainer.state.global_step == 2
    assert steering.events == [
        ("train_begin", 0),
        ("step_begin", 0), ("step_end", 1, True, False), ("save", 1, ["checkpoint-1"]),  # step 1: saved, not logged
        ("step_begin", 1), ("step_end", 2, True, False), ("log", 2, True, False, False),  # step 2: logged, then stop
        ("save", 2, ["checkpoint-1", "checkpoint-2"]),  # a stop saves as the end of training does
        ("log", 2, False, True, False), ("train_end", 2)]  # the TrainOutput's metrics, then the end
    assert [line["step"] for line in metrics_lines(tmp_path / "run")] == [2]
    assert Counting.logs == [2, 2]
    seen = steering.seen  # transformers' positional arguments and keyword arguments
    assert seen["args"] is trainer.args and seen["state"] is trainer.state
    assert seen["model"] is trainer.model and seen["processing_class"] is tokenizer
    assert seen["optimizer"] is trainer.optimizer and seen["lr_scheduler"] is trainer.scheduler
    assert seen["train_dataloader"] is None and seen["eval_dataloader"] is None


@pytest.mark.parametrize("strategy, eval_steps, prompts, expected", [
    ("steps", None, 8, [2, 4]),  # eval_steps unset: logging_steps (2), as in transformers; and the last step
    ("steps", 3, 8, [3, 4]),
    ("epoch", None, 6, [3, 4]),  # 2 prompts a step: the pass over 6 ends with step 3; and the last step
    ("no", None, 8, []),
])
def test_eval_strategy_and_eval_steps_as_transformers_reads_them(tmp_path, tokenizer, strategy, eval_steps,
                                                                 prompts, expected):
    class Evaluated:
        steps = []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            Evaluated.steps.append((state.global_step, metrics["eval/num_examples"]))

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=4, logging_steps=2, eval_strategy=strategy,
                      eval_steps=eval_steps, eval_limit=2, **TINY)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(prompts), eval_dataset=digit_prompts(2),
                          callbacks=[Evaluated])
    trainer.train()
    evals = [line["step"] for line in metrics_lines(tmp_path / "run") if "eval/num_examples" in line]
    assert evals == expected and Evaluated.steps == [(step, 2) for step in expected]
    assert [line["step"] for line in trainer.state.log_history if "eval/num_examples" in line] == expected
    # No eval_*_func set: what TRL logs, each reward function's mean on the (greedy) eval completions.
    for line in [line for line in metrics_lines(tmp_path / "run") if "eval/num_examples" in line]:
        assert 0 <= line["eval_rewards/digit_share/mean"] == line["eval_reward"] <= 1
        assert "eval/accuracy" not in line


def test_eval_steps_alone_evaluates_nothing_as_in_transformers_and_says_so(tmp_path, tokenizer, capsys):
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, eval_steps=1, **TINY)
    GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share, args=args,
                train_dataset=digit_prompts(8), eval_dataset=digit_prompts(2)).train()
    assert "eval/num_examples" not in "".join(map(str, metrics_lines(tmp_path / "run")))
    assert ('warning: eval_steps=1 has no effect with eval_strategy="no" (transformers\' default, as here): set '
            'eval_strategy="steps" to evaluate every 1 steps') in capsys.readouterr().err
