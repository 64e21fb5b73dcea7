"""TRL's sampling settings in a run: chat_template_kwargs reach the chat template in training and evaluation,
and min_p, repetition_penalty and generation_kwargs reach the decoder of a real Trainer run."""
import json
import math

import pytest
from datasets import Dataset
from jinja2.exceptions import TemplateError
from tiny_setup import tiny_model, tiny_tokenizer

from grpo.settings.components import EvalSettings
from grpo import Config, Trainer
from grpo.rollout.engines import decoding
from grpo.rollout.evaluate import evaluate
from grpo.rollout.engines.sampling import PromptEncoder
from grpo.tasks.tiny import CHAT_TEMPLATE

# A template that needs a variable only chat_template_kwargs can give it, and writes it into the prompt.
GREETING_TEMPLATE = ("{% if greeting is not defined %}{{ raise_exception('no greeting given') }}{% endif %}"
                     "{{ greeting }}\n" + CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = GREETING_TEMPLATE
    return tokenizer


def chat_prompts(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Write {1 + i % 9} digits:"}]}
                              for i in range(n)])


def content_length(completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]


def test_chat_template_kwargs_reach_the_template(tokenizer):
    prompts = chat_prompts(2)["prompt"]
    ids, mask = PromptEncoder(tokenizer, 64, {"greeting": "Write 7"})(prompts)
    assert tokenizer.decode(ids[0][mask[0].bool()]).startswith("Write 7\n<|im_start|>user")
    with pytest.raises(TemplateError, match="no greeting given"):
        PromptEncoder(tokenizer, 64)(prompts)

    model = tiny_model(tokenizer)
    settings = {"eval_accuracy_func": "content_length", "max_prompt_length": 64, "max_completion_length": 3}
    greeting = EvalSettings.of(Config(**settings, chat_template_kwargs={"greeting": "hi"}))
    metrics, _ = evaluate(model, tokenizer, chat_prompts(3), [content_length], greeting, progress=False)
    assert metrics["eval/num_examples"] == 3
    with pytest.raises(TemplateError, match="no greeting given"):
        evaluate(model, tokenizer, chat_prompts(3), [content_length], EvalSettings.of(Config(**settings)),
                 progress=False)


def test_a_run_samples_with_min_p_repetition_penalty_and_generation_kwargs(tmp_path, tokenizer, monkeypatch):
    filters, penalties = [], []
    filter_logits, penalize = decoding.filter_logits, decoding.penalize_repetitions
    monkeypatch.setattr(decoding, "filter_logits", lambda logits, *a: filters.append(a) or filter_logits(logits, *a))
    monkeypatch.setattr(decoding, "penalize_repetitions",
                        lambda logits, seen, p: penalties.append(p) or penalize(logits, seen, p))
    config = Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                    num_generations=2, max_prompt_length=64, max_completion_length=6, learning_rate=1e-3,
                    optim="adamw", seed=0, temperature=0.9, min_p=0.05, repetition_penalty=1.3,
                    generation_kwargs={"top_k": 20, "temperature": 0.8}, chat_template_kwargs={"greeting": "hi"},
                    eval_on_start=True, eval_limit=2, eval_accuracy_func="content_length",
                    eval_format_func=None, eval_free_accuracy_func=None)
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[content_length],
                      train_dataset=chat_prompts(8), eval_dataset=chat_prompts(4))
    trainer.train()
    assert trainer.step == 2
    # Sampling used the generation_kwargs over the fields (temperature, top_k, top_p, min_p); greedy eval did not.
    assert filters and set(filters) == {(0.8, 20, 1.0, 0.05)}
    assert penalties and set(penalties) == {1.3}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2]
    assert all(math.isfinite(line["loss"]) for line in lines if "loss" in line)
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [0]  # eval_on_start: rendered alike
