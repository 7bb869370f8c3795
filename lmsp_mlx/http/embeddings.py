"""POST /v1/embeddings: OpenAI's embeddings API (service/embeddings.py does the work)."""

from __future__ import annotations

from quart import Blueprint

from ..protocol.embeddings import parse_embedding
from ..service.embeddings import create_embeddings
from .auth import requires
from .body import read_json
from .context import state

bp = Blueprint("embeddings", __name__, url_prefix="/v1")


@bp.post("/embeddings")
@requires("responses:write")
async def embeddings():
    """One vector per input, as OpenAI's SDK reads them (float lists or base64)."""
    req = parse_embedding(await read_json())
    s = state()
    return await create_embeddings(s.engine, req, s.settings.engine.prefill_chunk)
