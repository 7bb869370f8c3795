"""Render protocol input items into the model's prompt with its own chat template."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.problems import Problem
from ..protocol.requests import InputItem, MessageItem, UnsupportedContent

# ChatML, for tokenizers that ship no chat template of their own.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: list[int]


def to_chat_messages(items: list[InputItem], instructions: str | None = None) -> list[dict]:
    """Protocol items -> the `messages` list chat templates expect."""
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for index, item in enumerate(items):
        if not isinstance(item, MessageItem):
            needs = "reasoning" if item.type == "reasoning" else "tools"
            raise Problem(
                "unsupported_capability",
                f"input[{index}] is a {item.type} item, which needs the '{needs}' capability this model lacks",
                param=f"input[{index}]",
            )
        if not isinstance(item.content, str):
            for j, part in enumerate(item.content):
                if isinstance(part, UnsupportedContent):
                    raise Problem(
                        "unsupported_capability",
                        f"content type {part.type!r} is not supported: LMSP 1.0 defines text only",
                        param=f"input[{index}].content[{j}]",
                    )
        # Chat templates know system/user/assistant; OpenAI's `developer` role is the system prompt.
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": item.text()})
    if not messages:
        raise Problem("invalid_request", "input must contain at least one message", param="input")
    return messages


def render(tokenizer, messages: list[dict]) -> Prompt:
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=template
        )
    except Exception as exc:  # jinja raises on conversations the template forbids
        raise Problem("invalid_request", f"the model's chat template rejected the input: {exc}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON may carry lone surrogates ("\ud800")
        raise Problem("invalid_request", f"the input is not valid Unicode text: {exc.reason} at {exc.start}") from None
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return Prompt(text=text, tokens=list(tokens))
