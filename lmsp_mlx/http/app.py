"""The Quart application: auth, web origins, LMSP-Version, problem documents, and the route blueprints."""

from __future__ import annotations

import asyncio
import logging
import time

from quart import Quart, Response, g, has_request_context, request, websocket
from werkzeug.exceptions import HTTPException

from .. import LMSP_VERSION
from ..engine.worker import Engine, QueueFull
from ..protocol.problems import Problem
from ..store import Database, IdempotencyKeys, StoredResponses, TaskLog
from ..service.auth import Tokens
from ..service.sealing import Sealer
from ..service.state import ServerSettings, ServerState
from ..service.tasks import Tasks
from . import chat, completions, lmsp, messages, responses
from .auth import authorize, requires
from .context import STATE
from .origins import Origins
from .problems import loggable_path, problem_response, queue_full

log = logging.getLogger("lmsp_mlx.server")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def create_app(engine: Engine, settings: ServerSettings, tokens: Tokens, db: Database, state_key: bytes) -> Quart:
    """The app over a started engine and an open store; tasks a previous process left
    running are marked failed here, before any request can ask for them. `state_key` seals
    the state clients carry (lmsp_mlx/service/sealing.py)."""
    app = Quart("lmsp_mlx")
    app.json.sort_keys = False  # keep the documented field order (id, object, ...)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    # Generations can outlast Quart's default 60 s response timeout; disconnects end them instead.
    app.config["RESPONSE_TIMEOUT"] = None
    tasks = Tasks(TaskLog(db), IdempotencyKeys(db))
    stored = StoredResponses(db)
    tasks.recover(stored)
    if lost := stored.recover(Problem("internal_error", "the service stopped while this response was "
                                         "running").document()):
        log.warning("%d stored response(s) were running when the service stopped: marked failed", lost)
    app.extensions[STATE] = ServerState(engine, settings, tokens, stored, tasks,
                                             Sealer(state_key, ""))  # each run's: Sealer.for_model
    app.register_blueprint(lmsp.bp)
    app.register_blueprint(responses.bp)
    app.register_blueprint(chat.bp)
    app.register_blueprint(completions.bp)
    app.register_blueprint(messages.bp)

    @app.before_serving
    async def start_sweeper():
        engine.begin_serving()
        app.extensions["lmsp_mlx_sweeper"] = asyncio.create_task(_sweep_forever(settings, stored, tasks))

    @app.after_serving
    async def stop_background():
        app.extensions["lmsp_mlx_sweeper"].cancel()
        await tasks.shutdown()
        # Stored responses still running (their streams were ended by the shutdown) are
        # kept as they ended before the process goes.
        running = [r.run.ended() for r in list(app.extensions[STATE].running.values())]
        if running:
            await asyncio.wait([asyncio.ensure_future(r) for r in running], timeout=10)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "model": engine.default_id,
                "models_loaded": [m for m in list(engine.models.slots) if engine.models.loaded(m)]}

    @app.get("/")
    async def root():
        # Clients probe it before their first call (Claude Code sends HEAD /): a liveness
        # answer, like /healthz, naming where the APIs are.
        return {"service": "lmsp-mlx", "lmsp": "/lmsp/v1", "openai": "/v1", "anthropic": "/v1/messages"}

    @app.get("/metrics")
    @requires("admin")
    async def metrics():
        c, memory = engine.counters, engine.memory()
        lines = [
            "# TYPE lmsp_queue_depth gauge", f"lmsp_queue_depth {engine.queued}",
            "# TYPE lmsp_busy gauge", f"lmsp_busy {int(engine.busy)}",
            "# TYPE lmsp_batch_sequences gauge", f"lmsp_batch_sequences {engine.running}",
            "# TYPE lmsp_batch_max gauge", f"lmsp_batch_max {engine.max_batch}",
            "# TYPE lmsp_models_loaded gauge",
            f"lmsp_models_loaded {sum(engine.models.loaded(m) for m in list(engine.models.slots))}",
            "# TYPE lmsp_requests_total counter",
            *(f'lmsp_requests_total{{status="{k}"}} {v}' for k, v in sorted(c.requests.items())),
            "# TYPE lmsp_prompt_tokens_total counter", f"lmsp_prompt_tokens_total {c.prompt_tokens}",
            "# TYPE lmsp_output_tokens_total counter", f"lmsp_output_tokens_total {c.output_tokens}",
            "# TYPE lmsp_kv_lookups_total counter",
            *(f'lmsp_kv_lookups_total{{source="{k}"}} {v}' for k, v in sorted(c.lookups.items())),
            "# TYPE lmsp_kv_live_continuations_total counter",
            f"lmsp_kv_live_continuations_total {c.live_continuations}",
            "# TYPE lmsp_kv_sessions gauge", f"lmsp_kv_sessions {memory.kv_sessions}",
            "# TYPE lmsp_kv_resident_bytes gauge", f"lmsp_kv_resident_bytes {memory.kv_bytes}",
            "# TYPE lmsp_mlx_active_bytes gauge", f"lmsp_mlx_active_bytes {memory.mlx_active_bytes}",
            "# TYPE lmsp_mlx_cache_bytes gauge", f"lmsp_mlx_cache_bytes {memory.mlx_cache_bytes}",
            "# TYPE lmsp_http_responses_total counter",
            *(f'lmsp_http_responses_total{{code="{k}"}} {v}'
              for k, v in sorted(app.extensions[STATE].http_statuses.items())),
        ]
        return Response("\n".join(lines) + "\n", mimetype="text/plain; version=0.0.4")

    origins = Origins(settings.cors_origins, enforce=not tokens.required)

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
        statuses = app.extensions[STATE].http_statuses
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        # One line per request: a generation's is the worker's (tokens, rates, status), an
        # error's is problem_response's; the rest get theirs here, but for liveness probes.
        if resp.status_code < 400 and not g.get("generation") and request.path not in ("/", "/healthz"):
            log.info("request %s %s status=%d ms=%.0f", request.method, loggable_path(request.path), resp.status_code,
                     (time.perf_counter() - g.get("arrived", time.perf_counter())) * 1000)
        return resp

    @app.errorhandler(Problem)
    async def on_problem(problem: Problem):
        return problem_response(problem)

    @app.errorhandler(QueueFull)
    async def on_queue_full(exc: QueueFull):
        return problem_response(queue_full(exc))

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException):
        code = _HTTP_CODES.get(exc.code or 500, "invalid_request" if (exc.code or 500) < 500 else "internal_error")
        detail = exc.description or exc.name
        if exc.code == 413:
            detail = f"the request body exceeds {settings.max_body_bytes} bytes"
        # Keep what the HTTP error itself must say (e.g. `Allow` on a 405).
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        problem = Problem(code, detail, headers=headers)
        problem.status = exc.code or problem.status
        return problem_response(problem)

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception):
        method, path = (request.method, request.path) if has_request_context() else ("WEBSOCKET", websocket.path)
        log.exception("unhandled error on %s %s", method, loggable_path(path))
        return problem_response(Problem("internal_error", f"{type(exc).__name__}: {exc}"))

    return app


async def _sweep_forever(settings: ServerSettings, stored: StoredResponses, tasks: Tasks) -> None:
    """Delete what is past retention, at a tenth of the shorter retention (at most every minute)."""
    period = min(60.0, settings.event_retention / 10, settings.store_retention / 10)
    while True:
        try:
            now = time.time()
            gone = await asyncio.to_thread(stored.sweep, now - settings.store_retention)
            logs, old = await asyncio.to_thread(tasks.log.sweep, now - settings.event_retention, now - settings.store_retention)
            keys = await asyncio.to_thread(tasks.keys.sweep)
            if gone or logs or old or keys:
                log.info("store sweep: %d responses, %d task event logs, %d tasks, %d idempotency keys removed",
                         gone, logs, old, keys)
        except Exception:
            log.exception("store sweep failed")
        await asyncio.sleep(period)
