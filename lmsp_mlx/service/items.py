"""The worker's events folded into output items, as item-level events the routes frame.

A message or reasoning item opens at its first delta and closes when another item starts
or the turn ends; a tool call arrives whole. Whitespace that precedes another item (the
newline between two calls) is not worth a message of its own and is dropped.
"""

from __future__ import annotations

from typing import Callable, Literal

from ..engine.events import ReasoningDelta, ReasoningEnd, TextDelta, ToolCall
from ..protocol.ids import new_id
from ..protocol.item_events import ItemEvent, ItemKind
from ..protocol.logprobs import TokenLogprob, openai_entries
from ..protocol.responses import (
    CustomToolCallOutput,
    FunctionCallOutput,
    MessageOutput,
    OutputItem,
    OutputTextPart,
    ReasoningOutput,
    SummaryText,
)


class ItemFolder:
    """`seal(raw)`, when given, makes a reasoning item's `encrypted_content` from the raw
    reasoning text the KV holds."""

    def __init__(self, seal: Callable[[str], str] | None = None, logprobs: bool = False) -> None:
        self.seal = seal
        self.logprobs = logprobs  # a message's text part carries its token entries
        self.items: list[OutputItem] = []
        self._open: int | None = None
        self._parts: list[str] = []
        self._entries: list[TokenLogprob] = []  # the open message's
        self._held = ""  # whitespace waiting for more text
        self._held_entries: tuple[TokenLogprob, ...] = ()

    def feed(self, event) -> list[ItemEvent]:
        if isinstance(event, TextDelta):
            return self._delta(MessageOutput, ItemKind.TEXT, event.text, event.logprobs)
        if isinstance(event, ReasoningDelta):
            return self._delta(ReasoningOutput, ItemKind.REASONING, event.text)
        if isinstance(event, ReasoningEnd):
            if self.seal is None or self._open is None or not isinstance(self.items[self._open], ReasoningOutput):
                return []
            i = self._open
            self.items[i] = self.items[i].model_copy(
                update={"encrypted_content": self.seal(event.raw)})
            return self.close()
        if isinstance(event, ToolCall):
            out = self.close()
            if event.custom:
                item = CustomToolCallOutput(id=event.id, call_id=event.call_id, name=event.name, input=event.arguments)
            else:
                item = FunctionCallOutput(id=event.id, call_id=event.call_id, name=event.name, arguments=event.arguments)
            self.items.append(item)
            i = len(self.items) - 1
            start = item.model_copy(update={"input" if event.custom else "arguments": ""})
            return out + [ItemEvent(ItemKind.ADDED, i, start), ItemEvent(ItemKind.ARGUMENTS, i, start, event.arguments),
                          ItemEvent(ItemKind.DONE, i, item)]
        return []

    def _delta(self, kind: type, name: ItemKind, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[ItemEvent]:
        out: list[ItemEvent] = []
        if self._open is None or not isinstance(self.items[self._open], kind):
            if not text.strip():  # nothing to show yet (whitespace dropped before another item takes its tokens)
                self._held += text
                self._held_entries += logprobs
                return out
            out += self.close()
            item = (MessageOutput(id=new_id("msg"), content=[]) if kind is MessageOutput
                    else ReasoningOutput(id=new_id("rs"), summary=[]))
            self.items.append(item)
            self._open = len(self.items) - 1
            out.append(ItemEvent(ItemKind.ADDED, self._open, item))
            text, self._held = self._held + text, ""
            logprobs, self._held_entries = self._held_entries + logprobs, ()
        self._parts.append(text)
        self._entries += logprobs
        out.append(ItemEvent(name, self._open, self.items[self._open], text, logprobs=logprobs))
        return out

    def close(self, ensure_message: bool = False, status: Literal["completed", "incomplete"] = "completed") -> list[ItemEvent]:
        """End the open item; at the turn's end (`ensure_message`) a reply with no item at
        all still gets an (empty) message. `status`: how the turn ended for the item it
        cuts ("incomplete" at the token limit)."""
        self._held, self._held_entries = "", ()
        out: list[ItemEvent] = []
        if self._open is not None:
            i = self._open
            item = self.items[i] = _with_text(self.items[i], "".join(self._parts), self._logprobs())
            self._open, self._parts, self._entries = None, [], []
            out.append(ItemEvent(ItemKind.DONE, i, item, status=status))
        if ensure_message and not self.items:
            item = MessageOutput(id=new_id("msg"), content=[OutputTextPart(text="", logprobs=self._logprobs())])
            self.items.append(item)
            out += [ItemEvent(ItemKind.ADDED, 0, item.model_copy(update={"content": []})),
                    ItemEvent(ItemKind.DONE, 0, item, status=status)]
        return out

    def snapshot(self) -> list[OutputItem]:
        """The items so far, the open one with its text so far (for in-progress objects)."""
        items = list(self.items)
        if self._open is not None:
            items[self._open] = _with_text(items[self._open], "".join(self._parts), self._logprobs())
        return items

    def _logprobs(self) -> list[dict] | None:
        return openai_entries(self._entries) if self.logprobs else None


def _with_text(item: OutputItem, text: str, logprobs: list[dict] | None = None) -> OutputItem:
    """A message or reasoning item holding `text` as its one part (a message's with its
    token entries, where they were asked for)."""
    if isinstance(item, MessageOutput):
        return item.model_copy(update={"content": [OutputTextPart(text=text, logprobs=logprobs)]})
    return item.model_copy(update={"summary": [SummaryText(text=text)]})
