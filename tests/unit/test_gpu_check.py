"""benchmarks/gpu_check.py's CPU-side logic: the clean skip without CUDA, reading a check's process output, and
the pass / fail judgement and table on recorded measurements (the GPU runs themselves need a GPU)."""
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

from grpo.settings import Config  # noqa: E402
from grpo.train import out_of_memory_report  # noqa: E402

STEP = {  # the shape of a `step` result; figures made up around the planner's 1B LoRA prediction
    "seconds": {"generate": 61.0, "reference log-probs": 1.2, "log-probs": 2.0, "backward": 6.5, "optimizer": 0.2},
    "step_s": 71.5, "tokens_per_s": 51.5, "generated_tokens": 3144.0, "loss": 0.0012, "changed_fraction": 1.0,
    "dtype_problems": [], "peak_gb": 3.5, "generation_peak_gb": 2.6, "predicted_gb": 3.73,
    "predicted_generation_gb": 2.76}
RESUMED = {"differing_tensors": 0, "first_differing": [], "metrics_equal": True, "steps": [1, 2],
           "completions_equal": True, "loss_finite": True}


def test_without_cuda_it_skips_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--output", str(tmp_path / "gpu_check.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("gpu_check: no CUDA device, nothing checked")
    assert not (tmp_path / "gpu_check.json").exists()


def test_memory_rows_pass_within_15_percent_of_the_prediction():
    rows = [{"model": "1B", "column": "LoRA", "predicted_gb": 3.73, "measured_gb": 3.50},  # +6.6%
            {"model": "1B", "column": "full", "predicted_gb": 34.91, "measured_gb": 27.5},  # +27%
            {"model": "3B", "column": "LoRA", "predicted_gb": 8.1, "skipped": "needs 9 GB, the card has 8"},
            {"model": "0.5B", "column": "QLoRA", "predicted_gb": 1.24, "error": "out of memory: CUDA out of memory"}]
    problems = gpu_check.judge("memory", {"rows": rows})
    assert problems == ["1B full: predicted +27% off the measured peak",
                        "0.5B QLoRA: out of memory: CUDA out of memory"]
    assert gpu_check.judge("memory", {"rows": rows[:1]}) == []
    assert gpu_check.judge("memory", {"rows": [dict(rows[0], measured_gb=None)]}) == ["1B LoRA: nothing measured"]
    # The CPU rehearsal measures no CUDA peak, and says nothing about the planner.
    assert gpu_check.judge("memory", {"rows": [dict(rows[1], measured_gb=None)]}, device="cpu") == []


def test_the_timed_step_fails_on_a_bad_loss_a_frozen_tensor_a_dtype_or_a_wrong_peak():
    assert gpu_check.judge("step", STEP) == []
    assert gpu_check.judge("step", dict(STEP, loss=math.nan)) == ["loss nan"]
    assert gpu_check.judge("step", dict(STEP, changed_fraction=0.5)) == [
        "only 50% of the trainable tensors were updated"]
    assert gpu_check.judge("step", dict(STEP, dtype_problems=["frozen lm_head.weight is not torch.bfloat16"])) == [
        "frozen lm_head.weight is not torch.bfloat16"]
    assert gpu_check.judge("step", dict(STEP, generation_peak_gb=2.0)) == [
        "generation_peak_gb 2.0 GB vs predicted 2.76 GB"]  # 38% over
    assert gpu_check.judge("step", dict(STEP, peak_gb=None), device="cpu") == []
    line = gpu_check.summary("step", STEP)
    assert "step 71.5 s (generate 61.0, reference log-probs 1.2, log-probs 2.0, backward 6.5, optimizer 0.2)" in line
    assert "decode 52 tokens/s" in line and "peak 3.50 GB (predicted 3.73)" in line


def test_resume_must_be_bit_identical_in_both_modes():
    assert gpu_check.judge("resume", gpu_check.merge([RESUMED, RESUMED])) == []
    lora = dict(RESUMED, differing_tensors=2, first_differing=["lora_A.weight", "lora_B.weight"])
    full = dict(RESUMED, metrics_equal=False)
    assert gpu_check.judge("resume", gpu_check.merge([lora, full])) == [
        "2 tensors differ, e.g. ['lora_A.weight', 'lora_B.weight']", "metrics.jsonl lines differ"]
    assert gpu_check.judge("resume", gpu_check.merge([RESUMED, {"error": "RuntimeError: no deterministic kernel"}])) \
        == ["RuntimeError: no deterministic kernel"]


def test_the_out_of_memory_check_wants_the_trainers_report_not_a_traceback():
    config = Config(model="meta-llama/Llama-3.2-1B-Instruct", use_lora=True, per_device_train_batch_size=16384)
    report = out_of_memory_report(config, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB"), None)
    assert gpu_check.judge("oom", {"returncode": 1, "stderr": report + "\n"}) == []
    assert gpu_check.summary("oom", {"returncode": 1, "stderr": report}).startswith(
        "error: out of GPU memory while loading the model")
    traceback = "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory."
    assert gpu_check.judge("oom", {"returncode": 1, "stderr": traceback}) == [
        "no 'error: out of GPU memory' line", "no 'settings that need less memory:' line",
        "no 'memory plan for this configuration:' line", "a traceback"]
    assert gpu_check.judge("oom", {"returncode": 137, "stderr": report}) == ["exit status 137, not 1"]


def test_the_out_of_memory_report_says_when_each_prompt_is_forwarded_once():
    # 32 completions of 4 prompts (G = 8): the shared-prompt forward counts 4 x 256 prompt tokens, not 32 x 256.
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")
    config = Config(model="meta-llama/Llama-3.2-1B-Instruct", use_lora=True, per_device_train_batch_size=32,
                    num_generations=8, max_prompt_length=256, max_completion_length=786, gradient_checkpointing=False)
    assert "micro-batch 32 sequences of 256+786 tokens, each prompt once: 4 x 256 + 32 x 786 tokens" in \
        out_of_memory_report(config, error, None)
    whole = out_of_memory_report(dataclasses.replace(config, shared_prompt_forward=False), error, None)
    assert "micro-batch 32 sequences of 256+786 tokens\n" in whole and "each prompt once" not in whole


def test_the_shared_prompt_check_bounds_each_layout_against_whole_rows():
    row = {"attention": "sdpa", "layout": "packed", "tokens": 3000, "logprob_error": 2e-5, "grad_error": 3e-6,
           "seconds": 0.8, "whole_seconds": 1.6, "peak_gb": 4.0, "whole_peak_gb": 7.5}
    assert gpu_check.judge("shared", {"rows": [row]}) == []
    assert gpu_check.judge("shared", {"rows": [dict(row, logprob_error=0.02, grad_error=math.nan)]}) == [
        "sdpa packed: log-prob error 0.02 > 0.001", "sdpa packed: gradient error nan > 0.001"]
    assert gpu_check.summary("shared", {"rows": [row]}) == \
        "sdpa packed err 2e-05/3e-06, 0.80/1.60 s, 4.00/7.50 GB (vs whole rows)"


def test_one_step_checks_and_the_table():
    qlora = {"loss": 0.01, "kl": 0.0, "step_s": 9.0, "tokens_per_s": 60.0, "changed_fraction": 1.0,
             "dtype_problems": [], "int8_states": 0, "peak_gb": 1.1}
    assert gpu_check.judge("qlora", qlora) == []
    assert gpu_check.judge("full-8bit", qlora) == ["no 8-bit optimizer state"]
    assert gpu_check.judge("full-8bit", dict(qlora, int8_states=120)) == []
    checks = [{"name": n, "passed": not gpu_check.judge(n, r), "problems": gpu_check.judge(n, r),
               "summary": gpu_check.summary(n, r)} for n, r in (("qlora", qlora), ("full-8bit", qlora))]
    lines = gpu_check.table(checks).splitlines()
    assert lines[2].split()[:2] == ["qlora", "PASS"] and "loss 0.01, kl 0, step 9.0 s, 60 tokens/s" in lines[2]
    assert lines[3].split()[:2] == ["full-8bit", "FAIL"] and lines[4].strip() == "! no 8-bit optimizer state"


@pytest.mark.parametrize("script, expected", [
    ("print('noise'); print('{\"loss\": 1.5}')", {"loss": 1.5}),  # the last line is the result
    ("import sys; sys.stderr.write('Traceback\\nKeyError: x\\n'); sys.exit(3)", {"error": "exit 3: KeyError: x"}),
    ("import time; time.sleep(30)", {"error": "timed out after 2 s"}),
])
def test_a_checks_process_output_becomes_its_result(tmp_path, monkeypatch, script, expected):
    child = tmp_path / "child.py"
    child.write_text(script)
    monkeypatch.setattr(gpu_check, "CHILD", child)
    result = gpu_check.run_child([], timeout=2, env=dict(os.environ))
    assert {k: v for k, v in result.items() if k != "stderr"} == expected
    json.dumps(result)  # written to gpu_check.json as it is
