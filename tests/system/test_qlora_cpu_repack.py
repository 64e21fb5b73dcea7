"""bitsandbytes' CPU repacking of 4-bit weights never reaches QLoRA training. On a CPU with AVX512-BF16,
bitsandbytes 0.50 repacks a Linear4bit weight for its bf16 inference kernel at the first eval-mode forward
without grad (our sampling). These tests arm that decision on every CPU: for real where the CPU has the
instruction set, and elsewhere by making bitsandbytes believe it has it (`repack_armed`). The repack itself is
plain torch and runs anywhere; only the packed kernel needs AVX512-BF16 (it dies with SIGILL without it), so a
packed forward on such a CPU computes garbage through bitsandbytes' default kernel, which the log-prob
checks below would catch. Either way, sample -> train -> sample -> save -> reload must compute what a model
that never sampled computes."""
import bitsandbytes as bnb
import pytest
import torch
from tiny_setup import digit_prompts, text_length, tiny_4bit_model, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.policy.models import keep_4bit_layout
from grpo.rollout.batches import Rollout


@pytest.fixture
def repack_armed(monkeypatch):
    """4-bit layers built from now on decide to repack, whatever this CPU is (the decision is taken when a
    Linear4bit is built)."""
    import bitsandbytes.nn.modules as modules

    if not modules.has_avx512bf16():
        monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)


def saved_model(path, build):
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    build(tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_model(tmp_path_factory.mktemp("tiny-4bit-model"), tiny_4bit_model)


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):  # in_features 32: less than one 4-bit block
    return saved_model(tmp_path_factory.mktemp("tiny-model"), tiny_model)


def linear4bit(in_features=128, out_features=64) -> bnb.nn.Linear4bit:
    """As transformers loads one for `load_model` (NF4, no double quantization)."""
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                              compress_statistics=False)
    torch.manual_seed(0)
    layer.weight = bnb.nn.Params4bit(torch.randn(out_features, in_features) / 10, requires_grad=False,
                                     quant_type="nf4", compress_statistics=False, module=layer)
    layer.weight._quantize("cpu")
    return layer


def packed(layer) -> bool:
    return getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def test_bitsandbytes_repacks_when_sampling_and_converts_back_only_when_saving(repack_armed):
    """What the trainer guards against, as bitsandbytes 0.50 does it (fails if a version changes it)."""
    layer = linear4bit()
    data, absmax = layer.weight.data.clone(), layer.weight.quant_state.absmax.clone()
    with torch.no_grad():
        layer.train()(torch.randn(2, 128))
        assert not packed(layer), "train mode never repacks"
        layer.eval()(torch.randn(2, 128))
        assert packed(layer), "eval mode without grad repacks"
        layer.train()(torch.randn(2, 128))
    assert packed(layer), "back in train mode, the layer keeps the inference layout"
    layer.state_dict()
    assert not packed(layer) and torch.equal(layer.weight.data, data)
    assert layer.weight.quant_state.absmax.dtype == torch.bfloat16, "the save converts back, scales now bf16"
    assert not torch.equal(layer.weight.quant_state.absmax.flatten().float(), absmax), "and in another order"


def test_keep_4bit_layout_stops_the_repack_and_refuses_a_repacked_layer(repack_armed):
    layer, x = linear4bit(), torch.randn(3, 128)  # [3, 128]
    keep_4bit_layout(layer)
    with torch.no_grad():
        training = layer.train()(x)  # [3, 64]
        sampling = layer.eval()(x)  # [3, 64]
    assert not packed(layer) and torch.equal(sampling, training)

    repacked = linear4bit()
    with torch.no_grad():
        repacked.eval()(x)
    with pytest.raises(ConfigError, match="repacked for bitsandbytes' CPU inference kernel"):
        keep_4bit_layout(torch.nn.Sequential(repacked))


def qlora_trainer(output_dir, model_dir, **overrides) -> Trainer:
    settings = dict(model=str(model_dir), output_dir=str(output_dir), use_lora=True, load_in_4bit=True, lora_r=4,
                    lora_alpha=8, lora_dropout=0.0,  # dropout would make gradients differ between two backwards
                    max_steps=1, per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
                    max_prompt_length=16, max_completion_length=8, learning_rate=1e-2,
                    optim="adamw", beta=0.04, gradient_checkpointing=True, seed=0)
    return Trainer(Config(**{**settings, **overrides}), reward_funcs=[text_length], train_dataset=digit_prompts())


@pytest.mark.slow
def test_4bit_layers_smaller_than_a_block_train_on_any_cpu(repack_armed, tmp_path, small_model_dir):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(small_model_dir, quantization_config=quantization,
                                                 device_map={"": "cpu"}).eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"shape '\[32, 0\]' is invalid"):
        model(torch.tensor([[5, 6, 7]]))  # bitsandbytes alone: the error of issue 18

    trainer = qlora_trainer(tmp_path / "run", small_model_dir)
    trainer.train()  # samples, trains, saves
    assert trainer.step == 1 and (tmp_path / "run" / "checkpoint-1" / "adapter_model.safetensors").exists()


def fixed_rollout(trainer) -> Rollout:
    prompt_ids, prompt_mask = trainer.engine.encode(digit_prompts(2)["prompt"])  # [2, P]
    completion_ids = torch.randint(4, len(trainer.tokenizer), (2, 6), generator=torch.Generator().manual_seed(0))
    return Rollout(prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), ["", ""],
                   torch.ones(2, dtype=torch.bool))


def logprobs_and_grads(trainer, rollout):
    """The training forward and backward, as a step runs them (train mode, grad)."""
    logprobs = trainer.policy.logprobs(rollout)  # [2, 6]
    logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return logprobs.detach(), grads


def base_4bit(model) -> dict:
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 2 * 7 and not any(packed(m) for m in layers.values())
    return {n: (m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for n, m in layers.items()}


@pytest.mark.slow
def test_sample_train_sample_save_reload_compute_as_without_the_repack(repack_armed, tmp_path, model_dir):
    trainer = qlora_trainer(tmp_path / "run", model_dir, max_steps=2, save_steps=1)
    rollout, base = fixed_rollout(trainer), base_4bit(trainer.model)
    before, grads_before = logprobs_and_grads(trainer, rollout)
    assert len(grads_before) == 2 * 7 * 2, "every LoRA A and B matrix gets a gradient"

    trainer.engine(digit_prompts(2)["prompt"])  # eval mode, no grad: where bitsandbytes repacks
    after, grads_after = logprobs_and_grads(trainer, rollout)
    assert torch.equal(after, before)
    for name, grad in grads_before.items():  # the packed kernel has no backward: earlier layers would differ
        assert torch.equal(grads_after[name], grad), name

    trainer.train()  # each of the 2 steps: sample, train, save
    trained = trainer.policy.logprobs(rollout).detach()  # [2, 6]
    assert not torch.equal(trained, before), "the adapters trained"
    for name, (data, absmax) in base_4bit(trainer.model).items():
        assert torch.equal(data, base[name][0]) and torch.equal(absmax, base[name][1]), f"{name}: the base changed"

    reloaded = qlora_trainer(tmp_path / "run", model_dir, max_steps=2)
    reloaded.resume("latest")
    assert reloaded.step == 2
    reloaded.engine(digit_prompts(2)["prompt"])
    assert torch.equal(reloaded.policy.logprobs(rollout).detach(), trained)
    assert base_4bit(reloaded.model).keys() == base.keys()
