"""Render protocol input items into the model's prompt with its own chat template.

Two texts come out of it: the prompt of a request, and after the turn the *visible
transcript* of that turn, the text a client's replay renders to (see `turn_binding`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..cache.session import Binding

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


def apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=template
    )


def render(tokenizer, messages: list[dict]) -> Prompt:
    try:
        text = apply_template(tokenizer, messages)
    except Exception as exc:  # jinja raises on conversations the template forbids
        raise Problem("invalid_request", f"the model's chat template rejected the input: {exc}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON may carry lone surrogates ("\ud800")
        raise Problem("invalid_request", f"the input is not valid Unicode text: {exc.reason} at {exc.start}") from None
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return Prompt(text=text, tokens=list(tokens))


# Private-use characters no client text is expected to contain: follow-up turns whose
# renderings share the replayed turn's text, and a marker for where the reply ends.
_FOLLOW_UPS = (("user", "\ue000a"), ("user", "\ue000b"), ("system", "\ue000c"))
_REPLY_END = "\ue001"


def turn_binding(tokenizer, messages: list[dict], reply: str, kv_after_reply: str) -> Binding | None:
    """The visible transcript of a finished turn and what its KV lacks to reach its end.

    A client replays the turn as `messages` plus an assistant message with `reply`; the
    template renders that followed by the next turn. The key is the text all follow-up
    roles share (so it ends where the next turn's own text starts); a marker after the
    reply shows where the reply ends inside it. The KV holds the sampled tokens, hidden
    reasoning included, then `kv_after_reply` (the end-of-turn token if it was fed); the
    tail is the rest of the key after that. None where the template does not render the
    reply verbatim: such a turn is still found by token or text prefix."""
    turn = messages + [{"role": "assistant", "content": reply}]
    renders = []
    for role, text in _FOLLOW_UPS:
        try:
            renders.append(apply_template(tokenizer, turn + [{"role": role, "content": text}]))
        except Exception:  # templates may refuse a role in that position
            continue
    if len(renders) < 2:
        return None
    key = os.path.commonprefix(renders)
    try:
        marked = apply_template(
            tokenizer, messages + [{"role": "assistant", "content": reply + _REPLY_END},
                                   {"role": "user", "content": _FOLLOW_UPS[0][1]}],
        )
    except Exception:
        return None
    at = marked.find(_REPLY_END)
    if at < 0 or at > len(key) or marked[:at] + marked[at + 1:] != renders[0]:
        return None
    closing = key[at:]
    if not closing.startswith(kv_after_reply):
        return None
    return Binding(key=key, tail=closing[len(kv_after_reply):])
