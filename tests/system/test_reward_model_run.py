"""Reward models (TRL's sequence classifiers in `reward_funcs`) through real runs: the Trainer (training and
evaluation), a recipe through `python -m grpo.train` and `python -m grpo.eval`, and TRL's own scoring."""
import copy
import json

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, logged, tiny_model, tiny_reward_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.eval import main as eval_main
from grpo.rollout.reward_models import reward_callables
from grpo.train import main as train_main


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def config(tmp_path, **overrides) -> Config:
    return Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                  max_prompt_length=16, max_completion_length=6, learning_rate=1e-2, optim="adamw", seed=0,
                  eval_accuracy_func="digit_share", eval_format_func=None, eval_free_accuracy_func=None,
                  **overrides)


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def direct_scores(model, tokenizer, prompts, completions) -> list[float]:
    """The reward model on each prompt + completion alone (eval mode, no special tokens added)."""
    scores = []
    for p, c in zip(prompts, completions):
        ids = tokenizer(p + c, return_tensors="pt", add_special_tokens=False).to(model.device)
        with torch.no_grad():
            scores.append(model.eval()(**ids).logits[0, 0].item())
    return scores


def test_a_run_with_a_reward_model_and_a_function_logs_the_models_rewards(tmp_path, tokenizer):
    reward_model = tiny_reward_model(tokenizer, name="org/tiny-rm")
    trainer = Trainer(config(tmp_path, eval_strategy="steps", eval_steps=2), model=tiny_model(tokenizer),
                      tokenizer=tokenizer, reward_funcs=[reward_model, digit_share],
                      reward_processing_classes=[tokenizer, None], train_dataset=digit_prompts(),
                      eval_dataset=digit_prompts(4))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert reward_model.device == trainer.policy.device  # next to the policy (the GPU when there is one)
    metrics, rows = read(tmp_path / "run" / "metrics.jsonl"), read(tmp_path / "run" / "completions.jsonl")
    assert [m["step"] for m in metrics if "rewards/tiny-rm/mean" in m and "rewards/digit_share/mean" in m] == [1, 2]
    assert "eval_rewards/tiny-rm/mean" in logged(trainer)[-1]
    # Each logged completion's reward-model column is the model's score of its prompt + completion.
    expected = direct_scores(reward_model, tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    # float32, a padded batch against each text alone: 1e-5 (test_reward_models.py says why)
    torch.testing.assert_close(torch.tensor([r["reward/tiny-rm"] for r in rows]), torch.tensor(expected),
                               atol=1e-5, rtol=1e-5)
    step_1 = [r["reward/tiny-rm"] for r in rows if r["step"] == 1]
    assert metrics[0]["rewards/tiny-rm/mean"] == pytest.approx(sum(step_1) / len(step_1), abs=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(before, trainer.model.parameters())) > 1e-4


RECIPE = """
from grpo import Config
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

config = Config(output_dir={out!r}, max_steps=1, per_device_train_batch_size=4, num_generations=2,
                max_prompt_length=16, max_completion_length=4, optim="adamw", gradient_checkpointing=False,
                eval_accuracy_func="digit_share", eval_format_func=None, eval_free_accuracy_func=None)
reward_funcs = [digit_share, {model!r}]  # a reward model's folder: loaded with its own tokenizer
train_dataset = digit_prompts
eval_dataset = digit_prompts

def build_model(config):
    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer), tokenizer
"""


def test_a_recipe_names_a_reward_model_by_its_folder(tmp_path, tokenizer, capsys):
    folder = tmp_path / "models" / "digits-rm"
    tiny_reward_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE.format(out=str(tmp_path / "run"), model=str(folder)))
    assert train_main([str(recipe)]) == 0, capsys.readouterr().err
    assert "rewards/digits-rm/mean" in read(tmp_path / "run" / "metrics.jsonl")[0]
    assert eval_main([str(recipe), "--limit=3", f"--output={tmp_path / 'eval.json'}"]) == 0, capsys.readouterr().err
    samples = json.loads((tmp_path / "eval.json").read_text())["samples"]
    expected = direct_scores(tiny_reward_model(tokenizer), tokenizer, [s["prompt"] for s in samples],
                             [s["completion"] for s in samples])
    assert [s["reward/digits-rm"] for s in samples] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_scores_match_trls_own(tmp_path, tokenizer, chat):
    """TRL 1.16's GRPOTrainer._calculate_rewards and ours on the same prompts, completions and model."""
    pytest.importorskip("trl", reason="the TRL comparison needs trl (the bench extra)")
    from trl import GRPOConfig, GRPOTrainer

    prompts = ["Write 3 digits:", "Write 9 digits:", "hi", "Write 1 digits:"]
    completions = [" 012", " 012345678 and more", "!", ""]
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    reward_model = tiny_reward_model(tokenizer)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=4)
    # .eval(): as from_pretrained leaves a model (TRL keeps a passed model's train mode, dropout and all).
    trl_trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=[copy.deepcopy(reward_model).eval()], args=args,
                              processing_class=tokenizer, reward_processing_classes=[copy.deepcopy(tokenizer)],
                              train_dataset=digit_prompts())
    theirs = trl_trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions,
                                            [[0]] * len(prompts))  # [N, 1]
    [ours] = reward_callables([reward_model], [tokenizer])
    torch.testing.assert_close(torch.tensor(ours(prompts, completions)), theirs[:, 0], atol=1e-5, rtol=1e-5)
    assert trl_trainer.reward_func_names == [ours.__name__]
