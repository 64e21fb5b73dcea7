"""What a TRL 1.16 script sets every day, ported by changing its import lines: each test is shaped as TRL's own
GRPOTrainer tests are (GRPOConfig keywords, GRPOTrainer(model=, reward_funcs=, args=, train_dataset=, ...)), on
the tiny offline model of tiny_setup in place of TRL's tiny Hub models."""
import json
from unittest.mock import Mock

import pytest
import torch
from datasets import DatasetDict, IterableDataset, IterableDatasetDict
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_reward_model, tiny_tokenizer

from grpo import Config as GRPOConfig  # was: from trl import GRPOConfig, GRPOTrainer
from grpo import Trainer as GRPOTrainer
from grpo.algo.advantages import group_advantages, normalized_sum_advantages
from grpo.errors import ConfigError


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


def constant_reward_1(completions, **kwargs):
    return [1.0] * len(completions)


def constant_reward_0(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("multi_objective_aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_multi_objective_aggregation_is_trls(tmp_path, tokenizer, multi_objective_aggregation):
    args = trl_args(tmp_path, max_steps=1, reward_weights=[0.7, 0.3],
                    multi_objective_aggregation=multi_objective_aggregation)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer,
                          reward_funcs=[constant_reward_1, digit_share], args=args, train_dataset=digit_prompts(6))
    trainer.train()
    step = trainer.state.log_history[-2]
    assert step["reward"] == pytest.approx(0.7 + 0.3 * step["rewards/digit_share/mean"]), "weighted, as in TRL"
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    per_func = torch.tensor([[r["reward/constant_reward_1"], r["reward/digit_share"]] for r in rows])
    expected = (normalized_sum_advantages(per_func, torch.tensor([0.7, 0.3]), 3)
                if multi_objective_aggregation == "normalize_then_sum"
                else group_advantages(torch.tensor([r["reward"] for r in rows]), 3))
    assert per_func[:, 1].std() > 0 and torch.allclose(torch.tensor([r["advantage"] for r in rows]), expected)


def reward_func1(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def test_the_last_log_history_entry_holds_the_last_steps_metrics(tmp_path, tokenizer):
    args = trl_args(tmp_path, max_steps=2, reward_weights=[0.7, 0.3])
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer,
                          reward_funcs=[reward_func1, digit_share], args=args, train_dataset=digit_prompts(6))
    trainer.train()
    last, step = trainer.state.log_history[-1], trainer.state.log_history[-2]
    assert last["train_loss"] is not None and last["step"] == step["step"] == 2
    for key in ("rewards/reward_func1/mean", "rewards/reward_func1/std", "rewards/digit_share/mean", "reward", "loss"):
        assert last[key] == step[key]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_entropy_bonus_logs_trls_policy_loss(tmp_path, tokenizer, loss_type):
    args = trl_args(tmp_path, max_steps=2, entropy_coef=0.5, loss_type=loss_type, logging_steps=1, beta=0.04)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(6))
    trainer.train()
    assert trainer.state.log_history[-1]["policy_loss"] is not None
    assert trainer.state.log_history[-1]["entropy_coef"] == 0.5
    logs = [h for h in trainer.state.log_history if "policy_loss" in h and "loss" in h and h.get("entropy")]
    assert len(logs) == 3 and all("loss/policy" in h for h in logs)  # two steps and the last entry; ours kept
    for h in logs:  # TRL's own check: the bonus is entropy_coef x the mean entropy (one micro-batch a step)
        assert (h["policy_loss"] - h["loss"]) / h["entropy"] == pytest.approx(0.5, rel=1e-4)


def dummy_reward_func(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_sequence_level_sampling_with_a_token_summed_loss_warns_as_trl(tmp_path, tokenizer, caplog, loss_type):
    args = trl_args(tmp_path, importance_sampling_level="sequence", loss_type=loss_type)
    with caplog.at_level("WARNING"):  # TRL's test reads its logger's records
        GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=dummy_reward_func,
                    args=args, train_dataset=digit_prompts(6))
    assert ("weights each sequence by its completion length" in caplog.text) == (loss_type != "grpo")


def always_none_reward_func(completions, **kwargs):
    return [None] * len(completions)


def test_all_reward_functions_returning_none_warns_as_trl(tmp_path, tokenizer, caplog):
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer,
                          reward_funcs=always_none_reward_func, args=trl_args(tmp_path, max_steps=1),
                          train_dataset=digit_prompts(6))
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs: prompt='Write 1 digits:', completion=" \
        in caplog.text and ", num_digits=1 (3 of 3 completions unscored)" in caplog.text


def test_trls_mask_helpers_are_on_the_trainer_class():
    # TRL's tests call them on the class: get_high_entropy_mask as a method (with a stand-in trainer), the other
    # as a static method; TRL's cases.
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    keep = GRPOTrainer.get_high_entropy_mask(Mock(spec=GRPOTrainer), entropies, mask, 0.8)  # the top 20%
    assert keep.tolist() == [[False] * 6, [False, False, True, True, False, False]]
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    logps = torch.tensor([-2.0, -0.5, -2.0])[:, None].expand(3, 4)  # mean KL(old || current) 2, 0.5, 2
    kept = GRPOTrainer.get_off_policy_mask(advantages, logps, torch.zeros(3, 4), torch.ones(3, 4), 1.0)
    assert torch.equal(kept, torch.tensor([[1.0], [1.0], [0.0]])), "dropped: A < 0 and KL > 1"


@pytest.mark.parametrize("kind", ["dict", "DatasetDict"])
def test_several_eval_sets_are_evaluated_apart_as_in_transformers(tmp_path, tokenizer, kind):
    sets = {"data1": digit_prompts(3), "data2": digit_prompts(5)}
    eval_dataset = DatasetDict(sets) if kind == "DatasetDict" else sets
    args = trl_args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=args, train_dataset=digit_prompts(6), eval_dataset=eval_dataset)
    assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
    trainer.train()
    lines = [line for line in trainer.state.log_history if any(k.startswith("eval_data") for k in line)]
    assert [(line["step"], line[f"eval_{name}/num_examples"]) for line, name in zip(lines, ("data1", "data2"))] == [
        (1, 3), (1, 5)]
    assert {"eval_data1_loss", "eval_data1_reward", "eval_data2_loss"} <= {k for line in lines for k in line}


def streamed(dataset):
    return IterableDataset.from_generator(lambda: (yield from dataset))


def test_a_streaming_train_dataset_is_read_in_order_and_again_from_its_start(tmp_path, tokenizer):
    def run(name, dataset, **settings):  # TRL's test_train_with_iterable_dataset, one prompt a step
        args = trl_args(tmp_path / name, shuffle_dataset=False, **settings)
        trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                              args=args, train_dataset=dataset)
        trainer.train()
        return trainer, (tmp_path / name / "run" / "completions.jsonl").read_text()

    stream = streamed(digit_prompts(3))
    with pytest.raises(ConfigError, match="^train_dataset is a stream .* set max_steps"):
        run("no_max_steps", stream)
    trainer, completions = run("stream", stream, max_steps=4)
    assert trainer.train_dataset is stream and trainer.state.epoch == 1.0, "transformers' epoch: steps / max_steps"
    # the same rows as the Dataset's, in its order, the fourth step's from the start again, sampled the same
    assert completions == run("dataset", digit_prompts(3), max_steps=4)[1]


def test_the_checks_before_training_open_each_stream_once(tmp_path, tokenizer):
    opened = {"train": 0, "eval": 0}  # a remote stream opened again is another request

    def counted(name, dataset):
        def rows():
            opened[name] += 1
            yield from dataset
        return IterableDataset.from_generator(rows)
    args = trl_args(tmp_path, max_steps=1, eval_on_start=True)
    train, evaluated = counted("train", digit_prompts(3)), {"data1": counted("eval", digit_prompts(2))}
    GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share, args=args,
                train_dataset=train, eval_dataset=evaluated)
    assert opened == {"train": 1, "eval": 1}, "its first row, read once for every check (dataset, eval, chat template)"


def test_streaming_eval_sets_are_evaluated_on_all_their_rows(tmp_path, tokenizer):
    rows = digit_prompts(5)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                          args=trl_args(tmp_path, max_steps=1, per_device_eval_batch_size=2),
                          train_dataset=digit_prompts(6), eval_dataset={"data1": streamed(rows), "data2": rows})
    both = trainer.evaluate()
    data1, data2 = ({k.replace(name, ""): v for k, v in both.items() if name in k and "seconds" not in k}
                    for name in ("data1", "data2"))
    assert data1 == data2 and both["eval_data1/num_examples"] == 5 and "eval__loss" in data1
    one = trainer.evaluate(eval_dataset=IterableDatasetDict({"data1": streamed(rows)}))
    assert one["eval_data1_loss"] == both["eval_data1_loss"]


def test_the_attributes_a_trl_script_reads(tmp_path, tokenizer):
    reward_model, dataset = tiny_reward_model(tokenizer), digit_prompts(6)
    args = trl_args(tmp_path, max_steps=1, reward_weights=[0.5, 1.0], beta=0.04)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer,
                          reward_funcs=[digit_share, reward_model], reward_processing_classes=[None, tokenizer],
                          args=args, train_dataset=dataset)
    assert trainer.args is args and trainer.processing_class is tokenizer and trainer.train_dataset is dataset
    assert trainer.reward_func_names == ["digit_share", "tiny-rm"]
    assert trainer.reward_processing_classes == [None, tokenizer]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    no_kl = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                        args=trl_args(tmp_path), train_dataset=dataset)
    assert no_kl.ref_model is None and no_kl.reward_weights.tolist() == [1.0]


def test_running_the_same_script_again_keeps_the_earlier_run(tmp_path, tokenizer, capsys):
    def script():  # a TRL script as docs/coming-from-trl.md shows it, run twice (the edit-and-rerun loop)
        args = trl_args(tmp_path, max_steps=1, save_strategy="steps")
        trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                              args=args, train_dataset=digit_prompts(6))
        trainer.train()
        trainer.save_model(args.output_dir)

    script()
    out = tmp_path / "run"
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".grpo.lock"}
    script()
    assert "moved it to" in capsys.readouterr().err
    kept = out / "previous-run-1"
    assert {p: (kept / p).read_bytes() for p in first} == first, "every file of the first run, as it was"
    assert (out / "checkpoint-1").is_dir() and (out / "metrics.jsonl").exists() and (out / "config.json").exists()
