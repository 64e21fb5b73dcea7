"""TRL 1.16 GRPOConfig fields a ported (open-r1 style) script sets, accepted with TRL's meaning: the model's
from_pretrained kwargs (dtype, the older torch_dtype), transformers' schedules with their kwargs, prompts left
whole, the data order (shuffle_dataset, data_seed), and a peft LoraConfig without target_modules (peft's
default for the architecture). Through the script's own lines, only its imports changed."""
import json
import math

import pytest
import torch
from datasets import Dataset
from tiny_setup import digit_share, logged, saved_tiny_model, tiny_model, tiny_tokenizer

from grpo import Config as GRPOConfig  # was: from trl import GRPOConfig, GRPOTrainer
from grpo import Trainer as GRPOTrainer
from grpo.errors import ConfigError
from grpo.policy.optim import Updates
from grpo.settings.components import OptimSettings

# open-r1's lines (recipes/*/grpo/config_demo.yaml), as a TRL 1.16 script passes them
OPEN_R1 = dict(  # noqa: C408 -- keywords, as GRPOConfig(...) is written
    model_init_kwargs={"torch_dtype": "float32", "attn_implementation": "eager"},
    lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_ratio=0.0,
    learning_rate=1e-2, max_prompt_length=None, ddp_find_unused_parameters=False, num_generations_eval=4,
    shuffle_dataset=False, data_seed=7, save_only_model=False, per_device_train_batch_size=8, num_generations=4,
    max_completion_length=4, max_steps=4, logging_steps=1, optim="adamw_torch", report_to="none", seed=0,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("model"))


def prompts(n=8):
    """The first prompt is longer than max_prompt_length's default (512 tokens), which would cut it."""
    return Dataset.from_list([{"prompt": f"Write {1 + i} digits:" + " 5" * (600 if i == 0 else 0)}
                              for i in range(n)])


def test_an_open_r1_config_trains_with_trls_meaning(tmp_path, folder, capsys):
    from peft import LoraConfig

    args = GRPOConfig(output_dir=str(tmp_path / "run"), **OPEN_R1)
    assert args.bf16 is False and args.model_init_kwargs == {"dtype": "float32", "attn_implementation": "eager"}
    trainer = GRPOTrainer(model=str(folder), args=args, reward_funcs=[digit_share], train_dataset=prompts(),
                          peft_config=LoraConfig(task_type="CAUSAL_LM"))
    # peft's default targets for the architecture (Qwen2: q_proj, v_proj), as get_peft_model picks them
    assert trainer.config.lora_target_modules == ["q_proj", "v_proj"]
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in trainer.model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    assert trainer.model.config._attn_implementation == "eager"  # model_init_kwargs reached from_pretrained
    trainer.train()
    lines = logged(trainer)
    # transformers' cosine_with_min_lr over 4 steps, no warmup: min + (1 - min) (1 + cos(pi s / 4)) / 2
    expected = [1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 4))) for s in range(4)]
    assert [line["learning_rate"] for line in lines] == pytest.approx(expected)
    # shuffle_dataset=False: the prompts in the dataset's order, 2 per step; max_prompt_length=None: none cut
    rows = [json.loads(r) for r in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows[::4]] == prompts()["prompt"]
    assert "prompts are cut" not in capsys.readouterr().err


def test_the_schedule_is_transformers_own():
    from transformers import get_scheduler

    for name, kwargs in [("cosine_with_restarts", {"num_cycles": 2}), ("polynomial", {"power": 2.0}),
                         ("warmup_stable_decay", {"num_decay_steps": 3}), ("constant", {}),
                         ("constant_with_warmup", {}), ("inverse_sqrt", {})]:
        args = GRPOConfig(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, warmup_steps=2, max_steps=10,
                          learning_rate=1.0, optim="adamw")
        model = torch.nn.Linear(2, 2)
        ours = Updates(model.parameters(), OptimSettings.of(args), 10).scheduler
        theirs = get_scheduler(name, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0), 2, 10,
                               scheduler_specific_kwargs=kwargs)
        for _ in range(10):
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr()), name
            ours.optimizer.step(), ours.step(), theirs.step()


def test_what_cannot_work_says_so_in_one_line(folder):
    with pytest.raises(ConfigError, match="model_init_kwargs dtype='bfloat16' and bf16=False disagree"):
        GRPOConfig(model_init_kwargs={"dtype": torch.bfloat16}, bf16=False)
    with pytest.raises(ConfigError, match="use load_in_4bit=True"):
        GRPOConfig(model_init_kwargs={"quantization_config": {}})
    with pytest.raises(ConfigError, match="One of min_lr or min_lr_rate should be set"):
        GRPOTrainer(model=str(folder), args=GRPOConfig(lr_scheduler_type="cosine_with_min_lr", max_steps=1,
                                                       output_dir="/nonexistent/unused"),
                    reward_funcs=[digit_share], train_dataset=prompts())
    assert GRPOConfig(model_init_kwargs={"torch_dtype": torch.bfloat16}).bf16 is True
    from peft import LoraConfig

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    model.config.model_type = "my_arch"  # an architecture peft has no default targets for
    with pytest.raises(ConfigError, match="peft has none for model_type 'my_arch': name them"):
        GRPOTrainer(model=model, processing_class=tokenizer, args=GRPOConfig(output_dir="/nonexistent/unused"),
                    reward_funcs=[digit_share], train_dataset=prompts(), peft_config=LoraConfig(r=4))


def test_loss_type_vespo_trains_with_trls_settings(tmp_path):
    # TRL 1.16's eighth loss type, its four settings by TRL's names; equal to TRL's on identical tensors:
    # tests/unit/test_loss_vs_trl.py
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=1.0,
                      max_steps=2, per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
                      steps_per_generation=2, learning_rate=1e-2, optim="adamw", report_to="none")
    trainer = GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=args,
                          reward_funcs=[digit_share], train_dataset=prompts())
    assert trainer.plan.loss["loss_type"] == "vespo" and trainer.plan.loss["vespo_k_pos"] == 1.5
    trainer.train()
    lines = logged(trainer)
    # step 2 trains on the batch step 1 sampled, after one update: phi(w) moves off 1 (phi(1) = 1 on-policy)
    assert lines[0]["vespo/phi_seq_mean"] == pytest.approx(1.0)
    assert 0 < lines[1]["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-6)
