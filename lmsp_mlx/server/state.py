"""What the routes share: the engine (which owns the model) and the server's settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from quart import current_app, request

from ..engine.worker import Engine
from ..protocol.problems import Problem
from ..protocol.requests import ResponsesRequest, parse_request


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    prefill_step: int = 256
    max_body_bytes: int = 16 * 1024 * 1024


@dataclass
class ServerState:
    engine: Engine
    settings: ServerSettings


def state() -> ServerState:
    return current_app.extensions["lmsp_mlx"]


async def read_request() -> ResponsesRequest:
    """The body as a validated request; malformed JSON is 400 `invalid_request`."""
    raw = await request.get_data()
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Problem("invalid_request", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise Problem("invalid_request", "the body nests JSON too deeply") from None
    return parse_request(body)
