"""Tool calling inside the decode (rollout/tools.py, chat.py, tool_loop.py): schemas, Hermes parsing,
running calls (errors, timeouts, async), environments, inline tools, and `ToolLoop` driven by scripted tokens
one per step, as the decode loop will drive it. A tokenizer trained in code on a few lines, with the ChatML
tools template of tasks/calculator.py."""
import asyncio
import functools
import os
import threading
import time

import pytest
from tiny_setup import loop_metrics

from grpo.errors import ConfigError
from grpo.rollout.engines.tool_loop import ToolLoop
from grpo.rollout.engines.chat import check_tool_template, render
from grpo.rollout.engines.sampling import PromptEncoder
from grpo.rollout.engines.tool_runner import ToolRunner
from grpo.rollout.environments import make_envs
from grpo.rollout.tools import InlineTool, MalformedCall, ToolCall, Tools, parse_hermes, strip_hermes
from grpo.tasks.calculator import CHATML_TOOLS, calculate
from grpo.tasks.tiny import CHAT_TEMPLATE, train_tokenizer

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
COMPACT_CALL = '<tool_call>{"name":"multiply","arguments":{"a":3,"b":4}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]
# What the row is fed after CALL<|im_end|>: the template ends the assistant turn with "\n" after the EOS the row
# sampled, then a user turn holding the tool's response, then the next assistant header.
TOOL_TURN_12 = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divides one number by another.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


async def async_add(a: int, b: int) -> int:
    """Adds two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.2)
    return a + b


def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


@pytest.fixture(scope="module")
def tok():
    texts = [CALL, COMPACT_CALL, "The answer is 12.", "<<12+7=19>> apples", "What is 3 times 4?"] * 5
    tokenizer = train_tokenizer(texts, vocab_size=300)
    tokenizer.chat_template = CHATML_TOOLS
    return tokenizer


def drive(loop, tok, scripts, max_tokens=400):
    """Decode as the decode loop will: each step, every live row takes the next token of its script (its own
    token) and the loop is told; fed tokens go into the row with mask 0, and the row goes on with its next
    scripted turn. A row ends at EOS, when told None, or when its script runs out.
    `scripts[r]`: row r's turns, each a text the model writes (with <|im_end|> where it samples EOS).
    Returns each row's (ids, mask) and everything `after_tokens` answered."""
    rows = [{"turns": [tok.encode(t, add_special_tokens=False) for t in turns], "ids": [], "mask": []}
            for turns in scripts]
    for row in rows:
        row["queue"] = row["turns"].pop(0)
    answers, live = [], list(range(len(rows)))
    while live:
        tokens = [rows[r]["queue"].pop(0) for r in live]
        for r, t in zip(live, tokens):
            rows[r]["ids"].append(t)
            rows[r]["mask"].append(1)
        answer = loop.after_tokens(live, tokens, [max_tokens - len(rows[r]["ids"]) for r in live])
        answers.append(answer)
        still = []
        for r, t in zip(live, tokens):
            row = rows[r]
            if r in answer:
                if answer[r] is None:
                    continue
                row["ids"] += answer[r]
                row["mask"] += [0] * len(answer[r])
                if row["queue"] or not row["turns"]:
                    continue  # the script wrote past the trigger, or has no next turn: done
                row["queue"] = row["turns"].pop(0)
            elif t == tok.eos_token_id or not row["queue"]:
                continue
            still.append(r)
        live = still
    return [(row["ids"], row["mask"]) for row in rows], answers


def fed(answers, row):
    return [a[row] for a in answers if row in a]


# --- schemas, templates, parsing ------------------------------------------------------------------------------


def test_a_typed_docstringed_function_becomes_a_json_schema():
    assert Tools.of(tools=[multiply]).schemas == [{"type": "function", "function": {
        "name": "multiply", "description": "Multiplies two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {"type": "integer", "description": "The second integer."}}, "required": ["a", "b"]},
        "return": {"type": "integer"}}}]


def test_a_tool_without_hints_or_docstring_a_clash_or_no_tool_is_a_config_error():
    def bare(a):
        return a
    with pytest.raises(ConfigError, match="'bare' cannot be described"):
        Tools.of(tools=[bare])
    with pytest.raises(ConfigError, match="two tools are named multiply"):
        Tools.of(tools=[multiply, multiply])
    with pytest.raises(ConfigError, match="no tools"):
        Tools.of()
    with pytest.raises(ConfigError, match="parser 'json' is not known"):
        Tools.of(tools=[multiply], parser="json")


def test_the_prompt_holds_the_schemas_and_a_template_without_tools_is_refused(tok):
    text = render(tok, QUESTION, schemas=Tools.of(tools=[multiply]).schemas)
    assert '<tools>\n{"type": "function", "function": {"name": "multiply"' in text
    assert text.endswith("<|im_start|>user\nWhat is 3 times 4?<|im_end|>\n<|im_start|>assistant\n")
    check_tool_template(tok)
    plain = train_tokenizer(["x"], vocab_size=270)
    plain.chat_template = CHAT_TEMPLATE  # ChatML that never renders `tools`
    with pytest.raises(ConfigError, match="ignores `tools`"):
        check_tool_template(plain)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="the tokenizer has none"):
        check_tool_template(plain)
    plain.chat_template = CHATML_TOOLS.replace("{%- if message.role == 'tool' %}",
                                               "{%- if message.role == 'tool' %}{{ raise_exception('no tools') }}")
    with pytest.raises(ConfigError, match="cannot render a conversation with tools: no tools"):
        check_tool_template(plain)
    plain.chat_template = CHATML_TOOLS.replace("message.content + '\\n</tool_response>'", "'\\n</tool_response>'")
    with pytest.raises(ConfigError, match="does not render tool messages"):
        check_tool_template(plain)


# The generation prompt opens an empty reasoning block that past assistant turns are rendered without (Qwen3's
# enable_thinking=False): a row's text is no prefix of the conversation with its tool turn.
THINKING_TOOLS = CHATML_TOOLS.replace("{{- '<|im_start|>assistant\\n' }}{%- endif %}",
                                      "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


def test_a_template_that_renders_past_turns_otherwise_is_refused_before_any_decode(tok):
    assert THINKING_TOOLS != CHATML_TOOLS
    thinking = train_tokenizer(["x"], vocab_size=270)
    thinking.chat_template = THINKING_TOOLS
    thinking.name_or_path = "org/thinking-model"
    with pytest.raises(ConfigError, match=r"chat template of the tokenizer 'org/thinking-model' does not render a "
                                          r"conversation's earlier turns as the model wrote them.*part at character"):
        check_tool_template(thinking)
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    check_tool_template(tok, eos_ids=[pad, im_end])  # the template ends its turns with one of the model's EOS
    with pytest.raises(ConfigError, match="ends its turns with one of the model's EOS tokens"):
        check_tool_template(tok, eos_ids=[pad])


def test_hermes_calls_one_two_malformed():
    assert parse_hermes("Let me see.\n" + CALL) == [ToolCall("multiply", {"a": 3, "b": 4})]
    two = CALL + "\n" + '<tool_call>\n{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    assert parse_hermes(two) == [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("divide", {"a": 1, "b": 2})]
    assert parse_hermes("No call here.") == []
    assert strip_hermes("Let me see.\n" + CALL) == "Let me see."
    for bad in ['<tool_call>{"name": "multiply", "arguments": {"a": 3</tool_call>',  # not JSON
                '<tool_call>["multiply"]</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "multiply", "arguments": 3}</tool_call>',
                '<tool_call>{"name": "multiply", "arguments": {}}']:  # never closed
        with pytest.raises(MalformedCall):
            parse_hermes(bad)


# --- running calls --------------------------------------------------------------------------------------------


def run_calls(groups, timeout_s):
    return ToolRunner(timeout_s).run(groups)


def test_a_raising_tool_returns_trls_error_text_and_fails():
    [[ok, error]] = run_calls([[functools.partial(divide, 1, 4), functools.partial(divide, 1, 0)]], timeout_s=5)
    assert (ok.text, ok.failed) == ("0.25", False)
    assert (error.text, error.failed) == ("{'error': 'division by zero'}", True)  # str({"error": str(e)})
    [[wrong]] = run_calls([[functools.partial(multiply, a=3, c=4)]], timeout_s=5)
    assert wrong.failed and "unexpected keyword argument 'c'" in wrong.text


def test_the_rows_calls_run_at_once_each_with_a_timeout():
    start = time.perf_counter()
    outcomes = run_calls([[functools.partial(async_add, 1, 2)], [functools.partial(async_add, 3, 4)],
                          [functools.partial(nap, 0.2)], [functools.partial(nap, 0.2)], [functools.partial(nap, 30)]],
                         timeout_s=0.5)
    took = time.perf_counter() - start
    assert [[o.text for o in g] for g in outcomes[:4]] == [["3"], ["7"], ["awake"], ["awake"]]
    assert outcomes[4][0].failed and outcomes[4][0].text == "{'error': 'timed out after 0.5 s'}"
    assert took < 2.0, f"{took:.2f} s: the calls did not run at once (one after another: 30.8 s)"


def test_a_rows_calls_run_in_the_order_written(tmp_path):
    written = tmp_path / "written"  # each call runs in a process of its own: what they share is on disk

    def log(word: str, wait: float) -> int:
        time.sleep(wait)
        with open(written, "a") as f:
            f.write(word + "\n")
        return len(written.read_text().split())

    outcomes = run_calls([[functools.partial(log, "first", 0.2), functools.partial(log, "second", 0.0)]], 5)
    assert written.read_text().split() == ["first", "second"] and [o.text for o in outcomes[0]] == ["1", "2"]


def spin(seconds: float) -> str:
    """Busy-loops (a code-execution tool stuck in `while True`) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


@pytest.mark.parametrize("kind", ["pool", "closure"])
def test_a_call_that_times_out_is_killed_and_its_cpu_freed(kind):
    runner = ToolRunner(timeout_s=0.3)
    thunk = functools.partial(spin, 60) if kind == "pool" else (lambda: spin(60))
    before = children(os.getpid())
    [[outcome]] = runner.run([[thunk]])
    assert outcome.failed and outcome.text == "{'error': 'timed out after 0.3 s'}"
    assert outcome.why == "timed out after 0.3 s"
    assert not runner.workers and not runner.idle, "the worker that ran it is gone"
    assert not [c for c in children(os.getpid()) - before if is_alive(c)], "nothing it started runs on"
    [[again]] = runner.run([[functools.partial(multiply, 6, 7)]])  # a new worker for the next call
    assert again.text == "42" and len(runner.workers) == 1


def children(pid: int) -> set[int]:
    found = set()
    for task in os.scandir(f"/proc/{pid}/task"):
        with open(f"{task.path}/children") as f:
            found |= {int(c) for c in f.read().split()}
    return found


def is_alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_workers_are_made_once_and_serve_every_step():
    runner = ToolRunner(timeout_s=5)
    for _ in range(3):
        runner.run([[functools.partial(multiply, i, 2)] for i in range(4)])
    assert len(runner.workers) <= 4 and len(runner.idle) == len(runner.workers)
    first = list(runner.workers)
    runner.run([[functools.partial(multiply, 1, 2)]])
    assert set(runner.workers) == set(first), "no worker made anew for a later step"


def test_an_async_tool_keeps_its_timeout():
    async def stuck() -> str:
        await asyncio.sleep(60)
        return "never"
    start = time.perf_counter()
    [[outcome]] = ToolRunner(timeout_s=0.3).run([[stuck]])
    assert outcome.failed and "timed out" in outcome.text and time.perf_counter() - start < 5


class Tally:
    """A stateful environment: its calls count."""

    def __init__(self):
        self.seen = []

    def add(self, x: int) -> int:
        """Adds one.

        Args:
            x: The number.
        """
        self.seen.append(x)
        return len(self.seen)


@pytest.mark.parametrize("where", ["worker", "forked for the call"])
def test_an_environment_method_runs_in_another_process_and_its_state_comes_back(where):
    class Local(Tally):  # a class defined in a function does not pickle: a process is forked for each call
        pass
    env, runner = (Tally() if where == "worker" else Local()), ToolRunner(timeout_s=5)
    outcomes = runner.run([[functools.partial(env.add, 1), functools.partial(env.add, 2)]])
    assert [o.text for o in outcomes[0]] == ["1", "2"] and env.seen == [1, 2]
    assert len(runner.workers) == (1 if where == "worker" else 0)


class Locked(Tally):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def test_an_environment_whose_state_cannot_be_pickled_runs_in_the_trainers_process(capsys):
    env = Locked()
    [[outcome]] = ToolRunner(timeout_s=5).run([[functools.partial(env.add, 1)]])
    assert outcome.text == "1" and env.seen == [1]
    assert "warning: the state of Locked cannot be pickled" in capsys.readouterr().err


# --- the loop, chat tools -------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [CALL, COMPACT_CALL], ids=["as-the-template-writes-it", "compact"])
def test_a_call_at_eos_feeds_the_tool_turn_and_the_next_header(tok, call):
    loop = ToolLoop(Tools.of(tools=[multiply]), tok, [QUESTION, QUESTION], max_iterations=3)
    rows, answers = drive(loop, tok, [[call + "<|im_end|>", "The answer is 12.<|im_end|>"],
                                      ["The answer is 12.<|im_end|>"]])
    (forced,) = fed(answers, 0)
    assert tok.decode(forced) == TOOL_TURN_12
    assert fed(answers, 1) == []
    ids, mask = rows[0]
    assert tok.decode(ids) == call + "<|im_end|>" + TOOL_TURN_12 + "The answer is 12.<|im_end|>"
    assert loop.completion_messages(0, ids, mask) == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "The answer is 12."}]
    assert loop.completion_messages(1, *rows[1]) == [{"role": "assistant", "content": "The answer is 12."}]
    assert loop_metrics(loop) == {"tools/call_frequency": 0.5, "tools/failure_frequency": 0.0}  # 1 call, 2 rows


def test_the_fed_text_continues_the_prompt_as_one_rendering_of_the_whole_conversation(tok):
    """Prompt + what the row holds after two rounds is the template's rendering of the conversation: the KV
    cache holds what a prompt of the whole conversation would."""
    tools = Tools.of(tools=[multiply])
    loop = ToolLoop(tools, tok, [QUESTION], max_iterations=None)
    rows, _ = drive(loop, tok, [[CALL + "<|im_end|>", "Again.\n" + CALL + "<|im_end|>", "12.<|im_end|>"]])
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    conversation = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "name": "multiply", "content": "12"},
                               {"role": "assistant", "content": "Again.", "tool_calls": [call]},
                               {"role": "tool", "name": "multiply", "content": "12"},
                               {"role": "assistant", "content": "12."}]
    whole = tok.apply_chat_template(conversation, tools=tools.schemas, tokenize=False)
    assert render(tok, QUESTION, schemas=tools.schemas) + tok.decode(rows[0][0]) + "\n" == whole
    assert loop_metrics(loop)["tools/call_frequency"] == 2.0


def test_errors_are_read_by_the_model_unknown_and_malformed_calls_end_the_row(tok):
    bad = '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "power", "arguments": {"a": 2, "b": 9}}\n</tool_call>'
    loop = ToolLoop(Tools.of(tools=[multiply, divide]), tok, [QUESTION] * 3)
    _, answers = drive(loop, tok, [[bad + "<|im_end|>", "Oops.<|im_end|>"], [unknown + "<|im_end|>", "x"],
                                   ['<tool_call>{"name": "multiply"<|im_end|>', "x"]])
    (forced,) = fed(answers, 0)
    assert "<tool_response>\n{'error': 'division by zero'}\n</tool_response>" in tok.decode(forced)
    assert fed(answers, 1) == [None] and fed(answers, 2) == [None]
    assert loop_metrics(loop) == {"tools/call_frequency": 1.0, "tools/failure_frequency": 1.0}  # 3 calls, 3 failed


def test_async_tools_of_rows_that_call_in_one_step_run_at_once(tok):
    tools = Tools.of(tools=[async_add])
    tools.runner.run([[functools.partial(multiply, 1, 1)]] * 3)  # its workers, made once per run, are made
    loop = ToolLoop(tools, tok, [QUESTION] * 3)
    call = '<tool_call>\n{"name": "async_add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    start = time.perf_counter()
    _, answers = drive(loop, tok, [[call, "7.<|im_end|>"]] * 3)  # the rows reach EOS on the same step
    took = time.perf_counter() - start
    assert all("<tool_response>\n7\n" in tok.decode(fed(answers, r)[0]) for r in range(3))
    assert took < 0.5, f"{took:.2f} s: the rows' calls (0.2 s each) did not overlap"


def test_output_longer_than_the_room_left_ends_the_row(tok):
    loop = ToolLoop(Tools.of(tools=[multiply]), tok, [QUESTION])
    ids = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    for token in ids[:-1]:
        assert loop.after_tokens([0], [token], [100]) == {}
    assert loop.after_tokens([0], [ids[-1]], [len(tok.encode(TOOL_TURN_12)) - 1]) == {0: None}


def test_max_iterations_is_respected(tok):
    loop = ToolLoop(Tools.of(tools=[multiply]), tok, [QUESTION], max_iterations=1)
    rows, answers = drive(loop, tok, [[CALL + "<|im_end|>", CALL + "<|im_end|>", "never"]])
    assert len(fed(answers, 0)) == 1  # the second call is not run: its EOS ends the row
    assert tok.decode(rows[0][0]).endswith("</tool_call><|im_end|>")
    assert loop.completion_messages(0, *rows[0])[-1]["content"] == CALL


def test_a_template_that_renders_the_history_otherwise_is_a_clear_error(tok):
    loop = ToolLoop(Tools.of(tools=[multiply]), tok, [QUESTION], eos_ids=[tok.eos_token_id, tok.pad_token_id])
    with pytest.raises(ConfigError, match="renders the conversation with its tool turn otherwise than the row"):
        drive(loop, tok, [[CALL + "<|pad|>", "x"]])  # the template ends its turns with <|im_end|>, not <|pad|>


# --- environments ----------------------------------------------------------------------------------------------


class Counter:
    """A stateful environment: the model adds to a running total."""

    def reset(self, prompt, start: int, **columns) -> str:
        self.total = start
        return f" Start from {start}."

    def add(self, n: int) -> int:
        """Adds to the running total.

        Args:
            n: The number to add.
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return float(self.total == 10)

    def _helper(self):
        return None


def test_an_environment_per_completion_its_methods_its_reward(tok):
    tools = Tools.of(environment_factory=Counter)
    assert [s["function"]["name"] for s in tools.schemas] == ["add"]
    assert tools.schemas[0]["function"]["parameters"]["properties"] == {
        "n": {"type": "integer", "description": "The number to add."}}
    envs, prompts = make_envs(tools, [{"prompt": QUESTION, "start": 3}, {"prompt": QUESTION, "start": 8}])
    assert prompts[1] == [{"role": "user", "content": "What is 3 times 4? Start from 8."}]
    assert QUESTION[0]["content"] == "What is 3 times 4?"  # the dataset's row is left as it was
    loop = ToolLoop(tools, tok, prompts, envs=envs)
    add = '<tool_call>\n{"name": "add", "arguments": {"n": 2}}\n</tool_call><|im_end|>'
    _, answers = drive(loop, tok, [[add, "Done.<|im_end|>"], [add, "Done.<|im_end|>"]])
    assert "<tool_response>\n5\n" in tok.decode(fed(answers, 0)[0])
    assert "<tool_response>\n10\n" in tok.decode(fed(answers, 1)[0])
    (reward,) = tools.rewards()  # its get_reward, TRL's reward named after the class
    assert reward.__name__ == "Counter" and reward(environments=envs) == [0.0, 1.0]
    with pytest.raises(ValueError, match="pass envs="):
        ToolLoop(tools, tok, prompts)


class Echo:
    """A second environment, without a reward of its own."""

    def reset(self, prompt, **columns) -> None:
        self.said = []

    def shout(self, text: str) -> str:
        """Shouts the text.

        Args:
            text: What to shout.
        """
        return text.upper()


def test_a_dict_of_environments_gives_each_row_its_own_class_tools_and_reward(tok):
    tools = Tools.of(environment_factory={"counter": Counter, "echo": Echo, "again": Counter})
    rows = [{"prompt": QUESTION, "start": 3, "environment": "counter"}, {"prompt": QUESTION, "environment": "echo"}]
    envs, prompts = make_envs(tools, rows)
    assert [type(env) for env in envs] == [Counter, Echo]  # `environment` is not passed to reset, which takes none
    encode = PromptEncoder(tok, None, tools=tools)
    ids, mask = encode(prompts, envs=envs)
    counter_text, echo_text = (tok.decode(row[m.bool()]) for row, m in zip(ids, mask))
    assert '"add"' in counter_text and '"shout"' not in counter_text  # each prompt shows its own tools only
    assert '"shout"' in echo_text and '"add"' not in echo_text
    assert tools.resolve("add", envs[0]) is not None and tools.resolve("add", envs[1]) is None
    assert [t.__name__ for t in tools] == ["add", "shout"]  # TRL's trainer.tools
    (reward,) = tools.rewards()  # one per class that owns its reward, however many names map to it
    envs[0].total = 10
    assert reward.__name__ == "Counter" and reward(environments=envs) == [1.0, None]
    with pytest.raises(ValueError, match="not among the environments of environment_factory"):
        make_envs(tools, [{"prompt": QUESTION, "environment": "nope"}])
    with pytest.raises(ConfigError, match=r"environment_factory\['echo'\] must be a class"):
        Tools.of(environment_factory={"echo": lambda: Echo()})


# --- inline tools ----------------------------------------------------------------------------------------------


def test_inline_span_detection():
    tool = InlineTool("<<", "=", ">>", calculate)
    assert tool.expression("She has <<12+7=") == "12+7"
    assert tool.expression("She has <<12+7=19>> and 3=") is None  # the span was closed
    assert tool.expression("So x = ") is None and tool.expression("So x =") is None
    assert tool.expression("<<12+7=19>> then <<19*2=", since=11) == "19*2"
    assert tool.expression("<<12+7=", since=11) is None  # opened before the last forced result ended


def test_an_inline_trigger_forces_the_result_and_the_close(tok):
    loop = ToolLoop(Tools.of(inline=[InlineTool("<<", "=", ">>", calculate)]), tok, ["Q: 12 and 7 more. A:"])
    rows, answers = drive(loop, tok, [[" <<12+7=", " apples, then <<19*2=", " in all.<|im_end|>"]])
    assert [tok.decode(f) for f in fed(answers, 0)] == ["19>>", "38>>"]
    ids, mask = rows[0]
    assert tok.decode(ids) == " <<12+7=19>> apples, then <<19*2=38>> in all.<|im_end|>"
    assert loop.completion_messages(0, ids, mask) == [
        {"role": "assistant", "content": " <<12+7=19>> apples, then <<19*2=38>> in all."}]
    assert loop_metrics(loop) == {"tools/call_frequency": 2.0, "tools/failure_frequency": 0.0}


def test_a_made_tools_carries_its_environments_and_refuses_another_beside_it():
    # One carrier for the environments: training's source and evaluation read them from the run's Tools.
    made = Tools.of(tools=[multiply])
    assert Tools.of(made) is made
    with pytest.raises(ConfigError, match="inside the Tools"):
        Tools.of(made, environment_factory=lambda: None)
