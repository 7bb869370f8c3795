"""OpenAI-style compatibility routes (/v1) for the clients people already use.

Same engine, Open Responses framing: lifecycle events carry the whole response object,
deltas carry output_index/content_index, the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

from quart import Blueprint

from ..protocol.problems import Problem
from ..protocol.responses import v1_response
from .run import ResponseRun, start_run
from .sse import OpenResponsesEvents, sse_response
from .state import state

bp = Blueprint("openai", __name__, url_prefix="/v1")


def _model_object() -> dict:
    lm = state().engine.model
    return {"id": lm.id, "object": "model", "created": 0, "owned_by": "lmsp-mlx"}


@bp.get("/models")
async def list_models():
    return {"object": "list", "data": [_model_object()]}


@bp.get("/models/<path:model_id>")
async def get_model(model_id: str):
    if model_id != state().engine.model.id:
        raise Problem("model_not_found", f"model {model_id!r} is not served here", param="model")
    return _model_object()


@bp.post("/responses")
async def create_response():
    run = await start_run("v1")
    if not run.req.stream:
        return v1_response(await run.run_to_end(), run.req, run.completed_at)
    return sse_response(stream_v1(run))


async def stream_v1(run: ResponseRun):
    event = OpenResponsesEvents()
    item_id = run.message_id

    def snapshot():
        return v1_response(run.response(), run.req, run.completed_at)

    try:
        yield event("response.created", response=snapshot())
        yield event("response.in_progress", response=snapshot())
        item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        yield event("response.output_item.added", output_index=0, item=item)
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=empty)
        async for delta in run.deltas():
            yield event(
                "response.output_text.delta",
                item_id=item_id, output_index=0, content_index=0, delta=delta, logprobs=[],
            )
        if run.status == "cancelled":  # only a shutdown cancels a run someone still reads
            yield event("error", code="cancelled", message="the server is shutting down", param=None)
            yield OpenResponsesEvents.DONE
            return
        final = snapshot()
        done_item = final["output"][0] if final["output"] else {**item, "status": "incomplete"}
        part = done_item["content"][0] if done_item["content"] else empty
        yield event(
            "response.output_text.done",
            item_id=item_id, output_index=0, content_index=0, text=part["text"], logprobs=[],
        )
        yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=done_item)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            run.status, "response.failed"
        )
        yield event(kind, response=final)
        yield OpenResponsesEvents.DONE
    finally:
        run.cancel()
