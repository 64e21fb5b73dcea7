"""What a TRL 1.16 script sets every day, ported by changing its import lines: each test is shaped as TRL's own
GRPOTrainer tests are (GRPOConfig keywords, GRPOTrainer(model=, reward_funcs=, args=, train_dataset=, ...)), on
the tiny offline model of tiny_setup in place of TRL's tiny Hub models."""
import pytest
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config as GRPOConfig  # was: from trl import GRPOConfig, GRPOTrainer
from grpo import Trainer as GRPOTrainer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def trl_args(tmp_path, **settings) -> GRPOConfig:
    """The keywords TRL's tests pass to every GRPOConfig (bf16 off: float32 on the CPU)."""
    return GRPOConfig(**{"output_dir": str(tmp_path / "run"), "learning_rate": 0.1, "per_device_train_batch_size": 3,
                         "num_generations": 3, "max_completion_length": 8, "report_to": "none", "bf16": False,
                         **settings})


def test_per_device_eval_batch_size_is_trls_completions_per_eval_batch(tmp_path, tokenizer):
    args = trl_args(tmp_path, per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2, max_steps=2)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(6), eval_dataset=digit_prompts(5))
    trainer.train()
    assert trainer.plan.decode.evaluation == 2, "greedy evaluation: one completion per prompt, 2 per decode"
    evals = [line for line in trainer.state.log_history if "eval_reward" in line]
    assert [line["step"] for line in evals] == [2] and evals[0]["eval/num_examples"] == 5


def test_evaluate_takes_trls_arguments_and_logs_its_eval_loss(tmp_path, tokenizer):
    args = trl_args(tmp_path, max_steps=1, beta=0.04, per_device_eval_batch_size=2)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(6), eval_dataset=digit_prompts(3))
    metrics = trainer.evaluate(eval_dataset=digit_prompts(5))
    assert metrics["eval/num_examples"] == 5, "the dataset passed, not the Trainer's"
    # One greedy completion per prompt: advantage 0, so the loss is beta x KL, and the policy is its reference yet.
    assert metrics["eval_loss"] == pytest.approx(0.0, abs=1e-6) and "eval_reward" in metrics
    trainer.train()
    test = trainer.evaluate(metric_key_prefix="test")
    assert test["test/num_examples"] == 3 and test["test_loss"] > 0, "the policy has moved off its reference"
    assert {"test_reward", "test_rewards/digit_share/mean"} <= set(test) and not any(k.startswith("eval") for k in test)
    assert trainer.state.log_history[-1] == test
