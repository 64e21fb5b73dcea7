"""TRL 1.16's environments beyond one class with tools, ported by changing the import lines: each test is the body
of the TRL GRPOTrainer test of its name, on tiny offline models. Where TRL patches `model.generate` with fixed
completions, a scripted policy (tests/scripted.py) writes the same tool call on cue, since completions here come
from our own decode loop; as its completions within a group are alike, a reward by place gives the group the
signal TRL's varied completions give."""
import json

import pytest
import torch
from datasets import Dataset
from scripted import chain, scripted_model, scripted_tokenizer
from tiny_setup import tiny_model, tiny_tokenizer

from grpo import Config as GRPOConfig  # was: from trl import GRPOConfig, GRPOTrainer
from grpo import Trainer as GRPOTrainer

INCREMENT = '{"name": "increment", "arguments": {"step": 1}}'
QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]


def calling(call: str = INCREMENT):
    """A tokenizer and a policy that writes `<tool_call>{call}</tool_call>` then EOS at the start of every assistant
    turn (tests/scripted.py), whatever the prompt."""
    tokenizer = scripted_tokenizer(call)
    header = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return scripted_model(tokenizer, chain(tokenizer, header, "<tool_call>", call, "</tool_call>")), tokenizer


def by_place(completions, **kwargs):
    return [i / len(completions) for i in range(len(completions))]


def trl_args(tmp_path, **settings) -> GRPOConfig:
    """TRL's GRPOConfig keywords for these tests; one tool round (TRL's fixed completions call once), prompts whole
    (the tools' schemas take many of the scripted tokenizer's tokens) and bf16 off (float32 on the CPU)."""
    return GRPOConfig(**{"output_dir": str(tmp_path / "run"), "report_to": "none", "bf16": False,
                         "max_tool_calling_iterations": 1, "max_prompt_length": None, "max_completion_length": 64,
                         **settings})


def changed(before: dict, model, every: bool = True) -> bool:
    """Whether every parameter moved (TRL's check), or some (`every=False`: the scripted policy's layers write
    nothing, so most of its weights get no gradient)."""
    moved = [not torch.equal(p, model.get_parameter(n)) for n, p in before.items()]
    return all(moved) if every else any(moved)


def test_train_with_multiple_environments(tmp_path):
    # With a dict, each row picks its environment by its `environment` column (here its only column: reset() writes
    # the prompt), and only that environment's tools are its tools: a counter row's call of `increment` runs on its
    # own CounterEnvironment, an echo row's is an unknown tool (EchoEnvironment has `shout` only).
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 2})

    reset_kwargs_seen = {"counter": [], "echo": []}

    class CounterEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen["counter"].append(kwargs)
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.incremented = step  # a tool runs in a worker process: its environment's state comes back
            return step

    class EchoEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen["echo"].append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            self.shouted = text
            return text.upper()

    environments_seen = []

    def calls_made(environments, **kwargs):
        environments_seen.extend(environments)
        return by_place(environments)

    training_args = trl_args(tmp_path, learning_rate=0.1, per_device_train_batch_size=4, num_generations=2,
                             shuffle_dataset=False, max_steps=1)
    model, tokenizer = calling()
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=calls_made,
        args=training_args,
        train_dataset=dataset,
        environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment},
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    # The batch is [counter, counter, echo, echo]: the counter rows' calls ran, the echo rows' were unknown.
    assert [type(env).__name__ for env in environments_seen] == ["CounterEnvironment"] * 2 + ["EchoEnvironment"] * 2
    assert [getattr(env, "incremented", None) for env in environments_seen] == [1, 1, None, None]
    assert not any(hasattr(env, "shouted") for env in environments_seen)
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(1.0)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(2 / 4)
    # Both environments were reset, `environment` (a control field) not passed, and their text is the prompt.
    assert reset_kwargs_seen["counter"] and reset_kwargs_seen["echo"]
    assert all("environment" not in kwargs for kwargs in reset_kwargs_seen["counter"] + reset_kwargs_seen["echo"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["prompt"][-1]["content"] for r in rows] == ["Count.", "Count.", "Echo.", "Echo."]
    assert changed(previous_trainable_params, trainer.model, every=False)


def test_train_with_unknown_environment_raises(tmp_path):
    # An example whose `environment` names none of the dict's environments fails with a clear error.
    dataset = Dataset.from_list([{"prompt": QUESTION, "environment": "unknown"}] * 3)

    class CounterEnvironment:
        def reset(self, **kwargs): ...

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            return step

    training_args = trl_args(tmp_path, per_device_train_batch_size=3, num_generations=3)
    model, tokenizer = calling()
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=by_place,
        args=training_args,
        train_dataset=dataset,
        environment_factory={"counter": CounterEnvironment},
    )

    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def test_multiple_environments_without_dataset_raises(tmp_path):
    # A dict needs a `train_dataset` whose `environment` column routes each example.
    class EnvA:
        def reset(self, **kwargs): ...

    class EnvB:
        def reset(self, **kwargs): ...

    tokenizer = tiny_tokenizer()
    training_args = trl_args(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(
            model=tiny_model(tokenizer),
            processing_class=tokenizer,
            reward_funcs=by_place,
            args=training_args,
            environment_factory={"a": EnvA, "b": EnvB},
        )


def test_environment_owned_data_requires_max_steps(tmp_path):
    class DummyEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    tokenizer = tiny_tokenizer()
    training_args = trl_args(tmp_path)  # max_steps unset
    with pytest.raises(ValueError, match="max_steps"):
        GRPOTrainer(
            model=tiny_model(tokenizer),
            processing_class=tokenizer,
            reward_funcs=by_place,
            args=training_args,
            environment_factory=DummyEnvironment,
        )


def test_train_with_environment_owned_data(tmp_path):
    # The environment owns the data: no `train_dataset`, `reset()` returns the prompt, `max_steps` sets the length.
    class GuessTheWordEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."  # the env owns the data and returns the prompt

    prompts_seen = []

    def reward_len(prompts, completions, **kwargs):
        prompts_seen.extend(prompts)
        return [float(len(completion[-1]["content"])) for completion in completions]

    training_args = trl_args(tmp_path, learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                             max_steps=2, max_completion_length=8)
    tokenizer = tiny_tokenizer()
    trainer = GRPOTrainer(
        model=tiny_model(tokenizer),
        processing_class=tokenizer,
        reward_funcs=[reward_len, by_place],
        args=training_args,
        environment_factory=GuessTheWordEnvironment,
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.global_step == 2
    # The rewards see the prompt the environment wrote, as the model did.
    assert prompts_seen == [[{"role": "user", "content": "Guess the 5-letter word."}]] * 6
    assert changed(previous_trainable_params, trainer.model)


class DummyEnvironment:
    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter

    def get_reward(self) -> float:
        return float(self._counter)


def test_train_with_environment_owned_reward(tmp_path):
    # The environment owns the reward (`get_reward`), and no `reward_funcs` is passed; nor a dataset.
    training_args = trl_args(tmp_path, learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                             max_steps=1)
    model, tokenizer = calling()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=training_args,
                          environment_factory=DummyEnvironment)

    # The only reward source, logged under the class name, weight 1; `get_reward` and `reset` are not tools.
    assert trainer.reward_func_names == ["DummyEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0]
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "increment" in tool_names
    assert "get_reward" not in tool_names
    assert "reset" not in tool_names

    trainer.train()
    # Every completion called `increment` once on its own environment: each counter is 1.
    assert trainer.state.log_history[-1]["rewards/DummyEnvironment/mean"] == pytest.approx(1.0)


def test_environment_owned_reward_coexists_with_reward_funcs(tmp_path):
    class GuessEnvironment:
        def reset(self, **kwargs):
            self._solved = False

        def guess(self, word: str) -> str:
            """
            Submit a guess.

            Args:
                word: The guessed word.

            Returns:
                Feedback about the guess.
            """
            return "nope"

        def get_reward(self) -> float:
            return 1.0 if self._solved else 0.0

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    training_args = trl_args(tmp_path, per_device_train_batch_size=3, num_generations=3, max_steps=5,
                             reward_weights=[0.5])  # weight only applies to the trainer-owned reward func
    model, tokenizer = calling()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=format_reward, args=training_args,
                          environment_factory=GuessEnvironment)

    # Appended after the trainer-owned reward func, under the class name, with a fixed weight of 1.
    assert trainer.reward_func_names == ["format_reward", "GuessEnvironment"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "guess" in tool_names
    assert "get_reward" not in tool_names


def test_environment_owned_reward_mixed_environments(tmp_path):
    # Each class that defines `get_reward` is one reward column, scoring only its own rollouts; two names of one
    # class share the column.
    class ScoredEnvironment:  # owns its reward
        def reset(self, **kwargs): ...

        def act(self, x: int) -> int:
            """
            Act.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

        def get_reward(self) -> float:
            return 1.0

    class PlainEnvironment:  # no `get_reward`; scored by `reward_funcs`
        def reset(self, **kwargs): ...

        def play(self, x: int) -> int:
            """
            Play.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    dataset = Dataset.from_dict({"environment": ["scored", "scored2", "plain"]})
    training_args = trl_args(tmp_path, per_device_train_batch_size=3, num_generations=3, max_steps=1,
                             shuffle_dataset=False)  # the first step draws the "scored" row
    model, tokenizer = calling()
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=format_reward,
        args=training_args,
        train_dataset=dataset,
        environment_factory={"scored": ScoredEnvironment, "scored2": ScoredEnvironment, "plain": PlainEnvironment},
    )

    assert trainer.reward_func_names == ["format_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    env_reward_func = trainer.reward_funcs[-1]
    rewards = env_reward_func(environments=[ScoredEnvironment(), PlainEnvironment()])
    assert rewards == [1.0, None]
    # And in a run: the scored rows score 1, the plain one is unscored (its mean is over the scored rows alone).
    trainer.train()
    assert trainer.state.log_history[-1]["rewards/ScoredEnvironment/mean"] == 1.0


def test_no_reward_source_raises(tmp_path):
    # `reward_funcs` is optional, but a reward must come from somewhere: `reward_funcs` or an environment's own.
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, args=trl_args(tmp_path),
                    train_dataset=Dataset.from_list([{"prompt": "Write 3 digits:"}] * 3))


def test_dataset_required_without_environment(tmp_path):
    # The data comes from a `train_dataset` or from an environment that owns it.
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=by_place,
                    args=trl_args(tmp_path))
