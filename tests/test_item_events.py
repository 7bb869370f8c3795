"""The one table from item events to the wire APIs' events (protocol/item_events.py): every
item event the service makes has a row, and a stream's events read back (what a task a
restart left unfinished reports) give the items that were streamed, from either framing."""

from __future__ import annotations

import pytest

from lmsp_mlx.engine.events import ReasoningDelta, TextDelta, ToolCall
from lmsp_mlx.protocol.item_events import ChatDelta, chat_delta, events_for
from lmsp_mlx.protocol.responses import v1_item
from lmsp_mlx.service.items import ItemFolder
from lmsp_mlx.service.tasks import output_of
from lmsp_mlx.store import StoredEvent

TURN = [ReasoningDelta("weighing "), ReasoningDelta("it"), TextDelta("Hello"), TextDelta(", world"),
        ToolCall("fc_1", "call_1", "files.read", '{"path": "a"}'),
        ToolCall("ctc_2", "call_2", "apply_patch", "*** Begin Patch", custom=True), TextDelta("done")]


def item_events():
    folder = ItemFolder()
    out = [e for event in TURN for e in folder.feed(event)] + folder.close()
    return folder, out


@pytest.mark.parametrize("wire", ["lmsp", "v1"])
def test_a_stream_read_back_gives_the_items_it_streamed(wire):
    folder, events = item_events()
    stored = [StoredEvent(n, name, fields) for n, (name, fields) in
              enumerate((x for e in events for x in events_for(e, wire)), 1)]
    got = output_of(stored)
    want = [item.model_dump() if wire == "lmsp" else v1_item(item, "completed") for item in folder.snapshot()]
    if wire == "v1":  # read back, a /v1 call's namespace is part of its name again
        want[2] = {**{k: v for k, v in want[2].items() if k != "namespace"}, "name": "files.read"}
    assert [i["type"] for i in got] == ["reasoning", "message", "function_call", "custom_tool_call", "message"]
    assert got == want


def test_a_chat_choice_takes_text_reasoning_and_function_calls():
    _, events = item_events()
    kinds = [chat_delta(e) for e in events]
    assert kinds.count(ChatDelta.REASONING) == 2 and kinds.count(ChatDelta.CONTENT) == 3
    assert kinds.count(ChatDelta.TOOL_CALL) == 1  # a custom tool's call is not a Chat tool call
    assert kinds.count(ChatDelta.FLUSH) == 2  # each message's end


@pytest.mark.parametrize("wire", ["lmsp", "v1"])
def test_items_cut_before_their_done_event_are_rebuilt_from_their_deltas(wire):
    """A restart can cut a task's stream anywhere: the items then come from the added events
    and the deltas after them."""
    folder, events = item_events()
    stored = [StoredEvent(n, name, fields) for n, (name, fields) in
              enumerate((x for e in events for x in events_for(e, wire) if not x[0].endswith(".done")), 1)]
    got = output_of(stored)
    assert [i["content"][0]["text"] for i in got if i["type"] == "message"] == ["Hello, world", "done"]
    assert [i["summary"][0]["text"] for i in got if i["type"] == "reasoning"] == ["weighing it"]
    assert [i["arguments"] for i in got if i["type"] == "function_call"] == ['{"path": "a"}']
    assert [i["input"] for i in got if i["type"] == "custom_tool_call"] == ["*** Begin Patch"]
