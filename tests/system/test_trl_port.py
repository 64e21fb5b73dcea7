"""A TRL 1.16 user's script, ported by changing its import lines. The dict a TRL script passes to
`GRPOConfig(...)` goes to `Config(**settings)` verbatim, every value in TRL's meaning (the TRL settings that
change nothing here accepted with a warning each), and trains a tiny model through `Trainer` with TRL's own
reward helpers; the example of docs/coming-from-trl.md runs as written, with TRL's call shape."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, logged, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.settings.trl_names import TRL_ONLY

ROOT = Path(__file__).resolve().parents[2]
# As a TRL 1.16 user writes it: a Dr. GRPO run with DAPO's clip-higher and overlong masking. TRL 1.16 has no
# max_prompt_length (ours keeps its default). output_dir is replaced by a scratch folder in the tests.
TRL_SETTINGS = dict(  # noqa: C408 -- keywords, as GRPOConfig(...) is written
    output_dir="Qwen2.5-0.5B-GRPO", learning_rate=1e-5, lr_scheduler_type="cosine", max_grad_norm=1.0,
    optim="adamw_8bit", per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
    max_completion_length=8, temperature=0.9, loss_type="dr_grpo", scale_rewards=False, beta=0.04,
    epsilon_high=0.28, mask_truncated_completions=True, max_steps=2, logging_steps=1, seed=42, bf16=False,
    gradient_checkpointing=True, disable_dropout=True, report_to="none", use_vllm=False, remove_unused_columns=False,
    logging_strategy="steps",
)
# TRL settings this trainer lacks (grpo/settings/trl_names.py) that change nothing here at these values.
NO_EFFECT = {"remove_unused_columns", "logging_strategy"}


def ported(output_dir: str | None = None) -> dict:
    return {**TRL_SETTINGS, "output_dir": output_dir} if output_dir else TRL_SETTINGS


def test_trl_settings_that_change_nothing_here_are_accepted_with_a_warning_each(capsys):
    assert set(TRL_SETTINGS) & TRL_ONLY == NO_EFFECT
    Config(**TRL_SETTINGS)
    assert capsys.readouterr().err.splitlines() == [
        "warning: TRL's `remove_unused_columns` has no effect here: every dataset column reaches the reward "
        "functions",
        "warning: TRL's `logging_strategy` has no effect here: logging_steps sets when a metrics line is "
        "written"]
    with pytest.raises(ConfigError, match='vllm_mode="colocate" is not supported: vLLM runs in its own'):
        Config(**{**TRL_SETTINGS, "use_vllm": True})  # TRL's default vllm_mode


def test_config_keeps_every_value_with_trls_meaning():
    config = Config(**ported())
    assert all(getattr(config, k) == v for k, v in ported().items() if k not in NO_EFFECT | {"scale_rewards"})
    assert config.scale_rewards == "none", "TRL's scale_rewards=False: no std scaling (Dr. GRPO)"
    settings = config.loss_settings()
    assert (settings["epsilon_low"], settings["epsilon_high"], settings["loss_type"]) == (0.2, 0.28, "dr_grpo")


def test_trl_resolves_the_same_values():
    trl = pytest.importorskip("trl", reason="trl (a test peer) is not installed")
    args, config = trl.GRPOConfig(**TRL_SETTINGS, use_cpu=True), Config(**ported())
    # TRL normalizes report_to="none" into a list; everything else it holds as we do.
    same = {k for k in ported() if k not in NO_EFFECT | {"report_to"}}
    assert {k: getattr(config, k) for k in same} == {k: getattr(args, k) for k in same}
    assert (args.epsilon, args.epsilon_high) == (config.epsilon, config.epsilon_high)


def test_a_ported_config_trains_with_trls_reward_helpers(tmp_path):
    trl_rewards = pytest.importorskip("trl.rewards", reason="trl (a test peer) is not installed")
    trl = pytest.importorskip("trl")
    rewards = [trl_rewards.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4),
               trl_rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0), digit_share]
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    # Half the vocabulary ends a completion: most completions end within 8 tokens and so stay in the loss.
    model.generation_config.eos_token_id = list(range(4, len(tokenizer), 2))
    trainer = Trainer(Config(**ported(str(tmp_path / "run"))), model=model, tokenizer=tokenizer,
                      reward_funcs=rewards, train_dataset=digit_prompts(8))
    args = trl.GRPOConfig(**TRL_SETTINGS, use_cpu=True)
    # The generation batch TRL resolves: steps_per_generation micro-batches, generation_batch_size completions.
    assert trainer.schedule.micro_batches_per_generation == args.steps_per_generation == 2
    assert trainer.schedule.prompts_per_generation * args.num_generations == args.generation_batch_size == 16
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    history = logged(trainer)
    assert trainer.step == 2 and [line["step"] for line in history] == [1, 2]
    lines = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == history
    for line in lines:  # TRL's reward helpers are named as in TRL's logs
        assert {"loss", "kl", "grad_norm", "rewards/soft_overlong_punishment_reward/mean",
                "rewards/repetition_penalty_reward/mean", "rewards/digit_share/mean"} <= line.keys()
        assert all(math.isfinite(v) for v in line.values())
    assert max((a - b).abs().max().item() for a, b in zip(before, model.parameters())) > 0


def python_example(page: Path) -> str:
    """The first Python block of a docs page, as a reader copies it."""
    return re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)


def test_the_docs_trl_script_runs_as_written_with_a_tiny_model(tmp_path, monkeypatch, capsys):
    # The model the example names, as a local folder holding a tiny model and its tokenizer: the one change.
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "tiny-model")
    tokenizer.save_pretrained(tmp_path / "tiny-model")
    script = python_example(ROOT / "docs" / "coming-from-trl.md")
    assert script.count('"Qwen/Qwen2.5-0.5B-Instruct"') == 1 and "\nfrom trl import" not in script
    monkeypatch.chdir(tmp_path)
    namespace = {}
    tiny = repr(str(tmp_path / "tiny-model"))
    exec(script.replace('"Qwen/Qwen2.5-0.5B-Instruct"', tiny), namespace)  # noqa: S102

    trainer, out = namespace["trainer"], tmp_path / "Qwen2.5-0.5B-GRPO"
    assert trainer.state.global_step == trainer.state.max_steps == 4 == trainer.args.max_steps
    captured = capsys.readouterr()
    assert "trained 4 steps" in captured.out
    assert [line for line in captured.err.splitlines() if line.startswith("warning:")] == []
    # warmup_steps=2 of 4, then linear decay: lr 1e-5 x (0, 1/2, then 1 - (s - 2) / 2 at s = 2, 3).
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["learning_rate"] for line in lines] == pytest.approx([0.0, 0.5e-5, 1e-5, 0.5e-5])
    # save_model(output_dir): the model and tokenizer for from_pretrained, as transformers writes them.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out)
    pairs = zip(saved.state_dict().values(), trainer.model.state_dict().values())
    assert all(torch.equal(p, q) for p, q in pairs)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == trainer.tokenizer.get_vocab()


def test_trls_call_shape_and_its_refusals(tmp_path):
    tokenizer = tiny_tokenizer()
    args = Config(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                  num_generations=2, max_completion_length=4, optim="adamw")
    trainer = Trainer(model=tiny_model(tokenizer), args=args, processing_class=tokenizer,
                      reward_funcs=digit_share, train_dataset=digit_prompts())
    assert trainer.tokenizer is tokenizer and trainer.args is args and trainer.state.global_step == 0
    # A model object without its tokenizer: the folder's its config names (TRL's choice), else a clear line.
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    trainer = Trainer(args, model=loaded, reward_funcs=[digit_share], train_dataset=digit_prompts())
    assert trainer.tokenizer.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(ConfigError) as error:
        Trainer(args, model=tiny_model(tokenizer), reward_funcs=[digit_share], train_dataset=digit_prompts())
    assert str(error.value) == ("a model passed to Trainer needs its tokenizer: pass "
                                "processing_class=tokenizer (TRL's name; tokenizer= works too); its config "
                                "names no folder or hub id to load one from")
    for call, message in [
        (dict(peft_config=object()), "peft_config must be a peft LoraConfig (this trainer trains LoRA adapters), "
                                     "got object"),
        (dict(optimizers=(object(), None)), "Trainer's `optimizers`: set optim, learning_rate"),
        (dict(config="Qwen/Qwen2.5-0.5B-Instruct"),
         "Trainer's first argument is a grpo Config (TRL's `args=`), got str 'Qwen/Qwen2.5-0.5B-Instruct': "
         "pass the model as model="),
        (dict(config=args, args=args), "pass the Config once: as `config` or as TRL's `args=`, not both"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            Trainer(**{"model": tiny_model(tokenizer), "tokenizer": tokenizer, "reward_funcs": [digit_share],
                       "train_dataset": digit_prompts(), **call})
