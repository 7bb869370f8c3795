"""The Quart application: auth, LMSP-Version, problem documents, and the route blueprints."""

from __future__ import annotations

import hmac
import json
import logging

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from .. import LMSP_VERSION
from ..engine.worker import Engine
from ..protocol.problems import Problem
from . import lmsp, openai
from .state import ServerSettings, ServerState

log = logging.getLogger("lmsp_mlx.server")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def problem_response(problem: Problem) -> Response:
    """LMSP routes get RFC 9457 documents; /v1 routes get OpenAI's `{"error": ...}`."""
    if _is_v1(request.path):
        body, mimetype = {"error": problem.openai_error()}, "application/json"
    else:
        body, mimetype = problem.document(), "application/problem+json"
    log.info("request %s %s status=%d code=%s", request.method, request.path, problem.status, problem.code)
    resp = Response(json.dumps(body), status=problem.status, mimetype=mimetype)
    for name, value in problem.headers.items():
        resp.headers[name] = value
    return resp


def create_app(engine: Engine, settings: ServerSettings) -> Quart:
    app = Quart("lmsp_mlx")
    app.json.sort_keys = False  # keep the documented field order (id, object, ...)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    # Generations can outlast Quart's default 60 s response timeout; disconnects end them instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.extensions["lmsp_mlx"] = ServerState(engine=engine, settings=settings)
    app.register_blueprint(lmsp.bp)
    app.register_blueprint(openai.bp)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "model": engine.model.id}

    @app.get("/metrics")
    async def metrics():
        c = engine.counters
        lines = [
            "# TYPE lmsp_queue_depth gauge", f"lmsp_queue_depth {engine.queued}",
            "# TYPE lmsp_busy gauge", f"lmsp_busy {int(engine.busy)}",
            "# TYPE lmsp_requests_total counter",
            *(f'lmsp_requests_total{{status="{k}"}} {v}' for k, v in sorted(c.requests.items())),
            "# TYPE lmsp_prompt_tokens_total counter", f"lmsp_prompt_tokens_total {c.prompt_tokens}",
            "# TYPE lmsp_output_tokens_total counter", f"lmsp_output_tokens_total {c.output_tokens}",
        ]
        return Response("\n".join(lines) + "\n", mimetype="text/plain; version=0.0.4")

    @app.before_request
    async def check_auth_and_version():
        if settings.api_key and request.path != "/healthz":
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            given = token.strip().encode("utf-8", "surrogateescape")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, settings.api_key.encode()):
                raise Problem(
                    "unauthorized",
                    "a valid 'Authorization: Bearer <key>' header is required",
                    headers={"WWW-Authenticate": 'Bearer realm="lmsp"'},
                )
        version = request.headers.get("LMSP-Version")
        if version is not None and version.strip() != LMSP_VERSION and request.path.startswith("/lmsp/"):
            raise Problem(
                "unsupported_version",
                f"LMSP-Version {version!r} is not supported; this service speaks {LMSP_VERSION}",
            )

    @app.after_request
    async def version_header(resp: Response) -> Response:
        resp.headers["LMSP-Version"] = LMSP_VERSION
        return resp

    @app.errorhandler(Problem)
    async def on_problem(problem: Problem):
        return problem_response(problem)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException):
        code = _HTTP_CODES.get(exc.code or 500, "invalid_request" if (exc.code or 500) < 500 else "internal_error")
        detail = exc.description or exc.name
        if exc.code == 413:
            detail = f"the request body exceeds {settings.max_body_bytes} bytes"
        # Keep what the HTTP error itself must say (e.g. `Allow` on a 405).
        keep = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        problem = Problem(code, detail, headers=keep)
        problem.status = exc.code or problem.status
        return problem_response(problem)

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return problem_response(Problem("internal_error", f"{type(exc).__name__}: {exc}"))

    return app
