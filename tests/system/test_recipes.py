"""The shipped recipes load offline and say what the README says they do."""
from datasets import Dataset

from grpo.settings.recipe import load_recipe
from grpo.tasks.gsm8k import SYSTEM_PROMPT

# The "GRPO on a 16 GB GPU" write-up's settings, which gsm8k_lora.py must port field for field; its TRL (~0.14)
# counted prompts in per_device_train_batch_size=1 (x 4 generations), TRL 1.16 and we count the 4 completions.
ARTICLE = dict(learning_rate=5e-6, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1,
               lr_scheduler_type="cosine", logging_steps=1, bf16=True, per_device_train_batch_size=4,
               gradient_accumulation_steps=4, num_generations=4, max_prompt_length=256,
               max_completion_length=786, num_train_epochs=1, save_steps=100, save_total_limit=1,
               max_grad_norm=0.1)


def test_gsm8k_recipe_ports_the_article_settings():
    recipe = load_recipe("recipes/gsm8k_lora.py")
    config = recipe.config
    for key, value in ARTICLE.items():
        assert getattr(config, key) == value, key
    assert config.model == "meta-llama/Llama-3.2-1B-Instruct"
    assert (config.use_lora, config.lora_r, config.lora_alpha, config.lora_target_modules) == (True, 16, 32, None)
    assert config.optim == "adamw_8bit" and config.gradient_checkpointing
    assert [f.__name__ for f in recipe.reward_funcs] == ["xml_format_reward", "answer_accuracy_reward"]


def test_gsm8k_rows_become_chat_prompts_with_the_reference_answer(monkeypatch, tmp_path):
    recipe = load_recipe("recipes/gsm8k_lora.py")
    fake = Dataset.from_list([{"question": "Tom has 3 apples and buys 1,200 more. How many?",
                               "answer": "3 + 1200 = 1203\n#### 1,203"}])
    for split in ("train", "test"):  # a local copy in the Hub repository's layout
        (tmp_path / "main").mkdir(exist_ok=True)
        fake.to_parquet(tmp_path / "main" / f"{split}-00000-of-00001.parquet")
    monkeypatch.setenv("GSM8K_PATH", str(tmp_path))
    row = recipe.train_dataset()[0]
    assert row["prompt"] == [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": fake[0]["question"]}]
    assert row["answer"] == "1203"
    assert set(recipe.eval_dataset().column_names) == {"prompt", "answer"}


def test_the_calculator_recipe_is_word_problems_with_the_inline_calculator():
    from dataclasses import replace

    from grpo.settings.recipe import resolve_dataset
    from grpo.tasks.calculator import INLINE_CALCULATOR, last_result_reward
    base, calculator = load_recipe("recipes/word_problems.py"), load_recipe("recipes/calculator.py")
    assert calculator.tools == [INLINE_CALCULATOR] and base.tools is None
    assert calculator.reward_funcs == [*base.reward_funcs, last_result_reward]
    # the documented differences only: 48 steps and the last-result reward's weight beside the base two
    assert replace(calculator.config, output_dir=base.config.output_dir, max_steps=base.config.max_steps,
                   reward_weights=base.config.reward_weights) == base.config
    assert calculator.config.max_steps == 48 and calculator.config.reward_weights == [0.25, 1.0, 0.25]
    held_out, plain = resolve_dataset(calculator.eval_dataset), resolve_dataset(base.eval_dataset)
    assert held_out["question"] == plain["question"] and held_out["answer"] == plain["answer"]
    prompt, plain_prompt = held_out[0]["prompt"], plain[0]["prompt"]
    # system, one-step example (user, assistant), then the base prompt's two-step example, annotated, and question
    assert prompt[0] == plain_prompt[0] and prompt[-1] == plain_prompt[-1] and len(prompt) == len(plain_prompt) + 2
    assert "<<12+7=19>>19" in prompt[2]["content"]
    two_step = prompt[4]["content"]
    assert "<<" in two_step and "<<" not in plain_prompt[2]["content"]
