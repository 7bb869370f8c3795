"""POST /v1/chat/completions: OpenAI's Chat Completions body, as the Responses request the
engine runs, and the completion objects and chunks it answers with.

A chat request is a Responses request in other words: messages become input items (an
assistant's `tool_calls` become function_call items, a `tool` message a function_call_output),
`tools` lose their `function` wrapper, `max_completion_tokens` (or the older `max_tokens`) is
`max_output_tokens`. So the same conversation reaches the same live KV whichever API a
client speaks.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .ids import new_id
from .problems import Problem
from .requests import (LogitBias, Penalty, ResponsesRequest, Seed, Temperature, TemplateSettings, TopP, json_object,
                       parse_request, validation_problem)
from .responses import ResponseObject


class _Chat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Chat):
    type: Literal["text"]
    text: str


class OtherPart(_Chat):
    """Images, audio and files: reserved by LMSP 1.0 for later versions."""

    type: Literal["image_url", "input_audio", "file", "refusal"]


class CalledFunction(_Chat):
    name: str
    arguments: str


class ToolCall(_Chat):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Chat):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Annotated[Union[TextPart, OtherPart], Field(discriminator="type")]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # what this server sends back for a reasoning model

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class FunctionSpec(_Chat):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Chat):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Chat):
    include_usage: bool | None = None


Stop = Annotated[str, Field(max_length=256)]  # longer ones would make each delta's scan slow
Stops = Union[Stop, Annotated[list[Stop], Field(max_length=16)]]  # Chat's and text completions' `stop`
STOPS_DETAIL = "stop must be a string or a list of up to 16 strings, each at most 256 characters"


def stop_list(stop: str | list[str] | None) -> list[str]:
    """A `stop` field as the sequences it names (empty ones dropped)."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    return [s for s in stops if s]


class ChatRequest(_Chat):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None  # one choice: a second would be a second run
    stop: Stops | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # with logprobs: alternatives per token
    parallel_tool_calls: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None  # the same seed, prompt and settings sample the same reply
    logit_bias: LogitBias | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: TemplateSettings | None = None  # the template's settings, as mlx_lm.server and vLLM take them
    speculate: bool | None = None  # an extension: false drafts no tokens for this request (--speculate)
    # The API's first form of tools, replaced by `tools` / `tool_choice`; refused, not ignored.
    functions: list[Any] | None = None
    function_call: Any = None

    def stops(self) -> list[str]:
        return stop_list(self.stop)


def parse_chat(body: Any) -> ChatRequest:
    """Validate a decoded body; every failure is a 400 naming the field."""
    try:
        req = ChatRequest.model_validate(json_object(body))
    except ValidationError as exc:
        problem = validation_problem(exc, _TAGS)
        if problem.param == "n":
            problem.detail = "n must be 1: this server returns one choice per request"
        elif (problem.param or "").startswith("stop"):
            problem.detail = STOPS_DETAIL
            problem.param = "stop"
        raise problem from None
    if req.top_logprobs is not None and not req.logprobs:
        raise Problem("invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")
    for legacy in ("functions", "function_call"):
        if getattr(req, legacy) is not None:
            raise Problem("invalid_request", f"{legacy} is the API's deprecated form of tools: send tools and "
                          "tool_choice instead", param=legacy)
    return req


_TAGS = frozenset({"text", "image_url", "input_audio", "file", "refusal"})  # content parts' types


def to_responses(req: ChatRequest) -> tuple[ResponsesRequest, list[int]]:
    """The Responses request of a chat request, and for each of its input items the index of
    the message it came from (to name `messages[i]` in errors about `input[j]`)."""
    items: list[dict[str, Any]] = []
    origin: list[int] = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list) and any(isinstance(p, OtherPart) and p.type != "refusal" for p in m.content):
            raise Problem("unsupported_capability", "LMSP 1.0 defines text content only", param=f"messages[{i}].content")
        if m.content is None and m.role != "assistant":
            raise Problem("invalid_request", f"a {m.role} message needs content", param=f"messages[{i}].content")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise Problem("invalid_request", "a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
            items.append({"type": "function_call_output", "call_id": m.tool_call_id, "output": m.text()})
        elif m.role == "assistant":
            if m.reasoning_content:
                items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": m.reasoning_content}]})
                origin.append(i)
            if m.text() or not m.tool_calls:
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": m.text()}]})
                origin.append(i)
            for call in m.tool_calls or []:
                items.append({"type": "function_call", "call_id": call.id, "name": call.function.name,
                              "arguments": call.function.arguments})
                origin.append(i)
            continue
        else:
            items.append({"type": "message", "role": m.role, "content": m.text()})
        origin.append(i)
    tools = [{"type": "function", **t.function.model_dump(exclude_none=True)} for t in req.tools or []]
    body: dict[str, Any] = {
        "model": req.model, "input": items, "tools": tools or None, "tool_choice": _tool_choice(req.tool_choice),
        "max_output_tokens": req.max_completion_tokens or req.max_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "response_format": _format(req.response_format),
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty, "seed": req.seed,
        "logit_bias": req.logit_bias,
        "parallel_tool_calls": req.parallel_tool_calls, "chat_template_kwargs": req.chat_template_kwargs,
        "reasoning": {"effort": req.reasoning_effort} if req.reasoning_effort else None,
        "extensions": None if req.speculate is None else {"speculate": req.speculate},
        "include": ["message.output_text.logprobs"] if req.logprobs else None,
        "top_logprobs": req.top_logprobs,
    }
    return parse_request(body), origin


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "allowed_tools" and isinstance(choice.get("allowed_tools"), dict):
        # Chat's shape: {"allowed_tools": {"mode", "tools": [{"type": "function", "function": {"name"}}]}}
        inner = choice["allowed_tools"]
        tools = [{"type": "function", "name": (t.get("function") or {}).get("name") if isinstance(t, dict) else None}
                 for t in inner.get("tools") or []]
        return {"type": "allowed_tools", "mode": inner.get("mode"), "tools": tools}
    name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise Problem("invalid_request", 'tool_choice must be "auto", "none", "required" or '
                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    return {"type": "function", "name": name}


def _format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's response_format has LMSP's shape already; `text` is the default."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") not in ("json_object", "json_schema"):
        raise Problem("invalid_request", 'response_format.type must be "text", "json_object" or "json_schema"',
                      param="response_format.type")
    return fmt


def chat_param(problem: Problem, origin: list[int], req: ChatRequest) -> Problem:
    """The same problem with its param named as the chat request names it: `input[j]` as
    the message item j came from, a tool's fields inside its `function`, and so on."""
    param = problem.param or ""
    if m := re.fullmatch(r"input\[(\d+)\](.*)", param):
        if int(m[1]) < len(origin):
            param = f"messages[{origin[int(m[1])]}]" + m[2].replace(".call_id", ".tool_call_id")
    elif m := re.fullmatch(r"tools\[(\d+)\]\.(?!type\b)(.+)", param):
        param = f"tools[{m[1]}].function.{m[2]}"
    else:
        param = {"input": "messages", "tool_choice.name": "tool_choice.function.name",
                 "max_output_tokens": "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens",
                 }.get(param, param)
    if param == (problem.param or ""):
        return problem
    return Problem(problem.code, problem.detail.replace(problem.param, param), param=param, headers=problem.headers)


def completion_id() -> str:
    return new_id("chatcmpl")


def chat_usage(resp: ResponseObject) -> dict[str, Any] | None:
    u = resp.usage
    if u is None:
        return None
    return {"prompt_tokens": u.input_tokens, "completion_tokens": u.output_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.input_tokens_details.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.output_tokens_details.reasoning_tokens}}


def completion(cid: str, resp: ResponseObject, content: str | None, reasoning: str,
               calls: list[dict[str, Any]], finish_reason: str,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A `chat.completion` object with its one choice; `logprobs`: its content's entries,
    where the request asked for them."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {"id": cid, "object": "chat.completion", "created": resp.created_at, "model": resp.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}],
            "usage": chat_usage(resp), "system_fingerprint": None, "service_tier": "default"}


def chunk(cid: str, created: int, model: str, delta: dict[str, Any] | None, finish_reason: str | None = None,
          usage: Any = False, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A `chat.completion.chunk`; `delta=None` is the usage chunk (no choices). `usage`:
    False leaves it out, None or an object puts it in (`stream_options.include_usage`).
    `logprobs`: the entries of the tokens this chunk's content finished."""
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None,
                           "choices": [] if delta is None else [{
                               "index": 0, "delta": delta, "finish_reason": finish_reason,
                               "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}]}
    if usage is not False:
        out["usage"] = usage
    return out
