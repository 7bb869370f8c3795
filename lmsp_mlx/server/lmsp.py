"""LMSP 1.0 routes under /lmsp/v1 (section 6 and PROTOCOL.md)."""

from __future__ import annotations

from quart import Blueprint

from .. import LMSP_VERSION, __version__
from ..protocol.problems import Problem
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
    """Section 6.3: created, item added, text deltas, item done, exactly one final event."""
    event = LmspEvents(run.id)
    try:
        yield event("response.created", status="in_progress")
        item = {"id": run.message_id, "type": "message", "role": "assistant", "content": []}
        yield event("response.output_item.added", output_index=0, item=item)
        async for delta in run.deltas():
            yield event(
                "response.output_text.delta",
                item_id=run.message_id, output_index=0, content_index=0, delta=delta,
            )
        if run.status == "cancelled":
            yield event("response.cancelled", status="cancelled")
            return
        yield event("response.output_item.done", output_index=0, item=run.message().model_dump())
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
