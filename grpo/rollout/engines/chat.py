"""The chat template, used in one place: a prompt as the model sees it (`render`), the checks a template passes
before it is used with tools, and the text a tool call appends to a row (`tool_turn_text`)."""
from __future__ import annotations

import functools

from ...errors import ConfigError

PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_7391", "description": "Checks the template.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "A number."}},
                   "required": ["x"]}}}
PROBE_RESULT = "probe result 7391"
PROBE_PROMPT = [{"role": "user", "content": "Call the probe."}]
PROBE_CALL = {"type": "function", "function": {"name": "probe_tool_7391", "arguments": {"x": 1}}}
PROBE_MESSAGE = '<tool_call>\n{"name": "probe_tool_7391", "arguments": {"x": 1}}\n</tool_call>'  # as a model writes it
PROBE_TURN = {"role": "tool", "name": "probe_tool_7391", "content": PROBE_RESULT}


def is_chat(prompt) -> bool:
    return isinstance(prompt, list)


def render(tokenizer, prompt, chat_template_kwargs: dict | None = None, schemas: list | None = None) -> str:
    """A prompt as the model sees it: a string unchanged; chat messages through the tokenizer's chat template with
    a generation prompt, the run's `chat_template_kwargs` and the tools' `schemas` (then a template that raises is a
    ConfigError)."""
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


def check_tool_template(tokenizer, chat_template_kwargs: dict | None = None, eos_ids: list[int] | None = None) -> None:
    """A ConfigError, one line, unless the tokenizer's chat template renders the tools' schemas into the prompt,
    tool messages, and a conversation's earlier turns as a row holds them (`check_tool_history`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("tools need a chat template, and the tokenizer has none: set tokenizer.chat_template "
                          "to one that renders `tools` and tool messages (e.g. grpo.tasks.calculator.CHATML_TOOLS "
                          "for a ChatML model; the tokenizer: grpo.load_tokenizer(name))")
    messages = [*PROBE_PROMPT, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}, PROBE_TURN]
    text = render(tokenizer, messages, chat_template_kwargs, [PROBE_TOOL])
    if PROBE_TOOL["function"]["description"] not in text:  # only the schema holds it, not the call
        raise ConfigError("the tokenizer's chat template ignores `tools`: the model would never see the tools' "
                          "schemas; set tokenizer.chat_template to one that renders them (e.g. Qwen2.5's, or "
                          "grpo.tasks.calculator.CHATML_TOOLS for a ChatML model such as SmolLM2), on the "
                          "tokenizer passed as processing_class= (grpo.load_tokenizer(name) loads it)")
    if PROBE_RESULT not in text:
        raise ConfigError("the tokenizer's chat template does not render tool messages (role 'tool'); set "
                          "tokenizer.chat_template to one that does (e.g. grpo.tasks.calculator.CHATML_TOOLS)")
    check_tool_history(tokenizer, chat_template_kwargs, eos_ids)


def check_tool_history(tokenizer, chat_template_kwargs: dict | None = None, eos_ids: list[int] | None = None) -> None:
    """A ConfigError, one line, unless the rendering of a conversation extended by a tool turn starts with the
    text the row held before it (what `tool_turn_text` relies on), probed with a Hermes call and each of `eos_ids`."""
    eos_ids = [i for i in (eos_ids if eos_ids is not None else [tokenizer.eos_token_id]) if i is not None]
    start = render(tokenizer, PROBE_PROMPT, chat_template_kwargs, [PROBE_TOOL])
    ids = tokenizer.encode(PROBE_MESSAGE, add_special_tokens=False)
    text = functools.partial(tokenizer.decode, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    forms, parted = _forms(text(ids), [PROBE_CALL]), ""
    for eos in eos_ids:
        rest, parted = _continuation(tokenizer, PROBE_PROMPT, forms, [PROBE_TURN], start + text(ids + [eos]),
                                     [PROBE_TOOL], chat_template_kwargs)
        if rest is not None:
            return
    if eos_ids:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        ends = ", ".join(repr(tokenizer.decode([i])) for i in eos_ids)
        raise ConfigError(f"the chat template of the tokenizer {name!r} does not render a conversation's earlier turns "
                          f"as the model wrote them (after a tool call ended by {ends}, {parted}): a tool's output "
                          f"could not be appended to a row; set tokenizer.chat_template to one that renders past "
                          f"turns as written (e.g. no reasoning dropped from them, no other generation prompt) and "
                          f"ends its turns with one of the model's EOS tokens (e.g. grpo.tasks.calculator.CHATML_TOOLS "
                          f"for a ChatML model), or adjust chat_template_kwargs")


def _forms(message: str, tool_calls: list[dict]) -> list[dict]:
    """The ways to pass an assistant message that made calls, in order: with its parsed `tool_calls`, then verbatim."""
    before = message[:message.find("<tool_call>")].rstrip()
    return [{"role": "assistant", "content": before, "tool_calls": tool_calls},
            {"role": "assistant", "content": message}]


def _continuation(tokenizer, conversation: list, forms: list[dict], tool_messages: list[dict], held: str,
                  schemas: list, chat_template_kwargs: dict | None) -> tuple[str | None, dict | str]:
    """(the text after `held`, the form used) for the first assistant form whose rendering of the conversation
    with the tool turn starts with `held`; (None, where the last rendering and `held` part) when none does."""
    for assistant in forms:
        text = render(tokenizer, conversation + [assistant, *tool_messages], chat_template_kwargs, schemas)
        if text.startswith(held):
            return text[len(held):], assistant
    position = next((i for i, (a, b) in enumerate(zip(text, held)) if a != b), min(len(text), len(held)))
    return None, (f"they part at character {position}: {held[position:position + 40]!r} held, "
                  f"{text[position:position + 40]!r} rendered")


def tool_turn_text(tokenizer, conversation: list, message: str, tool_calls: list[dict], tool_messages: list[dict],
                   held: str, schemas: list, chat_template_kwargs: dict | None = None) -> tuple[str, dict]:
    """The text to append to a row that holds `held` (its prompt and everything decoded so far, the EOS
    included) after its assistant `message` made calls (`tool_calls`, parsed): the tool turn(s) and the next
    assistant header, as the template renders `conversation + [assistant, *tool_messages]` past `held`, so that the
    KV cache holds what a prompt of the whole conversation would; and the assistant message as passed (`_forms`).
    A ConfigError where no form's rendering starts with `held` (`check_tool_history` probed it at start-up)."""
    rest, assistant = _continuation(tokenizer, conversation, _forms(message, tool_calls), tool_messages, held, schemas,
                                    chat_template_kwargs)
    if rest is None:
        raise ConfigError(f"the chat template renders the conversation with its tool turn otherwise than the row "
                          f"holds it ({assistant}), so the tool's output cannot be appended to the row; use a "
                          f"template that renders earlier turns as they were written (e.g. no reasoning dropped "
                          f"from past turns), and EOS tokens the template ends its turns with")
    return rest, assistant
