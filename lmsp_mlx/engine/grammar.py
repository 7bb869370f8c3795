"""What a reply must look like, as an llguidance Lark grammar (docs/syntax.md of llguidance).

A request can constrain its reply three ways:
- `response_format` / `text.format` `json_schema`: the reply is one JSON value valid
  against the schema;
- `tool_choice` `required` or a named function: the reply is one tool call whose
  arguments are valid against that function's `parameters`;
- strict function tools under `tool_choice: auto`: free text, but once the model opens a
  tool call the call must name an offered function with valid arguments (llguidance's
  "lazy" lexeme: anything until the call marker, then the schema);
- `tool_choice: none` with tools: free text that never opens a call, so the tools can
  stay in the prompt (the conversation's KV stays valid) while none can be called;
- Codex-style custom tools: the call's raw input (after a `{"name": ...}` line) follows
  the tool's own Lark grammar, compiled as a separate grammar so that its rule names
  cannot clash with these.

A reasoning model keeps its reasoning free: the constraint starts after the think block
(or after its closing tag, when the chat template opened the block in the prompt). JSON is
generated compact (no free whitespace): a small model given free whitespace can pad a
value with blanks until the token limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from .constrain import GrammarError, lark_literal, ll_tokenizer
from .output import DEFAULT_CALL, OutputFormat

COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any] | None = None
    custom: bool = False  # a Codex-style custom tool: raw input after its name line
    grammar: str | None = None  # its Lark grammar, if it has one (else free text)


@dataclass(frozen=True)
class ReplySpec:
    """The constraint a request puts on its reply, before the model's markup is known."""

    kind: Literal["json", "json_or_call", "call", "calls", "text"]  # calls: text with strict tool calls; text: none
    schema: dict[str, Any] | bool | None = None  # kinds json, json_or_call
    tools: tuple[Tool, ...] = ()  # kind call / calls


def json_rule(schema: dict[str, Any] | bool) -> str:
    body = {"x-guidance": COMPACT} if schema is True else {**schema, "x-guidance": COMPACT}
    return "%json " + json.dumps(body, ensure_ascii=False)


def check_schema(schema: Any, where: str) -> None:
    """Compile `schema` alone; a GrammarError names the engine's reason and the JSON pointer
    (within the schema) of the deepest subschema that fails by itself."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{where} must be a JSON Schema object, not {type(schema).__name__}")
    reason = _compile_error(schema)
    if reason is None:
        return
    pointer = _deepest_failing(schema, schema, "")
    raise GrammarError(f"{where} cannot be enforced: {reason.strip()} (at JSON pointer '{pointer}')")


def _compile_error(schema: Any) -> str | None:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        return llguidance.LLMatcher.validate_grammar(grammar) or None
    except Exception as exc:  # llguidance raises ValueError/RuntimeError with its reason
        return str(exc) or type(exc).__name__


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


def closed(schema: Any) -> Any:
    """The schema as OpenAI's strict mode reads it: an object that does not say otherwise
    takes no keys beyond its `properties`. (Open, a small model asked for a tool without
    arguments writes keys until the token limit: `{"type": "object", "properties": {}}`,
    as MCP tools have it, never closed.)"""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key == "allOf":  # its branches describe one object together: closing each would split it
            out[key] = value
        elif key in _SUBSCHEMA_LISTS or key in _SUBSCHEMA_ONE:
            out[key] = closed(value)
        else:
            out[key] = value
    types = schema.get("type")
    is_object = types == "object" or isinstance(types, list) and "object" in types or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _deepest_failing(root: dict | bool, schema: Any, pointer: str) -> str:
    """The pointer of the deepest subschema that fails to compile on its own (given the
    root's definitions, so that its references still resolve)."""
    defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root, dict) and isinstance(root.get(k), dict)}
    for child_pointer, child in _children(schema, pointer):
        if isinstance(child, dict) and _compile_error({**defs, **child}) is not None:
            return _deepest_failing(root, child, child_pointer)
    return pointer


def _children(schema: Any, pointer: str) -> list[tuple[str, Any]]:
    if not isinstance(schema, dict):
        return []
    out: list[tuple[str, Any]] = []
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out += [(f"{pointer}/{key}/{_escape(k)}", v) for k, v in schema[key].items()]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out += [(f"{pointer}/{key}/{i}", v) for i, v in enumerate(schema[key])]
    for key in _SUBSCHEMA_ONE:
        if key in schema:
            out.append((f"{pointer}/{key}", schema[key]))
    return out


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """A `<tool_call>` body: the name of one of `tools` and arguments valid for it (any
    object for a tool whose `parameters` are None). Parameters that refer into themselves
    (`#/$defs/...`, as pydantic writes nested models and enums; `#` for recursion) move
    under the body's `$defs`, their references rebased: nested in the body as they are,
    they would point at the body."""
    defs: dict[str, Any] = {}
    calls = []
    for i, t in enumerate(tools):
        arguments = t.parameters or {"type": "object"}
        if '"$ref"' in json.dumps(arguments):
            home = f"#/$defs/tool{i}"
            defs[f"tool{i}"] = _rebased(arguments, home)
            arguments = {"$ref": home}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**body, "$defs": defs} if defs else body


def _rebased(schema: Any, home: str) -> Any:
    """`schema` with its local references (`#...`) made relative to `home`; only schema
    positions are walked, so data (const, enum, default) that looks like a reference stays."""
    if isinstance(schema, list):
        return [_rebased(s, home) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = home + value[1:]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, home) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS or key in _SUBSCHEMA_ONE:
            out[key] = _rebased(value, home)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Rules:
    """Lark rules defining `reply`, and the custom tools' grammars they reference by name."""

    text: str
    grammars: dict[str, str]


def reply_rules(spec: ReplySpec, fmt: OutputFormat) -> Rules | None:
    """The rules of `reply`; None where this model's call syntax cannot be constrained
    (calls that are not `<tool_call>` JSON: docs/tools-and-reasoning.md, "Tool calls")."""
    json_reply = Rules(f"reply: {json_rule(spec.schema)}\n", {}) if spec.schema is not None else None
    if fmt.call != DEFAULT_CALL or spec.kind == "json":
        return json_reply
    if spec.kind == "text":  # any text but the call marker (llguidance's lexeme `&` and `~`)
        marker = re.escape(DEFAULT_CALL[0]).replace("/", "\\/")
        return Rules(f"reply: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n", {})
    start, end = (lark_literal(m) for m in DEFAULT_CALL)
    calls, rules, grammars = [], "", {}
    functions = tuple(t for t in spec.tools if not t.custom)
    if functions:
        calls.append("call_json")
        rules += f"call_json: \"\\n\" call_body \"\\n\" {end}\n" + f"call_body: {json_rule(call_schema(functions))}\n"
    for i, tool in enumerate(t for t in spec.tools if t.custom):
        head = lark_literal("\n" + json.dumps({"name": tool.name}) + "\n")
        if tool.grammar is not None:
            grammars[f"custom_{i}"] = tool.grammar
            rules += f"call_custom_{i}: {head} @custom_{i} \"\\n\" {end}\n"
        else:  # free text up to the closing marker
            rules += f"call_custom_{i}[lazy]: {head} /(.|\\n)*/ \"\\n\" {end}\n"
        calls.append(f"call_custom_{i}")
    rules += f"call: {' | '.join(calls)}\n"
    if spec.kind == "json_or_call":  # the JSON answer, or one call instead
        return Rules(f"reply: {json_rule(spec.schema)} | {start} call\n" + rules, grammars)
    if spec.kind == "call":
        return Rules(f"reply: {start} call\n" + rules, grammars)
    return Rules("reply: (call_head call)* TEXT\nTEXT: /(.|\\n)*/\n" f"call_head[lazy]: TEXT {start}\n" + rules, grammars)


def _top_level(lark: str, grammars: dict[str, str]) -> str:
    """llguidance's input: the Lark text alone, or its JSON form when custom tools' grammars
    are referenced from it (`@name`)."""
    if not grammars:
        return lark
    return json.dumps({"grammars": [{"lark_grammar": lark},
                                    *({"name": name, "lark_grammar": g} for name, g in grammars.items())]})


def full_grammar(spec: ReplySpec, fmt: OutputFormat, opened: bool, tokenizer) -> str | None:
    """The grammar of the whole sampled text: the reasoning block (free), then `reply`.
    `opened`: the prompt already opened the think block."""
    found = reply_rules(spec, fmt)
    if found is None:
        return None
    rules = found.text
    if fmt.think is None:
        return _top_level("start: reply\n" + rules, found.grammars)
    open_tag, close_tag = fmt.think
    # Special-token markers are matched as tokens (<think>); text markers lazily as text.
    special = f"<{open_tag.strip('<>')}>" == open_tag and f"<{close_tag.strip('<>')}>" == close_tag
    for as_tokens in ((True, False) if special else (False,)):
        o, c = (open_tag, close_tag) if as_tokens else (lark_literal(open_tag), lark_literal(close_tag))
        lazy = "" if as_tokens else "[lazy]"
        think = f"think_rest{lazy}: /(.|\\n)*/ {c}\n" + ("" if opened else f"think: {o} think_rest\n")
        start = "start: think_rest WS reply\n" if opened else "start: WS think? WS reply\n"
        grammar = _top_level(start + think + "WS: /[ \\t\\n]*/\n" + rules, found.grammars)
        if as_tokens and llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar).is_error():
            continue  # the tokenizer does not know them as special tokens
        return grammar
    return None
