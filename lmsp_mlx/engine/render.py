"""Render protocol input items into the model's prompt with its own chat template.

Two texts come out of it: the prompt of a request, and after the turn the *visible
transcript* of that turn, the text a client's replay renders to (see `turn_binding`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..cache.calls import CallMemory
from ..cache.session import Binding

from ..protocol.problems import Problem
from ..protocol.requests import (
    CompactionItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ReasoningItem,
    UnsupportedContent,
)
from .tools import call_text, response_text, tool_prompt

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


def to_chat_messages(
    items: list[InputItem],
    instructions: str | None = None,
    *,
    tools: list[FunctionTool] = (),
    native_tools: bool = False,
    memory: CallMemory | None = None,
    hidden: list[str] | None = None,
    allow_empty: bool = False,
) -> list[dict]:
    """Protocol items -> the `messages` list chat templates expect.

    Consecutive assistant-side items (an assistant message, reasoning, function calls) are
    one assistant turn. A turn whose calls the server sampled itself is rendered with the
    text it sampled (exact replay, from `memory`); others are rendered from their items.
    With `hidden` (a list to fill), a turn whose reasoning item carried sealed raw reasoning
    starts with a marker for it, and the raw text is appended to `hidden`: see `reveal`."""
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    i = 0
    while i < len(items):
        item = items[i]
        if isinstance(item, CompactionItem):  # lmsp_mlx/service/compaction.py expands these before rendering
            raise Problem("invalid_request", "a compaction item cannot be rendered here", param=f"input[{i}]")
        if isinstance(item, MessageItem) and item.role != "assistant":
            _check_content(item, i)
            # Chat templates know system/user/assistant; OpenAI's `developer` role is the system prompt.
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            i += 1
            continue
        j = i
        if isinstance(item, FunctionCallOutputItem):
            while j < len(items) and isinstance(items[j], FunctionCallOutputItem):
                j += 1
            outputs = items[i:j]
            if native_tools:
                messages += [{"role": "tool", "tool_call_id": o.call_id, "content": o.text()} for o in outputs]
            else:
                messages.append({"role": "user", "content": response_text([o.text() for o in outputs])})
        else:
            while j < len(items) and _assistant_side(items[j]):
                _check_content(items[j], j)
                j += 1
            messages.append(_assistant_turn(items[i:j], native_tools, memory, hidden))
        i = j
    if not messages and not allow_empty:  # (a compacted conversation may be continued as it is)
        raise Problem("invalid_request", "input must contain at least one message", param="input")
    if tools and not native_tools:
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tool_prompt(list(tools))}
        else:
            messages.insert(0, {"role": "system", "content": tool_prompt(list(tools))})
    return messages


def _assistant_side(item: InputItem) -> bool:
    return isinstance(item, (FunctionCallItem, ReasoningItem)) or (
        isinstance(item, MessageItem) and item.role == "assistant"
    )


def _check_content(item: InputItem, index: int) -> None:
    if isinstance(item, MessageItem) and not isinstance(item.content, str):
        for j, part in enumerate(item.content):
            if isinstance(part, UnsupportedContent):
                raise Problem(
                    "unsupported_capability",
                    f"content type {part.type!r} is not supported: LMSP 1.0 defines text only",
                    param=f"input[{index}].content[{j}]",
                )


def _assistant_turn(group: list[InputItem], native_tools: bool, memory: CallMemory | None,
                    hidden: list[str] | None = None) -> dict:
    text = "".join(it.text() for it in group if isinstance(it, MessageItem))
    reasoning = "\n".join(t for it in group if isinstance(it, ReasoningItem) and (t := it.text()))
    calls = [it for it in group if isinstance(it, FunctionCallItem)]
    sampled = next((t for c in calls if memory is not None and (t := memory.get(c.call_id, None)) and t.replays(calls, text)),
                   None)
    message: dict = {"role": "assistant", "content": text}
    if sampled is not None:
        message["content"] = sampled.visible
    elif calls and native_tools:
        message["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {
                "name": _qualified(c), "arguments": {"input": c.arguments} if c.custom else _json_or_text(c.arguments)}}
            for c in calls
        ]
    elif calls:
        message["content"] = "\n".join(([text] if text else []) + [call_text(_qualified(c), c.arguments, c.custom) for c in calls])
    raw = "".join(it._raw for it in group if isinstance(it, ReasoningItem) and it._raw)
    if hidden is not None and raw:
        message["content"] = _hidden_marker(len(hidden)) + message["content"]
        hidden.append(raw)
    elif reasoning:
        message["reasoning_content"] = reasoning  # templates that replay reasoning (Qwen3) read this
    return message


def _hidden_marker(k: int) -> str:
    return f"\ue002{k}\ue002"


def _qualified(call: FunctionCallItem) -> str:
    return f"{call.namespace}.{call.name}" if call.namespace else call.name


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class Templated:
    """A tokenizer whose chat template also gets `args` (--chat-template-args, a request's
    chat_template_kwargs, enable_thinking under reasoning effort none). Every rendering of a
    conversation (its prompt, its visible transcript, its compacted history) goes through
    `apply_chat_template`, so wrapping the tokenizer renders all of them alike; everything
    else is the tokenizer's own."""

    def __init__(self, tokenizer, args: dict) -> None:
        self._tokenizer = tokenizer
        self.template_args = args

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, **{**self.template_args, **kwargs})

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def with_template_args(tokenizer, args: dict | None):
    """`tokenizer` rendering with `args` too; they win over the ones it already has."""
    if not args:
        return tokenizer
    if isinstance(tokenizer, Templated):
        return Templated(tokenizer._tokenizer, {**tokenizer.template_args, **args})
    return Templated(tokenizer, dict(args))


def apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=template, **extra
    )


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Prompt:
    """`tools`: the tool specs for templates that render tools themselves."""
    return encode(tokenizer, prompt_text(tokenizer, messages, tools))


def encode(tokenizer, text: str) -> Prompt:
    return Prompt(text=text, tokens=list(tokenizer.encode(text, add_special_tokens=False)))


def prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    try:
        text = apply_template(tokenizer, messages, tools=tools)
    except Exception as exc:  # jinja raises on conversations the template forbids
        raise Problem("invalid_request", f"the model's chat template rejected the input: {exc}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON may carry lone surrogates ("\ud800")
        raise Problem("invalid_request", f"the input is not valid Unicode text: {exc.reason} at {exc.start}") from None
    return text


def reveal(text: str, hidden: list[str]) -> str | None:
    """`text` with each turn's hidden reasoning where the model sampled it: the true
    history, which a live KV holds byte for byte. Templates render an earlier assistant turn
    from its content (dropping reasoning), so the raw reasoning goes where the content
    starts; None where the template did not keep a marker exactly once."""
    for k, raw in enumerate(hidden):
        if text.count(_hidden_marker(k)) != 1:
            return None
        text = text.replace(_hidden_marker(k), raw)
    return text


# Private-use characters no client text is expected to contain: follow-up turns whose
# renderings share the replayed turn's text, and a marker for where the reply ends.
_FOLLOW_UPS = (("user", "\ue000a"), ("user", "\ue000b"), ("system", "\ue000c"))
_REPLY_END = "\ue001"


def _follow_up_renders(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[str]:
    renders = []
    for role, text in _FOLLOW_UPS:
        try:
            renders.append(apply_template(tokenizer, messages + [{"role": role, "content": text}], tools=tools))
        except Exception:  # templates may refuse a role in that position
            continue
    return renders


def history_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str | None:
    """The text a conversation renders to up to where the next turn's own text starts, as
    every follow-up renders it (a turn binding's key, for a whole conversation); None where
    the template renders too few follow-ups to tell."""
    renders = _follow_up_renders(tokenizer, messages, tools)
    return os.path.commonprefix(renders) if len(renders) >= 2 else None


# What a continuation is rendered after: any short conversation ending with a finished turn.
_STAND_IN = [{"role": "user", "content": "\ue000s"}, {"role": "assistant", "content": "\ue000t"}]


def continuation_text(tokenizer, messages: list[dict], history: bool = False) -> str | None:
    """The text `messages` render to when they follow an earlier conversation, to be put
    after that conversation's `history_text`: they are rendered after a stand-in
    conversation, from where its next turn starts; as a prompt, or with `history` up to
    where the turn after them starts. None where the template does not render them as a
    plain continuation."""
    key = history_text(tokenizer, _STAND_IN)
    full = history_text(tokenizer, _STAND_IN + messages) if history else prompt_text(tokenizer, _STAND_IN + messages)
    if key is None or full is None or not full.startswith(key):
        return None
    return full[len(key):]


def continued_binding(tokenizer, head: str, messages: list[dict], kv_after_reply: str) -> Binding | None:
    """`turn_binding` for a turn that continues a compacted conversation's text `head`."""
    key = history_text(tokenizer, _STAND_IN)
    found = turn_binding(tokenizer, _STAND_IN + messages, kv_after_reply)
    if key is None or found is None or not found.key.startswith(key):
        return None
    return Binding(key=head + found.key[len(key):], tail=found.tail)


def turn_binding(tokenizer, messages: list[dict], kv_after_reply: str, tools: list[dict] | None = None) -> Binding | None:
    """The visible transcript of a finished turn and what its KV lacks to reach its end.

    `messages` ends with the turn's assistant message as a client's replay renders it.
    The template renders it followed by the next turn; the key is the text all follow-up
    roles share (so it ends where the next turn's own text starts), and a marker after the
    reply's content shows where that content ends inside it. The KV holds the sampled
    tokens, hidden reasoning included, then `kv_after_reply` (the end-of-turn token if it
    was fed); the tail is the rest of the key after that. None where the template does not
    render the reply verbatim: such a turn is still found by token or text prefix."""
    renders = _follow_up_renders(tokenizer, messages, tools)
    if len(renders) < 2:
        return None
    key = os.path.commonprefix(renders)
    reply = messages[-1]
    try:
        marked = apply_template(
            tokenizer,
            messages[:-1] + [{**reply, "content": reply["content"] + _REPLY_END},
                             {"role": "user", "content": _FOLLOW_UPS[0][1]}],
            tools=tools,
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
