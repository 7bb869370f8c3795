"""What a route knows of the request it serves: the server's state (the app's one
`ServerState`) and the caller's owner (http/auth.py sets `g.identity` before the route).
Routes hand both to the response service explicitly."""

from __future__ import annotations

from quart import current_app, g

from ..protocol.requests import ResponsesRequest
from ..protocol.routes import Route
from ..service import responses
from ..service.run import ResponseRun
from ..service.state import ServerState
from ..store.responses import Stored
from .body import read_json

STATE = "lmsp_mlx"  # the app.extensions key of the ServerState


def state() -> ServerState:
    return current_app.extensions[STATE]


def owner() -> str:
    return g.identity.owner


def generation_logged() -> None:
    """This request's log line is the worker's (tokens, rates, status): app.py writes none."""
    g.generation = True


async def start_run(route: Route, req: ResponsesRequest, local: dict[str, Stored] | None = None,
                    stop: tuple[str, ...] = ()) -> ResponseRun:
    """The service's start_run (service/responses.py) for this request's caller; the
    request's log line is then the worker's."""
    run = await responses.start_run(state(), owner(), route, req, local, stop=stop)
    generation_logged()
    return run


async def compact_conversation(route: Route) -> dict:
    """POST .../responses/compact for this request's caller (service/responses.py)."""
    answer = await responses.compact(state(), owner(), route, await read_json())
    generation_logged()
    return answer
