"""LMSP 1.0 routes under /lmsp/v1 (section 6 and PROTOCOL.md)."""

from __future__ import annotations

from quart import Blueprint

from .. import LMSP_VERSION, __version__
from ..protocol.problems import Problem
from ..protocol.responses import FunctionCallOutput
from .run import ResponseRun, start_run
from .sse import LmspEvents, sse_response
from .state import state

bp = Blueprint("lmsp", __name__, url_prefix="/lmsp/v1")


@bp.get("")
@bp.get("/")
async def service_document():
    lm = state().engine.model
    return {
        "object": "service",
        "lmsp_version": LMSP_VERSION,
        "service": {"name": "lmsp-mlx", "version": __version__},
        "capabilities": list(lm.capabilities),
        "models": [lm.id],
    }


@bp.get("/models")
async def list_models():
    return {"object": "list", "data": [state().engine.model.describe()]}


@bp.get("/models/<path:model_id>")
async def get_model(model_id: str):
    lm = state().engine.model
    if model_id != lm.id:
        raise Problem("model_not_found", f"model {model_id!r} is not served here")
    return lm.describe()


@bp.post("/responses")
async def create_response():
    run = await start_run("lmsp")
    if not run.req.stream:
        return (await run.run_to_end()).model_dump(mode="json")
    return sse_response(stream_lmsp(run))


@bp.get("/responses/<response_id>")
async def get_response(response_id: str):
    # Section 6.2: optional, needs the `conversations` capability; nothing is stored yet.
    raise Problem("response_not_found", f"response {response_id!r} is not stored on this service")


async def stream_lmsp(run: ResponseRun):
    """Section 6.3: created, then per output item its added event, deltas and done event
    (section 6.5's argument events for calls), then exactly one final event."""
    event = LmspEvents(run.id)
    try:
        yield event("response.created", status="in_progress")
        async for e in run.events():
            where = {"item_id": e.item.id, "output_index": e.index}
            if e.kind == "added":
                yield event("response.output_item.added", output_index=e.index, item=e.item.model_dump())
            elif e.kind == "text":
                yield event("response.output_text.delta", **where, content_index=0, delta=e.delta)
            elif e.kind == "reasoning":
                yield event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=e.delta)
            elif e.kind == "arguments":
                yield event("response.function_call_arguments.delta", **where, delta=e.delta)
            elif e.kind == "done":
                if isinstance(e.item, FunctionCallOutput):
                    yield event("response.function_call_arguments.done", **where, arguments=e.item.arguments)
                yield event("response.output_item.done", output_index=e.index, item=e.item.model_dump())
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
            yield event("response.failed", status="failed", error=run.error)
    finally:
        run.cancel()
