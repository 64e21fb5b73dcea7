"""A newcomer's traps, each fixed or saying what is true: --help without a recipe lists the settings; a reward
function's missing column is refused before anything loads; grpo.plan on a machine without a GPU plans for its
CPU; a half-written checkpoint is named, not passed over in silence."""
import pytest
import torch
from tiny_setup import digit_prompts, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.rollout.rewards import RewardError
from grpo.plan import main as plan_main
from grpo.train import main as train_main


def test_help_without_a_recipe_lists_every_setting(capsys):
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m grpo.train RECIPE") and "--learning_rate=1e-06" in out
    assert "--lr_scheduler_kwargs=none" in out and "A recipe is a Python file defining `config`" in out


def test_a_missing_column_is_refused_before_the_model_loads():
    def judge(completions, answer, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"^reward function 'judge' takes a column the dataset does not have: "
                                          r"answer \(its columns: prompt, num_digits\)$"):
        Trainer(Config(output_dir="/nonexistent/unused"), model="not loaded: no such model",
                reward_funcs=[judge], train_dataset=digit_prompts())


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for this machine's GPU where there is one")
def test_plan_on_a_machine_without_a_gpu_plans_for_its_cpu(capsys):
    from pathlib import Path

    assert plan_main([str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.py")]) == 0
    captured = capsys.readouterr()
    assert "predicted peak CPU memory" in captured.out and "no GPU here: planning for this CPU" in captured.err


def test_a_half_written_checkpoint_is_named(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)  # a save that was cut short: no COMPLETE marker
    (out / "checkpoint-2" / "trainer_state.pt").write_bytes(b"")
    tokenizer = tiny_tokenizer()
    config = Config(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=4, resume_from_checkpoint="latest", report_to="none")
    Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], train_dataset=digit_prompts()).train()
    err = capsys.readouterr().err
    assert (f"no complete checkpoint in {out} (checkpoint-2: no COMPLETE marker, its save was interrupted, so it "
            f"cannot be resumed and a save of its step replaces it): starting from step 0") in err
