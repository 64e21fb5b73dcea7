"""Bad inputs a new user tries, each reported by `python -m grpo.train` as one `error:` line, with a non-zero
exit, no traceback and nothing written: an output folder that cannot be created, a model that cannot be found
(a local path, or a hub id without a network), `--model` on a recipe that builds its own, a checkpoint of
another shape, an empty chat or text prompt, a prompt longer than the model's context, a `config` that is not
a Config, a damaged checkpoint; `grpo.eval --reward_funcs` naming a function of a TRL-style script that trains
when imported."""
import json
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_errors import assert_short_error, run
from test_trl_port import python_example
from tiny_setup import tiny_model, tiny_tokenizer

from grpo.eval import main as eval_main
from grpo.run.checkpoint import damage
from grpo.train import main

ROOT = Path(__file__).resolve().parents[2]
# A recipe that loads `config.model` itself (no build_model).
LOADS_MODEL = """
from grpo import Config
from tiny_setup import digit_prompts, digit_share

config = Config(output_dir={out!r}, model={model!r}, max_steps=1, per_device_train_batch_size=4,
                num_generations=2, optim="adamw")
reward_funcs = [digit_share]
train_dataset = digit_prompts
"""
# A recipe whose model's hidden size comes from the environment, to resume a checkpoint onto another shape.
SIZED = """
import os
from grpo import Config
from tiny_setup import digit_prompts, digit_share, tiny_tokenizer
from grpo.tasks.tiny import model_for

config = Config(output_dir={out!r}, max_steps=2, save_steps=1, per_device_train_batch_size=4, num_generations=2,
                max_prompt_length=16, max_completion_length=4, optim="adamw", lora_r=2)
reward_funcs = [digit_share]
train_dataset = digit_prompts

def build_model(config):
    tokenizer = tiny_tokenizer()
    return model_for(tokenizer, hidden_size=int(os.environ["HIDDEN"]), num_layers=1, num_heads=2, num_kv_heads=1,
                     seed=0), tokenizer
"""


def write_recipe(tmp_path, template: str, **fields) -> str:
    recipe = tmp_path / "recipe.py"
    recipe.write_text(textwrap.dedent(template).format(out=str(tmp_path / "run"), **fields))
    return str(recipe)


def test_an_output_dir_that_cannot_be_created(tmp_path, capsys):
    code, err = run(tmp_path, capsys, "--output_dir=/proc/grpo-run")
    assert_short_error(code, err, 2, "error: output_dir=/proc/grpo-run cannot be created: making a folder in /proc "
                                     "fails", "pick a writable --output_dir")
    assert not Path("/proc/grpo-run").exists()


def test_a_model_path_that_does_not_exist(tmp_path, capsys):
    code = main([write_recipe(tmp_path, LOADS_MODEL, model="/nonexistent/model")])
    err = capsys.readouterr().err
    assert_short_error(code, err, 2, "error: model=/nonexistent/model is read as a local path (not a hub id "
                                     "'namespace/name'), and there is no such folder: point --model at a folder "
                                     "holding config.json")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a subprocess: seconds of imports
def test_a_hub_model_without_a_network(tmp_path):
    # HF_HUB_OFFLINE=1 makes the hub lookup fail at once, as a machine without a network would after retries;
    # an empty HF_HOME, so that a model cached on this machine is not found. A subprocess: huggingface_hub reads
    # HF_HUB_OFFLINE when it is imported.
    recipe = write_recipe(tmp_path, LOADS_MODEL, model="Qwen/Qwen2.5-0.5B-Instruct")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-m", "grpo.train", recipe], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert_short_error(result.returncode, result.stderr, 2,
                       "error: model=Qwen/Qwen2.5-0.5B-Instruct is read as a Hugging Face Hub id, it is not in the "
                       "Hugging Face cache (HF_HOME) and HF_HUB_OFFLINE=1 is set: the closest model shipped for "
                       "offline use is --model=smollm2-135m-instruct", "point --model at a folder")
    assert [line for line in result.stderr.splitlines() if line.strip()] == [result.stderr.strip()], "one line"
    assert not (tmp_path / "run").exists()


def test_model_on_a_recipe_that_builds_its_own(tmp_path, capsys):
    code, err = run(tmp_path, capsys, "--model=Qwen/Qwen2.5-0.5B-Instruct")
    assert_short_error(code, err, 2, "builds its own model in build_model; --model is not used: drop "
                                     "--model=Qwen/Qwen2.5-0.5B-Instruct")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("lora", ["false", "true"])
def test_resuming_onto_a_model_of_another_shape(tmp_path, capsys, monkeypatch, lora):
    recipe = write_recipe(tmp_path, SIZED)
    monkeypatch.setenv("HIDDEN", "16")
    assert main([recipe, f"--use_lora={lora}", "--max_steps=1"]) == 0
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    monkeypatch.setenv("HIDDEN", "32")
    code = main([recipe, f"--use_lora={lora}", "--resume_from_checkpoint=latest"])
    err = capsys.readouterr().err
    shapes = "lora_A.weight (2, 64) vs (2, 128)" if lora == "true" else "embed_tokens.weight (260, 16) vs (260, 32)"
    assert_short_error(code, err, 2, f"error: {tmp_path / 'run' / 'checkpoint-1'} does not fit this model: ",
                       "tensors of another shape (saved vs this model), e.g. ", shapes,
                       "resume with the model it was trained from")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


def test_an_empty_chat_prompt(tmp_path, capsys):
    chat = "[{'role': 'user', 'content': 'Write 3 digits:'}]"
    body = f"reward_funcs = [digit_share]\ntrain_dataset = Dataset.from_list([{{'prompt': {chat}}}, {{'prompt': []}}])"
    code, err = run(tmp_path, capsys, body=body)
    assert_short_error(code, err, 1, "error: train_dataset has 1 empty chat prompts (no messages) out of 2, first "
                                     "at row 1")
    assert not (tmp_path / "run").exists()


def test_an_empty_text_prompt(tmp_path, capsys):
    # The tiny tokenizer adds a BOS, so "" would train silently; SmolLM2's adds none, and transformers fails.
    body = "reward_funcs = [digit_share]\ntrain_dataset = Dataset.from_list([{'prompt': 'Write 3 digits:'}] * 2 + " \
           "[{'prompt': ''}])"
    code, err = run(tmp_path, capsys, body=body)
    assert_short_error(code, err, 1, "error: train_dataset has 1 empty prompts ('') out of 3, first at row 2: each "
                                     "needs some text; drop them with train_dataset.filter(lambda row: "
                                     "len(row['prompt']) > 0)")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_prompt_longer_than_the_models_context(tmp_path, capsys):
    # tiny_model's context is 4,096 positions; with prompts whole the third row would be decoded past them.
    rows = "[{'prompt': 'Write 3 digits:'}, {'prompt': 'Write 3 digits: ' * 300}]"
    body = f"reward_funcs = [digit_share]\ntrain_dataset = eval_dataset = Dataset.from_list({rows})"
    code, err = run(tmp_path, capsys, "--max_prompt_length=None", "--shuffle_dataset=false", body=body)
    said = ("row 1: its prompt is 4,800 tokens, more than the model's context of 4,096 positions (its "
            "max_position_embeddings), and max_prompt_length=None keeps prompts whole: set --max_prompt_length=4092 "
            "to cut prompts from the left and leave room for the completion, or drop the row")
    assert_short_error(code, err, 1, f"error: train_dataset {said}")
    assert err.strip().splitlines()[-1].startswith("error: ") and err.count("error") == 1, err
    assert not list((tmp_path / "run").glob("*checkpoint*")) and not list((tmp_path / "run").glob("*.jsonl"))

    code = eval_main([str(tmp_path / "recipe.py"), "--max_prompt_length=None", "--eval_accuracy_func=digit_share",
                      "--eval_format_func=None"])
    err = capsys.readouterr().err
    assert_short_error(code, err, 1, f"error: eval_dataset {said}")
    assert err.strip().splitlines()[-1].startswith("error: ") and err.count("error") == 1, err


def test_a_config_that_is_not_a_config(tmp_path, capsys):
    recipe = tmp_path / "recipe.py"
    recipe.write_text("config = 5\n")
    code = main([str(recipe)])
    assert_short_error(code, capsys.readouterr().err, 2, f"error: recipe {recipe} does not define reward_funcs, "
                       "train_dataset and defines `config` as int 5, not a grpo.Config (write config = Config(...))")


def test_a_damaged_newest_checkpoint(tmp_path, capsys):
    # 3 steps, a checkpoint after each; then checkpoint-3's weights are cut short, as a full disk leaves them.
    body = "reward_funcs = [digit_share]\ntrain_dataset = digit_prompts\neval_dataset = digit_prompts"
    settings = "eval_accuracy_func='digit_share', eval_format_func=None"
    assert run(tmp_path, capsys, body=body, config=settings)[0] == 0
    out, recipe = tmp_path / "run", str(tmp_path / "recipe.py")
    newest, older = out / "checkpoint-3", out / "checkpoint-2"
    weights = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    cut = f"model.safetensors is cut short ({len(weights) // 2:,} bytes, its header says {len(weights):,})"

    # Named explicitly: one line naming the file and the checkpoint that would work, in training and eval.
    for command, setting in [(main, "--resume_from_checkpoint"), (eval_main, "--checkpoint")]:
        code = command([recipe, f"{setting}={newest}"])
        err = capsys.readouterr().err
        assert err == (f"error: {setting}={newest} cannot be loaded: {cut}; the newest loadable checkpoint "
                       f"beside it is {older}: {setting}={older}\n")
        assert code == 2

    # `latest` passes over it, says so, and continues from checkpoint-2: step 3 again, saved anew.
    code, err = run(tmp_path, capsys, "--resume_from_checkpoint=latest", body=body, config=settings)
    assert code == 0, err
    said = f"{newest} cannot be loaded ({cut}): resuming from {older}, the newest loadable checkpoint\n"
    assert said in err
    assert "Traceback" not in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and damage(newest) is None


def test_eval_reward_funcs_from_a_script_that_trains_when_imported(tmp_path, capsys, monkeypatch):
    # docs/coming-from-trl.md's script as a user saves and runs it (port.py), then evaluates its checkpoint
    # with its reward function: importing port.py would run its training again.
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "tiny-model")
    tokenizer.save_pretrained(tmp_path / "tiny-model")
    script = python_example(ROOT / "docs" / "coming-from-trl.md")
    script = script.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(tmp_path / "tiny-model")))
    (tmp_path / "port.py").write_text(script)
    (tmp_path / "held_out.jsonl").write_text('{"prompt": "Name a word that rhymes with sun:"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    runpy.run_path("port.py", run_name="__main__")  # python port.py
    capsys.readouterr()
    run_folder = tmp_path / "Qwen2.5-0.5B-GRPO"
    logged = (run_folder / "metrics.jsonl").read_text()

    code = eval_main(["--checkpoint", str(run_folder / "checkpoint-4"), "--eval_dataset=held_out.jsonl",
                      "--reward_funcs=port.reward_len"])
    err = capsys.readouterr().err
    line = script[:script.index("trainer.train()")].count("\n") + 1
    assert_short_error(code, err, 2, f"error: --reward_funcs='port.reward_len': importing port would train "
                                     f"({tmp_path / 'port.py'}:{line} calls .train() at its top level): put its "
                                     "training under "
                                     "`if __name__ == \"__main__\":`, or reward_len in a module of its own")
    assert len(err.strip().splitlines()) == 1, err
    assert "port" not in sys.modules and (run_folder / "metrics.jsonl").read_text() == logged, "nothing ran"
