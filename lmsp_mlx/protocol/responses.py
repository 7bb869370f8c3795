"""Response objects (section 6.2) and their OpenAI/Open Responses rendering for /v1."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, Field, model_serializer

from .requests import ReasoningSettings

Status = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


class OutputTextPart(BaseModel):
    """`logprobs`: the text's token entries (protocol/logprobs.py `openai_entries`), only
    where the request asked for them; otherwise the part has no such field."""

    type: Literal["output_text"] = "output_text"
    text: str
    logprobs: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict[str, Any]:
        out = handler(self)
        if self.logprobs is None:
            out.pop("logprobs", None)
        return out


class MessageOutput(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class FunctionCallOutput(BaseModel):
    """A call the model made (section 6.5); `arguments` is a JSON-encoded string."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str


class CustomToolCallOutput(BaseModel):
    """/v1 only: a call of a Codex-style `custom` tool; `input` is its raw text."""

    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningOutput(BaseModel):
    """The model's reasoning (section 6.2): here the reasoning text itself, not a summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryText]
    # /v1 with include ["reasoning.encrypted_content"]: the sealed raw reasoning (lmsp_mlx/service/sealing.py).
    encrypted_content: str | None = Field(default=None, exclude=True)


OutputItem = Union[MessageOutput, FunctionCallOutput, CustomToolCallOutput, ReasoningOutput]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV state was reused, not prefilled


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens spent in the think block


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    """Exactly the fields of section 6.2."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None


def v1_item(item: OutputItem, status: str) -> dict[str, Any]:
    """An output item in the OpenAI / Open Responses shape."""
    if isinstance(item, FunctionCallOutput):
        out = {"id": item.id, "type": "function_call", "status": status, "call_id": item.call_id,
               "name": item.name, "arguments": item.arguments}
        if "." in item.name:  # a function of a Codex `namespace` group
            out["namespace"], out["name"] = item.name.split(".", 1)
        return out
    if isinstance(item, CustomToolCallOutput):
        return {"id": item.id, "type": "custom_tool_call", "status": status, "call_id": item.call_id,
                "name": item.name, "input": item.input}
    if isinstance(item, ReasoningOutput):
        return {"id": item.id, "type": "reasoning", "status": status, "encrypted_content": item.encrypted_content,
                "summary": [p.model_dump() for p in item.summary]}
    return {
        "id": item.id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [
            {"type": "output_text", "text": part.text, "annotations": [], "logprobs": part.logprobs or []}
            for part in item.content
        ],
    }


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "custom_tool_call": "ctc", "custom_tool_call_output": "ctco", "compaction": "cmp"}


def v1_input_item(item: dict[str, Any], key: str) -> dict[str, Any]:
    """A stored input item as OpenAI lists it: with an id (`key` makes one where the
    client sent none), a status, and a message's text as content parts."""
    item = dict(item)
    if item.pop("custom", False):  # stored as the function call the engine renders (requests._plain)
        item = {**{k: v for k, v in item.items() if k != "arguments"}, "type": "custom_tool_call",
                "input": item["arguments"]}
    kind = item.get("type", "message")
    out = {**item, "id": item.get("id") or f"{_ID_PREFIX.get(kind, 'item')}_{key}"}
    out.setdefault("status", "completed")
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


def v1_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the response object echoes it: Open Responses requires `description`,
    `parameters` and `strict` (each may be null) on every function tool, so validating
    clients reject one that lacks them."""
    if tool.get("type") != "function":
        return tool
    return {"description": None, "parameters": None, "strict": None, **tool}


def v1_response(resp: ResponseObject, request: Any, completed_at: int | None) -> dict[str, Any]:
    """The same response as OpenAI-style clients expect it on /v1/responses."""
    # Items before the last one ended when the next began; the last one shares the end.
    last = {"completed": "completed", "in_progress": "in_progress"}.get(resp.status, "incomplete")
    earlier = "in_progress" if resp.status == "in_progress" else "completed"
    output = [v1_item(item, last if i == len(resp.output) - 1 else earlier) for i, item in enumerate(resp.output)]
    reasoning = request.reasoning or ReasoningSettings()
    text = request.text or {}
    usage = None
    if resp.usage is not None:
        usage = v1_usage(resp.usage)
    error = None
    if resp.error is not None:
        error = {"code": resp.error.get("code", "server_error"), "message": resp.error.get("detail", "")}
    return {
        "id": resp.id,
        "object": "response",
        "created_at": resp.created_at,
        "completed_at": completed_at if resp.status == "completed" else None,  # OpenAI's: only once completed
        "status": resp.status,
        "model": resp.model,
        "output": output,
        "usage": usage,
        "error": error,
        # OpenAI's enum has no context-window reason; a length cut is `max_output_tokens` there.
        "incomplete_details": {"reason": "max_output_tokens"} if resp.incomplete_details else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "metadata": request.metadata or {},
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
        "store": request.store,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_logprobs": 0,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "text": {"format": text.get("format") or {"type": "text"},
                 **({"verbosity": text["verbosity"]} if "verbosity" in text else {})},
        "tool_choice": request.tool_choice or "auto",
        "tools": [v1_tool(t) for t in request.tools or []],
        "truncation": request.truncation or "disabled",
        "service_tier": "default",
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        "background": bool(request.background),
        "user": request.user,
    }


def v1_usage(usage: ResponseUsage) -> dict[str, Any]:
    """Usage as OpenAI's types have it: every prompt token not reused was prefilled into
    the session's KV, which this server keeps for the next turn (`cache_write_tokens`)."""
    out = usage.model_dump()
    out["input_tokens_details"]["cache_write_tokens"] = usage.input_tokens - usage.input_tokens_details.cached_tokens
    return out
