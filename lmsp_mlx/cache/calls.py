"""What the server remembers of recent tool-call turns, by call id.

For each turn that made calls: the visible text exactly as sampled (call markup included)
and the conversation items through that turn. A replay that carries those call ids is
rendered with the sampled text (exact replay), so it matches the live KV byte for byte;
a request that sends only the tool outputs is expanded to the whole conversation.
Written by the worker after a turn, read by request handlers while they render: the one
piece of KV-related state shared across threads, behind a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..protocol.auth import LOCAL_OWNER


@dataclass(frozen=True)
class CallTurn:
    call_ids: tuple[str, ...]
    visible: str  # the turn's sampled text after any reasoning, call markup included
    items: tuple  # the conversation's input items through this turn's output, as JSON dicts
    head: str = ""  # the compacted conversation's text the items continue (lmsp_mlx/service/compaction.py)
    owner: str = LOCAL_OWNER  # the token whose request made the turn: it alone continues it by call id


    def replays(self, calls: list, text: str) -> bool:
        """Whether a client's replay of this turn is the turn as it was: the same calls
        (ids, names, arguments) and the same text. An edited turn is rendered as sent."""
        output: list[dict] = []
        for item in reversed(self.items):  # the turn's own items close the conversation
            if item.get("type") not in ("function_call", "reasoning") and item.get("role") != "assistant":
                break
            output.insert(0, item)
        mine = [(i["call_id"], i["name"], i.get("namespace"), i["arguments"])
                for i in output if i.get("type") == "function_call"]
        said = "".join(i["content"] for i in output if i.get("role") == "assistant" and isinstance(i.get("content"), str))
        return mine == [(c.call_id, c.name, c.namespace, c.arguments) for c in calls] and said.strip() == text.strip()


class CallMemory:
    def __init__(self, capacity: int = 4096) -> None:
        self._turns: OrderedDict[str, CallTurn] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity

    def remember(self, turn: CallTurn) -> None:
        with self._lock:
            for call_id in turn.call_ids:
                self._turns[call_id] = turn
                self._turns.move_to_end(call_id)
            while len(self._turns) > self.capacity:
                self._turns.popitem(last=False)

    def get(self, call_id: str, owner: str | None) -> CallTurn | None:
        """The turn that made `call_id`, if `owner` made it. None as owner: any turn, only
        for what the caller already holds (an exact replay renders text the client sent)."""
        with self._lock:
            turn = self._turns.get(call_id)
        return turn if turn is not None and owner in (None, turn.owner) else None
