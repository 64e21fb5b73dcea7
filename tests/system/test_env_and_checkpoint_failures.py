"""Failures that used to be tracebacks or lost steps: an environment whose `reset` or `get_reward` raises is one
line naming the class, the row and the error; a checkpoint folder that turns read-only mid-run is one line
naming the folder and the cause, and the state is saved in a rescue folder that resuming accepts; so is one deleted
while the run is going."""
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from scripted import CALL, UNKNOWN_CALL, chain, scripted_model, scripted_tokenizer
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import TrainingStopped, UserError
from grpo.train import main

QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]


class Broken:
    """An environment whose reset fails on the row whose answer is "bad"."""

    def reset(self, **row):
        if row["answer"] == "bad":
            raise KeyError("no such puzzle")

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a * b

    def get_reward(self) -> float:
        raise ValueError("the episode never finished")


def calling_trainer(tmp_path, answers, reward):
    tokenizer = scripted_tokenizer(CALL, UNKNOWN_CALL)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    model = scripted_model(tokenizer, chain(tokenizer, prompt, "<tool_call>", CALL, "</tool_call>"))
    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                    max_prompt_length=1024, max_completion_length=160, optim="adamw", save_steps=1000,
                    max_tool_calling_iterations=1)
    dataset = Dataset.from_list([{"prompt": QUESTION, "answer": a} for a in answers])
    return Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[reward] if reward else [],
                   train_dataset=dataset,
                   environment_factory=Broken)


GET_REWARD_RAISED = ("environment Broken.get_reward raised ValueError: the episode never finished for completion 0 "
                     "of the batch (prompt ")


def one_line_error(trainer) -> str:
    """The message of the UserError `trainer.train()` raises, checked to be one line."""
    with pytest.raises(UserError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_raising_reset_is_one_line_naming_the_environment_the_row_and_the_error(tmp_path):
    trainer = calling_trainer(tmp_path, ["bad"], lambda completions, **kw: [0.0] * len(completions))
    message = one_line_error(trainer)
    assert message.startswith("environment Broken.reset raised KeyError: 'no such puzzle' on the dataset row ")
    assert "'answer': 'bad'" in message and "What is 3 times 4?" in message


def test_a_raising_get_reward_is_one_line_naming_the_environment_the_completion_and_the_error(tmp_path):
    trainer = calling_trainer(tmp_path, ["12"], None)  # Broken's own get_reward is the reward, as in TRL
    message = one_line_error(trainer)
    assert message.startswith(GET_REWARD_RAISED)


def test_a_raising_get_reward_in_a_reward_function_of_ones_own_is_the_same_line(tmp_path):
    def mine(environments, **kwargs):
        return [env.get_reward() for env in environments]
    trainer = calling_trainer(tmp_path, ["12"], mine)
    message = one_line_error(trainer)
    assert message.startswith(GET_REWARD_RAISED)
    assert message.endswith(", in reward function 'mine'")


def test_a_raising_reset_on_the_command_line_is_one_error_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(textwrap.dedent(f"""
        from datasets import Dataset
        from grpo import Config
        from scripted import CALL, UNKNOWN_CALL, chain, scripted_model, scripted_tokenizer
        from test_env_and_checkpoint_failures import QUESTION, Broken

        config = Config(output_dir={str(tmp_path / 'run')!r}, max_steps=1, per_device_train_batch_size=4,
                        num_generations=4, max_prompt_length=1024, max_completion_length=160, optim="adamw")
        reward_funcs = [lambda completions, **kw: [0.0] * len(completions)]
        train_dataset = Dataset.from_list([{{"prompt": QUESTION, "answer": "bad"}}] * 4)
        environment_factory = Broken

        def build_model(config):
            tokenizer = scripted_tokenizer(CALL, UNKNOWN_CALL)
            prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
            return scripted_model(tokenizer, chain(tokenizer, prompt, "<tool_call>", CALL, "</tool_call>")), tokenizer
    """))
    code = main([str(recipe)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: environment Broken.reset raised KeyError: 'no such puzzle' on the dataset row ")


def freeze(folder: Path) -> None:
    """Make `folder` refuse new entries, as a folder turned read-only does, even to root; skip where this
    machine cannot."""
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0 if \
        Path("/usr/bin/chattr").exists() or Path("/bin/chattr").exists() else False
    if not done:
        folder.chmod(0o555)
    try:
        (folder / ".probe").mkdir()
    except OSError:
        return
    (folder / ".probe").rmdir()
    thaw(folder)
    pytest.skip("cannot make a folder read-only here (root on a filesystem without chattr +i)")


def thaw(folder: Path) -> None:
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def run_trainer(out, tokenizer, callbacks=(), **overrides) -> Trainer:
    config = Config(output_dir=str(out), max_steps=4, save_steps=1, save_total_limit=1, per_device_train_batch_size=8,
                    num_generations=4, max_prompt_length=16, max_completion_length=8, learning_rate=1e-2,
                    optim="adamw", seed=0, **overrides)
    return Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                   train_dataset=digit_prompts(), callbacks=list(callbacks))


@pytest.mark.slow
def test_a_checkpoint_folder_turned_read_only_is_one_line_and_the_state_is_rescued(tmp_path):
    tokenizer = tiny_tokenizer()
    out = tmp_path / "run"

    class TurnReadOnly:
        """After step 2 (before its checkpoint), the output folder stops taking new entries."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                freeze(out)

    trainer = run_trainer(out, tokenizer, callbacks=[TurnReadOnly()])
    try:
        with pytest.raises(TrainingStopped) as info:
            trainer.train()
    finally:
        thaw(out)
    rescued = tmp_path / "run.rescue" / "checkpoint-2"
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint-2 cannot be written into {out} (")
    assert f"the state after step 2 is saved in {rescued} instead" in message
    assert f"resume_from_checkpoint={str(rescued)!r}" in message
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]

    resumed = run_trainer(out, tokenizer, resume_from_checkpoint=str(rescued))
    resumed.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    reference = run_trainer(tmp_path / "reference", tokenizer)
    reference.train()
    for a, b in zip(resumed.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b), "the rescued state continues exactly as the uninterrupted run"


# A recipe whose callback deletes the output folder after step 2 (before its log line and checkpoint), as a
# cleanup script or a mistaken `rm -r` does while the run is going.
DELETES_ITS_FOLDER = """
import shutil
from grpo import Config
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

config = Config(output_dir={out!r}, max_steps=4, save_steps=1, per_device_train_batch_size=8, num_generations=4,
                max_prompt_length=16, max_completion_length=8, learning_rate=1e-2, optim="adamw", seed=0)
reward_funcs = [digit_share]
train_dataset = digit_prompts


class DeleteOutputDir:
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and {delete}:
            shutil.rmtree(args.output_dir)


callbacks = [DeleteOutputDir()]


def build_model(config):
    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer), tokenizer
"""


@pytest.mark.slow  # three short runs
def test_an_output_folder_deleted_mid_run_is_one_line_and_the_state_is_rescued(tmp_path, capsys):
    from safetensors.torch import load_file

    out, reference = tmp_path / "run", tmp_path / "reference"
    (tmp_path / "deletes.py").write_text(DELETES_ITS_FOLDER.format(out=str(out), delete=True))
    code = main([str(tmp_path / "deletes.py")])
    err = capsys.readouterr().err
    rescued = tmp_path / "run.rescue" / "checkpoint-2"
    assert code == 1 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line == (f"error: checkpoint-2 cannot be written into {out} (it was deleted while the run was going): "
                    f"the state after step 2 is saved in {rescued} instead; resume with "
                    f"--resume_from_checkpoint={rescued}")
    assert not out.exists(), "not made again: it would hold the last checkpoint without the rest of the run"

    assert main([str(tmp_path / "deletes.py"), f"--resume_from_checkpoint={rescued}"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    (tmp_path / "reference.py").write_text(DELETES_ITS_FOLDER.format(out=str(reference), delete=False))
    assert main([str(tmp_path / "reference.py")]) == 0
    resumed, uninterrupted = (load_file(run / "checkpoint-4" / "model.safetensors") for run in (out, reference))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), "the rescued state continues exactly"


def test_when_the_folder_beside_it_refuses_too_the_checkpoint_goes_to_the_temporary_folder(tmp_path, monkeypatch):
    import tempfile

    from grpo.run.checkpoint import damage, save_or_rescue

    tokenizer = tiny_tokenizer()
    parent, spare = tmp_path / "runs", tmp_path / "tmp"
    out = parent / "a"
    out.mkdir(parents=True)
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    freeze(out)
    try:
        freeze(parent)  # no runs/a.rescue either: a full disk
        try:
            path, line = save_or_rescue(str(out), 3, tiny_model(tokenizer), tokenizer, {"seed": 0}, {"step": 3})
        finally:
            thaw(parent)
    finally:
        thaw(out)
    assert path == spare / "grpo-rescue-a" / "checkpoint-3" and damage(path, weights_only=True) is None
    assert line.startswith(f"checkpoint-3 cannot be written into {out} (")
    assert f", nor into {parent / 'a.rescue'} (" in line
    assert f"the state after step 3 is saved in {path} instead" in line
