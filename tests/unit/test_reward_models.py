"""Reward models as reward functions (grpo/rollout/reward_models.py): TRL 1.16's scoring of prompt + completion
by a sequence classifier, checked against the model called directly on each text alone (no padding)."""
import copy

import pytest
import torch
from tiny_setup import tiny_reward_model, tiny_tokenizer
from transformers import PretrainedConfig

from grpo.errors import ConfigError
from grpo.settings.recipe import load_recipe
from grpo.rollout.reward_models import RewardModel, reward_callables
from grpo.rollout.rewards import RewardError, compute_rewards, reward_func_names, reward_metrics

PROMPTS = ["Write 3 digits:", "Write 9 digits:", "hi", "Write 1 digits:"]
COMPLETIONS = [" 012", " 012345678 and some more text to make it long", "!", ""]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# atol = rtol = 1e-5 below: a padded batch against each text alone, float32 in other orders. A score sums ~500 terms
# along its path (2 layers of 128 + 32 + <= 50 keys + 32, the 32-wide head) of scores ~1-3: sqrt(n) * u * 3 = 4e-6
# (measured <= 9.5e-7); wrong padding or positions move scores by > 0.1, as they differ between texts.


def direct_score(model, tokenizer, text: str) -> float:
    """The model (in eval mode: no dropout) on one text alone: no padding, no special tokens added."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return model.eval()(**ids).logits[0, 0].item()


def chat(prompt: str, completion: str):
    return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]


def test_plain_prompts_score_prompt_plus_completion_as_the_model_does_alone(tokenizer):
    model = tiny_reward_model(tokenizer)
    [reward] = reward_callables([model], [tokenizer])
    scores = reward(PROMPTS, COMPLETIONS)
    expected = [direct_score(model, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert max(expected) - min(expected) > 0.1, "scores must differ for the comparison to mean anything"
    # Padding: the batch (lengths 4 to 50 tokens) scores each text as it scores it alone.
    one_at_a_time = [reward([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(one_at_a_time), atol=1e-5, rtol=1e-5)


def test_chat_prompts_go_through_the_reward_tokenizers_chat_template(tokenizer):
    model = tiny_reward_model(tokenizer, seed=1)
    [reward] = reward_callables(model, tokenizer)  # single entries, as TRL accepts them
    prompts, completions = zip(*(chat(p, c) for p, c in zip(PROMPTS, COMPLETIONS)))
    scores = reward(list(prompts), list(completions))
    texts = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{c}<|im_end|>\n"  # ChatML, written out
             for p, c in zip(PROMPTS, COMPLETIONS)]
    expected = [direct_score(model, tokenizer, t) for t in texts]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    plain = reward(PROMPTS, COMPLETIONS)
    assert max(abs(a - b) for a, b in zip(scores, plain)) > 1e-3


def test_chat_template_kwargs_reach_the_reward_tokenizers_template(tokenizer):
    """TRL passes chat_template_kwargs to the reward tokenizer's template too (e.g. enable_thinking)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if greeting is defined %}{{ greeting }} {% endif %}"
                         "{{ m['content'] }}\n{% endfor %}")
    model = tiny_reward_model(tok, seed=2)
    [plain_template] = reward_callables([model], [tok])
    [with_kwargs] = reward_callables([model], [tok], chat_template_kwargs={"greeting": "hello there"})
    prompt, completion = chat(PROMPTS[0], COMPLETIONS[0])
    expected = direct_score(model, tok, f"hello there {PROMPTS[0]}\nhello there {COMPLETIONS[0]}\n")
    assert with_kwargs([prompt], [completion])[0] == pytest.approx(expected, abs=1e-5)
    assert plain_template([prompt], [completion])[0] == pytest.approx(
        direct_score(model, tok, f"{PROMPTS[0]}\n{COMPLETIONS[0]}\n"), abs=1e-5)
    assert abs(with_kwargs([prompt], [completion])[0] - plain_template([prompt], [completion])[0]) > 1e-4


def test_no_special_tokens_are_added(tokenizer):
    from tokenizers import processors

    bos_tokenizer = copy.deepcopy(tokenizer)  # one that prepends <|endoftext|> unless told not to
    bos = bos_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    bos_tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    assert bos_tokenizer("hi")["input_ids"][0] == bos
    model = tiny_reward_model(tokenizer)
    [reward] = reward_callables([model], [bos_tokenizer])
    with_bos = bos_tokenizer("hi!", return_tensors="pt")
    assert reward(["hi"], ["!"])[0] == pytest.approx(direct_score(model, tokenizer, "hi!"), abs=1e-5)
    assert reward(["hi"], ["!"])[0] != pytest.approx(model.eval()(**with_bos).logits[0, 0].item(), abs=1e-3)


def test_the_metric_name_is_the_last_part_of_name_or_path(tokenizer):
    model = tiny_reward_model(tokenizer, name="Skywork/Skywork-Reward-V2-Qwen3-0.6B")
    funcs = reward_callables([model, model], [tokenizer, tokenizer])
    rewards, per_func = compute_rewards(funcs, PROMPTS, COMPLETIONS, {})
    metrics = reward_metrics(rewards, per_func, reward_func_names(funcs))
    assert {"rewards/Skywork-Reward-V2-Qwen3-0.6B/mean", "rewards/Skywork-Reward-V2-Qwen3-0.6B_2/mean"} <= set(metrics)
    torch.testing.assert_close(rewards, per_func.sum(dim=1))
    assert metrics["rewards/Skywork-Reward-V2-Qwen3-0.6B/mean"] == pytest.approx(per_func[:, 0].mean().item())
    assert RewardModel(tiny_reward_model(tokenizer, name=""), tokenizer).__name__ == "GPT2ForSequenceClassification"


def test_the_model_runs_in_eval_mode_without_grad(tokenizer):
    model = tiny_reward_model(tokenizer).train()  # its dropout would make two calls differ
    grad_enabled = []
    model.register_forward_hook(lambda *args: grad_enabled.append(torch.is_grad_enabled()))
    [reward] = reward_callables([model], [tokenizer])
    assert not model.training
    with torch.enable_grad():
        assert reward(PROMPTS, COMPLETIONS) == reward(PROMPTS, COMPLETIONS)
    assert grad_enabled == [False, False]


def test_plain_functions_pass_through_and_their_tokenizer_entries_are_ignored(tokenizer):
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    funcs = reward_callables([length, tiny_reward_model(tokenizer)], [tokenizer, tokenizer])
    assert funcs[0] is length and isinstance(funcs[1], RewardModel)


def test_a_tokenizer_without_pad_token_pads_with_eos_as_in_trl(tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    model = tiny_reward_model(tokenizer)
    model.config.pad_token_id = None
    [reward] = reward_callables([model], [no_pad])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert no_pad.pad_token_id == eos and model.config.pad_token_id == eos
    scores = reward(PROMPTS, COMPLETIONS)
    expected = [direct_score(model, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_a_model_path_loads_with_its_own_tokenizer(tmp_path, tokenizer):
    model = tiny_reward_model(tokenizer)
    folder = tmp_path / "my-rm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    [reward] = reward_callables(str(folder))  # no reward_processing_classes: the tokenizer comes from the path
    assert reward.__name__ == "my-rm"
    expected = [direct_score(model, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(torch.tensor(reward(PROMPTS, COMPLETIONS)), torch.tensor(expected), atol=1e-5,
                               rtol=1e-5)


class WrongShape(torch.nn.Module):
    """A module with a one-label config whose logits have two columns."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig(num_labels=1, name_or_path="x/wrong-shape")
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask):
        return type("Output", (), {"logits": torch.zeros(len(input_ids), 2)})


@pytest.mark.parametrize("make, message", [  # make(tokenizer) -> (reward_funcs, reward_processing_classes)
    (lambda tok: ([], None), "at least one reward function"),
    (lambda tok: ([tiny_reward_model(tok, num_labels=2)], [tok]),
     "GPT2ForSequenceClassification with num_labels=2: a reward model must be a sequence-classification model"),
    (lambda tok: ([tiny_reward_model(tok)], [tok, None]),
     "reward_processing_classes has 2 entries but there are 1 reward functions"),
    (lambda tok: ([tiny_reward_model(tok, name="")], None),
     r"reward_funcs\[0\] is a model without a config._name_or_path"),
    (lambda tok: ([len, 3], None), r"reward_funcs\[1\] is int 3: expected a function"),
    (lambda tok: (["/nonexistent/rm"], None), "reward model '/nonexistent/rm' cannot be loaded"),
])
def test_setup_errors(tokenizer, make, message):
    with pytest.raises(ConfigError, match=message):
        reward_callables(*make(tokenizer))


def test_a_tokenizer_with_neither_pad_nor_eos_is_an_error(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.pad_token, bare.eos_token = None, None
    with pytest.raises(ConfigError, match="neither a pad nor an EOS token"):
        reward_callables([tiny_reward_model(tokenizer)], [bare])


def test_logits_of_the_wrong_shape_are_a_reward_error(tokenizer):
    with pytest.raises(RewardError, match=r"'wrong-shape' returned logits of shape \(\d, 2\); expected \(\d, 1\)"):
        compute_rewards(reward_callables([WrongShape()], [tokenizer]), PROMPTS, COMPLETIONS, {})


def test_recipes_accept_model_paths_and_reward_processing_classes(tmp_path):
    recipe = tmp_path / "r.py"
    recipe.write_text("from grpo.settings import Config\nconfig = Config()\ntrain_dataset = dict\n"
                      "reward_funcs = [len, 'org/some-rm', 'runs/rm']\nreward_processing_classes = [None, 't', None]\n")
    loaded = load_recipe(str(recipe))
    assert loaded.reward_funcs == [len, "org/some-rm", "runs/rm"]
    assert loaded.reward_processing_classes == [None, "t", None]
    recipe.write_text("from grpo.settings import Config\nconfig = Config()\ntrain_dataset = dict\n"
                      "reward_funcs = [len, 'digit_share']\n")  # a function's name: a slip, not a model
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\] is not callable: 'digit_share' \(a function goes in"):
        load_recipe(str(recipe))
