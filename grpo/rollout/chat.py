"""The chat template, used in one place: a prompt as the model sees it (`render`: with the tools' schemas when the
model calls some), the checks a template passes before it is used with tools, and the text a tool call appends
to a row.

The prompt renders the tools' JSON schemas through the chat template (`tools=`). After a call, what the row
is fed is the template's own rendering of the conversation with the tool turn(s) and the next assistant
header, minus the text the row already holds: the KV cache then holds exactly what a prompt of that whole
conversation would, and nothing is prefilled twice.
"""
from __future__ import annotations

from ..errors import ConfigError

PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_7391", "description": "Checks the template.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "A number."}},
                   "required": ["x"]}}}
PROBE_RESULT = "probe result 7391"


def is_chat(prompt) -> bool:
    return isinstance(prompt, list)


def render(tokenizer, prompt, chat_template_kwargs: dict | None = None, schemas: list | None = None) -> str:
    """A prompt as the model sees it: a string unchanged; chat messages through the tokenizer's chat template with
    a generation prompt, the run's `chat_template_kwargs` (e.g. Qwen3's enable_thinking=False, which the template
    reads as variables) and, when the model calls tools in chat turns, the tools' `schemas`; then a template that
    raises is a ConfigError (without tools, its own error)."""
    if isinstance(prompt, str):
        return prompt
    if not is_chat(prompt):
        raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    try:
        return tokenizer.apply_chat_template(prompt, tools=schemas or None, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    except Exception as e:  # jinja2's TemplateError, or a template's raise_exception(...)
        if not schemas:
            raise
        raise ConfigError(f"the chat template cannot render a conversation with tools: {e}") from None


def check_tool_template(tokenizer, chat_template_kwargs: dict | None = None) -> None:
    """A ConfigError, one line, unless the tokenizer's chat template renders the tools' schemas into the prompt
    and renders tool messages (a probe conversation, rendered once)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("tools need a chat template, and the tokenizer has none: set tokenizer.chat_template "
                          "to one that renders `tools` and tool messages (e.g. grpo.tasks.calculator.CHATML_TOOLS "
                          "for a ChatML model; the tokenizer: grpo.load_tokenizer(name))")
    call = {"type": "function", "function": {"name": "probe_tool_7391", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "Call the probe."},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "probe_tool_7391", "content": PROBE_RESULT}]
    text = render(tokenizer, messages, chat_template_kwargs, [PROBE_TOOL])
    if PROBE_TOOL["function"]["description"] not in text:  # only the schema holds it, not the call
        raise ConfigError("the tokenizer's chat template ignores `tools`: the model would never see the tools' "
                          "schemas; set tokenizer.chat_template to one that renders them (e.g. Qwen2.5's, or "
                          "grpo.tasks.calculator.CHATML_TOOLS for a ChatML model such as SmolLM2), on the "
                          "tokenizer passed as processing_class= (grpo.load_tokenizer(name) loads it)")
    if PROBE_RESULT not in text:
        raise ConfigError("the tokenizer's chat template does not render tool messages (role 'tool'); set "
                          "tokenizer.chat_template to one that does (e.g. grpo.tasks.calculator.CHATML_TOOLS)")


def tool_turn_text(tokenizer, conversation: list, assistant_forms: list[dict], tool_messages: list[dict],
                   held: str, schemas: list, chat_template_kwargs: dict | None = None) -> tuple[str, dict]:
    """The text to append to a row that holds `held` (its prompt and everything decoded so far, the EOS
    included) after its assistant message made calls: the tool turn(s) and the next assistant header, as the
    template renders `conversation + [assistant, *tool_messages]`. `assistant_forms`: the ways to pass the
    assistant message, tried in order (its parsed `tool_calls`, then its text verbatim); the first whose
    rendering starts with `held` is returned with the text. A ConfigError when none does: this template does
    not render a conversation's history as it rendered it while the row was written."""
    for assistant in assistant_forms:
        text = render(tokenizer, conversation + [assistant, *tool_messages], chat_template_kwargs, schemas)
        if text.startswith(held):
            return text[len(held):], assistant
    position = next((i for i, (a, b) in enumerate(zip(text, held)) if a != b), min(len(text), len(held)))
    raise ConfigError(f"the chat template renders the conversation with its tool turn otherwise than the row "
                      f"holds it (they part at character {position}: {held[position:position + 40]!r} held, "
                      f"{text[position:position + 40]!r} rendered), so the tool's output cannot be appended to "
                      f"the row; use a template that renders earlier turns as they were written (e.g. no "
                      f"reasoning dropped from past turns), and EOS tokens the template ends its turns with")
