"""The CUDA dtype plan rehearsed on CPU (`bf16=True`): LoRA on a bf16 base, QLoRA computing in bf16, and full
fine-tuning under bf16 autocast with a bf16 reference copy train for real, keep each tensor in the dtype the plan
names, and give the float32 run's log-probs up to bf16 rounding. Plus the plan itself and the planner's use of it."""
import dataclasses
import time
from pathlib import Path

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, logged, text_length, tiny_tokenizer

from grpo import Config, Trainer
from grpo.memory.estimate import estimate, settings_of
from grpo.memory.parts import Architecture
from grpo.settings.cli import apply_overrides
from grpo.errors import ConfigError
from grpo.policy.precision import ENV, CpuBf16, Precision
from grpo.tasks.tiny import model_for

MODES = {
    "lora": dict(use_lora=True, optim="adamw_8bit"),
    "qlora": dict(use_lora=True, load_in_4bit=True, optim="adamw_8bit"),
    "full": dict(optim="adamw_8bit"),
}


NATIVE, AVX2 = CpuBf16(True, "AVX512-BF16"), CpuBf16(False, "no AVX512-BF16 or AMX")  # the CPU's two answers


def test_the_plan_bf16_where_the_hardware_computes_it_unless_asked():
    cpu = Precision.plan(None, use_lora=True, device="cpu", cpu=AVX2)
    assert (cpu.bf16, cpu.base_dtype, cpu.reference_dtype) == (False, torch.float32, torch.float32)
    assert not cpu.bf16_sampling
    native = Precision.plan(None, use_lora=True, device="cpu", cpu=NATIVE)
    cuda_lora, cuda_full = Precision.plan(None, True, "cuda"), Precision.plan(None, False, "cuda")
    assert cuda_lora.bf16 and cuda_lora.base_dtype == torch.bfloat16 == cuda_lora.reference_dtype
    assert cuda_full.base_dtype == torch.float32 and cuda_full.reference_dtype == torch.bfloat16
    same = lambda a, b: dataclasses.replace(a, why="") == dataclasses.replace(b, why="")  # noqa: E731
    assert same(native, dataclasses.replace(cuda_lora, device_type="cpu"))  # CUDA's plan, and it samples in bf16
    assert native.bf16_sampling and not cuda_lora.bf16_sampling
    for answer in (NATIVE, AVX2):  # set, bf16 decides alone, on either CPU
        assert same(Precision.plan(True, True, "cpu", cpu=answer), native)
        assert same(Precision.plan(False, True, "cpu", cpu=answer), cpu)
    # int8_sampling_weights samples on int8 copies of float32 weights: None keeps them float32
    assert not Precision.plan(None, True, "cpu", cpu=NATIVE, int8_sampling=True).bf16
    off = Precision.plan(False, False, "cuda")
    assert not off.bf16 and off.reference_dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    with Precision.plan(True, False, "cpu").autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with cpu.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_the_plan_says_what_it_chose_and_why_in_one_line():
    lines = {answer: Precision.plan(None, True, "cpu", cpu=answer).statement for answer in (NATIVE, AVX2)}
    assert lines[NATIVE] == ("precision: bf16 on cpu: bf16=None and this CPU computes bf16 natively (AVX512-BF16); "
                             "bf16=False keeps float32")
    assert lines[AVX2] == ("precision: float32 on cpu: bf16=None and this CPU has no native bf16 (no AVX512-BF16 "
                           "or AMX); bf16=True forces it, slower")
    assert Precision.plan(False, True, "cpu").statement == "precision: float32 on cpu: bf16=False"


def test_the_cpus_answer_is_its_flags_unless_GRPO_CPU_BF16_says(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    flags = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert CpuBf16.read().native == (flags and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    for value in ("0", "1"):
        monkeypatch.setenv(ENV, value)
        assert CpuBf16.read() == CpuBf16(value == "1", f"{ENV}={value}")
        assert Precision.plan(None, True, "cpu").bf16 == (value == "1")
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ConfigError, match="GRPO_CPU_BF16='yes': set it to 1") as refused:
        CpuBf16.read()
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("native", ["0", "1"])
def test_the_planner_prints_the_plan_of_this_cpu(native, monkeypatch, capfd):
    from grpo.plan import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny.py"
    monkeypatch.setenv(ENV, native)
    code = main([str(recipe), "--device=cpu"])  # `python -m grpo.plan`, without a start of Python and torch
    out, err = capfd.readouterr()
    assert code == 0, err
    said = [line for line in out.splitlines() if line.startswith("precision:")]
    assert said == [Precision.plan(None, True, "cpu", cpu=CpuBf16(native == "1", f"{ENV}={native}")).statement]


def test_bf16_is_true_false_or_none_on_the_command_line():
    assert Config().bf16 is None  # auto: bf16 on CUDA and on a CPU that computes it natively
    assert apply_overrides(Config(), ["--bf16"]).bf16 is True  # a bare flag, as for plain booleans
    assert apply_overrides(Config(bf16=True), ["--bf16=none"]).bf16 is None
    assert apply_overrides(Config(), ["--bf16=false"]).bf16 is False


def test_the_planner_follows_the_same_plan(monkeypatch):
    a = Architecture(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=100,
                     tie_word_embeddings=True)
    s, n = Config(beta=0.04), a.num_params()
    assert estimate(a, s, "cpu").parts["reference model"] == 4 * n  # bf16=None: float32 on this CPU (conftest)
    assert settings_of(s, "cpu")[0].logprobs_kept == 1  # the reference's
    monkeypatch.setenv(ENV, "1")
    assert estimate(a, s, "cpu").parts["reference model"] == 2 * n  # bf16=None: bf16 on a CPU that computes it
    assert settings_of(s, "cpu")[0].logprobs_kept == 2  # and the old ones: bf16 samples are corrected
    monkeypatch.setenv(ENV, "0")
    assert estimate(a, s, "cuda").parts["reference model"] == 2 * n
    assert estimate(a, dataclasses.replace(s, bf16=True), "cpu").parts["reference model"] == 2 * n
    assert estimate(a, dataclasses.replace(s, bf16=False), "cuda").parts["reference model"] == 4 * n
    lora = dataclasses.replace(s, use_lora=True, bf16=True)
    assert estimate(a, lora, "cpu").parts["weights"] == estimate(a, lora, "cuda").parts["weights"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 saved in bf16 (so the float32 and bf16 runs start from the same values), with layer sizes
    multiples of 64 as bitsandbytes' CPU 4-bit kernels need, and weights large enough (init std 0.2) that
    log-probs spread over several nats: a wrong dtype path shows up, rounding alone does not."""
    path = tmp_path_factory.mktemp("bf16-model")
    tokenizer = tiny_tokenizer()
    model = model_for(tokenizer, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                      initializer_range=0.2)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_trainer(tmp_path, model_dir, mode: str, bf16: bool) -> Trainer:
    config = Config(model=str(model_dir), output_dir=str(tmp_path / f"{mode}-{bf16}"), bf16=bf16, max_steps=2,
                    per_device_train_batch_size=8, num_generations=4, max_prompt_length=16, max_completion_length=8,
                    learning_rate=1e-2, beta=0.04, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                    gradient_checkpointing=True, save_steps=10**9, seed=0, **MODES[mode])
    # text_length beside digit_share: a random model's groups may hold no digit at all, and a step whose rewards
    # are all equal trains nothing (the policy would still be its reference at step 2).
    return Trainer(config, reward_funcs=[digit_share, text_length], train_dataset=digit_prompts())


def check_dtypes(trainer: Trainer, mode: str) -> None:
    import bitsandbytes as bnb

    params = dict(trainer.model.named_parameters())
    trained = {n: p for n, p in params.items() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in trained.values()), "adapters / trained weights stay float32"
    if mode == "full":
        assert all(p.dtype == torch.bfloat16 for p in trainer.policy.reference.parameters()), "bf16 reference copy"
        assert len(trained) == len(params)
        return
    assert all("lora_" in n for n in trained) and trainer.policy.reference is None
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if mode == "qlora":
        assert len(quantized) == 2 * 7 and all(m.compute_dtype == torch.bfloat16 for m in quantized)
        packed = {id(m.weight) for m in quantized}
        assert all(p.dtype == torch.uint8 for p in frozen.values() if id(p) in packed)
        frozen = {n: p for n, p in frozen.items() if id(p) not in packed}
    else:
        assert not quantized
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen.values()), "the frozen base is bf16"


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_plan_trains_on_cpu_and_matches_float32(tmp_path, model_dir, mode):
    half = make_trainer(tmp_path, model_dir, mode, bf16=True)
    assert half.precision.bf16 and half.precision.device_type == "cpu"
    check_dtypes(half, mode)
    before = {n: p.detach().clone() for n, p in half.model.named_parameters() if p.requires_grad}
    start = time.perf_counter()
    half.train()
    history = logged(half)
    seconds = (time.perf_counter() - start) / len(history)
    assert all(torch.isfinite(torch.tensor(line["loss"])) for line in history)
    assert history[-1]["kl"] > 0, "the second step's policy differs from its reference"
    unchanged = [n for n, p in half.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert not unchanged, f"not updated under bf16: {unchanged[:5]}"
    check_dtypes(half, mode)  # still, after the optimizer steps

    # The float32 run, given the trained weights, scores the bf16 run's completions.
    full = make_trainer(tmp_path, model_dir, mode, bf16=False)
    assert not full.precision.bf16
    with torch.no_grad():
        target = dict(full.model.named_parameters())
        for name, p in half.model.named_parameters():
            if p.requires_grad:
                target[name].copy_(p)
    rollout = half.engine(["Write 3 digits:", "Write 5 digits:"])[0]
    mask = rollout.completion_mask.bool()  # [N, C]
    with torch.no_grad():
        pairs = {"policy": (half.policy.logprobs(rollout), full.policy.logprobs(rollout)),
                 "reference": (half.policy.reference_logprobs(rollout), full.policy.reference_logprobs(rollout))}
    moved = (pairs["policy"][1] - pairs["reference"][1])[mask].abs().mean().item()
    for name, (low, exact) in pairs.items():
        assert low.dtype == torch.float32  # the softmax runs in float32 whatever the matmul dtype
        diff = (low - exact)[mask].abs()  # [tokens]
        print(f"{mode} {name}: max |bf16 - float32| {diff.max():.4f}, mean {diff.mean():.4f} nats; two "
              f"steps moved the float32 log-probs by {moved:.3f} on average; bf16 step {seconds:.2f} s")
        # bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.002) in every matmul and activation: on
        # logits of a few units, through 2 layers, that is ~0.02 nats on average (0.1 at most, measured). The
        # bounds are 2.5x that, and the two training steps move the log-probs by ~10x more (asserted below),
        # so a wrong weight, a missing adapter or a float32 fallback (difference 0) fails.
        assert 0 < diff.mean() < 0.05 and diff.max() < 0.3
    assert moved > 0.15


def lora_run(tmp_path, model_dir, name: str, **settings) -> Trainer:
    config = Config(model=str(model_dir), output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=8,
                    num_generations=4, max_prompt_length=16, max_completion_length=8, learning_rate=1e-2,
                    use_lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, save_strategy="no", seed=0,
                    logging_steps=1, **settings)
    trainer = Trainer(config, reward_funcs=[digit_share, text_length], train_dataset=digit_prompts())
    trainer.train()
    return trainer


VOLATILE = ("perf/", "memory/", "step_time")  # timings and memory differ between any two runs


def test_on_a_cpu_without_native_bf16_the_default_is_the_float32_run_exactly(tmp_path, model_dir, monkeypatch,
                                                                              capsys):
    monkeypatch.setenv(ENV, "0")
    auto = lora_run(tmp_path, model_dir, "auto")
    assert "precision: float32 on cpu: bf16=None and this CPU has no native bf16 (GRPO_CPU_BF16=0)" in \
        capsys.readouterr().err
    off = lora_run(tmp_path, model_dir, "off", bf16=False)
    assert not auto.precision.bf16 and auto.plan.generation.sampling_correction is None
    drop = lambda line: {k: v for k, v in line.items() if not k.startswith(VOLATILE)}  # noqa: E731
    assert [drop(line) for line in logged(auto)] == [drop(line) for line in logged(off)]
    weights = dict(off.model.named_parameters())
    assert all(torch.equal(p, weights[n]) for n, p in auto.model.named_parameters())


def test_on_a_cpu_with_native_bf16_the_default_samples_and_trains_in_bf16(tmp_path, model_dir, monkeypatch, capsys):
    monkeypatch.setenv(ENV, "1")
    trainer = lora_run(tmp_path, model_dir, "native", vllm_importance_sampling_mode="token_truncate")
    assert "precision: bf16 on cpu: bf16=None and this CPU computes bf16 natively (GRPO_CPU_BF16=1)" in \
        capsys.readouterr().err
    assert trainer.precision.bf16 and trainer.plan.sampling.bf16 and trainer.plan.generation.old_logprobs
    check_dtypes(trainer, "lora")  # a bf16 base, float32 adapters
    for line in logged(trainer):  # TRL's correction of the bf16 sampler's log-probs against the policy's
        difference = line["sampling/sampling_logp_difference/mean"]
        ratios = [line[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
        # bf16 rounding of the sampler's and the trainer's forwards (their products in other orders): 0.01 nats
        # per token measured; 0 if the sampler's log-probs were the trainer's
        assert 0 < difference < 0.05 and line["sampling/sampling_logp_difference/max"] >= difference
        assert 0.5 < ratios[0] < ratios[1] < ratios[2] <= 3.0, ratios  # token_truncate at TRL's clip_max
