"""When checkpoints are written and how a run is picked up again, with transformers' names and meanings:
`save_strategy` ("no" writes none), `resume_from_checkpoint=True` (the newest checkpoint), Ctrl-C from Python a
KeyboardInterrupt raised once the checkpoint is written, hints in the caller's language (Python or the command
line), and a checkpoint whose bytes changed after its save recognised by its checksums and passed over."""
import json
import os
import signal

import pytest
from test_errors import GOOD_BODY, run
from test_resume import make_trainer, read_jsonl, stop_when
from tiny_setup import logged, text_length

from grpo.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_setup import tiny_tokenizer

    return tiny_tokenizer()


def checkpoints(out) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


def sigint():
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_from_python_is_a_keyboard_interrupt_once_saved_and_says_how_to_resume_in_python(tmp_path, tokenizer):
    out = tmp_path / "run"
    first = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=4, save_steps=10)
    stop_when(first, "accumulate", 2, sigint)  # step 3 is rolled back: steps 1-2 are saved
    with pytest.raises(KeyboardInterrupt) as info:
        first.train()
    assert str(info.value) == (f"interrupted by SIGINT after step 2: saved {out / 'checkpoint-2'}; to resume, set "
                               f"resume_from_checkpoint=True in the Config")
    assert checkpoints(out) == ["checkpoint-2"]
    resumed = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=4, save_steps=10, resume_from_checkpoint=True)
    resumed.train()
    assert [line["step"] for line in logged(resumed)] == [1, 2, 3, 4]  # the log_history of the whole run


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_ctrl_c_while_a_reward_function_runs_stops_the_step_not_the_function(tmp_path, tokenizer, kind):
    calls = []

    def slow_judge(completions, **kwargs):  # a judge model or an API: where Ctrl-C most often lands
        calls.append(1)
        if len(calls) == 2:
            sigint()
        return text_length(completions)

    async def async_judge(completions, **kwargs):
        return slow_judge(completions)

    out = tmp_path / "run"
    trainer = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=4, save_steps=10)
    trainer.pipeline.source.reward_funcs = [slow_judge if kind == "def" else async_judge]
    with pytest.raises(KeyboardInterrupt, match=r"interrupted by SIGINT after step 1: saved .*checkpoint-1"):
        trainer.train()


CTRL_C_IN_STEP_2 = GOOD_BODY + """
import os
import signal
from transformers import TrainerCallback

class CtrlCInStep2(TrainerCallback):  # the user's Ctrl-C, injected through TRL's callbacks=
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)

callbacks = [CtrlCInStep2()]
"""


def test_ctrl_c_on_the_command_line_prints_the_resume_command_and_exits_130_and_the_resume_says_from_where(
        tmp_path, capsys):
    code, err = run(tmp_path, capsys, "--save_steps=10", body=CTRL_C_IN_STEP_2)
    saved = tmp_path / "run" / "checkpoint-1"
    assert code == 130
    lines = err.splitlines()
    assert lines[-2:] == [f"interrupted by SIGINT after step 1: saved {saved}",
                          f"resume with: python -m grpo.train {tmp_path / 'recipe.py'} --save_steps=10 "
                          f"--resume_from_checkpoint={saved}"]
    code, err = run(tmp_path, capsys, "--save_steps=10", f"--resume_from_checkpoint={saved}")  # no Ctrl-C now
    assert code == 0, err
    assert err.splitlines()[0] == f"resuming from {saved} (step 1 of 3)"


def test_a_rerun_into_the_same_output_dir_says_how_to_continue_in_the_callers_language(tmp_path, tokenizer, capsys):
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=1).train()
    capsys.readouterr()
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=1).train()  # the earlier run moved aside
    assert "previous-run-1 for this fresh run; resume_from_checkpoint=True in the Config continues a run " \
           "instead" in capsys.readouterr().err
    (tmp_path / "cli").mkdir()
    assert run(tmp_path / "cli", capsys)[0] == 0  # test_errors' recipe, into tmp_path / "cli" / "run"
    code, err = run(tmp_path / "cli", capsys)
    assert code == 0 and "previous-run-1 for this fresh run; --resume_from_checkpoint=latest continues a run " \
                         "instead" in err


def test_resume_from_checkpoint_true_is_the_newest_checkpoint_and_needs_one(tmp_path, tokenizer):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^resume_from_checkpoint=True: no checkpoint in .*run to resume from "
                                          r"\(\"latest\" would start from step 0 when there is none\)$"):
        make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, resume_from_checkpoint=True).train()
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, save_steps=1).train()
    resumed = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=3, resume_from_checkpoint=True)
    resumed.train()
    assert [line["step"] for line in logged(resumed)] == [1, 2, 3]


def test_train_takes_transformers_resume_from_checkpoint(tmp_path, tokenizer):
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, save_steps=1).train()
    resumed = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert [line["step"] for line in logged(resumed)] == [1, 2, 3]


def test_save_strategy_no_writes_no_checkpoint_not_even_on_ctrl_c(tmp_path, tokenizer):
    out = tmp_path / "run"
    trainer = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=3, save_steps=1, save_strategy="no")
    stop_when(trainer, "accumulate", 2, sigint)
    with pytest.raises(KeyboardInterrupt) as info:
        trainer.train()
    assert str(info.value) == 'interrupted by SIGINT after step 2: nothing saved (save_strategy="no")'
    assert checkpoints(out) == [] and [line["step"] for line in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    trainer.save_model()  # the model, for from_pretrained, as in transformers
    assert (out / "model.safetensors").is_file()


def test_save_strategy_epoch_saves_after_each_pass_over_the_prompts(tmp_path, tokenizer):
    # 8 prompts, 4 a step (8 completions, 2 of each prompt): an epoch is 2 steps; 3 epochs.
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=-1, num_train_epochs=3, save_strategy="epoch",
                 save_steps=1, num_generations=2, gradient_accumulation_steps=1).train()
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def flip_a_tensor_byte(path) -> None:
    """One bit of a tensor's data changed: the file keeps its size and its header."""
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0x01  # the last tensor's bytes end the file
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_the_weights_is_passed_over_like_a_truncated_file(tmp_path, tokenizer, capsys):
    out = tmp_path / "run"
    make_trainer(out, tokenizer, {}, optim="adamw", max_steps=2, save_steps=1).train()
    newest, older = out / "checkpoint-2", out / "checkpoint-1"
    flip_a_tensor_byte(newest / "model.safetensors")
    why = ("model.safetensors does not match its sha256 in checksums.sha256 (its bytes changed after it was "
           "saved)")
    with pytest.raises(ConfigError) as error:  # named: one line naming the one that works
        make_trainer(out, tokenizer, {}, optim="adamw", max_steps=3, resume_from_checkpoint=str(newest)).train()
    assert str(error.value) == (f"resume_from_checkpoint={newest} cannot be loaded: {why}; the newest loadable "
                                f"checkpoint beside it is {older}: resume_from_checkpoint={older}")
    capsys.readouterr()
    resumed = make_trainer(out, tokenizer, {}, optim="adamw", max_steps=3, resume_from_checkpoint="latest")
    resumed.train()
    assert [line["step"] for line in logged(resumed)] == [1, 2, 3], "step 2 again, from checkpoint-1"
    assert f"{newest} cannot be loaded ({why}): resuming from {older}" in capsys.readouterr().err

    for name in ("checkpoint-1", "checkpoint-3"):  # checkpoint-2 is still the damaged one: none is loadable now
        flip_a_tensor_byte(out / name / "model.safetensors")
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be loaded \(checkpoint-3: model.safetensors does "
                                          r"not match its sha256"):
        make_trainer(out, tokenizer, {}, optim="adamw", max_steps=4, resume_from_checkpoint="latest").train()


def test_a_lora_adapter_of_a_hub_model_is_saved_without_asking_the_hub(tmp_path, tokenizer):
    # peft's default save asks the Hub whether the base model's vocabulary changed: offline, two warnings at
    # the first save (and a wait where a firewall drops packets), though the vocabulary is never resized here.
    import warnings

    from tiny_setup import digit_prompts, tiny_model

    from grpo import Config, Trainer

    model = tiny_model(tokenizer)
    model.name_or_path = model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub model's name
    config = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                    num_generations=2, max_prompt_length=16, max_completion_length=4, optim="adamw",
                    use_lora=True, lora_r=4)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[text_length],
                      train_dataset=digit_prompts())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        trainer.save_model(str(tmp_path / "adapter"))
    hub = [str(w.message) for w in caught if "HuggingFaceTB" in str(w.message)]
    saved = tmp_path / "run" / "checkpoint-1"
    recorded = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub == [] and (saved / "adapter_model.safetensors").exists()
