"""`python -m grpo.train` as a user runs it: in a subprocess, on the offline recipe; its refusals and help through
its `main()` in the test process (what it writes to file descriptors 1 and 2), sparing a start of Python and torch
each."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "grpo.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_here(capfd, *args) -> subprocess.CompletedProcess:
    from grpo.train import main

    capfd.readouterr()
    code = main([str(ROOT / args[0]), *args[1:]])
    return subprocess.CompletedProcess(args, code, *capfd.readouterr())


def test_cli_trains_the_offline_recipe(tmp_path):
    out = tmp_path / "run"
    result = run("recipes/tiny.py", "--max_steps=2", f"--output_dir={out}", "--num_generations=2",
                 "--save_steps=1")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all("rewards/digit_count/mean" in line for line in lines)
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    assert not (out / "checkpoint-1").exists(), "save_total_limit=1 keeps only the newest"


def test_cli_help_lists_every_setting(capfd):
    result = run_here(capfd, "recipes/tiny.py", "--help")
    assert result.returncode == 0, result.stderr
    assert "--max_steps=20" in result.stdout and "--learning_rate=" in result.stdout
    assert "Completions per micro-batch" in result.stdout


def test_cli_unknown_key_names_the_closest_field(capfd):
    result = run_here(capfd, "recipes/tiny.py", "--learning_rat=1e-5")
    assert result.returncode == 2
    assert "learning_rate" in result.stderr and "Traceback" not in result.stderr


def test_cli_schedule_error_is_one_line(capfd):
    result = run_here(capfd, "recipes/tiny.py", "--steps_per_generation=3", "--gradient_accumulation_steps=2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == ("error: steps_per_generation=3 must be a multiple of gradient_accumulation_steps=2 here: "
                             "a generation batch feeds whole optimizer steps\n")
