"""Event streams as HTTP responses: the headers proxies must heed, and keep-alive comments
while a stream waits. The events themselves are framed in protocol/sse.py."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterable

from quart import Response

from ..protocol.problems import Problem
from ..protocol.requests import ResponsesRequest
from ..protocol.routes import Route
from ..protocol.sse import SseEvent, V1Event
from ..service import responses
from ..service.run import ResponseRun
from ..engine.worker import QueueFull
from .context import generation_logged, owner, state
from .problems import queue_full

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


Frames = Iterable[str | SseEvent | V1Event]


async def needs_load(req: ResponsesRequest, stream: bool | None = None) -> bool:
    """A streamed request (`stream`: where its own request says so, as Chat's does) for a
    model this server has but not loaded: its stream starts before the load. (An unknown
    model is still its 404.)"""
    engine = state().engine
    model = engine.catalog.resolve(req.model)
    if not (req.stream if stream is None else stream) or engine.models.loaded(model):
        return False
    return await asyncio.to_thread(engine.catalog.find, model) is not None


def loading_stream(route: Route, req: ResponsesRequest, stream: Callable[[ResponseRun], AsyncIterator],
                   failed: Callable[[Problem], Frames], stop: tuple[str, ...] = ()) -> Response:
    """A stream that starts at once while its model loads (minutes for a big one), with
    keep-alive comments meanwhile, so no client or proxy idle timeout cuts it; the status
    line has gone out, so a refusal after the load (a 400, 507 or 503 otherwise) is the
    stream's own error event (`failed`)."""
    s, who = state(), owner()
    generation_logged()

    async def events():
        try:
            try:
                run = await responses.start_run(s, who, route, req, stop=stop)
            except QueueFull as exc:
                raise queue_full(exc) from None
        except Problem as problem:
            for frame in failed(problem):
                yield frame
            return
        async for e in stream(run):
            yield e

    return sse_response(events())
