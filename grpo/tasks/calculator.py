"""A calculator tool for arithmetic word problems, and a ChatML chat template that renders tools.

- `calculate`: + - * / and parentheses on numbers, evaluated on the expression's syntax tree (never `eval`);
  as a chat tool (`Tools.of(tools=[calculate])`) or inline as GSM8K annotates its solutions
  (`INLINE_CALCULATOR`: `<<12+7=` is completed to `<<12+7=19>>`).
- `CHATML_TOOLS`: SmolLM2-135M-Instruct's ChatML with tools the way Qwen2.5's template renders them
  (docs/tools.md, "Trying it offline, on the shipped model").
"""
from __future__ import annotations

import ast
import math
import operator
import re

from ..rollout.tools import InlineTool
from .gsm8k import completion_text, extract_xml_answer, parse_number

MAX_EXPRESSION = 200  # characters: a GSM8K annotation is far shorter; longer ones are not arithmetic homework
MAX_MAGNITUDE = 1e15  # beyond it a product of products is a number no word problem needs

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. "(12 + 7) * 3".

    Returns:
        The value, e.g. "57"; a whole number is written without a decimal point.
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return number_text(_value(tree.body))


def _value(node) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        value = OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        value = SIGNS[type(node.op)](_value(node.operand))
    else:
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value beyond {MAX_MAGNITUDE:g}")
    return value


def number_text(value: float | int) -> str:
    """`value` as a person writes it: whole numbers without `.0`, others to 12 significant digits."""
    return str(int(value)) if float(value).is_integer() else f"{value:.12g}"


INLINE_CALCULATOR = InlineTool(open="<<", trigger="=", close=">>", fn=calculate)
# The word problems' worked example (grpo/tasks/word_problems.py) with GSM8K's calculator annotations: the model
# writes `<<12+7=`, the calculator writes `19>>`, and the model goes on from the result.
INLINE_EXAMPLE_ANSWER = ("<reasoning>\n12 + 7 = <<12+7=19>>19\n19 - 5 = <<19-5=14>>14\n</reasoning>\n"
                         "<answer>\n14\n</answer>")

RESULT = re.compile(r"<<[^<>=]*=([^<>]*)>>")


def last_result_reward(completions, **kwargs) -> list[float]:
    """1.0 when the number in a completion's <answer> block is the last result the calculator wrote
    (`<<expression=result>>`), else 0.0: the answer is where the worked-out steps end, not an earlier step's
    result. Without a calculator result or an answer it is 0.0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        results, content = RESULT.findall(text), extract_xml_answer(text)
        answer = parse_number(content) if content is not None else None
        last = parse_number(results[-1]) if results else None
        rewards.append(float(answer is not None and last is not None and abs(answer - last) < 1e-6))
    return rewards


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Jinja, as transformers renders chat templates; `tojson` writes `", "` and `": "` separators, as Qwen2.5's does.
CHATML_TOOLS = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system, rest = messages[0].content, messages[1:] %}"
    "{%- else %}"
    "{%- set system, rest = '" + SMOLLM2_SYSTEM + "', messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n' + ({'name': call.name, 'arguments': call.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
