"""The memory model's arithmetic (hand-computed cases), the planner's output, and predicted vs measured peak
memory of real CPU training runs."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo.settings import Config
from grpo.memory.estimate import estimate
from grpo.memory.fit import cheapest_fit, memory_savings, needed_gb, plan_summary, smaller_micro_batches
from grpo.memory.known_models import KNOWN, architecture_of
from grpo.memory.parts import Architecture, prompts_in_micro_batch
from grpo.plan import main, table

ROOT = Path(__file__).resolve().parents[2]
QWEN_05B = KNOWN["Qwen/Qwen2.5-0.5B-Instruct"]
LLAMA_1B = KNOWN["meta-llama/Llama-3.2-1B-Instruct"]


def test_parameter_counts_match_the_published_models():
    assert QWEN_05B.num_params() == 494_032_768  # Qwen2.5-0.5B: tied embeddings, q/k/v biases
    assert LLAMA_1B.num_params() == 1_235_814_400  # Llama-3.2-1B: tied, head_dim 64
    assert KNOWN["meta-llama/Llama-3.1-8B-Instruct"].num_params() == 8_030_261_248  # untied


def test_architecture_from_a_transformers_config():
    from transformers import Qwen2Config

    hf = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    arch = architecture_of(Config().model, hf)
    assert arch.num_params() == QWEN_05B.num_params()
    assert (arch.q_dim, arch.kv_dim) == (896, 128)


@pytest.mark.parametrize("settings, rows, logprobs", [
    (dict(), 2, 0),  # on-policy without a reference: the loss's own log-probs are the old ones
    (dict(beta=0.04), 2, 1),  # the reference's
    (dict(num_iterations=2), 2, 1),  # the old policy's: the second pass is off-policy
    (dict(steps_per_generation=2, beta=0.04, use_lora=True), 4, 2),  # both (LoRA's reference: the adapter off)
])
def test_rollouts_hold_the_log_probs_the_trainer_keeps(settings, rows, logprobs):
    a = Architecture(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=100)
    s = Config(per_device_train_batch_size=2, num_generations=2, max_prompt_length=3, max_completion_length=5,
               **settings)
    # Per row: ids and masks [P + C] int64 each, and [C] float32 per log-prob tensor kept.
    assert estimate(a, s, "cpu").parts["rollouts"] == rows * (8 * 8 * 2 + 5 * 4 * logprobs)


def test_hand_computed_parts_of_a_tiny_model():
    # V=100, H=8, 1 layer, 2 heads (head_dim 4), 1 KV head, I=16, tied, no bias.
    a = Architecture(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=100,
                     tie_word_embeddings=True)
    linear = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k, v, o, gate/up/down
    assert a.linear_params() == linear == 576
    assert a.num_params() == 576 + 100 * 8 + 2 * 8 + 8  # + embedding + 2 norms + final norm
    assert sum(a.trainable_tensors()) == a.num_params() and sum(QWEN_05B.trainable_tensors()) == QWEN_05B.num_params()
    s = Config(optim="adamw", beta=0.04, per_device_train_batch_size=2, num_generations=2, max_prompt_length=3,
               max_completion_length=5, logprob_chunk_size=4, gradient_checkpointing=False)
    cpu = estimate(a, s, "cpu").parts
    n = a.num_params()
    assert cpu["weights"] == cpu["reference model"] == cpu["gradients"] == 4 * n
    assert cpu["optimizer states"] == 8 * n
    assert cpu["log-prob chunk"] == 4 * 100 * 4 + 2 * 5 * 8 * 4  # 4 rows x V float32, + the hidden states' grad
    assert "entropy buffer" not in cpu  # the entropy's exponentials are taken by small row blocks
    assert cpu["LM-head gradient"] == 4 * 100 * 8 and cpu["pending embedding gradients"] == 0  # sparse lookup grad
    accumulating = estimate(a, dataclasses.replace(s, gradient_accumulation_steps=2), "cpu").parts
    assert accumulating["pending embedding gradients"] == 4 * 100 * 8  # the new head gradient, added at the end
    cuda = estimate(a, s, "cuda").parts
    assert cuda["reference model"] == 2 * n  # bf16 copy
    assert cuda["autocast weight copies"] == 2 * 576
    lora = estimate(a, dataclasses.replace(s, use_lora=True, lora_r=2), "cuda").parts
    lora_params = 2 * (8 + 8) + 2 * (8 + 4) * 2 + 2 * (8 + 8) + 2 * (8 + 16) * 2 + 2 * (16 + 8)
    assert lora["gradients"] == 4 * lora_params and lora["reference model"] == 0
    assert lora["weights"] == 2 * n + 4 * lora_params  # bf16 base, float32 adapters


def test_hand_computed_parts_with_bf16_weights():
    a = Architecture(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=100,
                     tie_word_embeddings=True)
    n = a.num_params()
    s = Config(optim="adamw", beta=0.04, num_generations=2, per_device_train_batch_size=2, max_prompt_length=3,
               max_completion_length=5, logprob_chunk_size=4, bf16_weights=True)
    for device in ("cpu", "cuda"):
        parts = estimate(a, s, device).parts
        assert parts["weights"] == parts["reference model"] == parts["gradients"] == 2 * n
        assert parts["optimizer states"] == 8 * n  # float32 states, as before
        assert parts["autocast weight copies"] == 0
        assert parts["LM-head gradient"] == 2 * 100 * 8 and parts["LM-head float32 accumulator"] == 4 * 100 * 8
        # One block of V=100 rows: its bf16 product and float32 promotion [100, 8], its gradient logits [4, 100].
        assert parts["LM-head gradient block"] == 100 * 8 * (2 + 4) + 4 * 100 * 2
        # 4 rows x V: the bf16 matmul output and its float32 copy; the hidden states' bf16 gradient (2 x 5 rows).
        assert parts["log-prob chunk"] == 4 * 100 * (4 + 2) + 2 * 5 * 8 * 2  # + the bf16 head's matmul output
    # torch AdamW on the largest tensor (the [100, 8] head) in one slice: float32 weight, gradient, 2 temporaries.
    assert estimate(a, s, "cpu").parts["optimizer step temporaries"] == 4 * 4 * 100 * 8
    eight_bit = estimate(a, dataclasses.replace(s, optim="adamw_8bit"), "cpu").parts
    assert eight_bit["optimizer step temporaries"] == (6 + 3) * 4 * 100 * 8  # + bitsandbytes' six copies


def test_bf16_weights_lower_full_finetuning_to_half_the_write_up():
    from grpo.memory.known_models import ARTICLE_CONFIG, ARTICLE_GB, TABLE_MODELS

    lean = dataclasses.replace(ARTICLE_CONFIG, optim="adamw_8bit", gradient_checkpointing=True)
    for size in ("0.5B", "1B", "3B"):
        arch = KNOWN[TABLE_MODELS[size]]
        bf16 = estimate(arch, dataclasses.replace(lean, bf16_weights=True)).peak / 1e9
        assert bf16 < estimate(arch, lean).peak / 1e9
        assert bf16 <= ARTICLE_GB[size][0] / 2, size
    cpu = dataclasses.replace(lean, bf16=None)  # on CPU the float32 plan is the one to halve
    assert estimate(QWEN_05B, dataclasses.replace(cpu, bf16_weights=True), "cpu").peak < \
        estimate(QWEN_05B, cpu, "cpu").peak / 1.5


def test_each_memory_setting_moves_the_prediction_the_right_way():
    base = Config(optim="adamw", beta=0.04, per_device_train_batch_size=4, num_generations=4, max_prompt_length=256,
                  max_completion_length=786, gradient_accumulation_steps=4, gradient_checkpointing=False)
    peak = lambda **kw: estimate(LLAMA_1B, dataclasses.replace(base, **kw)).peak  # noqa: E731
    parts = lambda **kw: estimate(LLAMA_1B, dataclasses.replace(base, **kw)).parts  # noqa: E731
    assert parts(optim="adamw_8bit")["optimizer states"] == pytest.approx(parts()["optimizer states"] / 4, rel=0.02)
    assert parts(gradient_checkpointing=True)["activations"] < parts()["activations"] / 5
    assert parts(beta=0.0)["reference model"] == 0
    assert parts(use_lora=True, load_in_4bit=True)["weights"] < parts(use_lora=True)["weights"] / 2
    assert peak(use_lora=True) < peak(optim="adamw_8bit", gradient_checkpointing=True) < peak()
    assert parts(logprob_chunk_size=128)["log-prob chunk"] < parts()["log-prob chunk"] / 2
    assert peak(per_device_train_batch_size=8) > peak()
    # A micro-batch counts completions, and one decode samples the whole generation batch (4 micro-batches of 4
    # here): its KV cache grows with the generation batch, not with completions per prompt.
    kv = 2 * LLAMA_1B.num_layers * 16 * (256 + 786) * LLAMA_1B.kv_dim * 4 * (1 + 1 / LLAMA_1B.num_layers)
    assert parts()["KV cache"] == kv and parts(num_generations=8)["KV cache"] == kv
    assert parts(steps_per_generation=8)["KV cache"] == 2 * kv and peak(num_generations=8) == peak()


def test_evaluation_decodes_as_many_prompts_as_fit_within_the_training_peak():
    from grpo.memory.fit import eval_batch_size

    def eval_prompts(config, device):
        return estimate(LLAMA_1B, config, device).eval_prompts

    s = Config(per_device_train_batch_size=8, num_generations=8, max_prompt_length=256, max_completion_length=128,
               use_lora=True, gradient_checkpointing=False)
    n = eval_prompts(s, "cpu")
    e = estimate(LLAMA_1B, s, "cpu")  # sampling: 8 rows of one prompt, prefilled once
    V = LLAMA_1B.vocab_size
    per_prompt = e.parts["KV cache"] / 8 + 20 * V + (e.parts["sampling buffers"] - 8 * 20 * V)  # greedy: 1 row
    # Sampling and evaluation fold the adapters into a float32 copy of the adapted weights, packed for oneDNN on a
    # CPU (policy/folding).
    assert e.parts["sampling weight copies"] == 4 * LLAMA_1B.linear_params() and "sampling weight copies" in \
        e.moments["generation"]
    assert estimate(LLAMA_1B, s, "cuda").parts["sampling weight copies"] == 0  # bf16 bases are not folded
    q = dataclasses.replace(s, lora_target_modules=["q_proj"], bf16=False)
    assert estimate(LLAMA_1B, q, "cuda").parts["sampling weight copies"] == 4 * LLAMA_1B.num_layers * \
        LLAMA_1B.hidden_size * LLAMA_1B.q_dim  # float32 LoRA on a GPU: the adapted weights folded, not packed
    free = e.peak - sum(e.parts[p] for p in ("weights", "optimizer states", "reference model", "rollouts",
                                             "sampling weight copies"))
    assert n * per_prompt <= free < (n + 1) * per_prompt
    assert n > 8  # far more prompts than the 8 completions sampling decodes at once
    checkpointed = dataclasses.replace(s, gradient_checkpointing=True)  # a lower peak: fewer prompts fit
    assert 1 <= eval_prompts(checkpointed, "cpu") < n
    assert eval_batch_size(dataclasses.replace(s, per_device_eval_batch_size=5)) == 5  # a set size is honoured
    assert eval_batch_size(dataclasses.replace(s, model="no/such-model-here")) == 64  # no plan without a config


def test_sampling_ahead_holds_a_decode_during_every_training_moment():
    s = Config(per_device_train_batch_size=8, num_generations=8, max_prompt_length=256, max_completion_length=128,
               use_lora=True, gradient_checkpointing=False)
    for settings in (s, dataclasses.replace(s, use_lora=False, optim="adamw")):
        sync = estimate(LLAMA_1B, settings, "cpu")
        ahead = estimate(LLAMA_1B, dataclasses.replace(settings, async_generation=True), "cpu")
        # The sampler process decodes while the trainer trains: its KV cache, buffers and folded weights.
        decode = sum(sync.parts[p] for p in ("KV cache", "sampling buffers", "sampling weight copies"))
        # One float32 copy of the trainable weights in shared memory: as large as their gradients.
        copy = ahead.parts["sampler's weight copy"]
        assert copy == sync.parts["gradients"] > 0 and sync.parts["sampler's weight copy"] == 0
        for moment in sync.moments:
            extra = copy if moment == "generation" else copy + decode
            assert ahead.total(moment) == pytest.approx(sync.total(moment) + extra), moment
        assert ahead.peak > sync.peak


def test_the_shared_prompt_forward_counts_each_prompt_once():
    assert [prompts_in_micro_batch(n, g) for n, g in [(8, 8), (4, 8), (16, 8), (6, 4), (3, 2), (1, 4)]] == \
        [1, 1, 2, 2, 2, 1]
    a = Architecture(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=100,
                     tie_word_embeddings=True)
    s = Config(optim="adamw", beta=0.04, per_device_train_batch_size=4, num_generations=4, max_prompt_length=3,
               max_completion_length=5, gradient_checkpointing=True)
    shared, whole = (estimate(a, dataclasses.replace(s, shared_prompt_forward=on), "cpu").parts for on in (True, False))
    # Checkpointed layer inputs and the final norm: 1 x 3 + 4 x 5 tokens instead of 4 x (3 + 5); the prompt's
    # keys and values [1, 3] (kv_dim 4) of both layers.
    per_token = 2 * 4 * 8 + (4 + 4) * 8
    hidden = 4 * 5 * 8 * 4
    assert whole["activations"] == per_token * 4 * 8 + hidden
    assert shared["activations"] == per_token * (3 + 4 * 5) + 2 * 3 * 2 * 4 * 4 + hidden
    llama = Config(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=4,
                   max_prompt_length=256, max_completion_length=786, beta=0.04, use_lora=True, optim="adamw_8bit")
    for checkpointing in (True, False):
        shared, whole = (estimate(LLAMA_1B, dataclasses.replace(llama, gradient_checkpointing=checkpointing,
                                                                shared_prompt_forward=on)) for on in (True, False))
        ratio = shared.parts["activations"] / whole.parts["activations"]
        assert 0.75 < ratio < 0.95, ratio  # (256 + 4 x 786) / (4 x 1042) = 0.82, and the prompt's keys
        assert shared.peak < whole.peak


def test_table_meets_the_issue_targets_for_lora():
    lora = Config(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=4,
                  max_prompt_length=256, max_completion_length=786, beta=0.04, use_lora=True,
                  optim="adamw_8bit", gradient_checkpointing=True)
    gb = lambda name, **kw: estimate(KNOWN[name], dataclasses.replace(lora, **kw)).peak / 1e9  # noqa: E731
    assert gb("meta-llama/Llama-3.2-1B-Instruct") <= 8
    assert gb("Qwen/Qwen2.5-3B-Instruct") <= 16
    assert gb("meta-llama/Llama-3.1-8B-Instruct", load_in_4bit=True) <= 16
    text = table()
    assert "Llama-3.1-8B" in text and "QLoRA" in text and "article LoRA" in text and "+bf16w" in text


def test_plan_summary_for_a_local_model_suggests_a_change_that_fits(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path)
    config = Config(model=str(tmp_path), num_generations=8, max_completion_length=1024, beta=0.04, optim="adamw",
                    gradient_checkpointing=False)
    summary = plan_summary(config, gpu_memory_gb=12)
    assert "predicted peak GPU memory" in summary and "optimizer states" in summary
    assert "does not fit in 12.0 GB" in summary and "cheapest change that fits: --" in summary
    change, after = cheapest_fit(QWEN_05B, config, 12)
    assert after <= 12 and needed_gb(QWEN_05B, dataclasses.replace(config, **change)) == after
    assert "fits in 80.0 GB" in plan_summary(config, gpu_memory_gb=80)


def test_the_planner_offers_bf16_weights_for_full_finetuning_never_with_lora():
    config = Config(model="meta-llama/Llama-3.2-1B-Instruct", optim="adamw_8bit", gradient_checkpointing=True,
                    num_generations=4, gradient_accumulation_steps=4, max_completion_length=786, beta=0.04)
    budget = needed_gb(LLAMA_1B, dataclasses.replace(config, bf16_weights=True)) + 0.1  # 13.2 GB, from 19.3
    assert needed_gb(LLAMA_1B, config) > budget
    assert cheapest_fit(LLAMA_1B, config, budget)[0] == {"bf16_weights": True}
    for budget in (3, 4, 5, 8):  # LoRA and QLoRA budgets: chains that pass through bf16_weights
        change, _ = cheapest_fit(LLAMA_1B, config, budget)
        assert change.get("use_lora") and not change.get("bf16_weights"), change
    on = dataclasses.replace(config, bf16_weights=True)
    assert cheapest_fit(LLAMA_1B, on, 5)[0]["bf16_weights"] is False  # LoRA must turn the user's setting off


def test_smaller_micro_batches_keep_the_steps_completions_down_to_one_group():
    def sizes(**settings):  # the batch fields alone: some of these micro-batches split a group, which a Config refuses
        fields = {"gradient_accumulation_steps": 1, "steps_per_generation": None, **settings}
        return [tuple(c.values()) for c in smaller_micro_batches(SimpleNamespace(**fields))]

    # 64 completions x 4 micro-batches = 256 a step; the divisors of 64 down to one group of 4.
    assert sizes(per_device_train_batch_size=64, gradient_accumulation_steps=4, num_generations=4) == [
        (32, 8), (16, 16), (8, 32), (4, 64)]
    # 12 x 1, a generation batch of 2 micro-batches (24 completions): 6 x 2 (4 of them), 4 x 3 (6 of them).
    assert sizes(per_device_train_batch_size=12, num_generations=4, steps_per_generation=2) == [
        (6, 2, 4), (4, 3, 6)]
    # A micro-batch of two groups or less halves at most: 6 -> 3 (6 = 4 + half a group), 4 -> 2, 2 -> 1.
    assert sizes(per_device_train_batch_size=6, num_generations=4) == [(3, 2)]
    assert sizes(per_device_train_batch_size=4, num_generations=4) == [(2, 2)]
    assert sizes(per_device_train_batch_size=1, num_generations=4) == []
    # The out-of-memory report names the largest only.
    report = [c for c, _ in memory_savings(Config(per_device_train_batch_size=64, num_generations=4))]
    assert [c for c in report if "per_device_train_batch_size" in c] == [
        {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}]


def test_the_planner_searches_micro_batches_down_to_one_group(capsys):
    # 64 completions of up to 4096 tokens a micro-batch on the write-up's 16 GB card: ~84 GB as it is.
    args = [str(ROOT / "recipes" / "gsm8k_lora.py"), "--per_device_train_batch_size=64",
            "--max_completion_length=4096"]
    assert main([*args, "--gpu-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "does not fit in 16.0 GB\ncheapest change that fits: --per_device_train_batch_size=8 " \
           "--gradient_accumulation_steps=32 (about 13.3 GB)" in out  # 64 x 4 = 8 x 32 completions a step
    config = Config(model="meta-llama/Llama-3.2-1B-Instruct", use_lora=True, per_device_train_batch_size=64,
                    gradient_accumulation_steps=4, num_generations=4, max_prompt_length=256,
                    max_completion_length=4096, beta=0.04, bf16=True, lora_dropout=0.05)
    at = lambda n, **more: needed_gb(LLAMA_1B, dataclasses.replace(  # noqa: E731
        config, per_device_train_batch_size=n, gradient_accumulation_steps=256 // n, **more))
    assert at(16) > 16 >= at(8), "the largest micro-batch that fits"
    # 8 GB: only one group a micro-batch fits, and only without LoRA's dropout copies.
    assert main([*args, "--gpu-memory", "8"]) == 0
    assert ("cheapest change that fits: --lora_dropout=0.0 --per_device_train_batch_size=4 "
            "--gradient_accumulation_steps=64 (about 7.4 GB)") in capsys.readouterr().out
    assert at(4) > 8 >= at(4, lora_dropout=0.0) and at(8, lora_dropout=0.0) > 8


def test_plan_summary_never_raises_when_the_config_cannot_be_read():
    summary = plan_summary(Config(model="/no/such/model"), gpu_memory_gb=16)
    assert summary.startswith("cannot read the config of '/no/such/model'") and "\n" not in summary


def test_cli_says_so_when_a_recipe_model_cannot_be_built_without_weights(tmp_path, capsys):
    recipe = tmp_path / "warm.py"
    recipe.write_text(textwrap.dedent("""
        from datasets import Dataset
        from grpo import Config
        from grpo.tasks.tiny import tiny_qwen2

        config = Config(output_dir="unused")
        reward_funcs = [lambda completions, **_: [0.0] * len(completions)]
        train_dataset = Dataset.from_list([{"prompt": "x"}])

        def build_model(config):
            model = tiny_qwen2(100, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
            model.lm_head.weight.sum().item()  # a warm start reads values: meta tensors have none
            return model, None
    """))
    assert main([str(recipe), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "warm.py's build_model does more than build a model (RuntimeError on the meta device" in err
    assert "Traceback" not in err


def test_cli_on_a_recipe_and_the_table(capsys):
    assert main([str(ROOT / "recipes" / "gsm8k_lora.py"), "--gpu-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "Llama-3.2-1B-Instruct" in out and "fits in 16.0 GB" in out
    assert main([str(ROOT / "recipes" / "tiny.py"), "--device", "cpu", "--beta=0"]) == 0
    out = capsys.readouterr().out
    assert "build_model" in out and "reference model" not in out
    assert main(["--table"]) == 0 and "14B" in capsys.readouterr().out


def test_the_planner_refuses_the_settings_train_refuses(capsys):
    assert main([str(ROOT / "recipes" / "tiny.py"), "--device", "cpu", "--load_in_4bit=true"]) == 2
    assert capsys.readouterr().err.startswith("error: load_in_4bit=True needs use_lora=True")


# --- predicted vs measured, on CPU ---------------------------------------------------------------------------
# Each run is a process that trains 2 steps (the second has optimizer states). Measured = peak RSS at the end
# of the last optimizer step (before the final checkpoint) minus the RSS just before the model is built, after
# a warm-up: the same settings on a model of a few thousand weights first load what a run loads once (lazily
# imported modules, oneDNN's kernels for this CPU: 60-70 MB here, more than the planner's error on these sizes,
# and different from one CPU and library version to the next), which the planner rightly does not count.
# glibc's mmap threshold is fixed at 64 KiB so that freed tensors leave RSS (as they leave a CUDA allocator's
# allocated count) instead of lingering in the heap. One subprocess imports what every run needs (a start of
# Python and torch costs seconds), then forks each run from itself: a forked process's peak RSS starts at its
# RSS when forked, so each run's peak is its own.
CHILD = textwrap.dedent(r"""
    import json, os, resource, sys, traceback
    import torch
    torch.set_num_threads(1)
    import grpo.trainer
    from grpo.run.logs import peak_rss_bytes
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from grpo import Config, Trainer
    from grpo.tasks.tiny import tiny_qwen2, wide_tokenizer
    import bitsandbytes, peft  # imported before the baseline, as the trainer would import them

    arch, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    data = Dataset.from_list([{"prompt": "x" * 16} for _ in range(8)])

    def train(arch, settings, output_dir):
        tokenizer = wide_tokenizer(arch["vocab_size"])
        model = tiny_qwen2(**arch)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        Trainer(Config(**dict(settings, output_dir=output_dir)), model=model, tokenizer=tokenizer,
                train_dataset=data,
                reward_funcs=[lambda completions, **_: [float(len(set(c))) for c in completions]]).train()

    def measure(settings):
        # Its peak stays far below the real run's, so VmHWM needs no reset.
        train(dict(arch, vocab_size=512, hidden_size=16, intermediate_size=32), settings,
              settings["output_dir"] + "-warm-up")
        peaks = []
        register_optimizer_step_post_hook(
            lambda *_: peaks.append(peak_rss_bytes()))  # VmHWM: ru_maxrss keeps the pytest parent's RSS
        with open("/proc/self/statm") as f:
            baseline = int(f.read().split()[1]) * resource.getpagesize()
        train(arch, settings, settings["output_dir"])
        return peaks[-1] - baseline

    for name, settings in runs.items():
        pid = os.fork()
        if pid == 0:
            try:
                print(json.dumps({name: measure(settings)}), flush=True)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        os.waitpid(pid, 0)
""")
ARCH = dict(vocab_size=32000, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=1408)
RUN = dict(max_steps=2, per_device_train_batch_size=8, num_generations=8, max_prompt_length=16, stop_at_eos=False,
           optim="adamw", beta=0.04, save_steps=10**9, max_completion_length=64, gradient_checkpointing=False)
MEASURED_RUNS = {
    "full": dict(RUN),  # full fine-tuning: weights, reference, AdamW states
    "lora": dict(RUN, use_lora=True, per_device_train_batch_size=32),  # LoRA: activations and the log-prob chunk
    "full-8bit-checkpointing": dict(RUN, optim="adamw_8bit", gradient_checkpointing=True),
    "full-bf16": dict(RUN, bf16_weights=True),
    "full-8bit-checkpointing-bf16": dict(RUN, optim="adamw_8bit", gradient_checkpointing=True, bf16_weights=True),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """MEASURED_RUNS' settings (with their output_dir) and, for each run that ended, its measured peak; the
    subprocess's stderr."""
    out = tmp_path_factory.mktemp("measured")
    runs = {name: dict(settings, output_dir=str(out / name)) for name, settings in MEASURED_RUNS.items()}
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(ARCH), json.dumps(runs)], env=env,
                          # bf16 matmuls are slow on CPUs without AVX512-BF16
                          capture_output=True, text=True, timeout=3000)
    peaks = {}
    for line in done.stdout.splitlines():
        peaks.update(json.loads(line))
    return runs, peaks, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", MEASURED_RUNS)
def test_predicted_peak_within_25_percent_of_measured_on_cpu(measured, name):
    runs, peaks, stderr = measured
    assert name in peaks, stderr[-3000:]
    settings, peak = runs[name], peaks[name]
    arch = Architecture(**{k: v for k, v in ARCH.items()}, tie_word_embeddings=True)
    predicted = estimate(arch, Config(**settings), device="cpu").peak
    print(f"predicted {predicted / 1e6:.0f} MB, measured {peak / 1e6:.0f} MB")
    assert predicted == pytest.approx(peak, rel=0.15 if settings.get("bf16_weights") else 0.25)


def test_a_model_whose_architecture_cannot_be_read_decodes_without_a_plan():
    """GPT-2's config names its sizes otherwise (n_embd, n_inner=None): sampling decodes a micro-batch's prompts
    at a time and evaluation takes its fixed batch, instead of the trainer failing on the planner."""
    from transformers import GPT2Config

    from grpo.memory.estimate import settings_of
    from grpo.memory.fit import EVAL_BATCH_WITHOUT_PLAN, decode_sizes

    gpt2 = GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=50)
    m, precision = settings_of(Config(), "cpu")
    sizes = decode_sizes(m, architecture_of(Config().model, gpt2), precision)
    assert sizes.sampling is None
    assert sizes.evaluation == EVAL_BATCH_WITHOUT_PLAN
