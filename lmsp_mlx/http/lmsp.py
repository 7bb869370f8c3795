"""LMSP 1.0 routes under /lmsp/v1 (sections 6.1-6.5, restated in docs/api.md)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from quart import Blueprint, request

from .. import LMSP_VERSION, __version__
from ..protocol.ids import new_id
from ..protocol.item_events import events_for
from ..protocol.problems import Problem
from ..protocol.requests import parse_request
from ..protocol.sse import LmspEvents, SseEvent
from ..engine.loader import CAPABILITIES
from ..service import models
from ..service.responses import stored_response
from ..service.run import ResponseRun
from ..service.tasks import LiveTask
from ..store import TaskRecord
from .auth import requires
from .body import read_json
from .context import compact_conversation, owner, start_run, state
from .sse import loading_stream, needs_load, response_start, sse_response

bp = Blueprint("lmsp", __name__, url_prefix="/lmsp/v1")


@bp.get("")
@bp.get("/")
@requires("models:read")
async def service_document():
    listed = await models.all_models(state().engine)
    capabilities = dict.fromkeys(c for d in listed for c in d.get("capabilities", CAPABILITIES))
    return {
        "object": "service",
        "lmsp_version": LMSP_VERSION,
        "service": {"name": "lmsp-mlx", "version": __version__},
        "capabilities": list(capabilities),
        "models": [d["id"] for d in listed],
    }


@bp.get("/openapi.json")
@requires("models:read")
async def openapi():
    """The OpenAPI document of every route."""
    from quart import current_app

    from .openapi import openapi_document

    return openapi_document(current_app)


@bp.get("/models")
@requires("models:read")
async def list_models():
    return {"object": "list", "data": await models.all_models(state().engine)}


@bp.get("/models/<path:model_id>")
@requires("models:read")
async def get_model(model_id: str):
    if model_id.endswith(("/load", "/unload")):  # a GET of an admin route's path
        raise Problem("method_not_allowed", f"{model_id.rpartition('/')[2]} takes POST")
    return await models.one_model(state().engine, model_id)


@bp.post("/models/<path:model_id>/load")
@requires("admin")
async def load_model(model_id: str):
    """Load the model now (a request naming it would load it too); it then idles under --keep-alive."""
    return await models.load(state().engine, model_id)


@bp.post("/models/<path:model_id>/unload")
@requires("admin")
async def unload_model(model_id: str):
    """Unload the model once its running requests end; its KV sessions are checkpointed first."""
    return await models.unload(state().engine, model_id)


@bp.post("/responses")
@requires("responses:write")
async def create_response():
    body = await read_json()
    req = parse_request(body).model_copy(update={"background": None})  # /v1's; tasks are LMSP's background
    key = request.headers.get("Idempotency-Key")
    if key is None:  # the response belongs to this connection (section 6.4)
        if await needs_load(req.model, bool(req.stream)):
            return loading_stream(response_start("lmsp", req), stream_lmsp, _failed)
        run = await start_run("lmsp", req)
        if not req.stream:
            return (await run.run_to_end()).model_dump(mode="json")
        return sse_response(stream_lmsp(run))
    # With a key the work runs as a task, so a retry can wait for it or re-attach to it.
    tasks = state().tasks
    sent = await tasks.start_once(owner(), key, "responses", body, lambda: _start_task(req))
    headers = {"Idempotent-Replayed": "true"} if sent.replayed else {}
    if req.stream:
        return sse_response(await tasks.events(owner(), sent.task_id, 0), headers)
    record = await _ended_task(sent.task_id)
    response = record.response or {}
    if response.get("status") == "failed":
        error = response.get("error") or {}
        raise Problem(error.get("code", "internal_error"), error.get("detail", "generation failed"), headers=headers)
    return response, 200, headers


@bp.post("/responses/compact")
@requires("responses:write")
async def compact_response():
    """Compact a conversation into its user messages and one compaction item.

    An extension of section 6, as on /v1: the item's sealed content resumes the
    conversation's checkpointed KV (or, where that is gone, a summary the model wrote)."""
    return await compact_conversation("lmsp")


@bp.get("/responses/<response_id>")
@requires("responses:read")
async def get_response(response_id: str):
    return (await stored_response(state(), owner(), response_id)).response


@bp.post("/tasks")
@requires("responses:write")
async def create_task():
    body = await read_json()
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        raise Problem("invalid_request", 'the body must be {"request": <responses request>}', param="request")
    req = parse_request(body["request"]).model_copy(update={"background": None})
    key = request.headers.get("Idempotency-Key")
    sent = await state().tasks.start_once(owner(), key, "tasks", body, lambda: _start_task(req))
    headers = {"Location": f"/lmsp/v1/tasks/{sent.task_id}"}
    if sent.replayed:
        headers["Idempotent-Replayed"] = "true"
    return await _task_object(sent.task_id), 202, headers


@bp.get("/tasks/<task_id>")
@requires("responses:read")
async def get_task(task_id: str):
    return await _task_object(task_id)


@bp.get("/tasks/<task_id>/events")
@requires("responses:read")
async def task_events(task_id: str):
    after = _after()
    return sse_response(await state().tasks.events(owner(), task_id, after))


@bp.post("/tasks/<task_id>/cancel")
@requires("responses:write")
async def cancel_task(task_id: str):
    live = state().tasks.live.get(task_id)
    if live is not None and live.owner == owner():
        await live.cancel()
    return await _task_object(task_id)


def _after() -> int:
    """Section 6.4: `?after=N` wins over `Last-Event-ID: N`."""
    raw, where = request.args.get("after"), "after"
    if raw is None:
        raw, where = request.headers.get("Last-Event-ID"), "Last-Event-ID"
    if raw is None or raw.strip() == "":
        return 0
    try:
        after = int(raw)
    except ValueError:
        raise Problem("invalid_request", f"{where} must be an event id (an integer), not {raw!r}", param=where) from None
    if not 0 <= after < 2**63:  # SQLite's INTEGER range; no stream gets near its top
        raise Problem("invalid_request", f"{where} must be an event id from 0 to 2**63-1, not {after}", param=where)
    return after


async def _start_task(req) -> LiveTask:
    run = await start_run("lmsp", req)
    return state().tasks.start(owner(), run, stream_lmsp(run))


async def _ended_task(task_id: str) -> TaskRecord:
    tasks, who = state().tasks, owner()
    live = tasks.live.get(task_id)
    if live is not None:
        await live.wait()
    record = await asyncio.to_thread(tasks.record, who, task_id)
    if record is None:
        raise Problem("task_not_found", f"no task {task_id!r}")
    return record


async def _task_object(task_id: str) -> dict:
    """The task object (docs/api.md, Tasks): the live state while it runs, the stored one after."""
    tasks, who = state().tasks, owner()
    live = tasks.live.get(task_id)
    if live is not None and live.owner == who:
        status, response_id, created = live.status, live.run.id, live.created_at
        response = live.run.response().model_dump(mode="json") if live.done else None
    else:
        record = await asyncio.to_thread(tasks.record, who, task_id)
        if record is None:
            raise Problem("task_not_found", f"no task {task_id!r}")
        status, response_id, created, response = record.status, record.response_id, record.created_at, record.response
    out = {"id": task_id, "object": "task", "status": status, "response_id": response_id, "created_at": int(created)}
    if response is not None and status not in ("queued", "in_progress"):
        out["response"] = response
    return out


def _failed(problem: Problem) -> list[SseEvent]:
    """A refusal once the stream has begun (the model loaded first): section 6.3's order
    still holds, created, then the one final event, failed."""
    event = LmspEvents(new_id("resp"))
    return [event("response.created", status="in_progress"),
            event("response.failed", status="failed", error=problem.document())]


async def stream_lmsp(run: ResponseRun) -> AsyncIterator[SseEvent]:
    """Section 6.3: created, then per output item its added event, deltas and done event
    (section 6.5's argument events for calls), then exactly one final event."""
    event = LmspEvents(run.id)
    try:
        yield event("response.created", status="in_progress")
        async for e in run.events():
            for name, fields in events_for(e, "lmsp"):
                yield event(name, **fields)
        if run.status == "cancelled":
            yield event("response.cancelled", status="cancelled")
            return
        resp = run.response()
        usage = resp.usage.model_dump() if resp.usage else None
        if run.status == "completed":
            yield event("response.completed", status="completed", usage=usage)
        elif run.status == "incomplete":
            yield event(
                "response.incomplete", status="incomplete",
                incomplete_details=resp.incomplete_details.model_dump(), usage=usage,
            )
        else:
            yield event("response.failed", status="failed", error=run.error.document())
    finally:
        run.cancel()
