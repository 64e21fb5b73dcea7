"""Tiny random stand-ins for the Hub models and data sets TRL's GRPOTrainer tests load, written into an offline
HF cache under the Hub names (models) and as parquet files the harness's conftest serves (data sets).

Text models only: the vision-language ones (tiny-*ForConditionalGeneration, zen-image) need processors and image
sizes we do not fake, so their tests fail on TRL too and stay out of the measure."""
from __future__ import annotations

import hashlib
from pathlib import Path

import transformers
from datasets import Dataset

from grpo.tasks.tiny import train_tokenizer

ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
    "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
    "Readability counts.", "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.", "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.", "Now is better than never.",
    "Although never is often better than *right* now.", "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]
PROMPT_WORDS = [4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 4, 5, 3, 6, 5, 5, 4]
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, max_position_embeddings=1024)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# The chat template each family's tiny Hub model carries (the real model's), as TRL's installed package ships it
# under trl/chat_templates/ (tool calling and TRL's response schemas recognise these exact templates).
TEMPLATES = {"qwen2": "qwen2_5", "qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3_2", "gemma2": "gemma",
             "cohere2": "cohere2", "gpt_oss": "gptoss", "glm4_moe": "glm4moe", "nemotron_h": "nemotron_3_nano"}
# Hub name (under trl-internal-testing/) -> transformers model_type, model class, config beyond SMALL.
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "Qwen2ForCausalLM", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "Qwen2ForSequenceClassification", {"num_labels": 1}),
    "tiny-Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM", {}),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification", {"num_labels": 1}),
    "tiny-LlamaForCausalLM-3.2": ("llama", "LlamaForCausalLM", {}),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "LlamaForSequenceClassification", {"num_labels": 1}),
    "tiny-MistralForCausalLM-0.2": ("mistral", "MistralForCausalLM", {}),
    "tiny-Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM", {}),
    "tiny-Cohere2ForCausalLM": ("cohere2", "Cohere2ForCausalLM", {}),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", MOE),
    "tiny-GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM", MOE),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM",
                                {**MOE, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                                 "topk_group": 1}),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "NemotronHForCausalLM",
                                       {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 8,
                                        "ssm_state_size": 8, "n_groups": 1, "mamba_n_groups": 1,
                                        "num_hidden_layers": 2}),
}


def _snapshot(hub: Path, repo: str) -> Path:
    """The snapshot folder of `repo` in an HF hub cache, with refs/main pointing at it, as a download leaves."""
    root = hub / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    folder = root / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_models(hub: Path, templates: Path | None) -> dict[str, str]:
    """Each stand-in saved under its Hub name, with its family's chat template where `templates` (a folder of
    <name>.jinja files) has it, else ChatML; returns the ones that could not be built, with why."""
    tokenizer = train_tokenizer(ZEN * 4, vocab_size=400)
    chatml, missing = tokenizer.chat_template, {}
    for name, (model_type, cls, extra) in MODELS.items():
        template = templates / f"{TEMPLATES.get(model_type)}.jinja" if templates else None
        tokenizer.chat_template = template.read_text() if template and template.is_file() else chatml
        try:
            config = transformers.AutoConfig.for_model(
                model_type, **{**SMALL, **extra}, vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
            model = getattr(transformers, cls)(config)
            folder = _snapshot(hub, f"trl-internal-testing/{name}")
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        except Exception as e:  # one family a transformers version cannot build must not stop the others
            missing[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return missing


def write_datasets(root: Path) -> None:
    """trl-internal-testing/zen's two prompt-only configs: 17 train rows, 2 test rows, as TRL's has. Its prompts
    are the Zen's lines cut short, in order (TRL's test_prepare_input_called_with_correct_data names the first
    twelve); the conversational config asks the same as a user turn."""
    prompts = [" ".join(line.split()[:n]) for line, n in zip(ZEN, PROMPT_WORDS)]
    standard = [{"prompt": p} for p in prompts]
    conversational = [{"prompt": [{"role": "user", "content": p}]} for p in prompts]
    for config, rows in (("standard_prompt_only", standard), ("conversational_prompt_only", conversational)):
        folder = root / "trl-internal-testing--zen" / config
        folder.mkdir(parents=True, exist_ok=True)
        Dataset.from_list(rows[:17]).to_parquet(str(folder / "train.parquet"))
        Dataset.from_list(rows[17:]).to_parquet(str(folder / "test.parquet"))
