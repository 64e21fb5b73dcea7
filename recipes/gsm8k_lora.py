"""GRPO on GSM8K with LoRA, 8-bit AdamW and gradient checkpointing: the settings of the well-known
"GRPO on a 16 GB GPU" write-up, ported field for field.

    python -m grpo.train recipes/gsm8k_lora.py                     # meta-llama/Llama-3.2-1B-Instruct (gated)
    python -m grpo.train recipes/gsm8k_lora.py --model=Qwen/Qwen2.5-0.5B-Instruct

GSM8K comes from the Hugging Face Hub (or its copy in the Hugging Face cache). Offline, point the environment
variable GSM8K_PATH at a local copy: a folder holding train and test files (.parquet, .jsonl, .json or .csv
with `question` and `answer` columns; the Hub repository's own layout, main/train-00000-of-00001.parquet, works
as it is) or the train file itself, and --model at a local folder or smollm2-135m-instruct:

    GSM8K_PATH=data/gsm8k python -m grpo.train recipes/gsm8k_lora.py --model=smollm2-135m-instruct
"""
import os

from grpo import Config
from grpo.tasks.gsm8k import answer_accuracy_reward, load_gsm8k, xml_format_reward

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
    # The write-up ran TRL ~0.14, whose per_device_train_batch_size counted prompts (1 prompt x 4 generations);
    # TRL 1.16 and this trainer count completions: 4 here is the write-up's micro-batch.
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    num_generations=4,
    max_prompt_length=256,
    max_completion_length=786,
    num_train_epochs=1,
    save_steps=100,
    save_total_limit=1,
    max_grad_norm=0.1,
    beta=0.04,
    use_bias_correction_kl=False,  # the write-up's TRL (~0.14) used the plain k3 KL
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    optim="adamw_8bit",
    gradient_checkpointing=True,
    eval_accuracy_func="answer_accuracy_reward",  # eval/accuracy: a right answer in the format
    eval_format_func="xml_format_reward",
    eval_free_accuracy_func="grpo.tasks.gsm8k.last_number_accuracy",  # the answer, whatever the format
)

reward_funcs = [xml_format_reward, answer_accuracy_reward]


def train_dataset():
    return load_gsm8k("train", os.environ.get("GSM8K_PATH"))


def eval_dataset():
    return load_gsm8k("test", os.environ.get("GSM8K_PATH"))
