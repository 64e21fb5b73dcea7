"""Crash-safe checkpoints: a process killed (-9) in the middle of a save leaves the previous checkpoint
loadable and picked by `latest`; SIGTERM / SIGINT to `python -m grpo.train` save, say how to resume, and
exit 143 / 130."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grpo.errors import ConfigError
from grpo.run.checkpoint import (
    CHECKSUMS,
    COMPLETE,
    STATE,
    complete_checkpoints,
    damage,
    find_checkpoint,
    save_checkpoint,
)
from grpo.run.logs import drop_log_lines_after
from grpo.train import main

ROOT = Path(__file__).resolve().parents[2]

KILLED_MID_SAVE = """
import os, signal, sys
import torch
sys.path[:0] = [{root!r}, {tests!r}]
from grpo import Config, Trainer
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

real_save = torch.save

def save_then_die(obj, path, *args, **kwargs):
    # The weights and tokenizer of checkpoint-4 are already in its temporary folder; the trainer
    # state gets half written, then the process is killed.
    if ".checkpoint-4.tmp" in str(path):
        with open(path, "wb") as f:
            f.write(b"half a trainer state")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, path, *args, **kwargs)

torch.save = save_then_die
tokenizer = tiny_tokenizer()
config = Config(output_dir={out!r}, max_steps=6, save_steps=2, save_total_limit=1, per_device_train_batch_size=4,
                num_generations=2, max_prompt_length=16, max_completion_length=4, optim="adamw_8bit", seed=0)
Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
        train_dataset=digit_prompts()).train()
"""


@pytest.mark.slow
def test_kill_9_mid_save_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(KILLED_MID_SAVE.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(out)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]

    half = out / ".checkpoint-4.tmp"
    assert (half / "model.safetensors").exists() and not (half / COMPLETE).exists()
    assert complete_checkpoints(out) == [out / "checkpoint-2"], "save_total_limit=1 counts complete ones only"
    assert find_checkpoint("latest", str(out)) == (out / "checkpoint-2", [])

    # The previous checkpoint loads: resuming from `latest` runs to the end and clears the leftover.
    recipe = tmp_path / "recipe.py"
    recipe.write_text(textwrap.dedent(f"""
        from grpo import Config
        from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer
        config = Config(output_dir={str(out)!r}, max_steps=6, save_steps=2, save_total_limit=1,
                        per_device_train_batch_size=4, num_generations=2, max_prompt_length=16,
                        max_completion_length=4, optim="adamw_8bit", seed=0)
        reward_funcs = [digit_share]
        train_dataset = digit_prompts
        def build_model(config):
            tokenizer = tiny_tokenizer()
            return tiny_model(tokenizer), tokenizer
    """))
    assert main([str(recipe), "--resume_from_checkpoint=latest"]) == 0
    assert complete_checkpoints(out) == [out / "checkpoint-6"] and not half.exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], "lines of steps 3-4, written after checkpoint-2, were dropped once"


@pytest.mark.slow
def test_sigterm_saves_prints_how_to_resume_and_exits_143(tmp_path):
    out = tmp_path / "run"
    args = ["recipes/tiny.py", "--max_steps=1000", f"--output_dir={out}", "--num_generations=2", "--save_steps=1000"]
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "grpo.train", *args], cwd=ROOT, stderr=stderr,
                                   stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 143
    err = (tmp_path / "stderr").read_text()
    assert "SIGTERM: saving a checkpoint, then stopping (SIGTERM again stops now, without saving)" in err
    step = len(metrics.read_text().splitlines())
    checkpoint = out / f"checkpoint-{step}"
    assert f"interrupted by SIGTERM after step {step}: saved {checkpoint}" in err
    assert complete_checkpoints(out) == [checkpoint] and "Traceback" not in err

    resume = err.split("resume with: ")[1].splitlines()[0]
    assert resume == f"python -m grpo.train {shlex.join(args)} --resume_from_checkpoint={checkpoint}"
    assert main(shlex.split(resume)[3:] + [f"--max_steps={step + 1}"]) == 0
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, step + 2))


def test_dropping_log_lines_after_a_step(tmp_path):
    lines = [{"step": s, "x": s} for s in (1, 2, 3, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "completions.jsonl").write_text(json.dumps({"step": 2}) + "\n" + '{"step": 3, "prom')  # torn
    drop_log_lines_after(str(tmp_path), 3)
    assert [json.loads(x)["x"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 3]
    assert (tmp_path / "completions.jsonl").read_text() == '{"step": 2}\n'
    drop_log_lines_after(str(tmp_path), 0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_incomplete_folders_are_not_checkpoints(tmp_path):
    for name, complete in [("checkpoint-2", True), ("checkpoint-10", True), ("checkpoint-12", False),
                           (".checkpoint-14.tmp", True), ("checkpoint-x", True)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / STATE).write_bytes(b"")
            (tmp_path / name / COMPLETE).write_text("")
    assert complete_checkpoints(tmp_path) == [tmp_path / "checkpoint-2", tmp_path / "checkpoint-10"]
    assert find_checkpoint("latest", str(tmp_path / "empty")) == (None, [])


def test_saving_a_step_again_replaces_it_and_leaves_no_temporary_folders(tmp_path):
    from tiny_setup import tiny_model, tiny_tokenizer

    model = tiny_model(tiny_tokenizer())
    (tmp_path / ".checkpoint-9.tmp").mkdir()  # left by an earlier crash
    for _ in range(2):
        path = save_checkpoint(str(tmp_path), 3, model, None, {}, {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    assert sorted(p.name for p in path.iterdir()) == [COMPLETE, CHECKSUMS, "config.json", "generation_config.json",
                                                      "grpo_config.json", "model.safetensors", STATE]


@pytest.fixture(scope="module")
def models():
    """A full model and a LoRA one (peft saves its adapter alone)."""
    from peft import LoraConfig, get_peft_model
    from tiny_setup import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    lora = get_peft_model(tiny_model(tokenizer), LoraConfig(r=2, target_modules="all-linear"))
    return {"full": tiny_model(tokenizer), "lora": lora}


def two_checkpoints(out: Path, model) -> tuple[Path, Path]:
    """checkpoint-1 and checkpoint-2 as the trainer writes them (a small state stands in for the real one)."""
    return tuple(save_checkpoint(str(out), step, model, None, {"seed": 0},
                                 {"step": step, "x": list(range(500))}) for step in (1, 2))


def flip_a_bit(path: Path) -> None:
    """One bit of the file's last bytes (a tensor's, or the zip directory's) changed; its size stays."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("kind, damaged, problem", [
    ("full", "model.safetensors", r"model.safetensors is cut short \([\d,]+ bytes, its header says [\d,]+\)"),
    ("lora", "adapter_model.safetensors", r"adapter_model.safetensors is cut short \(.*\)"),
    ("full", STATE, rf"{STATE} is cut short or damaged \([\d,]+ bytes, no zip directory at its end\)"),
    ("full", f"-{STATE}", f"no {STATE}"),  # deleted
    ("lora", "~adapter_model.safetensors", r"adapter_model.safetensors does not match its sha256 in "
                                           r"checksums.sha256 \(its bytes changed after it was saved\)"),  # a bit
    ("full", f"~{STATE}", rf"{STATE} does not match its sha256 in checksums.sha256 \(.*\)"),
])
def test_latest_passes_over_a_damaged_checkpoint_and_an_explicit_one_names_the_one_that_works(
        tmp_path, models, kind, damaged, problem):
    older, newest = two_checkpoints(tmp_path, models[kind])
    assert damage(older) is None and damage(newest) is None
    if damaged.startswith("-"):
        (newest / damaged[1:]).unlink()
    elif damaged.startswith("~"):
        flip_a_bit(newest / damaged[1:])
    else:
        cut_in_half(newest / damaged)

    path, passed_over = find_checkpoint("latest", str(tmp_path))
    assert path == older and len(passed_over) == 1
    assert re.fullmatch(rf"{re.escape(str(newest))} cannot be loaded \({problem}\): resuming from "
                        rf"{re.escape(str(older))}, the newest loadable checkpoint", passed_over[0])

    with pytest.raises(ConfigError) as error:
        find_checkpoint(str(newest), str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and re.search(problem, message)
    assert message.startswith(f"resume_from_checkpoint={newest} cannot be loaded: ")  # from Python
    assert message.endswith(f"the newest loadable checkpoint beside it is {older}: resume_from_checkpoint={older}")
    # What that line suggests works: the damaged newer checkpoint is not one that would be mixed in.
    assert find_checkpoint(str(older), str(tmp_path)) == (older, [])


def test_when_every_checkpoint_is_damaged_latest_refuses_to_start_over(tmp_path, models):
    older, newest = two_checkpoints(tmp_path, models["full"])
    cut_in_half(older / "model.safetensors")
    (newest / "grpo_config.json").write_text("{")
    message = (r"no checkpoint in .* can be loaded \(checkpoint-2: grpo_config.json is not valid JSON; "
               r"checkpoint-1: model.safetensors is cut short .*\): move them away to start again from "
               r"step 0")
    with pytest.raises(ConfigError, match=message):
        find_checkpoint("latest", str(tmp_path))


def test_a_sharded_checkpoint_needs_every_shard_its_index_lists(tmp_path, models):
    _, newest = two_checkpoints(tmp_path, models["full"])
    (newest / "model.safetensors").rename(newest / "model-00001-of-00002.safetensors")
    shards = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                             "b": "model-00002-of-00002.safetensors"}}
    (newest / "model.safetensors.index.json").write_text(json.dumps(shards))
    assert damage(newest) == "no model-00002-of-00002.safetensors"
