"""From a request's items and tools to the conversation the engine renders (section 6.5).

- `tools` are validated (LMSP: `function` only; /v1 also accepts Codex's `namespace`
  groups, flattened to `group.name`, and ignores hosted tool types).
- `tool_choice`: `none` offers no tools; `required` and a named function constrain the
  reply to one call (of that function), with arguments valid against its schema; under
  `auto`, calls to strict tools are held to their schemas (engine/grammar.py).
- `response_format` / `text.format` `json_schema`: the reply is JSON valid against it; a
  schema the engine cannot compile is 400 with its reason and JSON pointer.
- A request that begins with tool outputs for calls it does not contain continues the
  live turn that made those calls: it is expanded to that turn's conversation and must find
  its live (or checkpointed) KV state, else 409 `continuation_state_unavailable`.
- A tool output for a call neither the request nor the server knows: 400 `unknown_call_id`.
- A reasoning model's replayed tool-call turn without its reasoning item, which the server
  has no state for either: 400 `reasoning_state_missing`.
- A reasoning item's `encrypted_content` (sealed by this server, lmsp_mlx/service/sealing.py) is
  opened, and its raw reasoning is rendered where the model sampled it; one that does not
  open (altered, another key, another model) is 400 naming the item.
"""

from __future__ import annotations

import logging

from pydantic import TypeAdapter, ValidationError

from ..cache.calls import CallMemory
from ..engine.constrain import GrammarError
from ..engine.grammar import ReplySpec, Tool, check_schema, closed
from ..engine.output import DEFAULT_CALL, OutputFormat
from ..engine.tools import native_tools
from ..engine.turn import Conversation
from ..protocol.problems import Problem
from ..protocol.requests import (
    AllowedTools,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    function_tools,
    validation_problem,
)

from ..protocol.auth import LOCAL_OWNER
from ..protocol.routes import Route
from .sealing import Sealer, SealError

_ITEMS = TypeAdapter(list[InputItem])
log = logging.getLogger("lmsp_mlx.server")


def tool_choice(req: ResponsesRequest, tools: list[FunctionTool]) -> tuple[str | FunctionTool, list[FunctionTool]]:
    """`auto`, `none`, `required`, or the one tool a named choice forces; and the tools the
    reply may call (`allowed_tools` narrows them, while the prompt keeps them all, so the
    KV of a conversation whose allowed set changes turn by turn is reused)."""
    choice = req.tool_choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        try:
            allowed = AllowedTools.model_validate(choice)
        except ValidationError as exc:
            problem = validation_problem(exc, frozenset())
            raise Problem("invalid_request", f"tool_choice.{problem.detail}",
                          param=f"tool_choice.{problem.param}" if problem.param else "tool_choice") from None
        unknown = [r.name for r in allowed.tools if not any(_named(t, r.name) for t in tools)]
        if unknown:
            raise Problem("invalid_request", f"tool_choice.tools names {unknown}, which are not among the request's "
                          "tools", param="tool_choice.tools")
        tools = [t for t in tools if any(_named(t, r.name) for r in allowed.tools)]
        if not tools and allowed.mode == "auto":
            return "none", []
        return _plain_choice(allowed.mode, tools), tools
    return _plain_choice(choice, tools), tools


def _named(tool: FunctionTool, name: str) -> bool:
    """A tool is named by its name, or within a Codex namespace group by its last part."""
    return tool.name == name or tool.name.endswith("." + name)


def _plain_choice(choice: str | dict, tools: list[FunctionTool]) -> str | FunctionTool:
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise Problem("invalid_request", "tool_choice 'required' needs at least one function tool", param="tool_choice")
        return choice
    name = choice.get("name") or (choice.get("function") or {}).get("name")
    if choice.get("type") not in ("function", "custom") or not isinstance(name, str):
        raise Problem("invalid_request", "tool_choice must be auto, none, required or "
                      "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
    for t in tools:
        if _named(t, name):
            return t
    raise Problem("invalid_request", f"tool_choice names {name!r}, which is not among the request's tools",
                  param="tool_choice.name")


def reply_spec(req: ResponsesRequest, route: Route, choice: str | FunctionTool,
               tools: list[FunctionTool], offered: list[FunctionTool]) -> ReplySpec | None:
    """The constraint on the reply: a forced call, JSON for a schema, strict calls, or none.

    `required` and a named choice force one call with valid arguments (a schema that cannot
    be enforced is then a 400). Under `auto`, function
    tools are enforced unless they say `strict: false` (OpenAI's Responses API defaults to
    strict); a tool whose schema llguidance cannot compile is enforced only if it asked for
    `strict: true` explicitly (else 400), otherwise its arguments need only be an object,
    and so do those of `strict: false` tools, so that every offered tool stays callable.
    A custom tool's input always follows its grammar."""
    schema, where = response_schema(req, route)
    if schema is not None:
        try:
            check_schema(schema, where)
        except GrammarError as exc:
            raise Problem("invalid_request", str(exc), param=where) from None
    # `tools`: those the reply may call; `offered`: all the request's (indexes in errors).
    if isinstance(choice, FunctionTool) or choice == "required":
        chosen = [choice] if isinstance(choice, FunctionTool) else tools
        return ReplySpec("call", tools=tuple(_tool(t, offered.index(t), enforce=True, forced=True) for t in chosen))
    callable_ = tuple(_tool(t, offered.index(t), enforce=t.strict is not False) for t in tools) if choice == "auto" else ()
    enforced = any(t.parameters is not None or t.custom for t in callable_)
    if schema is not None:
        return ReplySpec("json_or_call", schema=schema, tools=callable_) if callable_ else ReplySpec("json", schema=schema)
    if choice == "none" and offered:
        return ReplySpec("text")
    return ReplySpec("calls", tools=callable_) if enforced else None


def _tool(t: FunctionTool, index: int, enforce: bool, forced: bool = False) -> Tool:
    """The tool as the grammar sees it; `parameters` None means "any JSON object". A schema
    that cannot be enforced is a 400 for a forced call or a tool that asked for strict."""
    if t.custom or not enforce:
        return Tool(t.name, None, custom=t.custom, grammar=t.grammar)
    parameters = t.parameters or {"type": "object"}
    if t.strict is not False:
        parameters = closed(parameters)
    try:
        check_schema(parameters, f"tools[{index}].parameters")
    except GrammarError as exc:
        if t.strict or forced:
            raise Problem("invalid_request", str(exc), param=f"tools[{index}].parameters") from None
        log.warning("tool %r: its parameters cannot be enforced, any object is accepted: %s", t.name, exc)
        return Tool(t.name, None)
    return Tool(t.name, parameters)


def response_schema(req: ResponsesRequest, route: Route) -> tuple[dict | bool | None, str]:
    """The JSON Schema the reply must follow, if any, and where the request gave it:
    LMSP's `response_format` (`{"type": "json_schema", "json_schema": {"name", "schema"}}`)
    or /v1's `text.format` (`{"type": "json_schema", "name", "schema", "strict"}`).
    `json_object` means any JSON object."""
    fmt, where = (req.response_format.model_dump() if req.response_format else None), "response_format"
    if fmt is None and route == "v1" and isinstance(req.text, dict) and req.text.get("format") is not None:
        fmt, where = req.text["format"], "text.format"
        if not isinstance(fmt, dict):
            raise Problem("invalid_request", 'text.format must be an object such as {"type": "text"}',
                          param="text.format")
    if fmt is None or fmt.get("type", "text") == "text":
        return None, where
    if fmt["type"] == "json_object":
        return {"type": "object"}, where
    if fmt["type"] != "json_schema":
        raise Problem("invalid_request", f"unknown {where} type {fmt['type']!r}", param=f"{where}.type")
    holder = fmt.get("json_schema") if where == "response_format" and "schema" not in fmt else fmt
    if not isinstance(holder, dict) or "schema" not in holder:
        path = f"{where}.json_schema.schema" if where == "response_format" else f"{where}.schema"
        raise Problem("invalid_request", f"{path} is required for a json_schema format", param=path)
    inner = "json_schema.schema" if holder is not fmt else "schema"
    schema = closed(holder["schema"]) if holder.get("strict") is True else holder["schema"]
    return schema, f"{where}.{inner}"


# Reasoning efforts that turn a template's thinking off (Qwen3's enable_thinking; mlx-lm's
# tokenizer passes it under the name the template reads).
NO_THINKING = ("none", "minimal")


def template_args(req: ResponsesRequest) -> dict:
    """What the request's chat template is rendered with besides the messages: its
    chat_template_kwargs, and enable_thinking false for reasoning effort none or minimal."""
    args = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort in NO_THINKING:
        args.setdefault("enable_thinking", False)
    return args


def prepare(req: ResponsesRequest, route: Route, tokenizer, calls: CallMemory, reasoning: bool, head: str = "",
            offset: int = 0, owner: str = LOCAL_OWNER) -> tuple[Conversation, ReplySpec | None]:
    """The conversation to render, and the constraint on its reply (or None). `head`: the
    compacted conversation's text the items continue (lmsp_mlx/service/compaction.py). `offset`: the
    items of the stored conversation (previous_response_id) before the request's own.
    `owner`: the token that sent it; another token's calls are unknown to it (a call id
    must not open another token's conversation and hidden state)."""
    offered = function_tools(req.tools, compat=route in ("v1", "chat"))
    choice, tools = tool_choice(req, offered)
    items = req.items()
    live: tuple[str, ...] = ()
    own_calls = {i.call_id for i in items if isinstance(i, FunctionCallItem)}
    if items and isinstance(items[0], FunctionCallOutputItem) and items[0].call_id not in own_calls:
        turn = calls.get(items[0].call_id, owner)
        if turn is None:
            raise Problem("unknown_call_id", f"no live call {items[0].call_id!r} and the request does not contain it; "
                          "replay the full conversation", param="input[0].call_id")
        live = tuple(i.call_id for i in items if isinstance(i, FunctionCallOutputItem) and i.call_id in turn.call_ids)
        items = _ITEMS.validate_python(list(turn.items)) + items
        head = turn.head
    known = {i.call_id for i in items if isinstance(i, FunctionCallItem)}
    for index, item in enumerate(req.items()):
        if isinstance(item, FunctionCallOutputItem) and item.call_id not in known:
            where = _input_path(index, offset)
            where += ".call_id" if where != "previous_response_id" else ""
            raise Problem("unknown_call_id", f"tool output for call {item.call_id!r}, which neither this request "
                          "nor the server's live state contains", param=where)
    # Chat Completions has no reasoning items: its clients replay calls without them (the
    # template renders such a turn as its other servers would), and Anthropic's drop their
    # thinking blocks where thinking is off; so only Responses clients are held to sending
    # them back.
    if reasoning and not live and route not in ("chat", "messages"):
        _check_reasoning(req.items(), calls, offset, owner)
    # Under `none` the tools stay in the prompt where a grammar can keep the reply free of
    # calls (the `<tool_call>` syntax): the prompt, and so the KV, is the one `auto` has.
    offer_tools = choice != "none" or OutputFormat.of(tokenizer).call == DEFAULT_CALL
    # What the output parser reads as calls: only tools the reply may call (a call of any
    # other stays text, where no grammar stopped the model from writing it).
    callable_ = () if choice == "none" else None if len(tools) == len(offered) else tuple(t.name for t in tools)
    conv = Conversation(items, req.instructions, offered if offer_tools else [], native_tools(tokenizer), live, head,
                        callable=callable_, owner=owner, template_args=template_args(req))
    return conv, reply_spec(req, route, choice, tools, offered)


def sealed_problem(index: int, offset: int, what: str, why: SealError) -> Problem:
    """400 for sealed content that does not open: `index` counts the stored conversation
    (`offset` items, from previous_response_id) before the request's own input."""
    if index >= offset:
        where = f"input[{index - offset}]"
        return Problem("invalid_request", f"{where} is {what} that cannot be used: {why}",
                       param=f"{where}.encrypted_content")
    return Problem("invalid_request", f"item {index} of the stored conversation is {what} that cannot be used: {why}",
                   param="previous_response_id")


def open_reasoning(items: list[InputItem], sealer: Sealer, purpose: str = "reasoning", offset: int = 0) -> None:
    """Reveal the raw reasoning sealed in reasoning items (ReasoningItem._raw), sealed for
    `purpose` (service/run.py's seal_purpose)."""
    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
            try:
                raw = sealer.open(purpose, item.encrypted_content).get("raw")
            except SealError as exc:
                raise sealed_problem(index, offset, "a reasoning item whose encrypted_content", exc) from None
            item._raw = raw if isinstance(raw, str) else None


def _input_path(index: int, offset: int) -> str:
    """Where item `index` of the conversation is in the client's request: its input, or
    the stored conversation its previous_response_id names (the first `offset` items)."""
    return f"input[{index - offset}]" if index >= offset else "previous_response_id"


def _check_reasoning(items: list[InputItem], calls: CallMemory, offset: int, owner: str) -> None:
    """A replayed tool-call turn of a reasoning model needs its reasoning item, unless the
    server still has that turn's state (live or checkpointed: its calls are remembered)."""
    since_user = []
    for index, item in enumerate(items):
        if isinstance(item, MessageItem) and item.role != "assistant" or isinstance(item, FunctionCallOutputItem):
            since_user = []
            continue
        since_user.append(item)
        if isinstance(item, FunctionCallItem) and calls.get(item.call_id, owner) is None \
                and not any(isinstance(i, ReasoningItem) for i in since_user):
            where = _input_path(index, offset)
            raise Problem("reasoning_state_missing", f"{where} replays a tool call of a reasoning model "
                          "without its reasoning item, and the server has no state for that turn; include the "
                          "reasoning item returned with the call", param=where)
