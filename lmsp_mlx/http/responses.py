"""OpenAI-style compatibility routes (/v1) for the clients people already use.

Same engine, Open Responses framing: lifecycle events carry the whole response object,
deltas carry output_index/content_index, the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from quart import Blueprint, request, websocket

from ..engine.worker import QueueFull
from ..protocol.item_events import events_for
from ..protocol.problems import Problem
from ..protocol.requests import json_object, parse_request
from ..protocol.responses import ResponseObject, v1_input_item, v1_response
from ..protocol.sse import OpenResponsesEvents, SseEvent, V1Event
from ..service import models
from ..service.responses import new_run, stored_response
from ..service.run import ResponseRun
from ..store.responses import Stored
from .auth import requires
from .body import decode_json, read_json
from .context import compact_conversation, owner, start_run, state
from .problems import queue_full
from .sse import loading_stream, needs_load, response_start, sse_response

bp = Blueprint("openai", __name__, url_prefix="/v1")


def _model_object(doc: dict) -> dict:
    """OpenAI's model object, Anthropic's fields beside it (`type`, `display_name`,
    `created_at`: the Anthropic SDK's models.list reads the same route), and whether the
    model is loaded now."""
    return {"id": doc["id"], "object": "model", "created": 0, "owned_by": "lmsp-mlx",
            "type": "model", "display_name": doc["id"], "created_at": "1970-01-01T00:00:00Z", "loaded": doc["loaded"]}


@bp.get("/models")
@requires("models:read")
async def list_models():
    data = [_model_object(d) for d in await models.all_models(state().engine)]
    return {"object": "list", "data": data, "has_more": False,  # and Anthropic's page fields
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@bp.get("/models/<path:model_id>")
@requires("models:read")
async def get_model(model_id: str):
    return _model_object(await models.one_model(state().engine, model_id))


@bp.post("/responses")
@requires("responses:write")
async def create_response():
    body = await read_json()
    req = parse_request(body)
    if isinstance(body, dict) and body.get("store") is None:
        req = req.model_copy(update={"store": True})  # OpenAI's default, which its clients rely on
    if req.background and not req.store:
        raise Problem("invalid_request", "a background response must be stored (store: true) to be polled",
                      param="store")
    if await needs_load(req.model, bool(req.stream)) and not req.background:
        return loading_stream(response_start("v1", req), stream_v1, _stream_error)
    run = await start_run("v1", req)
    if req.background:  # a task: GET /v1/responses/{id} polls it (or streams it again), .../cancel stops it
        task = state().tasks.start(owner(), run, _logged(stream_v1(run)), framing="v1")
        if req.stream:  # leaving this stream leaves the task running
            return sse_response(_framed(task.follow(0)))
        return {**v1_response(run.response(), run.req, None), "status": task.status}
    if not run.req.stream:
        return v1_response(await run.run_to_end(), run.req, run.completed_at)
    return sse_response(stream_v1(run))


@bp.post("/responses/input_tokens")
@requires("responses:write")
async def count_input_tokens():
    """Count a request's prompt tokens (instructions, tools, history included) without generating."""
    body = json_object(await read_json())
    body.setdefault("model", state().engine.default_id)  # optional here, as on OpenAI
    body.setdefault("input", [])
    run = await new_run(state(), owner(), "v1", parse_request(body))
    try:
        prompt = (await run.prompt())[2]
    finally:
        run.close()
    return {"object": "response.input_tokens", "input_tokens": len(prompt.tokens)}


@bp.post("/responses/<response_id>/cancel")
@requires("responses:write")
async def cancel_response(response_id: str):
    """Cancel a background response; one that has ended is returned as it is."""
    s, who = state(), owner()
    task = next((t for t in list(s.tasks.live.values()) if t.run.id == response_id and t.owner == who), None)
    if task is None:
        stored = await stored_response(state(), owner(), response_id)
        req = parse_request(stored.request)
        if not req.background:
            raise Problem("invalid_request", "only a background response can be cancelled", param="response_id")
        return v1_response(ResponseObject.model_validate(stored.response), req, stored.completed_at)
    if not task.run.req.background:
        raise Problem("invalid_request", "only a background response can be cancelled", param="response_id")
    await task.cancel()
    return v1_response(task.run.response(), task.run.req, task.run.completed_at)


@bp.post("/responses/compact")
@requires("responses:write")
async def compact_response():
    """Compact a conversation into its user messages and one compaction item.

    The item's sealed content resumes the conversation's checkpointed KV (or, where that
    is gone, a summary the model wrote)."""
    return await compact_conversation("v1")


@bp.get("/responses/<response_id>")
@requires("responses:read")
async def get_response(response_id: str):
    if request.args.get("stream", "false").lower() in ("true", "1"):
        return await _stream_again(response_id)
    stored = await stored_response(state(), owner(), response_id)
    req = parse_request(stored.request)
    out = v1_response(ResponseObject.model_validate(stored.response), req, stored.completed_at)
    running = state().running.get(response_id)
    return _queued(out, running.run) if running is not None else out


def _queued(out: dict, run: ResponseRun) -> dict:
    """OpenAI's status for a response the model has not started on yet: `queued`."""
    if out["status"] == "in_progress" and run.waiting:
        out["status"] = "queued"
    return out


async def _stream_again(response_id: str):
    """A background response's events from the start, or after `starting_after` (a
    sequence number): the live ones follow while it runs. Resumes a stream the client lost."""
    raw = request.args.get("starting_after", "-1")
    try:
        after = min(int(raw), 2**62)  # past every event, and within SQLite's integers
    except ValueError:
        after = -2
    if after < -1:
        raise Problem("invalid_request", f"starting_after must be a sequence number, got {raw!r}",
                      param="starting_after")
    s, who = state(), owner()
    record = await asyncio.to_thread(s.tasks.log.of_response, who, response_id)
    if record is None or record.framing != "v1":
        await stored_response(state(), owner(), response_id)  # 404 unless stored
        raise Problem("invalid_request", "only a response created with background: true on /v1 can be streamed "
                      "again; GET it without stream", param="stream")
    try:
        events = await s.tasks.events(who, record.id, after + 1)  # the SSE id of sequence number n is n + 1
    except Problem as problem:
        if problem.code != "event_history_expired":
            raise
        raise Problem(problem.code, f"the events of response {response_id!r} are past their retention; "
                      f"GET /v1/responses/{response_id} has its final result") from None
    return sse_response(_framed(events))


async def _logged(events: AsyncIterator[V1Event | str]) -> AsyncIterator[SseEvent]:
    """A /v1 stream as a task's event log keeps it: event n (from 1) is sequence number n - 1."""
    async for e in events:
        if isinstance(e, V1Event):
            yield SseEvent(e.data["sequence_number"] + 1, e.data["type"], e.data)


async def _framed(events: AsyncIterator[SseEvent]) -> AsyncIterator[V1Event | str]:
    async for e in events:
        yield V1Event(e.data)
    yield OpenResponsesEvents.DONE


@bp.delete("/responses/<response_id>")
@requires("responses:write")
async def delete_response(response_id: str):
    """Delete a stored response."""
    if (await stored_response(state(), owner(), response_id)).completed_at is None:  # 404 unless stored
        raise Problem("invalid_request", f"response {response_id!r} is still in progress; cancel its task first")
    if not await asyncio.to_thread(state().responses.delete, owner(), response_id):
        raise Problem("response_not_found", f"no stored response {response_id!r}")
    await asyncio.to_thread(state().tasks.log.forget_response, owner(), response_id)  # its events held it too
    return {"id": response_id, "object": "response", "deleted": True}


@bp.get("/responses/<response_id>/input_items")
@requires("responses:read")
async def list_input_items(response_id: str):
    """The input items of a stored response (its own, not those of the chain before it)."""
    stored = await stored_response(state(), owner(), response_id)
    items = [v1_input_item(item, f"{response_id}_{i}") for i, item in enumerate(stored.request.get("input", []))]
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise Problem("invalid_request", 'order must be "asc" or "desc"', param="order")
    limit = request.args.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise Problem("invalid_request", "limit must be an integer from 1 to 100", param="limit")
    items = items[::-1] if order == "desc" else items
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise Problem("invalid_request", f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[: int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


@bp.websocket("/responses")
@requires("responses:write")
async def responses_socket():
    """WebSocket mode: each `response.create` message (a POST /v1/responses body, without
    `stream`) runs one response and gets its events back as JSON messages, one response
    at a time. previous_response_id chains within the connection even with `store: false`.
    A bad message gets an `error` event and the connection stays open. A continuation that
    fails (refused, or ended `failed`) evicts the response it continued from the
    connection's state: naming it again is `previous_response_not_found`, as Open Responses
    requires, so that a client never continues state a failure may have left half-used."""
    local: dict[str, Stored] = {}
    while True:
        raw = await websocket.receive()
        body = None
        try:
            body = decode_json(raw, "the message")
            if not isinstance(body, dict) or body.get("type") != "response.create":
                raise Problem("invalid_request", 'expected a {"type": "response.create", ...} message', param="type")
            if body.get("background"):
                raise Problem("invalid_request", "background is not supported over the WebSocket: use POST "
                              "/v1/responses", param="background")
            fields = {k: v for k, v in body.items() if k not in ("type", "stream", "background")}
            req = parse_request(fields)
            if fields.get("store") is None:
                req = req.model_copy(update={"store": True})  # as on HTTP
            run = await start_run("v1", req, local)
        except (Problem, QueueFull) as refused:
            if isinstance(refused, Problem):  # a 429 is load, not a failed continuation
                _evict_continued(local, body)
            await websocket.send(_error_message(queue_full(refused) if isinstance(refused, QueueFull) else refused))
            continue
        try:
            async for e in stream_v1(run):
                if isinstance(e, V1Event):
                    await websocket.send(e.message())
        finally:
            run.cancel()  # the client left mid-response
        if run.status == "failed":
            _evict_continued(local, body)


def _evict_continued(local: dict[str, Stored], body) -> None:
    """Forget the connection-local response a failed `response.create` continued."""
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if isinstance(previous, str):
        local.pop(previous, None)


def _error_message(problem: Problem) -> str:
    err = problem.openai_error()
    return json.dumps({"type": "error", "sequence_number": 0, "status": problem.status,
                       "code": err["code"], "message": err["message"], "param": err["param"], "error": err})


def _stream_error(problem: Problem) -> list:
    """A refusal once the stream has begun: Open Responses' error event, then [DONE]."""
    return [OpenResponsesEvents()("error", code=problem.code, message=problem.detail, param=problem.param),
            OpenResponsesEvents.DONE]


async def stream_v1(run: ResponseRun):
    """Open Responses order: created, in_progress (a queued run's once its output begins);
    per item its added event, part events, deltas, done events; then the final response
    event and `[DONE]`."""
    event = OpenResponsesEvents()

    def snapshot():
        return _queued(v1_response(run.response(), run.req, run.completed_at), run)

    try:
        queued = run.waiting  # behind other requests: in_progress once its output begins
        yield event("response.created", response=snapshot())
        if not queued:
            yield event("response.in_progress", response=snapshot())
        async for e in run.events():
            if queued:
                queued = False
                yield event("response.in_progress", response=snapshot())
            for name, fields in events_for(e, "v1"):
                yield event(name, **fields)
        if run.status == "cancelled" and run.req.background:  # POST .../cancel, or a shutdown
            # Open Responses has no cancelled event: its final failure event, with the status that says why
            yield event("response.failed", response=snapshot())
            yield OpenResponsesEvents.DONE
            return
        if run.status == "cancelled":  # only a shutdown cancels a run someone still reads
            yield event("error", code="cancelled", message="the server is shutting down", param=None)
            yield OpenResponsesEvents.DONE
            return
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            run.status, "response.failed"
        )
        yield event(kind, response=snapshot())
        yield OpenResponsesEvents.DONE
    finally:
        run.cancel()
