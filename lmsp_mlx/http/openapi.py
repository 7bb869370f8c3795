"""GET /lmsp/v1/openapi.json: the OpenAPI 3.1 document of every route this app serves.

Built from the app itself, so it cannot drift from it: the paths and methods come from the
URL map, each operation's summary from its view's docstring, its security scope from
`@requires`, and the request and response schemas from the pydantic wire types.
"""

from __future__ import annotations

import re
from typing import Any

from quart import Quart

from .. import LMSP_VERSION, __version__
from ..protocol.chat import ChatRequest
from ..protocol.completions import CompletionRequest
from ..protocol.embeddings import EmbeddingRequest
from ..protocol.messages import CountTokensRequest, MessagesRequest
from ..protocol.problems import STATUS
from ..protocol.requests import ResponsesRequest
from ..protocol.responses import ResponseObject

_REF = "#/components/schemas/{model}"


def _schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (ResponsesRequest, ResponseObject, ChatRequest, CompletionRequest, EmbeddingRequest, MessagesRequest,
                  CountTokensRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas["Problem"] = {
        "type": "object",
        "required": ["type", "title", "status", "detail", "code"],
        "properties": {
            "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
            "detail": {"type": "string"}, "code": {"type": "string", "enum": sorted(STATUS)},
            "param": {"type": "string"},
        },
    }
    schemas["AnthropicError"] = {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"enum": ["invalid_request_error", "authentication_error", "permission_error",
                                             "not_found_error", "request_too_large", "rate_limit_error",
                                             "api_error", "overloaded_error"]},
                           "message": {"type": "string"}}}},
    }
    schemas["Compaction"] = {
        "type": "object", "required": ["id", "object", "created_at", "output", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "response.compaction"}, "created_at": {"type": "integer"},
            "output": {"type": "array", "description": "the user messages, then one compaction item",
                       "items": {"type": "object"}},
            "usage": {"$ref": _REF.format(model="ResponseUsage")},
        },
    }
    schemas["Task"] = {
        "type": "object", "required": ["id", "object", "status", "response_id", "created_at"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "task"},
            "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
            "response_id": {"type": "string"}, "created_at": {"type": "integer"},
            "response": {"$ref": _REF.format(model="ResponseObject"), "description": "once the task ended"},
        },
    }
    schemas["TaskCreate"] = {"type": "object", "required": ["request"],
                             "properties": {"request": {"$ref": _REF.format(model="ResponsesRequest")}}}
    return schemas


def _operation(app: Quart, endpoint: str, method: str, path: str) -> dict[str, Any]:
    view = app.view_functions[endpoint]
    doc = (view.__doc__ or endpoint.rsplit(".", 1)[-1].replace("_", " ")).strip().splitlines()[0]
    op: dict[str, Any] = {"operationId": endpoint.replace(".", "_"), "summary": doc,
                          "responses": {"default": {"description": "a problem document (RFC 9457)", "content": {
                              "application/problem+json": {"schema": {"$ref": _REF.format(model="Problem")}}}}}}
    if path.startswith("/v1/messages"):  # Anthropic's error shape
        op["responses"]["default"] = _json("Anthropic's error object", "AnthropicError")
        op["responses"]["default"]["description"] = "Anthropic's error object"
    scope = getattr(view, "required_scope", None)
    if scope:
        op["security"] = [{"bearer": [scope]}]
    params = re.findall(r"{(\w+)}", path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    body = {"/lmsp/v1/responses": "ResponsesRequest", "/v1/responses": "ResponsesRequest",
            "/lmsp/v1/responses/compact": "ResponsesRequest", "/v1/responses/compact": "ResponsesRequest",
            "/lmsp/v1/tasks": "TaskCreate", "/v1/chat/completions": "ChatRequest",
            "/v1/completions": "CompletionRequest", "/v1/messages": "MessagesRequest",
            "/v1/messages/count_tokens": "CountTokensRequest", "/v1/embeddings": "EmbeddingRequest"}.get(path) if method == "post" else None
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(model=body)}}}}
    op["responses"].update(_answers(method, path))
    if path.endswith("/tasks/{task_id}/events"):
        op["parameters"] += [
            {"name": "after", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0},
             "description": "replay the events after this id (wins over Last-Event-ID)"},
            {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "integer", "minimum": 0},
             "description": "the last event id the client saw (SSE reconnect)"}]
    if method == "get" and path == "/v1/responses/{response_id}":
        op["parameters"] += [
            {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"},
             "description": "a background response's events instead, live while it runs"},
            {"name": "starting_after", "in": "query", "required": False, "schema": {"type": "integer", "minimum": -1},
             "description": "with stream: the events after this sequence number"}]
        op["responses"]["200"]["content"].update(_SSE)
    return op


def _json(description: str, model: str | None = None) -> dict[str, Any]:
    schema = {"$ref": _REF.format(model=model)} if model else {"type": "object"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _answers(method: str, path: str) -> dict[str, Any]:
    """The route's answers besides problem documents."""
    if path.endswith("/responses/compact"):
        return {"200": _json("the compacted conversation", "Compaction")}
    if method == "post" and path in ("/lmsp/v1/responses", "/v1/responses"):
        ok = _json("the response object; with stream: true its events instead", "ResponseObject")
        ok["content"].update(_SSE)
        return {"200": ok}
    if method == "post" and path == "/v1/chat/completions":
        ok = _json("a chat.completion; with stream: true chat.completion.chunk events instead")
        ok["content"].update(_SSE)
        return {"200": ok}
    if method == "post" and path == "/v1/messages":
        ok = _json("a message; with stream: true Anthropic's message events instead")
        ok["content"].update(_SSE)
        return {"200": ok}
    if method == "post" and path == "/v1/messages/count_tokens":
        return {"200": _json("{\"input_tokens\": N}")}
    if method == "post" and path == "/v1/completions":
        ok = _json("a text_completion; with stream: true its chunks instead")
        ok["content"].update(_SSE)
        return {"200": ok}
    if method == "post" and path == "/lmsp/v1/tasks":
        accepted = _json("the task, queued; Location names it", "Task")
        accepted["headers"] = {"Location": {"schema": {"type": "string"}, "description": "the task's URL"}}
        return {"202": accepted}
    if path.endswith("/tasks/{task_id}/events"):
        return {"200": {"description": "the task's events after `after` / Last-Event-ID, then live ones until a "
                                       "final event", "content": _SSE}}
    if path.startswith("/lmsp/v1/tasks/"):
        return {"200": _json("the task", "Task")}
    if method == "get" and path.endswith("/responses/{response_id}"):
        return {"200": _json("the stored response", "ResponseObject")}
    return {"200": {"description": "OK"}}


def openapi_document(app: Quart) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.websocket:
            continue
        path = re.sub(r"<(?:[^:>]+:)?(\w+)>", r"{\1}", rule.rule)
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _operation(app, rule.endpoint, method.lower(), path)
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmsp-mlx", "version": __version__,
                 "description": f"LMSP {LMSP_VERSION} (its Responses chapter, section 6), with OpenAI-style /v1 routes and Anthropic's /v1/messages."},
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "scopes: responses:write, responses:read, models:read, admin"}},
        },
    }
