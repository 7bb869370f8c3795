"""Request bodies of POST /lmsp/v1/responses (section 6.1) and POST /v1/responses.

Both routes parse into `ResponsesRequest`; the /v1 variant accepts the extra fields
OpenAI-style clients send (`instructions`, `text`, the `developer` role, ...). Unknown
top-level fields are ignored so newer clients keep working; unknown item and content
types are rejected, because silently dropping part of a conversation changes its meaning.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BeforeValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from .problems import Problem


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str


class UnsupportedContent(_Strict):
    """Content parts LMSP reserves for later versions (images, audio, files)."""

    type: Literal["input_image", "input_audio", "input_file"]


ContentPart = Annotated[
    Union[InputText, OutputText, UnsupportedContent], Field(discriminator="type")
]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, (InputText, OutputText)))


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # for a custom tool's call: its raw input
    id: str | None = None
    namespace: str | None = None  # Codex: a function of a `namespace` tool group
    status: str | None = None
    custom: bool = False  # internal: a /v1 `custom_tool_call` (see ResponsesRequest.items)


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Any
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        """The output as the model reads it: strings as they are, content parts joined,
        anything else as JSON."""
        if isinstance(self.output, str):
            return self.output
        if isinstance(self.output, list) and all(isinstance(p, dict) and "text" in p for p in self.output):
            return "".join(str(p["text"]) for p in self.output)
        return json.dumps(self.output, ensure_ascii=False)


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[Any] = []
    id: str | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    # The raw reasoning its encrypted_content seals, once the server opened it (never from a client).
    _raw: str | None = PrivateAttr(default=None)

    def text(self) -> str:
        parts = (self.content or []) + self.summary
        return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


class CustomToolCallItem(_Strict):
    """/v1: a call of a Codex-style `custom` tool, whose input is free text (or follows the
    tool's grammar). The server handles it as a function call with raw arguments."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: str | None = None


class CustomToolCallOutputItem(_Strict):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: Any
    id: str | None = None


class CompactionItem(_Strict):
    """The output of POST .../responses/compact standing for the conversation before it
    (lmsp_mlx/service/compaction.py); its content is sealed by the server."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None
    created_by: str | None = None


InputItem = Annotated[
    Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, CustomToolCallItem,
          CustomToolCallOutputItem, CompactionItem],
    Field(discriminator="type"),
]


def _plain(item: InputItem) -> InputItem:
    """Custom tool calls and their outputs as the function calls and outputs the engine renders."""
    if isinstance(item, CustomToolCallItem):
        return FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.input,
                                id=item.id, status=item.status, custom=True)
    if isinstance(item, CustomToolCallOutputItem):
        return FunctionCallOutputItem(type="function_call_output", call_id=item.call_id, output=item.output, id=item.id)
    return item


class FunctionTool(_Strict):
    """A function tool, or (on /v1) a Codex-style `custom` tool: free-text input, optionally
    following a Lark grammar (`format: {"type": "grammar", "syntax": "lark", "definition"}`)."""

    type: Literal["function", "custom"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None  # custom tools

    @property
    def custom(self) -> bool:
        return self.type == "custom"

    @property
    def grammar(self) -> str | None:
        """A custom tool's Lark grammar, if its format has one."""
        f = self.format or {}
        if f.get("type") == "grammar" and f.get("syntax", "lark") == "lark" and isinstance(f.get("definition"), str):
            return f["definition"]
        return None


# Hosted tools OpenAI-style clients (Codex) list; on /v1 they are accepted and not offered.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
    "image_generation", "local_shell", "mcp", "tool_search",
})


def _hosted(kind: str) -> bool:
    """A hosted tool type, dated versions included (`web_search_2025_08_26`)."""
    return kind in HOSTED_TOOL_TYPES or re.sub(r"_\d{4}_\d{2}_\d{2}$", "", kind) in HOSTED_TOOL_TYPES


def function_tools(tools: list[dict[str, Any]] | None, *, compat: bool) -> list[FunctionTool]:
    """The function tools a request offers, namespace groups flattened to `group.name`.

    LMSP defines only `function`; anything else is 400 `unsupported_capability` naming the
    type. On /v1 (`compat`) the hosted tool types are ignored (nothing here runs them)."""
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        where = f"tools[{i}]"
        if kind == "function" or kind == "custom" and compat:
            out.append(_tool(tool, where))
        elif kind == "namespace" and compat and isinstance(tool.get("tools"), list):
            for j, sub in enumerate(tool["tools"]):
                if isinstance(sub, dict) and sub.get("type", "function") == "function":
                    fn = _tool({**sub, "type": "function"}, f"{where}.tools[{j}]")
                    out.append(fn.model_copy(update={"name": f"{tool.get('name')}.{fn.name}"}))
        elif compat and isinstance(kind, str) and _hosted(kind):
            continue
        else:
            supported = "'function' and 'custom' tools are" if compat else "only 'function' tools are"
            raise Problem("unsupported_capability", f"tool type {kind!r} is not supported: {supported}",
                          param=f"{where}.type")
        names = [t.name for t in out]
        if len(set(names)) < len(names):  # a call names its tool: two of one name are ambiguous
            twice = next(n for n in names if names.count(n) > 1)
            raise Problem("invalid_request", f"tool name {twice!r} is offered twice", param=f"{where}.name")
    return out


def _tool(raw: dict[str, Any], where: str) -> FunctionTool:
    try:
        return FunctionTool.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise Problem("invalid_request", f"{where}.{field}: {err['msg']}", param=f"{where}.{field}") from None


class ToolRef(_Strict):
    type: Literal["function", "custom"] = "function"
    name: str


class AllowedTools(_Strict):
    """tool_choice `{"type": "allowed_tools", "mode", "tools"}`: the reply may call only these."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ToolRef]


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    model_config = ConfigDict(extra="allow", strict=True)


def json_number(value: Any) -> Any:
    """JSON has one number type: `"temperature": 0` is as good as 0.0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


Temperature = Annotated[float, BeforeValidator(json_number), Field(ge=0, le=2)]
TopP = Annotated[float, BeforeValidator(json_number), Field(ge=0, le=1)]  # 0: only the likeliest token
Penalty = Annotated[float, BeforeValidator(json_number), Field(ge=-2, le=2)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # OpenAI's: a 64-bit integer
# Chat's logit_bias: token ids (as JSON keys) to what is added to their logits.
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                           Annotated[float, BeforeValidator(json_number), Field(ge=-100, le=100)]],
                      Field(max_length=1024)]


# apply_chat_template's own parameters and the variables a rendering sets itself: a setting
# of one of these names would change what is rendered (the messages, the tools, the
# generation prompt), not how, so --chat-template-args and chat_template_kwargs refuse them.
RESERVED_TEMPLATE_ARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "chat_template", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_tensors",
    # the tokenizer's special tokens and the template's own helpers, which a rendering also sets
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now",
})


def template_settings(value: Any) -> Any:
    if isinstance(value, dict) and (taken := sorted(RESERVED_TEMPLATE_ARGS & set(value))):
        raise ValueError(f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by the server's rendering "
                         "itself, not a template setting")
    return value


# Settings of the model's chat template (mlx-lm's and vLLM's name), e.g. {"enable_thinking": false}.
TemplateSettings = Annotated[dict[str, Any], AfterValidator(template_settings)]


class ReasoningSettings(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    # An extension (Anthropic's thinking.budget_tokens maps onto it): the think block is
    # closed once it holds this many tokens.
    budget_tokens: Annotated[int, Field(ge=1)] | None = None


class Extensions(BaseModel):
    """`extensions`: the private extensions this server reads; it ignores others."""

    model_config = ConfigDict(extra="allow", strict=True)
    speculate: bool | None = None  # false: this request drafts no tokens, whatever --speculate says
    # Each reply token's logprob with this many likeliest alternatives (protocol/logprobs.py):
    # text deltas and the message's text part carry `logprobs`.
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


# OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponsesRequest(_Strict):
    model: str
    input: Union[str, list[InputItem]]
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # vLLM's and Anthropic's: 0 or absent keeps every token
    # OpenAI's sampling settings beyond these (Chat's, and echoed by /v1's response object).
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    response_format: TextFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any]] | None = None
    store: bool = False
    previous_response_id: str | None = None
    extensions: Extensions | None = None
    # Fields of the OpenAI-style /v1 route (ignored on LMSP when absent).
    instructions: str | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None  # "reasoning.encrypted_content": sealed reasoning state
    # Settings /v1 clients send and read back from the response object. They do not change
    # generation here (one model, one sampler), but a client that set them sees them kept.
    metadata: Metadata | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: drop the oldest items to fit the context
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningSettings | None = None
    chat_template_kwargs: TemplateSettings | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # false: a prewarm (Codex sends it first on its WebSocket): the prompt goes into the KV,
    # nothing is generated, the response has no output.
    generate: bool | None = None
    conversation: Any = None  # OpenAI's Conversations API, not served: refused (run.check_capabilities)
    prompt: Any = None  # OpenAI's stored prompts: refused too
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # alternatives per token; turns logprobs on
    background: bool | None = None  # /v1: run as a task the client polls (lmsp_mlx/http/responses.py)

    def logprobs(self) -> int | None:
        """How many alternatives each reply token's logprob comes with, where the request
        asks for logprobs (/v1's `include: ["message.output_text.logprobs"]` or
        `top_logprobs`, LMSP's `extensions.logprobs`); None where it does not."""
        if self.extensions and self.extensions.logprobs is not None:
            return self.extensions.logprobs
        if "message.output_text.logprobs" in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [_plain(item) for item in self.input]


_UNION_TAGS = frozenset({
    "message", "function_call", "function_call_output", "reasoning", "custom_tool_call", "custom_tool_call_output",
    "compaction",
    "input_text", "output_text", "input_image", "input_audio", "input_file",
})


def json_path(loc: tuple, tags: frozenset[str]) -> str:
    """JSON path of a pydantic error location, without its union-branch labels (the type
    names of a union, and the `tags` of a tagged union, which follow an index)."""
    out, prev = "", None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (part in ("str", "int", "float", "bool") or "[" in part or isinstance(prev, int) and part in tags):
            out += f".{part}" if out else part
        prev = part
    return out


def json_object(body: Any) -> dict[str, Any]:
    """A decoded body that must be an object; a JSON null for one of its fields means "not
    given" (OpenAI's clients send `"stream": null`)."""
    if not isinstance(body, dict):
        raise Problem("invalid_request", "the request body must be a JSON object")
    return {k: v for k, v in body.items() if v is not None}


def validation_problem(exc: ValidationError, tags: frozenset[str]) -> Problem:
    """The 400 `invalid_request` for a body that does not validate, naming the field. A
    union reports one error per branch; the deepest one is what the client got wrong."""
    err = max(exc.errors(), key=lambda e: len(e["loc"]))
    where = json_path(err["loc"], tags)
    if err["type"] == "union_tag_invalid":
        msg = f"unknown type {err.get('ctx', {}).get('tag')!r} at {where}"
    elif err["type"] == "union_tag_not_found":
        msg = f"{where} has no 'type'"
    elif err["type"] == "missing":
        msg = f"missing required field {where}"
    else:
        msg = f"{where}: {err['msg']}" if where else err["msg"]
    return Problem("invalid_request", msg, param=where or None)


def parse_request(body: Any, *, default_type: bool = True) -> ResponsesRequest:
    """Validate a decoded JSON body; every failure is a 400 `invalid_request` problem."""
    body = json_object(body)
    if default_type and isinstance(body.get("input"), list):
        # OpenAI's "easy input message" omits `type`; it means a message.
        body["input"] = [
            {**item, "type": "message"} if isinstance(item, dict) and "type" not in item and "role" in item else item
            for item in body["input"]
        ]
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        problem = validation_problem(exc, _UNION_TAGS)
        if problem.param == "input" and exc.errors()[0]["type"] in ("string_type", "list_type"):
            problem.detail = "input must be a string or an array of input items"
        raise problem from None
