"""Errors as HTTP answers: a `Problem` as an RFC 9457 document (LMSP routes) or OpenAI's
`{"error": ...}` (/v1 routes), logged in one line; and the engine's own refusals turned
into problems (a full queue is 429 with `Retry-After`)."""

from __future__ import annotations

import json
import logging
import re

from quart import Response, has_request_context, request, websocket

from ..engine.worker import QueueFull
from ..protocol.problems import Problem

log = logging.getLogger("lmsp_mlx.server")


def queue_full(exc: QueueFull) -> Problem:
    return Problem("queue_full", str(exc), headers={"Retry-After": str(exc.retry_after)})


def loggable_path(path: str) -> str:
    """A request path as a log line may show it: decoded control characters (%0a, %00)
    escaped, so a URL cannot forge or break lines."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", path)


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def problem_response(problem: Problem) -> Response:
    """LMSP routes get RFC 9457 documents; /v1 routes get OpenAI's `{"error": ...}`, and
    Anthropic's Messages its `{"type": "error", ...}`. A refused WebSocket handshake gets the
    same document as an HTTP reply."""
    method, path = (request.method, request.path) if has_request_context() else ("WEBSOCKET", websocket.path)
    if _is_anthropic(path):
        body, mimetype = problem.anthropic_error(), "application/json"
    elif _is_v1(path):
        body, mimetype = {"error": problem.openai_error()}, "application/json"
    else:
        body, mimetype = problem.document(), "application/problem+json"
    detail = problem.detail if len(problem.detail) <= 300 else problem.detail[:300] + "..."
    log.info("request %s %s status=%d code=%s%s detail=%r", method, loggable_path(path), problem.status, problem.code,
             f" param={problem.param}" if problem.param else "", detail)
    resp = Response(json.dumps(body), status=problem.status, mimetype=mimetype)
    for name, value in problem.headers.items():
        resp.headers[name] = value
    return resp
