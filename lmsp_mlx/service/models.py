"""The models as the routes list, load and unload them: each one the server can serve
(engine/catalog.py), whether it is loaded, and its full description once it is."""

from __future__ import annotations

import asyncio
from typing import Any

from ..engine.catalog import reasons
from ..engine.slot import ModelSlot, ModelSpec, SlotState
from ..engine.worker import Engine
from ..protocol.problems import Problem
from .worker_run import WorkerRun


def describe(spec: ModelSpec, slot: ModelSlot | None) -> dict[str, Any]:
    """LMSP's model object: what the loaded model is, or what the directory says of it."""
    if slot is not None and slot.state is SlotState.READY and slot.lm is not None:
        doc = slot.lm.describe()
    else:
        doc = {"id": spec.id, "object": "model", "reasoning": reasons(spec.path)}
    doc["loaded"] = slot is not None and slot.state is SlotState.READY
    doc["state"] = slot.state.value if slot is not None else "unloaded"
    doc["pinned"] = spec.pinned
    return doc


async def all_models(engine: Engine) -> list[dict[str, Any]]:
    return [describe(spec, slot) for spec, slot in await asyncio.to_thread(engine.listing)]


async def one_model(engine: Engine, model_id: str) -> dict[str, Any]:
    for spec, slot in await asyncio.to_thread(engine.listing):
        if spec.id == model_id:
            return describe(spec, slot)
    raise Problem("model_not_found", f"model {model_id!r} is not served here", param="model")


async def load(engine: Engine, model_id: str) -> dict[str, Any]:
    """Load the model now (as a request naming it would); it then idles under --keep-alive."""
    lease = WorkerRun(engine, f"load {model_id}", model_id)
    try:
        await lease.lease()
    finally:
        lease.close()
    return await one_model(engine, model_id)


async def unload(engine: Engine, model_id: str) -> dict[str, Any]:
    """Unload the model once its running requests end, its KV sessions checkpointed first."""
    doc = await one_model(engine, model_id)  # 404 for an unknown id
    if doc["pinned"]:
        raise Problem("invalid_request", f"model {model_id!r} is pinned (--pin): it stays loaded", param="model")
    await engine.unload(model_id)
    try:
        return await one_model(engine, model_id)
    except Problem:  # its files were removed while it was loaded: it is gone now
        return {"id": model_id, "object": "model", "loaded": False, "state": "unloaded", "pinned": False}
