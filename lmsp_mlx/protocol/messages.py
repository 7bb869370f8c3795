"""POST /v1/messages: Anthropic's Messages body, as the Responses request the engine runs,
and the message objects and stream events it answers with.

A Messages request is a Responses request in other words, as a Chat one is: `system` is the
first system message, a `tool_use` block a function_call item, a `tool_result` block its
function_call_output, a `thinking` block a reasoning item whose `signature` is the sealed
raw reasoning (as `encrypted_content` on /v1). So a Claude Code loop reaches the same live
KV and checkpoints as any other client, and a stateless replay of thinking renders the
model's own text.

Anthropic's rules that the Responses request does not have are checked here, each a 400
naming the field: the first message is the user's, the last is not the assistant's (no
prefill), a tool_result answers a tool_use of the assistant message just before it and
every tool_use gets one, `budget_tokens` stays under `max_tokens`.

Claude Code puts `x-anthropic-billing-header: cc_version=...; cch=<nonce>;` first in its
system prompt, a line that changes every request. It is metadata for Anthropic's billing,
not an instruction, and rendering it would make every prompt differ from its first line
on: it is left out (`keep_billing` keeps it, as the peers do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .ids import new_id
from .problems import Problem
from .requests import ResponsesRequest, TopP, json_number, json_object, parse_request, validation_problem
from .responses import ResponseObject


class _Anthropic(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control, citations, ... are ignored


class TextBlock(_Anthropic):
    type: Literal["text"]
    text: str


class MediaBlock(_Anthropic):
    """Images, documents and search results: LMSP 1.0 is text only (refused in `to_responses`)."""

    type: Literal["image", "document", "search_result", "container_upload"]


class ToolUseBlock(_Anthropic):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Anthropic):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Annotated[Union[TextBlock, MediaBlock], Field(discriminator="type")]]] = ""
    is_error: bool = False


class ThinkingBlock(_Anthropic):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Anthropic):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, MediaBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]
_TAGS = frozenset({"text", "image", "document", "search_result", "container_upload", "tool_use", "tool_result",
                   "thinking", "redacted_thinking"})


class MessageParam(_Anthropic):
    # "system": a mid-conversation system turn (Claude Code sends them after the first user turn)
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolChoice(_Anthropic):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Anthropic):
    """`enabled` (with a budget), `disabled`, or `adaptive` (the model decides, as it does
    here anyway). `display: omitted` sends each thinking block with its signature only."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputConfig(_Anthropic):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}


Stop = Annotated[str, Field(min_length=1, max_length=256)]
UnitTemperature = Annotated[float, BeforeValidator(json_number), Field(ge=0, le=1)]  # Anthropic's range


class MessagesRequest(_Anthropic):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: Union[str, list[TextBlock]] | None = None
    stop_sequences: Annotated[list[Stop], Field(max_length=16)] | None = None
    temperature: UnitTemperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # user_id: Anthropic's abuse tracking, nothing here
    stream: bool = False
    tools: list[dict[str, Any]] | None = None  # checked one by one (`_tool`), to name the field
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: the same body without `max_tokens`."""

    max_tokens: Annotated[int, Field(ge=1)] = 1


def parse_messages(body: Any, count: bool = False) -> MessagesRequest:
    """Validate a decoded body; every failure is a 400 naming the field."""
    try:
        req = (CountTokensRequest if count else MessagesRequest).model_validate(json_object(body))
    except ValidationError as exc:
        raise validation_problem(exc, _TAGS) from None
    t = req.thinking
    if t is not None and t.type == "enabled":
        if t.budget_tokens is None:
            raise Problem("invalid_request", "thinking.budget_tokens is required when thinking is enabled",
                          param="thinking.budget_tokens")
        if not count and t.budget_tokens >= req.max_tokens:
            raise Problem("invalid_request", f"thinking.budget_tokens ({t.budget_tokens}) must be less than "
                          f"max_tokens ({req.max_tokens})", param="thinking.budget_tokens")
    if req.tool_choice is not None and req.tool_choice.type == "tool" and not req.tool_choice.name:
        raise Problem("invalid_request", 'tool_choice of type "tool" needs the tool\'s name', param="tool_choice.name")
    return req


BILLING_PREFIX = "x-anthropic-billing-header:"


@dataclass
class Mapped:
    """A Messages request as the engine's Responses request. `origin[j]`: where input item j
    came from (`messages[i].content[k]`, `system`), to name it in errors. `billing`: a
    Claude Code billing line was left out of the system prompt."""

    request: ResponsesRequest
    origin: list[str]
    billing: bool
    thinking_shown: bool  # thinking blocks go out (not when disabled)
    thinking_text: bool  # ... with their text (not with display "omitted")


def _system_text(system: str | list[TextBlock] | None, keep_billing: bool) -> tuple[str, bool]:
    blocks = [system] if isinstance(system, str) else [b.text for b in system or []]
    dropped = False
    if blocks and blocks[0].startswith(BILLING_PREFIX) and not keep_billing:
        blocks[0] = blocks[0].partition("\n")[2]
        dropped = True
    return "\n".join(b for b in blocks if b), dropped


def _result_text(block: ToolResultBlock, where: str) -> str:
    """A tool_result as the model reads it; `is_error` leads it with "Error: " (a chat
    template has no field for it, and the model must know the call failed)."""
    for k, part in enumerate([] if isinstance(block.content, str) else block.content):
        if isinstance(part, MediaBlock):
            raise Problem("unsupported_capability", f"a {part.type} block: LMSP 1.0 defines text content only",
                          param=f"{where}.content[{k}]")
    text = block.content if isinstance(block.content, str) else "\n".join(p.text for p in block.content)
    return f"Error: {text}" if block.is_error else text


def to_responses(req: MessagesRequest, *, keep_billing: bool = False) -> Mapped:
    """The Responses request of a Messages request (Anthropic's rules checked on the way)."""
    items: list[dict[str, Any]] = []
    origin: list[str] = []
    system, billing = _system_text(req.system, keep_billing)
    if system:
        items.append({"type": "message", "role": "system", "content": system})
        origin.append("system")
    first = next((i for i, m in enumerate(req.messages) if m.role != "system"), 0)
    if req.messages[first].role == "assistant":
        raise Problem("invalid_request", f"messages[{first}]: the first message must use the \"user\" role",
                      param=f"messages[{first}].role")
    last = next((i for i in range(len(req.messages) - 1, -1, -1) if req.messages[i].role != "system"), None)
    if last is None or req.messages[last].role != "user":
        raise Problem("invalid_request", f"messages[{last or 0}]: the last message must be the user's; prefilling "
                      "the assistant's reply is not supported", param=f"messages[{last or 0}].role")
    # The tool_use ids of the latest assistant message: the next user message answers each.
    asked: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        text: list[str] = []  # a user or system message's text blocks, as one message item

        def flush(role: str, where: str) -> None:
            if text:
                items.append({"type": "message", "role": role, "content": "\n".join(text)})
                origin.append(where)
                text.clear()

        answered = dict(asked) if m.role == "user" else {}
        for k, b in enumerate(m.blocks()):
            where = f"messages[{i}].content[{k}]"
            if isinstance(b, MediaBlock):
                raise Problem("unsupported_capability", f"a {b.type} block: LMSP 1.0 defines text content only",
                              param=where)
            if isinstance(b, TextBlock):
                if m.role == "assistant":
                    items.append({"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": b.text}]})
                    origin.append(where)
                elif b.text:
                    text.append(b.text)
                continue
            if m.role == "system" or (m.role == "user") != isinstance(b, ToolResultBlock):
                raise Problem("invalid_request", f"a {m.role} message cannot hold a {b.type} block", param=where)
            if isinstance(b, ToolResultBlock):
                if answered.pop(b.tool_use_id, None) is None:
                    raise Problem("invalid_request", f"tool_result for {b.tool_use_id!r}, which no tool_use of the "
                                  "assistant message before it has", param=f"{where}.tool_use_id")
                flush("user", where)
                items.append({"type": "function_call_output", "call_id": b.tool_use_id,
                              "output": _result_text(b, where)})
            elif isinstance(b, ToolUseBlock):
                asked[b.id] = where
                items.append({"type": "function_call", "call_id": b.id, "name": b.name,
                              "arguments": json.dumps(b.input, ensure_ascii=False)})
            elif isinstance(b, ThinkingBlock):
                items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": b.thinking}],
                              "encrypted_content": b.signature or None})
            else:  # redacted_thinking: its data is sealed state as a signature is
                items.append({"type": "reasoning", "summary": [], "encrypted_content": b.data})
            origin.append(where)
        flush("system" if m.role == "system" else "user", f"messages[{i}]")
        if m.role == "user":
            if answered:
                unanswered = next(iter(answered.values()))
                raise Problem("invalid_request", f"{unanswered} is a tool_use without a tool_result block in the "
                              "message after it: each tool_use is answered in the next user message",
                              param=unanswered)
            asked = {}
    thinking = req.thinking.type if req.thinking else None
    effort = "none" if thinking == "disabled" else req.output_config.effort if req.output_config else None
    body: dict[str, Any] = {
        "model": req.model, "input": items, "max_output_tokens": req.max_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k or None,
        "tools": [_tool(t, i) for i, t in enumerate(req.tools or [])] or None,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": False if req.tool_choice and req.tool_choice.disable_parallel_tool_use else None,
        "reasoning": _reasoning(effort, req.thinking),
        "response_format": _format(req),
    }
    shown = thinking != "disabled"
    return Mapped(parse_request(body), origin, billing, shown,
                  shown and not (req.thinking is not None and req.thinking.display == "omitted"))


def _reasoning(effort: str | None, thinking: ThinkingConfig | None) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    if effort:
        out["effort"] = {"max": "xhigh"}.get(effort, effort)
    if thinking is not None and thinking.type == "enabled":
        out["budget_tokens"] = thinking.budget_tokens
    return out or None


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise Problem("invalid_request", f"{where} must be an object", param=where)
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise Problem("unsupported_capability", f"{where}: tool type {kind!r} is one of Anthropic's server tools, "
                      "which this server does not run; offer client tools (name, input_schema)", param=f"{where}.type")
    if not isinstance(tool.get("input_schema"), dict):
        raise Problem("invalid_request", f"{where}.input_schema: a tool needs its input_schema (a JSON Schema object)",
                      param=f"{where}.input_schema")
    # Anthropic's strict tool use is opt-in: without it a call's input is not held to its schema
    # (tool_choice "any" or a named tool still is, by the grammar that forces the call).
    out = {"type": "function", "name": tool.get("name"), "parameters": tool["input_schema"],
           "strict": tool.get("strict", False)}
    if tool.get("description") is not None:
        out["description"] = tool["description"]
    return out


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "name": choice.name}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _format(req: MessagesRequest) -> dict[str, Any] | None:
    fmt, where = (req.output_config.format, "output_config.format") if req.output_config and req.output_config.format \
        else (req.output_format, "output_format")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise Problem("invalid_request", f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', param=where)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def messages_param(problem: Problem, mapped: Mapped | None) -> Problem:
    """The same problem naming the field as the Messages request names it: `input[j]` as the
    block item j came from, a tool's `parameters` as its `input_schema`, and so on."""
    param = problem.param or ""
    detail = problem.detail
    if mapped is not None and (m := re.fullmatch(r"input\[(\d+)\](.*)", param)) and int(m[1]) < len(mapped.origin):
        block = mapped.origin[int(m[1])]
        rest = {".encrypted_content": ".signature", ".call_id": ".tool_use_id"}.get(m[2], m[2])
        detail = detail.replace(f"input[{m[1]}] is a reasoning item whose encrypted_content",
                                f"{block} is a thinking block whose signature").replace(f"input[{m[1]}]", block)
        param = block + rest
    else:
        param = re.sub(r"^tools\[(\d+)\]\.parameters", r"tools[\1].input_schema",
                       {"max_output_tokens": "max_tokens", "input": "messages",
                        "response_format": "output_config.format"}.get(param, param))
        if problem.param:
            detail = detail.replace(problem.param, param)
    if param == (problem.param or "") and detail == problem.detail:
        return problem
    return Problem(problem.code, detail, param=param or None, headers=problem.headers)


# -- the reply -----------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


def message_id() -> str:
    return new_id("msg")


def message_usage(resp: ResponseObject | None) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens prefilled, without those read
    from the KV (`cache_read_input_tokens`); nothing is written to a cache on request
    (`cache_control` is ignored: every prompt's KV is kept), so creation is 0."""
    if resp is None or resp.usage is None:
        return {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
    u = resp.usage
    cached = u.input_tokens_details.cached_tokens
    return {"input_tokens": u.input_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": u.output_tokens}


def message(mid: str, model: str, content: list[dict[str, Any]], stop_reason: StopReason | None,
            stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    """A `message` object (the sync reply, and message_start's with no content yet)."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's `input` object (the grammar makes them one; text
    that is not, from a model without a constraint, is kept whole under `arguments`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
