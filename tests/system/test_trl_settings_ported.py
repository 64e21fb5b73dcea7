"""TRL 1.16 settings that were refused here and now carry TRL's meaning, each through a TRL script's lines
(only the imports changed): cast_lm_head_to_fp32, pad_to_multiple_of, sync_ref_model (TR-DPO) and adaptive
entropy control."""
import shutil

import pytest
import torch
from datasets import Dataset
from tiny_setup import digit_share, logged, saved_tiny_model, tiny_model, tiny_tokenizer

from grpo import Config as GRPOConfig  # was: from trl import GRPOConfig, GRPOTrainer
from grpo import Trainer as GRPOTrainer

SMALL = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4, "learning_rate": 1e-2,
         "optim": "adamw", "report_to": "none", "seed": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # the trainer loads it, in bf16 where the plan says so
    return str(saved_tiny_model(tmp_path_factory.mktemp("model")))


def prompts(n=8):
    return Dataset.from_list([{"prompt": f"Write {1 + i % 9} digits:"} for i in range(n)])


def char_codes(completions, **kwargs):
    """A reward that differs between almost any two completions: every group has a signal."""
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


def test_cast_lm_head_to_fp32_computes_a_bf16_heads_logits_in_float32(tmp_path, folder):
    # LoRA under bf16 keeps a bf16 base: the head, tied to the input embedding here, goes float32; the layers
    # still get bf16 embeddings (TRL's hook); the log-probs are those of the float32 head, exactly.
    args = GRPOConfig(output_dir=str(tmp_path / "run"), bf16=True, use_lora=True, max_steps=1,
                      cast_lm_head_to_fp32=True, **SMALL)
    trainer = GRPOTrainer(model=folder, args=args, reward_funcs=[digit_share], train_dataset=prompts())
    hf = trainer.model.get_base_model()
    head, embedding = hf.get_output_embeddings(), hf.get_input_embeddings()
    assert head.weight.dtype == torch.float32 and embedding.weight is head.weight
    assert hf.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    assert embedding(ids).dtype == torch.bfloat16
    trainer.train()
    batch = trainer.generation.batch
    rows = batch.select(torch.arange(2))
    got = trainer.policy.logprobs(rows)  # [2, C]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = hf.base_model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                               position_ids=(rows.attention_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
    P = rows.prompt_ids.shape[1]
    logits = hidden[:, P - 1:-1].double() @ head.weight.double().T  # [2, C, V] in float64
    want = logits.log_softmax(-1).gather(-1, rows.completion_ids[..., None]).squeeze(-1)
    mask = rows.completion_mask.bool()
    assert torch.allclose(got[mask].double(), want[mask], atol=1e-4)
    assert logged(trainer)[-1]["loss"] is not None


def test_use_liger_kernel_is_accepted_and_a_lora_adapter_on_the_head_refused(tmp_path, capsys):
    # TRL 1.16's Liger kernels are layer kernels for the same math: accepted with a warning that says they are
    # not applied. An adapter on lm_head would never train (log-probs read its weight directly): refused, as in TRL.
    from peft import LoraConfig

    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), use_liger_kernel=True, **SMALL)
    assert "`use_liger_kernel` has no effect here" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lm_head"):
        GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args, reward_funcs=[digit_share],
                    train_dataset=prompts(), peft_config=LoraConfig(target_modules=["q_proj", "v_proj", "lm_head"]))


def test_pad_to_multiple_of_pads_the_training_forwards_and_changes_no_log_prob(tmp_path):
    # TRL's meaning: prompt ids padded (left) and completion ids (right) to a multiple, the padding masked. The
    # same run without it samples the same completions and computes the same losses.
    tokenizer = tiny_tokenizer()
    runs = {}
    for multiple in (None, 8):
        args = GRPOConfig(output_dir=str(tmp_path / f"run{multiple}"), pad_to_multiple_of=multiple, max_steps=2,
                          steps_per_generation=2, bf16=False, **SMALL)
        trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args,
                              reward_funcs=[digit_share], train_dataset=prompts())
        trainer.train()
        runs[multiple] = trainer
    def widths(trainer):
        return [(m.rollout.prompt_ids.shape[1], m.rollout.completion_ids.shape[1])
                for m in trainer.generation.micro_batches]

    assert all(p % 8 == 0 and c % 8 == 0 for p, c in widths(runs[8]))
    assert all(c <= 4 for _, c in widths(runs[None]))  # max_completion_length
    assert runs[8].generation.batch.completions == runs[None].generation.batch.completions
    for padded, plain in zip(logged(runs[8]), logged(runs[None])):
        assert padded["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        assert padded["entropy"] == pytest.approx(plain["entropy"], abs=1e-5)
    assert GRPOConfig(pad_to_multiple_of="auto").pad_to_multiple_of is None  # TRL's default: Neuron only


def test_sync_ref_model_mixes_the_policy_into_the_reference_every_sync_steps(tmp_path):
    # TR-DPO as TRL's SyncRefModelCallback does it: after optimizer step 2 (ref_model_sync_steps=2), and not after
    # step 1, ref = alpha x policy + (1 - alpha) x ref; the checkpoint keeps the moved reference for a resume.
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), beta=0.1, sync_ref_model=True, ref_model_sync_steps=2,
                      ref_model_mixup_alpha=0.25, max_steps=3, bf16=False, save_steps=2, **SMALL)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args,
                          reward_funcs=[char_codes], train_dataset=prompts())
    start = {n: p.detach().double().clone() for n, p in trainer.ref_model.named_parameters()}
    after = []
    trainer.callbacks.callbacks.insert(0, type("Snapshot", (), {"on_step_end": lambda self, *a, **k: after.append(
        {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()})})())
    trainer.train()
    policy_2 = after[1]
    assert any(not torch.equal(policy_2[n], start[n]) for n in start)  # the policy moved: a real mixture
    for name, ref in trainer.ref_model.named_parameters():  # no sync after step 3 (3 % 2 != 0)
        torch.testing.assert_close(ref.double(), 0.25 * policy_2[name] + 0.75 * start[name], rtol=0, atol=1e-7)
    saved = torch.load(tmp_path / "run" / "checkpoint-2" / "trainer_state.pt", weights_only=False)["reference"]
    for name, ref in trainer.ref_model.state_dict().items():
        torch.testing.assert_close(saved[name], ref)
    shutil.rmtree(tmp_path / "run" / "checkpoint-3")  # resumed from checkpoint-2: its reference, not the start's
    resumed = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args,
                          reward_funcs=[char_codes], train_dataset=prompts())
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for name, ref in resumed.ref_model.state_dict().items():
        torch.testing.assert_close(ref, saved[name])
    for bad in ({"beta": 0.0}, {"use_lora": True}):  # TRL's refusals: no reference copy to mix into
        with pytest.raises(ValueError, match="sync_ref_model=True mixes the policy into the reference copy"):
            GRPOConfig(**{"beta": 0.1, "sync_ref_model": True, **bad})


def test_adaptive_entropy_moves_the_coefficient_once_per_step_and_gates_the_bonus(tmp_path):
    # TRL's controller: c starts at entropy_coef; after each optimizer step c += delta while the step's mean token
    # entropy H <= entropy_target, else c -= delta, within [min, max]; a step applies c only after a step ended
    # at or below the target (the first: 0). Here H (about log V, some 5 nats) is below 15 and above 1.
    tokenizer = tiny_tokenizer()
    for target, delta, lo, expected in ((15.0, 0.005, 0.0, [0.015, 0.02, 0.025]), (1.0, 0.004, 0.003,
                                                                                   [0.006, 0.003, 0.003])):
        args = GRPOConfig(output_dir=str(tmp_path / f"run{target}"), entropy_coef=0.01, use_adaptive_entropy=True,
                          entropy_target=target, entropy_coef_delta=delta, entropy_coef_min=lo, max_steps=3,
                          gradient_accumulation_steps=2, bf16=False, save_steps=2, **SMALL)
        trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args,
                              reward_funcs=[char_codes], train_dataset=prompts())
        trainer.train()
        lines = logged(trainer)
        assert [line["entropy_coef"] for line in lines] == pytest.approx(expected)
        assert trainer.entropy_coef == pytest.approx(expected[-1])
        applied = [-line["loss/entropy"] / line["entropy"] for line in lines]  # c x H / H, the applied c
        gated = [0.0, *expected[:-1]] if target == 15.0 else [0.0, 0.0, 0.0]
        assert applied == pytest.approx(gated, rel=0.05, abs=1e-9)  # H: token-weighted, the bonus by micro-batch
        saved = torch.load(tmp_path / f"run{target}" / "checkpoint-2" / "trainer_state.pt", weights_only=False)
        assert saved["entropy_control"] == {"entropy_coef": pytest.approx(expected[1]),
                                            "last_world_entropy": pytest.approx(lines[1]["entropy"])}
    # resumed from checkpoint-2, step 3 starts from the saved coefficient and gate, as the run did
    shutil.rmtree(tmp_path / f"run{target}" / "checkpoint-3")
    resumed = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args,
                          reward_funcs=[char_codes], train_dataset=prompts())
    resumed.train(resume_from_checkpoint=str(tmp_path / f"run{target}" / "checkpoint-2"))
    assert resumed.entropy_coef == pytest.approx(expected[-1]) and logged(resumed)[-1]["loss/entropy"] == 0.0
    with pytest.raises(ValueError, match="use_adaptive_entropy=True with top_entropy_quantile < 1"):
        GRPOConfig(use_adaptive_entropy=True, top_entropy_quantile=0.2)
