"""Tools called within our decode loop, end to end through `Trainer`: a scripted policy (tests/scripted.py) that
calls `multiply` at the start of every assistant turn, so that what the trainer does with the calls is known
exactly: the tool's turn is fed into the row's own KV cache, kept out of the loss, shown to rewards as TRL's
message lists and counted as TRL counts it."""
import json

import pytest
from datasets import Dataset
from scripted import CALL, UNKNOWN_CALL, chain, scripted_model, scripted_tokenizer

from grpo import Config, Trainer
from grpo.rollout.tools import InlineTool
from grpo.tasks.calculator import calculate

QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def config(tmp_path, **overrides) -> Config:
    settings = dict(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                    num_generations=4, max_prompt_length=1024, max_completion_length=160, learning_rate=1e-2,
                    optim="adamw", beta=0.0, save_steps=1000)
    return Config(**{**settings, **overrides})


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def tokenizer():
    return scripted_tokenizer(CALL, UNKNOWN_CALL)


def calling_model(tokenizer, call: str = CALL):
    """Writes `<tool_call>{call}</tool_call>` then EOS at the start of every assistant turn."""
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return scripted_model(tokenizer, chain(tokenizer, prompt, "<tool_call>", call, "</tool_call>"))


def test_trls_tools_example_runs_with_only_its_imports_changed(tmp_path, tokenizer):
    # TRL's documented shape: tools=[multiply] with max_tool_calling_iterations=2 (GRPOConfig -> Config).
    dataset = Dataset.from_list([{"prompt": QUESTION, "answer": "12"}] * 4)

    def product_seen(completions, answer, **kwargs):
        return [float(any(m["role"] == "tool" and m["content"] == a for m in c)) for c, a in zip(completions, answer)]

    def by_place(completions, **kwargs):  # the scripted completions are alike: this gives the group a signal
        return [i / len(completions) for i in range(len(completions))]

    model = calling_model(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=config(tmp_path, max_tool_calling_iterations=2), processing_class=tokenizer,
                      reward_funcs=[product_seen, by_place], train_dataset=dataset, tools=[multiply])
    trainer.train()
    (line,) = read(tmp_path / "run" / "metrics.jsonl")
    # Two rounds each (the third call is not run: the limit), none failing; every reward saw the tool's "12".
    assert line["tools/call_frequency"] == 2.0 and line["tools/failure_frequency"] == 0.0
    assert line["rewards/product_seen/mean"] == 1.0
    completion = read(tmp_path / "run" / "completions.jsonl")[0]["completion"]
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    assert completion == [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "name": "multiply", "content": "12"},
                          {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "name": "multiply", "content": "12"},
                          {"role": "assistant", "content": f"<tool_call>{CALL}</tool_call>"}]
    assert any((a - b).abs().max() > 0 for a, b in zip(before, trainer.model.parameters()))


def test_the_run_plan_records_the_tools_for_the_checkpoints(tmp_path, tokenizer):
    # grpo.export and grpo.generate read them from a checkpoint's grpo_config.json, the plan's session record
    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = Trainer(config(tmp_path), model=calling_model(tokenizer), tokenizer=tokenizer, reward_funcs=[zero],
                      train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 4), tools=[multiply])
    assert trainer.plan.session.record["tools"] == ["multiply"]


def spy_logprob_gradients(trainer) -> list:
    """The gradient the loss sends each training forward's log-probs [n, C], with the rollout it scored."""
    seen, logprobs = [], trainer.policy.logprobs

    def spied(rollout, **kwargs):
        out = logprobs(rollout, **kwargs)
        lp = out[0] if isinstance(out, tuple) else out
        if lp.requires_grad:
            lp.register_hook(lambda g: seen.append((rollout, g.clone())))
        return out
    trainer.policy.logprobs = spied
    return seen


def test_tool_output_is_never_trained_on(tmp_path, tokenizer):
    # Rewards differ within the group (row i gets i), so every row has an advantage and every own token a gradient.
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 4)
    trainer = Trainer(config(tmp_path, max_tool_calling_iterations=1, beta=0.04, use_lora=True),
                      model=calling_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[lambda completions, **kw: [float(i) for i in range(len(completions))]],
                      train_dataset=dataset, tools=[multiply])
    seen = spy_logprob_gradients(trainer)
    trainer.train()
    (rollout, grad), = seen
    text = trainer.tokenizer.decode(rollout.completion_ids[0][rollout.completion_mask[0].bool()])
    assert text.count("<tool_response>") == 1  # one round, fed into the row
    tool = (rollout.completion_mask == 1) & (rollout.loss_mask == 0)  # [n, C] attended to, not the model's
    assert tool.sum() >= 10 * len(tool)
    assert (grad[tool] == 0).all(), "the loss sends a gradient to tool output"
    own = rollout.loss_mask.bool()
    assert (grad[own] != 0).float().mean() > 0.9


def test_an_unknown_tool_ends_the_row_and_a_raising_tool_answers_with_its_error(tmp_path, tokenizer):
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 4)
    trainer = Trainer(config(tmp_path), model=calling_model(tokenizer, UNKNOWN_CALL), tokenizer=tokenizer,
                      reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], train_dataset=dataset,
                      tools=[multiply])
    trainer.train()
    (line,) = read(tmp_path / "run" / "metrics.jsonl")
    assert line["tools/call_frequency"] == 1.0 and line["tools/failure_frequency"] == 1.0
    assert read(tmp_path / "run" / "completions.jsonl")[0]["completion"] == [
        {"role": "assistant", "content": f"<tool_call>{UNKNOWN_CALL}</tool_call>"}]

    def broken(a: int, b: int) -> int:
        """
        Multiplies two integers, or fails to.

        Args:
            a: The first integer.
            b: The second integer.
        """
        raise ZeroDivisionError("division by zero")
    broken.__name__ = "multiply"
    trainer = Trainer(config(tmp_path / "2", max_tool_calling_iterations=1), model=calling_model(tokenizer),
                      tokenizer=tokenizer, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                      train_dataset=dataset, tools=[broken])
    trainer.train()
    (line,) = read(tmp_path / "2" / "run" / "metrics.jsonl")
    assert line["tools/failure_frequency"] == 1.0
    turns = read(tmp_path / "2" / "run" / "completions.jsonl")[0]["completion"]
    assert turns[1] == {"role": "tool", "name": "multiply", "content": "{'error': 'division by zero'}"}


def test_an_environment_per_completion_serves_its_methods_and_its_reward(tmp_path, tokenizer):
    class Counter:
        def reset(self, **row):
            self.calls, self.answer = [], row["answer"]

        def multiply(self, a: int, b: int) -> int:
            """
            Multiplies two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.calls.append((a, b))
            return a * b

    def used(environments, **kwargs):
        return [float(len(env.calls)) for env in environments]

    dataset = Dataset.from_list([{"prompt": QUESTION, "answer": "12"}] * 4)
    trainer = Trainer(config(tmp_path, max_tool_calling_iterations=2), model=calling_model(tokenizer),
                      tokenizer=tokenizer, reward_funcs=[used], train_dataset=dataset, environment_factory=Counter)
    trainer.train()
    (line,) = read(tmp_path / "run" / "metrics.jsonl")
    assert line["rewards/used/mean"] == 2.0  # each completion's own environment saw its two calls


def test_an_inline_calculator_writes_the_result_into_the_models_own_message(tmp_path):
    tokenizer = scripted_tokenizer("<<", "3*4")
    prompt = "Compute 3*4: "
    model = scripted_model(tokenizer, chain(tokenizer, prompt, "<<", "3*4", "="))
    trainer = Trainer(config(tmp_path), model=model, tokenizer=tokenizer,
                      reward_funcs=[lambda completions, **kw: [float(i) for i in range(len(completions))]],
                      train_dataset=Dataset.from_list([{"prompt": prompt}] * 4),
                      tools=[InlineTool("<<", "=", ">>", calculate)])
    seen = spy_logprob_gradients(trainer)
    trainer.train()
    (rollout, grad), = seen
    assert [r["completion"] for r in read(tmp_path / "run" / "completions.jsonl")] == ["<<3*4=12>>"] * 4
    fed = (rollout.completion_mask == 1) & (rollout.loss_mask == 0)  # [n, C]
    assert tokenizer.decode(rollout.completion_ids[0][fed[0]]) == "12>>"
    assert (grad[fed] == 0).all() and (grad[rollout.loss_mask.bool()] != 0).all()


def test_a_rollout_funcs_env_mask_takes_its_tokens_out_of_the_loss(tmp_path, tokenizer):
    # TRL's contract: env_mask is 1 on the model's tokens, 0 on what an environment wrote.
    def rollout_func(prompts, trainer):
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        completion = tokenizer.encode("The answer is 12.", add_special_tokens=False) + [tokenizer.eos_token_id]
        return {"prompt_ids": ids, "completion_ids": [completion] * len(prompts),
                "env_mask": [[1, 1, 0, 0, 0] + [1] * (len(completion) - 5)] * len(prompts)}

    trainer = Trainer(config(tmp_path), model=calling_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[lambda completions, **kw: [float(i) for i in range(len(completions))]],
                      train_dataset=Dataset.from_list([{"prompt": "What is 3 times 4?"}] * 4),
                      rollout_func=rollout_func)
    seen = spy_logprob_gradients(trainer)
    trainer.train()
    (rollout, grad), = seen
    assert (rollout.loss_mask[:, 2:5] == 0).all() and (grad[:, 2:5] == 0).all()
    assert (grad[rollout.loss_mask.bool()] != 0).all()


def test_a_tool_needs_a_template_that_renders_tools(tmp_path, tokenizer):
    from grpo.errors import ConfigError
    from grpo.tasks.tiny import CHAT_TEMPLATE
    tokenizer.chat_template = CHAT_TEMPLATE  # plain ChatML: no tools, no tool role
    with pytest.raises(ConfigError, match="chat template ignores `tools`"):  # before any step
        Trainer(config(tmp_path), model=calling_model(tokenizer), tokenizer=tokenizer,
                reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 4), tools=[multiply])


def test_a_template_that_renders_past_turns_otherwise_is_refused_at_start_up(tmp_path, tokenizer):
    """The property a tool round relies on (the conversation with its tool turn renders as an extension of what
    the row holds), checked before the first generation, not when a row first calls a tool."""
    from grpo.errors import ConfigError
    from grpo.tasks.calculator import CHATML_TOOLS
    model = calling_model(tokenizer)  # its script starts after the generation prompt's last token
    tokenizer.chat_template = CHATML_TOOLS.replace("{{- '<|im_start|>assistant\\n' }}{%- endif %}",
                                                   "{{- '<|im_start|>assistant\\n\\n' }}{%- endif %}")
    with pytest.raises(ConfigError, match="does not render a conversation's earlier turns as the model wrote them"):
        Trainer(config(tmp_path), model=model, tokenizer=tokenizer,
                reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 4), tools=[multiply])
