"""The Quart application and its hooks: auth, web origins, LMSP-Version, one log line per
request, problem documents; the routes are the blueprints of this package's modules.

What runs beside the requests (store recovery, the retention sweeper, a shutdown's waits)
is the service's `Lifecycle` (service/lifecycle.py), which the serving hooks start and stop;
`/metrics` is http/metrics.py."""

from __future__ import annotations

import logging
import time

from quart import Quart, Response, g, has_request_context, request, websocket
from werkzeug.exceptions import HTTPException

from .. import LMSP_VERSION
from ..engine.worker import QueueFull
from ..protocol.problems import Problem
from ..service.lifecycle import Lifecycle
from ..service.state import ServerState
from ..store import StoreUnavailable
from . import chat, completions, embeddings, lmsp, messages, metrics, page, responses
from .auth import authorize
from .context import STATE
from .origins import Origins
from .problems import loggable_path, problem_response, queue_full

log = logging.getLogger("lmsp_mlx.server")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def create_app(state: ServerState) -> Quart:
    """The app over the server's state (service/lifecycle.py's `open_state`: a started engine,
    an open store whose last process's unfinished work was already marked failed)."""
    app = Quart("lmsp_mlx")
    app.json.sort_keys = False  # keep the documented field order (id, object, ...)
    app.config["MAX_CONTENT_LENGTH"] = state.settings.server.max_body_bytes
    # Generations can outlast Quart's default 60 s response timeout; disconnects end them instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.extensions[STATE] = state
    for module in (lmsp, responses, chat, completions, embeddings, messages, metrics, page):
        app.register_blueprint(module.bp)
    lifecycle = Lifecycle(state)
    app.before_serving(lifecycle.begin)
    app.after_serving(lifecycle.end)
    _probes(app, state)
    _hooks(app, state)
    _error_handlers(app, state)
    return app


def _probes(app: Quart, state: ServerState) -> None:
    engine = state.engine

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "model": engine.default_id,
                "models_loaded": [m for m in list(engine.models.slots) if engine.models.loaded(m)]}

    @app.get("/")
    async def root():
        # Clients probe it before their first call (Claude Code sends HEAD /): a liveness
        # answer, like /healthz, naming where the APIs are. A browser gets the chat page.
        if page.wants_page():
            return page.page()
        return {"service": "lmsp-mlx", "lmsp": "/lmsp/v1", "openai": "/v1", "anthropic": "/v1/messages"}


def _hooks(app: Quart, state: ServerState) -> None:
    """Before a request: origin, auth and LMSP-Version; after it: the version header, CORS,
    the reply counted for /metrics and its log line."""
    tokens = state.tokens
    origins = Origins(state.settings.server.cors_origins, enforce=not tokens.required)

    @app.before_request
    async def check_auth_and_version():
        g.arrived = time.perf_counter()
        if (answer := origins.preflight(request.method, request.headers)) is not None:
            return answer  # before auth: a browser's preflight carries no token
        try:
            check_request()
        except Problem:
            await drain_body()
            raise

    def check_request() -> None:
        origins.check(request.headers.get("Origin"))
        authorize(tokens, app.view_functions.get(request.endpoint), request.method, request.path, request.headers)
        # Repeated headers (or one with a comma list) must all say 1.0: a proxy that added a
        # second value does not get to pick the one this service reads.
        versions = [v.strip() for h in request.headers.getlist("LMSP-Version") for v in h.split(",") if v.strip()]
        wrong = [v for v in versions if v != LMSP_VERSION]
        if wrong and request.path.startswith("/lmsp/"):
            raise Problem(
                "unsupported_version",
                f"LMSP-Version {wrong[0]!r} is not supported; this service speaks {LMSP_VERSION}",
            )

    async def drain_body() -> None:
        # Hypercorn closes a keep-alive connection whose response ended before the request's
        # body arrived, and a client that sent its next request on it in the meantime gets
        # "disconnected without a response" (a CI run caught it). A refusal made from the
        # headers alone therefore waits for the body, up to the size limit, before it answers.
        try:
            await request.get_data(cache=False)
        except HTTPException:
            pass  # too large: that connection closes either way, and the refusal still goes

    @app.before_websocket
    async def check_websocket_auth():
        try:
            origins.check(websocket.headers.get("Origin"))  # a page reads a WebSocket's replies without CORS
            authorize(tokens, app.view_functions.get(websocket.endpoint), "WEBSOCKET", websocket.path, websocket.headers)
        except Problem as problem:  # returned, not raised: Quart sends it as the handshake's reply
            return problem_response(problem)

    @app.after_request
    async def version_header(resp: Response) -> Response:
        resp.headers["LMSP-Version"] = LMSP_VERSION
        origins.decorate(resp, request.headers.get("Origin"))
        statuses = state.http_statuses
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        # One line per request: a generation's is the worker's (tokens, rates, status), an
        # error's is problem_response's; the rest get theirs here, but for liveness probes.
        if resp.status_code < 400 and not g.get("generation") and request.path not in ("/", "/healthz"):
            log.info("request %s %s status=%d ms=%.0f", request.method, loggable_path(request.path), resp.status_code,
                     (time.perf_counter() - g.get("arrived", time.perf_counter())) * 1000)
        return resp


def _error_handlers(app: Quart, state: ServerState) -> None:
    """Every error is a problem document (http/problems.py renders it in the route's dialect)."""

    @app.errorhandler(Problem)
    async def on_problem(problem: Problem):
        return problem_response(problem)

    @app.errorhandler(QueueFull)
    async def on_queue_full(exc: QueueFull):
        return problem_response(queue_full(exc))

    @app.errorhandler(StoreUnavailable)
    async def on_store_unavailable(exc: StoreUnavailable):
        log.warning("store unavailable: %s", exc)
        return problem_response(Problem("store_unavailable", f"{exc}; requests with store: false are served, and "
                                        "stored work resumes once it can be written", headers={"Retry-After": "5"}))

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException):
        code = _HTTP_CODES.get(exc.code or 500, "invalid_request" if (exc.code or 500) < 500 else "internal_error")
        detail = exc.description or exc.name
        # Keep what the HTTP error itself must say (e.g. `Allow` on a 405).
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        if exc.code == 413:
            detail = f"the request body exceeds {state.settings.server.max_body_bytes} bytes"
            # The body was never read, so the connection closes after this reply: say so, or a
            # pooling client may send its next request down it and lose that one.
            headers["Connection"] = "close"
        problem = Problem(code, detail, headers=headers)
        problem.status = exc.code or problem.status
        return problem_response(problem)

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception):
        method, path = (request.method, request.path) if has_request_context() else ("WEBSOCKET", websocket.path)
        log.exception("unhandled error on %s %s", method, loggable_path(path))
        return problem_response(Problem("internal_error", f"{type(exc).__name__}: {exc}"))
