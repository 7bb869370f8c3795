"""Responses as the routes start, find and compact them: a run's stored history loaded
before it starts, a stored response kept in_progress from the start and found while it
runs, and the compaction of a conversation. Each function takes the server's state and
the caller's owner."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import TypeAdapter

from ..protocol.problems import Problem
from ..protocol.routes import Route
from ..protocol.requests import InputItem, ResponsesRequest, parse_request
from ..protocol.responses import MessageOutput
from ..store import StoreUnavailable
from ..store.responses import Stored
from . import compaction
from .run import ResponseRun
from .state import RunningResponse, ServerState

_ITEMS = TypeAdapter(list[InputItem])


async def compact(s: ServerState, who: str, route: Route, body: Any) -> dict:
    """POST .../responses/compact: summarise the conversation, checkpoint its KV, and
    return its user messages and a compaction item (service/compaction.py)."""
    if isinstance(body, dict) and "input" not in body and body.get("previous_response_id"):
        body = {**body, "input": []}
    req = parse_request(body)
    req = req.model_copy(update={
        "stream": False, "store": False, "temperature": 0.0, "text": None, "response_format": None, "include": None,
        # The tools stay in the compacted text; the summary is free text, not a forced call.
        "tool_choice": "none" if req.tool_choice == "none" else "auto",
        "max_output_tokens": min(req.max_output_tokens or compaction.SUMMARY_TOKENS, compaction.SUMMARY_TOKENS)})
    run = await start_run(s, who, route, req, compact=True)
    resp = await run.run_to_end()
    summary = "".join(p.text for item in resp.output if isinstance(item, MessageOutput) for p in item.content)
    sealed = compaction.seal(run.sealer, req, run.compacted, summary.strip(), s.histories)
    return compaction.compacted_object(run.history + req.items(), sealed, resp.usage)


async def stored_response(s: ServerState, who: str, response_id: str) -> Stored:
    """A response the caller's token stored; 404 `response_not_found` otherwise."""
    # A response is kept when it ends: the running one answers first, so a GET as it ends
    # finds one or the other.
    found = None
    if (running := s.running.get(response_id)) is not None and running.owner == who:
        run = running.run
        found = Stored(run.stored_request(), run.response().model_dump(mode="json"), run.completed_at)
    if found is None:
        found = await asyncio.to_thread(s.responses.get, who, response_id)
    if found is None:
        raise Problem("response_not_found", f"no stored response {response_id!r}")
    return found


async def start_run(s: ServerState, who: str, route: Route, req: ResponsesRequest,
                    local: dict[str, Stored] | None = None, compact: bool = False,
                    stop: tuple[str, ...] = ()) -> ResponseRun:
    """Queue a request's generation, its stored history first: the common start of every
    route. `local`: a WebSocket connection's own responses, which chain with
    previous_response_id even when not stored; each finished run is added to it.
    `compact`: the run summarises the conversation for a compaction (ResponseRun)."""
    run = await new_run(s, who, route, req, local, compact, stop)
    if req.store:  # kept in_progress from the start: a crash leaves it failed, not unknown (recover)
        await asyncio.to_thread(s.responses.put, who, run.stored_request(), run.response().model_dump(mode="json"),
                                None)
        s.running[run.id] = RunningResponse(who, run)  # GET reads it here until store() keeps it as it ended
    try:
        await run.start()
    except BaseException:  # refused (a 400, a full queue): nothing to keep
        if req.store:
            s.running.pop(run.id, None)
            await asyncio.to_thread(s.responses.delete, who, run.id)
        raise
    return run


async def new_run(s: ServerState, who: str, route: Route, req: ResponsesRequest,
                  local: dict[str, Stored] | None = None, compact: bool = False,
                  stop: tuple[str, ...] = ()) -> ResponseRun:
    """The run of a request, its stored history loaded, not yet queued (start_run)."""
    history = None
    if req.previous_response_id is not None:
        running = s.running.get(req.previous_response_id)
        if running is not None and running.owner == who:  # stored once it ends: the chain continues from there
            await running.run.ended()
        items = await asyncio.to_thread(s.responses.conversation, who, req.previous_response_id, local)
        if items is None:
            raise Problem("response_not_found", f"no stored response {req.previous_response_id!r}",
                          param="previous_response_id")
        history = _ITEMS.validate_python(items)

    def store(run: ResponseRun) -> None:
        done = Stored(run.stored_request(), run.response().model_dump(mode="json"), run.completed_at)
        if local is not None:
            local[run.id] = done
        if req.store:
            try:
                s.responses.put(who, done.request, done.response, done.completed_at)
            except StoreUnavailable as exc:  # it stays stored in_progress: failed at the next start (recover)
                raise Problem("store_unavailable", f"the response was generated but could not be stored: {exc}",
                              headers={"Retry-After": "5"}) from None
            finally:
                s.running.pop(run.id, None)

    run = ResponseRun(s.engine, req, route, s.settings.engine.prefill_chunk, s.sealer, s.histories, history,
                      store if req.store or local is not None else None, compact=compact, stop=stop, owner=who)
    return run
