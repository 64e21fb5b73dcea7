"""GRPO on GSM8K with LoRA, 8-bit AdamW and gradient checkpointing: the settings of the well-known
"GRPO on a 16 GB GPU" write-up, ported field for field.

    python -m grpo.train recipes/gsm8k_lora.py                     # meta-llama/Llama-3.2-1B-Instruct (gated)
    python -m grpo.train recipes/gsm8k_lora.py --model=Qwen/Qwen2.5-0.5B-Instruct
"""
from datasets import load_dataset

from grpo import Config
from grpo.rewards import SYSTEM_PROMPT, answer_accuracy_reward, extract_hash_answer, xml_format_reward

config = Config(
    model="meta-llama/Llama-3.2-1B-Instruct",
    output_dir="runs/gsm8k_lora",
    learning_rate=5e-6,
    adam_beta1=0.9,
    adam_beta2=0.99,
    weight_decay=0.1,
    warmup_ratio=0.1,
    lr_scheduler_type="cosine",
    logging_steps=1,
    bf16=True,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=4,
    num_generations=4,
    max_prompt_length=256,
    max_completion_length=786,
    num_train_epochs=1,
    save_steps=100,
    save_total_limit=1,
    max_grad_norm=0.1,
    beta=0.04,
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    optim="adamw_8bit",
    gradient_checkpointing=True,
)

reward_funcs = [xml_format_reward, answer_accuracy_reward]


def gsm8k(split: str):
    """GSM8K as chat prompts; the reference answer (after '####') becomes the `answer` column."""
    data = load_dataset("openai/gsm8k", "main", split=split)
    return data.map(
        lambda row: {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
            "answer": extract_hash_answer(row["answer"]),
        },
        remove_columns=data.column_names,
    )


def train_dataset():
    return gsm8k("train")


def eval_dataset():
    return gsm8k("test")
