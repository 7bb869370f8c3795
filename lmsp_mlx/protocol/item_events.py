"""A response's item-level events, and the one table that maps each to every wire API's
stream: LMSP's events (section 6.3, 6.5 for calls), Open Responses' events (/v1), the
deltas of Chat's chunks and the content blocks of Anthropic's Messages. A task's stored events are read back into items through the same
names (`DELTA_EVENTS`, `TEXT_FIELD`).

An item event is one of five kinds (`ItemKind`) on one of four item types; `TABLE` has a
`Row` per pair that occurs. The response service (service/items.py) makes the events; the
routes frame what `events_for` and `chat_delta` give.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Literal

from .logprobs import TokenLogprob, openai_entries
from .responses import (CustomToolCallOutput, FunctionCallOutput, MessageOutput, OutputItem, ReasoningOutput,
                        v1_item)


class ItemKind(enum.Enum):
    ADDED = "added"  # an output item opens
    TEXT = "text"  # a message's text delta
    REASONING = "reasoning"  # a reasoning item's summary delta
    ARGUMENTS = "arguments"  # a tool call's arguments (a custom tool's input), whole
    DONE = "done"  # the item is complete (or cut: `status`)


@dataclass(frozen=True)
class ItemEvent:
    kind: ItemKind
    index: int
    item: OutputItem
    delta: str = ""
    status: Literal["completed", "incomplete"] = "completed"  # of a done item: "incomplete" when the limit cut it
    logprobs: tuple[TokenLogprob, ...] = ()  # of a text delta, where the request asked for them


class ChatDelta(enum.Enum):
    """What an item event is in a Chat choice."""

    CONTENT = "content"  # text of the reply (stop sequences apply)
    REASONING = "reasoning_content"
    FLUSH = "flush"  # the message ended: text held back for a stop sequence goes out
    TOOL_CALL = "tool_calls"  # one whole call


class MessagesBlock(enum.Enum):
    """What an item event is in an Anthropic message's content blocks."""

    TEXT_START = "text_start"  # a text block opens
    TEXT = "text_delta"  # (stop sequences apply)
    THINKING_START = "thinking_start"
    THINKING = "thinking_delta"
    STOP = "stop"  # the open block closes (a thinking block after its signature_delta)
    TOOL_USE = "tool_use"  # one whole call: its block's start, input_json_delta and stop


Wire = Literal["lmsp", "v1"]
Events = list[tuple[str, dict[str, Any]]]  # (event name, its fields), in order
Build = Callable[[ItemEvent], Events]

# The delta events. Read back (tasks), a delta extends its item's one text field, whatever
# the event's name (LMSP streams a custom call's input as function-call arguments).
TEXT_DELTA = "response.output_text.delta"
SUMMARY_DELTA = "response.reasoning_summary_text.delta"
ARGUMENTS_DELTA = "response.function_call_arguments.delta"
INPUT_DELTA = "response.custom_tool_call_input.delta"
DELTA_EVENTS = frozenset({TEXT_DELTA, SUMMARY_DELTA, ARGUMENTS_DELTA, INPUT_DELTA})
TEXT_FIELD = {"message": "content", "reasoning": "summary", "function_call": "arguments", "custom_tool_call": "input"}


def _where(e: ItemEvent) -> dict[str, Any]:
    return {"item_id": e.item.id, "output_index": e.index}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def _text(e: ItemEvent) -> str:
    content = e.item.content if isinstance(e.item, MessageOutput) else e.item.summary
    return content[0].text if content else ""


def _then(*builds: Build) -> Build:
    return lambda e: [event for build in builds for event in build(e)]


# -- LMSP (items as this server's objects) ------------------------------------------------------
def _added(e: ItemEvent) -> Events:
    return [("response.output_item.added", {"output_index": e.index, "item": e.item.model_dump()})]


def _done(e: ItemEvent) -> Events:
    return [("response.output_item.done", {"output_index": e.index, "item": e.item.model_dump()})]


# -- Open Responses (items in OpenAI's shape, with content parts) -------------------------------
def _added_v1(e: ItemEvent) -> Events:
    return [("response.output_item.added", {"output_index": e.index, "item": v1_item(e.item, "in_progress")})]


def _done_v1(e: ItemEvent) -> Events:
    return [("response.output_item.done", {"output_index": e.index, "item": v1_item(e.item, e.status)})]


def _part_added(e: ItemEvent) -> Events:
    return [("response.content_part.added", {**_where(e), "content_index": 0, "part": _text_part("")})]


def _summary_part_added(e: ItemEvent) -> Events:
    return [("response.reasoning_summary_part.added", {**_where(e), "summary_index": 0, "part": _summary_part("")})]


def _text_done(e: ItemEvent) -> Events:
    text = _text(e)
    logprobs = e.item.content[0].logprobs if e.item.content else None
    return [("response.output_text.done", {**_where(e), "content_index": 0, "text": text, "logprobs": logprobs or []}),
            ("response.content_part.done", {**_where(e), "content_index": 0, "part": _text_part(text, logprobs)})]


def _summary_done(e: ItemEvent) -> Events:
    text = _text(e)
    return [("response.reasoning_summary_text.done", {**_where(e), "summary_index": 0, "text": text}),
            ("response.reasoning_summary_part.done", {**_where(e), "summary_index": 0, "part": _summary_part(text)})]


def _input_done(e: ItemEvent) -> Events:
    return [("response.custom_tool_call_input.done", {**_where(e), "input": e.item.input})]


# -- both ---------------------------------------------------------------------------------------
def _text_delta(e: ItemEvent) -> Events:
    """LMSP's; with the `logprobs` extension, the delta's token entries in `logprobs`."""
    fields = {**_where(e), "content_index": 0, "delta": e.delta}
    return [(TEXT_DELTA, {**fields, "logprobs": openai_entries(e.logprobs)} if e.logprobs else fields)]


def _text_delta_v1(e: ItemEvent) -> Events:
    return [(TEXT_DELTA, {**_where(e), "content_index": 0, "delta": e.delta, "logprobs": openai_entries(e.logprobs)})]


def _summary_delta(e: ItemEvent) -> Events:
    return [(SUMMARY_DELTA, {**_where(e), "summary_index": 0, "delta": e.delta})]


def _arguments_delta(e: ItemEvent) -> Events:
    return [(ARGUMENTS_DELTA, {**_where(e), "delta": e.delta})]


def _input_delta(e: ItemEvent) -> Events:
    return [(INPUT_DELTA, {**_where(e), "delta": e.delta})]


def _arguments_done(e: ItemEvent) -> Events:
    return [("response.function_call_arguments.done", {**_where(e), "arguments": e.item.arguments})]


@dataclass(frozen=True)
class Row:
    lmsp: Build
    v1: Build
    chat: ChatDelta | None = None  # None: nothing in a Chat choice
    messages: MessagesBlock | None = None  # None: nothing in a Messages reply


TABLE: dict[tuple[ItemKind, type], Row] = {
    (ItemKind.ADDED, MessageOutput): Row(_added, _then(_added_v1, _part_added), messages=MessagesBlock.TEXT_START),
    (ItemKind.ADDED, ReasoningOutput): Row(_added, _then(_added_v1, _summary_part_added),
                                           messages=MessagesBlock.THINKING_START),
    (ItemKind.ADDED, FunctionCallOutput): Row(_added, _added_v1),
    (ItemKind.ADDED, CustomToolCallOutput): Row(_added, _added_v1),
    (ItemKind.TEXT, MessageOutput): Row(_text_delta, _text_delta_v1, ChatDelta.CONTENT, MessagesBlock.TEXT),
    (ItemKind.REASONING, ReasoningOutput): Row(_summary_delta, _summary_delta, ChatDelta.REASONING,
                                               MessagesBlock.THINKING),
    (ItemKind.ARGUMENTS, FunctionCallOutput): Row(_arguments_delta, _arguments_delta),
    # LMSP has one argument event for every call (section 6.5); /v1 names a custom tool's input
    (ItemKind.ARGUMENTS, CustomToolCallOutput): Row(_arguments_delta, _input_delta),
    (ItemKind.DONE, MessageOutput): Row(_done, _then(_text_done, _done_v1), ChatDelta.FLUSH, MessagesBlock.STOP),
    (ItemKind.DONE, ReasoningOutput): Row(_done, _then(_summary_done, _done_v1), messages=MessagesBlock.STOP),
    (ItemKind.DONE, FunctionCallOutput): Row(_then(_arguments_done, _done), _then(_arguments_done, _done_v1),
                                             ChatDelta.TOOL_CALL, MessagesBlock.TOOL_USE),
    (ItemKind.DONE, CustomToolCallOutput): Row(_done, _then(_input_done, _done_v1)),
}


def events_for(e: ItemEvent, wire: Wire) -> Events:
    """The stream events `wire` sends for `e`."""
    row = TABLE[(e.kind, type(e.item))]
    return row.lmsp(e) if wire == "lmsp" else row.v1(e)


def chat_delta(e: ItemEvent) -> ChatDelta | None:
    """What `e` is in a Chat choice, or None for nothing."""
    return TABLE[(e.kind, type(e.item))].chat


def messages_block(e: ItemEvent) -> MessagesBlock | None:
    """What `e` is in a Messages reply's content blocks, or None for nothing."""
    return TABLE[(e.kind, type(e.item))].messages
