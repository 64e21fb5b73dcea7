"""Every refusal of the generation engine fires before any model loads (rollout/engines/choice.check_engine,
called by run/startup.prepare): each test's model folder holds a config but no weights, so a run that got as
far as loading would fail there instead, with another message."""
import os

import pytest
import torch

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.rollout.engines.choice import check_engine
from grpo.settings.plan import RunPlan
from tiny_setup import digit_prompts, text_length, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def weightless(tmp_path_factory) -> str:
    """A model folder whose config.json the planner reads, with no weights: loading it fails."""
    folder = tmp_path_factory.mktemp("weightless")
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name in os.listdir(folder):
        if name.endswith((".safetensors", ".bin")):
            os.remove(folder / name)
    return str(folder)


def sampler(prompts, on_token=None, streams=None):
    raise AssertionError("never called: the run is refused first")


def rollout_func(prompts, trainer):
    raise AssertionError("never called: the run is refused first")


def test_a_weightless_folder_fails_at_loading(weightless, tmp_path):
    """The premise of the tests below: past the checks, this folder's load fails."""
    with pytest.raises(Exception, match="no file named model.safetensors|safetensors|weights"):
        Trainer(Config(model=weightless, output_dir=str(tmp_path / "run"), max_steps=1),
                reward_funcs=[text_length], train_dataset=digit_prompts())


@pytest.mark.parametrize("settings, passed, message", [
    (dict(use_vllm=True, vllm_mode="server", use_lora=True), dict(sampler=sampler),
     r"use_vllm=True samples on the vLLM server: pass no sampler or rollout_func with it \(got a sampler\)"),
    (dict(use_vllm=True, vllm_mode="server", use_lora=True), dict(rollout_func=rollout_func),
     r"pass no sampler or rollout_func with it \(got a rollout_func\)"),
    (dict(int8_sampling_weights=True), dict(sampler=sampler),
     r"int8_sampling_weights=True samples with our own decode loop: .*\(got a sampler\)"),
    (dict(int8_sampling_weights=True), dict(rollout_func=rollout_func), r"our own decode loop: .*rollout_func"),
    (dict(async_generation=True), dict(rollout_func=rollout_func), r"async_generation=True samples with our own"),
    (dict(async_generation=True), dict(sampler=sampler), r"async_generation=True samples with our own"),
], ids=["vllm-sampler", "vllm-rollout_func", "int8-sampler", "int8-rollout_func", "async-rollout_func",
        "async-sampler"])
def test_an_engine_that_cannot_run_is_refused_before_loading(weightless, tmp_path, settings, passed, message):
    with pytest.raises(ConfigError, match=message) as refusal:
        Trainer(Config(model=weightless, output_dir=str(tmp_path / "run"), max_steps=1, **settings),
                reward_funcs=[text_length], train_dataset=digit_prompts(), **passed)
    assert "\n" not in str(refusal.value)


def test_int8_sampling_without_fbgemm_is_refused_before_loading(weightless, tmp_path):
    previous = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "qnnpack"  # what a torch built without fbgemm runs
        with pytest.raises(ConfigError, match=r"needs torch's fbgemm \(x86\) quantized engine, .*'qnnpack'"):
            Trainer(Config(model=weightless, output_dir=str(tmp_path / "run"), max_steps=1,
                           int8_sampling_weights=True), reward_funcs=[text_length], train_dataset=digit_prompts())
    finally:
        torch.backends.quantized.engine = previous


@pytest.mark.parametrize("settings, message", [
    (dict(use_vllm=True, vllm_mode="server", use_lora=True), "use_vllm=True runs one trainer process here"),
    (dict(async_generation=True), r"async_generation=True runs one trainer process and its sampler; .*2 ranks"),
])
def test_what_one_process_runs_is_refused_under_torchrun(settings, message):
    """Under torchrun the same call refuses (rank counts come from the process group: here, the plan's)."""
    config = Config(**settings)
    with pytest.raises(ConfigError, match=message):
        check_engine(RunPlan.resolve(config, 2), 2, "cpu", sampler=False, rollout_func=False)
    check_engine(RunPlan.resolve(config, 1), 1, "cpu", sampler=False, rollout_func=False)

