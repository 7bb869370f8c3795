"""Event streams as HTTP responses: the headers proxies must heed, and keep-alive comments
while a stream waits. The events themselves are framed in protocol/sse.py."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Iterable, TypeVar

from quart import Response

from ..protocol.problems import Problem
from ..protocol.requests import ResponsesRequest
from ..protocol.routes import Route
from ..protocol.sse import OpenResponsesEvents, SseEvent, V1Event, data_frame
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
        keepalive = state().settings.server.sse_keepalive
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
Run = TypeVar("Run")


async def needs_load(model: str, stream: bool) -> bool:
    """A streamed request for a model this server has but not loaded: its stream starts
    before the load. (An unknown model is still its 404.)"""
    engine = state().engine
    model = engine.catalog.resolve(model)
    if not stream or engine.models.loaded(model):
        return False
    return await asyncio.to_thread(engine.catalog.find, model) is not None


def loading_stream(start: Callable[[], Awaitable[Run]], stream: Callable[[Run], AsyncIterator],
                   failed: Callable[[Problem], Frames]) -> Response:
    """A stream that starts at once while its model loads (minutes for a big one), with
    keep-alive comments meanwhile, so no client or proxy idle timeout cuts it; `start`
    leases the model and queues the run. The status line has gone out, so a refusal after
    the load (a 400, 507 or 503 otherwise) is the stream's own error event (`failed`)."""
    generation_logged()

    async def events():
        try:
            try:
                run = await start()
            except QueueFull as exc:
                raise queue_full(exc) from None
        except Problem as problem:
            for frame in failed(problem):
                yield frame
            return
        async for e in stream(run):
            yield e

    return sse_response(events())


def response_start(route: Route, req: ResponsesRequest, stop: tuple[str, ...] = ()) -> Callable[[], Awaitable[ResponseRun]]:
    """loading_stream's `start` for a response: the service's start_run for this request's
    caller (read now: the stream runs outside the request's context)."""
    s, who = state(), owner()
    return lambda: responses.start_run(s, who, route, req, stop=stop)


def openai_stream_error(problem: Problem) -> list[str]:
    """A refusal once a Chat or text completion stream has begun: OpenAI's error object as a
    data frame, then [DONE]."""
    return [data_frame({"error": problem.openai_error()}), OpenResponsesEvents.DONE]
