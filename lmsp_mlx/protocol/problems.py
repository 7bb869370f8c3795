"""Problem documents (RFC 9457), the one error type every route raises.

The table of codes and statuses is docs/api.md's (Problem codes); a route raises `Problem` and the
server renders it as `application/problem+json` on LMSP routes, as an OpenAI-style
`{"error": {...}}` on /v1 routes, and as Anthropic's `{"type": "error", "error": {...}}`
on /v1/messages.
"""

from __future__ import annotations

from typing import Any

STATUS = {
    "invalid_request": 400,
    "unsupported_version": 400,
    "unsupported_capability": 400,
    "context_length_exceeded": 400,
    "unknown_call_id": 400,
    "reasoning_state_missing": 400,
    "unauthorized": 401,
    "insufficient_scope": 403,
    "not_found": 404,
    "model_not_found": 404,
    "response_not_found": 404,
    "task_not_found": 404,
    "method_not_allowed": 405,
    "continuation_state_unavailable": 409,
    "event_history_expired": 410,
    "payload_too_large": 413,
    "idempotency_key_reused": 422,
    "queue_full": 429,
    "internal_error": 500,
    "model_load_failed": 503,  # the model exists but its load on demand failed; the loaded ones still serve
    "insufficient_memory": 507,  # the model cannot fit the memory budget beside what must stay loaded
    "model_limit_reached": 503,  # the pinned models take every place --max-loaded-models allows
    "store_unavailable": 503,  # the store cannot be written now (a full disk, a lock another process holds)
    "overloaded": 529,  # Anthropic's: the server cannot take the request now (it is shutting down); retry
}

TITLES = {
    "invalid_request": "Invalid request",
    "unsupported_version": "Unsupported LMSP version",
    "unsupported_capability": "Unsupported capability",
    "context_length_exceeded": "Context length exceeded",
    "unauthorized": "Unauthorized",
    "not_found": "Not found",
    "model_not_found": "Model not found",
    "method_not_allowed": "Method not allowed",
    "payload_too_large": "Payload too large",
    "queue_full": "Queue full",
    "internal_error": "Internal error",
    "model_load_failed": "Model load failed",
    "insufficient_memory": "Insufficient memory",
    "model_limit_reached": "Model limit reached",
    "store_unavailable": "Store unavailable",
    "overloaded": "Overloaded",
}

# OpenAI-style `error.type` for the /v1 rendering of the same problem.
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    507: "server_error",
}


# Anthropic's `error.type` by status (its API's table; 400s and the rest not named here are
# invalid_request_error). A 507 is a server that has no room now, as Anthropic's overload is.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    507: "overloaded_error",
    529: "overloaded_error",
}


class Problem(Exception):
    """An error the client caused or must know about, with its code from docs/api.md."""

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.param = param
        self.status = STATUS[code]
        self.headers = headers or {}

    @property
    def title(self) -> str:
        return TITLES.get(self.code, self.code.replace("_", " ").capitalize())

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "type": f"urn:lmsp:problem:{self.code}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if self.param is not None:
            doc["param"] = self.param
        return doc

    def openai_error(self) -> dict[str, Any]:
        kind = _OPENAI_TYPES.get(self.status, "invalid_request_error")  # OpenAI's 404s are invalid_request_error too
        code = self.code
        if code == "response_not_found" and self.param == "previous_response_id":
            code = "previous_response_not_found"  # the code OpenAI's clients test for
        return {"message": self.detail, "type": kind, "code": code, "param": self.param}

    def anthropic_error(self) -> dict[str, Any]:
        """Anthropic's error object (/v1/messages): its `type` by status; the field a 400
        names leads the message, as Anthropic's own messages do."""
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        message = self.detail
        if self.param and not message.startswith(self.param):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}
