"""Server-Sent Events as the wire APIs frame them: LMSP's (integer `id:`, section 6.3),
Open Responses' (/v1: `event:` equals the data's `type`, `data: [DONE]` at the end) and the
bare `data:` lines of Chat and text completions. Every SSE line is framed here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

def json_text(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class SseEvent:
    """One LMSP event: what a stream sends and a task's event log keeps."""

    id: int
    event: str
    data: dict[str, Any]

    def frame(self) -> str:
        return f"id: {self.id}\nevent: {self.event}\ndata: {json_text(self.data)}\n\n"


class LmspEvents:
    """Numbers one response's events from 1; every data object also carries `type` and
    `sequence_number` (= the id), as docs/api.md fixes (Streams), for generic Responses clients."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.last_id = 0

    def __call__(self, name: str, **fields: Any) -> SseEvent:
        self.last_id += 1
        data = {"type": name, "sequence_number": self.last_id, "response_id": self.response_id, **fields}
        return SseEvent(self.last_id, name, data)


@dataclass(frozen=True)
class V1Event:
    """One Open Responses event: an SSE frame on HTTP, a JSON message on the WebSocket."""

    data: dict[str, Any]

    def frame(self) -> str:
        return f"event: {self.data['type']}\ndata: {json_text(self.data)}\n\n"

    def message(self) -> str:
        return json_text(self.data)


class OpenResponsesEvents:
    """Open Responses framing: `event:` equals the data's `type`; an SSE stream ends with
    `data: [DONE]`."""

    DONE = "data: [DONE]\n\n"

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, name: str, **fields: Any) -> V1Event:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return V1Event(data)


def data_frame(data: Any) -> str:
    """A bare `data:` event (Chat chunks, text completion chunks)."""
    return f"data: {json_text(data)}\n\n"
