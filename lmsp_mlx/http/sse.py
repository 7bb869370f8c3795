"""Event streams as HTTP responses: the headers proxies must heed, and keep-alive comments
while a stream waits. The events themselves are framed in protocol/sse.py."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from quart import Response

from ..protocol.sse import SseEvent, V1Event
from .context import state

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[str | SseEvent | V1Event], headers: dict[str, str] | None = None,
                 keepalive: float | None = None) -> Response:
    """An event stream that proxies must not buffer; `events` yields frames (str) or events.
    After `keepalive` seconds without an event (a queued request, a long prefill) a comment
    line goes out, which SSE clients ignore, so idle timeouts of clients and proxies do not
    cut a stream that is only waiting."""
    if keepalive is None:
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
