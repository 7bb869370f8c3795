"""Server-Sent Events framing: LMSP's (integer `id:`, section 6.3) and Open Responses' (/v1)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from quart import Response

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[str | SseEvent | V1Event], headers: dict[str, str] | None = None,
                 keepalive: float | None = None) -> Response:
    """An event stream that proxies must not buffer; `events` yields frames (str) or events.
    After `keepalive` seconds without an event (a queued request, a long prefill) a comment
    line goes out, which SSE clients ignore, so idle timeouts of clients and proxies do not
    cut a stream that is only waiting."""
    if keepalive is None:
        from .state import state

        keepalive = state().settings.sse_keepalive
    return Response(_with_keepalive(events, keepalive), mimetype="text/event-stream",
                    headers={**SSE_HEADERS, **(headers or {})})


KEEPALIVE = ": keep-alive\n\n"


async def _with_keepalive(events: AsyncIterator[str | SseEvent | V1Event], every: float) -> AsyncIterator[str]:
    it = aiter(events)
    pending: asyncio.Task | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield KEEPALIVE
                continue
            try:
                e = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield e if isinstance(e, str) else e.frame()
    finally:  # the client left: the events' own cleanup (run.cancel()) runs now, not at collection
        if pending is not None and not pending.done():
            pending.cancel()
        await _close(it)


async def _close(it) -> None:
    try:
        await it.aclose()
    except (RuntimeError, asyncio.CancelledError):  # still running its cancelled step: it ends on its own
        pass


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
    `sequence_number` (= the id), as PROTOCOL.md fixes, for generic Responses clients."""

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
