"""Offline, with HF_HUB_OFFLINE unset (a laptop on a train): a model or a dataset that is not local fails within
seconds in one line saying what was looked for, that the Hub cannot be reached, the closest model shipped for
offline use and how to point at a local copy; the GSM8K recipe trains on a local copy of the data. The Hub's
endpoint is a closed local port (HF_ENDPOINT), so the Hub is out of reach whatever this machine's network."""
import json
import time

import pytest
from tiny_setup import tiny_model, tiny_tokenizer

from grpo.train import main


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("GSM8K_PATH", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))


def run_timed(capsys, *args) -> tuple[int, str, float]:
    t0 = time.monotonic()
    code = main(list(args))
    return code, capsys.readouterr().err, time.monotonic() - t0


def test_a_hub_model_not_in_the_cache_fails_within_seconds_naming_the_shipped_one(offline, tmp_path, capsys):
    code, err, seconds = run_timed(capsys, "recipes/word_problems.py", "--model=smollm2-135m",
                                   f"--output_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in err and "Retrying" not in err
    (line,) = err.splitlines()
    assert line.startswith("error: model=smollm2-135m is read as a Hugging Face Hub id, it is not in the Hugging Face "
                           "cache (HF_HOME) and the Hub cannot be reached (127.0.0.1: Connection refused): the closest "
                           "model shipped for offline use is --model=smollm2-135m-instruct")
    assert "point --model at a folder" in line
    assert seconds < 10, f"{seconds:.1f} s"


def test_gsm8k_offline_without_a_local_copy_fails_within_seconds_in_one_line(offline, tmp_path, capsys):
    code, err, seconds = run_timed(capsys, "recipes/gsm8k_lora.py", f"--output_dir={tmp_path / 'run'}")
    assert code == 1 and "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("error: GSM8K (openai/gsm8k on the Hugging Face Hub) is not in the Hugging Face cache "
                           "(HF_HOME) and the Hub cannot be reached (127.0.0.1: Connection refused): set GSM8K_PATH")
    assert seconds < 10, f"{seconds:.1f} s"


@pytest.mark.slow
def test_the_gsm8k_recipe_trains_offline_on_a_local_copy_of_the_data(offline, tmp_path, monkeypatch, capsys):
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"What is {k} plus {k}?", "answer": f"{k} and {k} make {2 * k}.\n#### {2 * k}"}
                for k in range(8)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tmp_path / "model"
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    monkeypatch.setenv("GSM8K_PATH", str(data / "train.jsonl"))
    out = tmp_path / "run"
    code = main(["recipes/gsm8k_lora.py", f"--model={model}", f"--output_dir={out}", "--max_steps=1",
                 "--max_prompt_length=512", "--max_completion_length=4", "--bf16=false", "--optim=adamw"])
    assert code == 0, capsys.readouterr().err[-2000:]
    (line,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 1
