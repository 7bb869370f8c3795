"""From a request's items and tools to the conversation the engine renders (section 6.5).

- `tools` are validated (LMSP: `function` only; /v1 also accepts Codex's `namespace`
  groups, flattened to `group.name`, and ignores hosted tool types).
- `tool_choice`: `none` offers no tools; `required` and a named function constrain the
  reply to one call (of that function), with arguments valid against its schema.
- A request that begins with tool outputs for calls it does not contain continues the
  live turn that made those calls: it is expanded to that turn's conversation and must find
  its live (or checkpointed) KV state, else 409 `continuation_state_unavailable`.
- A tool output for a call neither the request nor the server knows: 400 `unknown_call_id`.
- A reasoning model's replayed tool-call turn without its reasoning item, which the server
  has no state for either: 400 `reasoning_state_missing`.
"""

from __future__ import annotations

from pydantic import TypeAdapter

import json

from ..cache.calls import CallMemory
from ..engine.constrain import lark_literal
from ..engine.output import DEFAULT_CALL, OutputFormat
from ..engine.tools import native_tools
from ..engine.turn import Conversation
from ..protocol.problems import Problem
from ..protocol.requests import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    function_tools,
)

_ITEMS = TypeAdapter(list[InputItem])


def tool_choice(req: ResponsesRequest, tools: list[FunctionTool]) -> str | FunctionTool:
    """`auto`, `none`, `required`, or the one tool a named choice forces."""
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise Problem("invalid_request", "tool_choice 'required' needs at least one function tool", param="tool_choice")
        return choice
    name = choice.get("name") or (choice.get("function") or {}).get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise Problem("invalid_request", "tool_choice must be auto, none, required or "
                      "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
    for t in tools:
        if t.name == name or t.name.endswith("." + name):
            return t
    raise Problem("invalid_request", f"tool_choice names {name!r}, which is not among the request's tools",
                  param="tool_choice.name")


def call_grammar(choice: str | FunctionTool, tools: list[FunctionTool], tokenizer) -> str | None:
    """The Lark grammar that `required` / a named function impose on the reply: one call,
    `<tool_call>` + JSON (name and schema-valid arguments) + `</tool_call>`. None for
    `auto`/`none`, and for models whose call syntax is not that JSON (README)."""
    if choice in ("auto", "none") or OutputFormat.of(tokenizer).call != DEFAULT_CALL:
        return None
    chosen = [choice] if isinstance(choice, FunctionTool) else tools
    calls = [{
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": t.parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # Compact JSON: with free whitespace a weak model can pad a call with blanks forever.
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}
    start, end = DEFAULT_CALL
    return (f"start: {lark_literal(start + chr(10))} call {lark_literal(chr(10) + end)}\n"
            f"call: %json {json.dumps(schema)}\n")


def prepare(req: ResponsesRequest, route: str, tokenizer, calls: CallMemory,
            reasoning: bool) -> tuple[Conversation, str | None]:
    """The conversation to render, and the grammar its reply must follow (or None)."""
    tools = function_tools(req.tools, compat=route == "v1")
    choice = tool_choice(req, tools)
    items = req.items()
    live: tuple[str, ...] = ()
    own_calls = {i.call_id for i in items if isinstance(i, FunctionCallItem)}
    if items and isinstance(items[0], FunctionCallOutputItem) and items[0].call_id not in own_calls:
        turn = calls.get(items[0].call_id)
        if turn is None:
            raise Problem("unknown_call_id", f"no live call {items[0].call_id!r} and the request does not contain it; "
                          "replay the full conversation", param="input[0].call_id")
        live = tuple(i.call_id for i in items if isinstance(i, FunctionCallOutputItem) and i.call_id in turn.call_ids)
        items = _ITEMS.validate_python(list(turn.items)) + items
    known = {i.call_id for i in items if isinstance(i, FunctionCallItem)}
    for index, item in enumerate(req.items()):
        if isinstance(item, FunctionCallOutputItem) and item.call_id not in known:
            raise Problem("unknown_call_id", f"tool output for call {item.call_id!r}, which neither this request "
                          "nor the server's live state contains", param=f"input[{index}].call_id")
    if reasoning and not live:
        _check_reasoning(req.items(), calls)
    offered = [] if choice == "none" else tools
    conv = Conversation(items, req.instructions, offered, native_tools(tokenizer), live)
    return conv, call_grammar(choice, tools, tokenizer)


def _check_reasoning(items: list[InputItem], calls: CallMemory) -> None:
    """A replayed tool-call turn of a reasoning model needs its reasoning item, unless the
    server still has that turn's state (live or checkpointed: its calls are remembered)."""
    since_user = []
    for index, item in enumerate(items):
        if isinstance(item, MessageItem) and item.role != "assistant" or isinstance(item, FunctionCallOutputItem):
            since_user = []
            continue
        since_user.append(item)
        if isinstance(item, FunctionCallItem) and calls.get(item.call_id) is None \
                and not any(isinstance(i, ReasoningItem) for i in since_user):
            raise Problem("reasoning_state_missing", f"input[{index}] replays a tool call of a reasoning model "
                          "without its reasoning item, and the server has no state for that turn; include the "
                          "reasoning item returned with the call", param=f"input[{index}]")
