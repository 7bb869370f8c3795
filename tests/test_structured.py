"""Structured output: every reply under a JSON Schema parses and validates (llguidance).

The schema suite runs on the embedded default model at temperature 0 and 1. Its free
strings carry a maxLength and its fractional numbers a multipleOf: without them a 135M
model can ramble a value (digits after the point, greedily) into the token limit, which
ends `incomplete`, as it must (docs/structured-output.md)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tests.helpers import HTTP, lookups_during, read_sse

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False},
    "optional field": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                       "required": ["city"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"owner": {"type": "object", "properties": {"name": NAME,
               "contact": {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
                           "required": ["email"], "additionalProperties": False}}, "required": ["name", "contact"],
               "additionalProperties": False}}, "required": ["owner"], "additionalProperties": False},
    "array bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object",
                         "properties": {"id": {"type": "integer", "minimum": 1}, "label": NAME},
                         "required": ["id", "label"], "additionalProperties": False}},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
              "required": ["version", "ok"], "additionalProperties": False},
    "anyOf": {"anyOf": [{"type": "object", "properties": {"cat": NAME}, "required": ["cat"], "additionalProperties": False},
                        {"type": "object", "properties": {"dog": {"type": "integer"}}, "required": ["dog"],
                         "additionalProperties": False}]},
    "number bounds": {"type": "object", "properties": {"t": {"type": "number", "minimum": -10.5, "maximum": 40,
                                                             "multipleOf": 0.25}},
                      "required": ["t"], "additionalProperties": False},
    "exclusive bounds": {"type": "object", "properties": {"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
                         "required": ["p"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "date format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
                    "additionalProperties": False},
    "boolean": {"type": "boolean"},
    "integer": {"type": "integer", "minimum": 1, "maximum": 6},
    "string enum array": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 16}},
                 "required": ["note"], "additionalProperties": False},
    "all required": {"type": "object", "properties": {k: {"type": "integer"} for k in "abcd"},
                     "required": list("abcd"), "additionalProperties": False},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"], "additionalProperties": False},
    "deep nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object",
                     "properties": {"c": {"type": "integer"}}, "required": ["c"], "additionalProperties": False}},
                     "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    "oneOf": {"oneOf": [{"type": "integer", "maximum": -1}, {"type": "string", "maxLength": 5}]},
    "object with array": {"type": "object", "properties": {"title": NAME, "steps": {"type": "array", "items": NAME,
                          "minItems": 1, "maxItems": 3}}, "required": ["title", "steps"], "additionalProperties": False},
    "string length": {"type": "string", "minLength": 3, "maxLength": 8},
}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def ask_json(server, schema, temperature, route="/lmsp/v1/responses", max_tokens=300, **fields):
    body = {"model": "SmolLM2-135M-Instruct", "input": "Reply with an example value as JSON.", "temperature": temperature,
            "max_output_tokens": max_tokens, **fields}
    if route == "/v1/responses":
        body["text"] = {"format": {"type": "json_schema", "name": "example", "schema": schema, "strict": True}}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "example", "schema": schema}}
    return HTTP.post(server.url + route, json=body, timeout=600)


def message_text(resp: dict) -> str:
    return next(o["content"][0]["text"] for o in resp["output"] if o["type"] == "message")


@pytest.mark.slow
def test_structured_output_is_advertised(server):
    assert "structured_output" in HTTP.get(server.url + "/lmsp/v1/models").json()["data"][0]["capabilities"]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_reply_validates_against_its_schema(server, name, temperature):
    # JSON Schema puts no bound on an integer's digits, and at temperature 1 this model
    # sometimes writes ids of 10 to 20 digits (4 of 16 replies here; one CI run passed 300 tokens):
    # the room keeps this test about validity, not about length.
    r = ask_json(server, SCHEMAS[name], temperature, max_tokens=300 if temperature == 0 else 600)
    assert r.status_code == 200, r.text
    resp = r.json()
    if temperature == 1 and resp["status"] == "incomplete":
        # Sometimes it never stops an integer (runs wrote "age" or "dog" until even 1500
        # tokens ran out, 2 minutes of this suite): the documented case (docs/structured-output.md,
        # "The token limit mid-JSON"), and the only one accepted here: the partial reply ends in a run
        # of hundreds of digits.
        assert re.search(r"[0-9]{200,}$", message_text(resp)), message_text(resp)[-300:]
        return
    assert resp["status"] == "completed", resp
    jsonschema.validate(json.loads(message_text(resp)), SCHEMAS[name])


@pytest.mark.slow
def test_v1_text_format_streams_valid_json(server):
    schema = SCHEMAS["nested"]
    body = {"model": "SmolLM2-135M-Instruct", "input": "An owner as JSON.", "temperature": 1, "max_output_tokens": 300,
            "stream": True, "text": {"format": {"type": "json_schema", "name": "owner", "schema": schema}}}
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=600) as r:
        events = read_sse(list(r.iter_lines()))
    deltas = "".join(e["data"]["delta"] for e in events if e.get("event") == "response.output_text.delta")
    final = next(e["data"]["response"] for e in events if e.get("event") == "response.completed")
    assert final["text"]["format"]["type"] == "json_schema"
    jsonschema.validate(json.loads(deltas), schema)
    assert message_text(final) == deltas


@pytest.mark.slow
def test_the_token_limit_mid_json_is_incomplete_and_not_repaired(server):
    resp = ask_json(server, SCHEMAS["array of objects"], 0, max_tokens=6).json()
    assert resp["status"] == "incomplete" and resp["incomplete_details"]["reason"] == "max_output_tokens"
    text = message_text(resp)
    assert text.startswith("[") and resp["usage"]["output_tokens"] == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.slow
@pytest.mark.parametrize("schema, pointer, reason", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}, "/properties/a", "look-around"),
    ({"type": "object", "properties": {"list": {"type": "array", "items": {"type": "wibble"}}}},
     "/properties/list/items", "wibble"),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/missing"}}}, "/properties/p", "missing"),
    ({"type": "string", "format": "not-a-format"}, "", "not-a-format"),
])
def test_a_schema_the_engine_cannot_compile_is_400_with_its_pointer(server, schema, pointer, reason):
    for route, param in (("/lmsp/v1/responses", "response_format.json_schema.schema"),
                         ("/v1/responses", "text.format.schema")):
        r = ask_json(server, schema, 0, route=route)
        assert r.status_code == 400, r.text
        err = r.json() if route.startswith("/lmsp") else r.json()["error"]
        detail = err["detail"] if route.startswith("/lmsp") else err["message"]
        assert err["code"] == "invalid_request" and err["param"] == param
        assert f"JSON pointer '{pointer}'" in detail and reason in detail


@pytest.mark.slow
def test_a_format_without_a_schema_is_400(server):
    r = HTTP.post(server.url + "/lmsp/v1/responses", json={
        "model": "SmolLM2-135M-Instruct", "input": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert r.status_code == 400 and r.json()["param"] == "response_format.json_schema.schema"


WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}, "auto"])
@pytest.mark.parametrize("temperature", [0, 1])
def test_strict_tool_arguments_validate(server, choice, temperature):
    body = {"model": "SmolLM2-135M-Instruct", "input": "What is the weather in Hangzhou? Use the tool.",
            "tools": [{**WEATHER, "strict": True}], "tool_choice": choice, "temperature": temperature,
            "max_output_tokens": 200}
    resp = HTTP.post(server.url + "/lmsp/v1/responses", json=body, timeout=600).json()
    calls = [o for o in resp["output"] if o["type"] == "function_call"]
    if choice != "auto":
        assert len(calls) == 1
    for call in calls:  # under auto the model may answer in text; any call it makes is valid
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])


# What pydantic writes for a nested model and an enum: `$defs` and references into them,
# and a tree whose nodes refer to the root (`#`).
TRIP = {"type": "function", "name": "plan_trip", "description": "Plan a trip.", "parameters": {
    "$defs": {"Unit": {"enum": ["km", "mi"], "type": "string"},
              "Stop": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"$ref": "#/$defs/Unit"}},
                       "required": ["city", "unit"], "additionalProperties": False}},
    "type": "object", "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}, "minItems": 1,
                                               "maxItems": 2}},
    "required": ["stops"], "additionalProperties": False}}
TREE = {"type": "function", "name": "draw_tree", "description": "Draw a tree.", "parameters": {
    "type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                     "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
    "required": ["label", "kids"], "additionalProperties": False}}


def test_a_call_body_keeps_each_tools_references_pointing_into_its_own_parameters():
    from lmsp_mlx.engine.grammar import Tool, call_schema

    body = call_schema((Tool(TREE["name"], TREE["parameters"]), Tool(TRIP["name"], TRIP["parameters"])))
    tree = {"label": "a", "kids": [{"label": "b", "kids": []}]}
    jsonschema.validate({"name": "draw_tree", "arguments": tree}, body)
    jsonschema.validate({"name": "plan_trip", "arguments": {"stops": [{"city": "Oslo", "unit": "km"}]}}, body)
    for wrong in ({"name": "draw_tree", "arguments": {"label": "a", "kids": [{"label": "b"}]}},
                  {"name": "plan_trip", "arguments": {"stops": [{"city": "Oslo", "unit": "miles"}]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, body)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/lmsp/v1/responses", "/v1/chat/completions"])
def test_tool_parameters_with_defs_are_enforced(server, route):
    tool = TRIP
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "Use the tool."}], "max_tokens": 200,
                "tools": [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}},
                          {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]}
    else:
        body = {"input": "Use the tool.", "max_output_tokens": 200, "tools": [tool, WEATHER]}
    r = HTTP.post(server.url + route, timeout=600, json={
        "model": "SmolLM2-135M-Instruct", "temperature": 0, **body,
        "tool_choice": {"type": "function", "name": tool["name"]} if route != "/v1/chat/completions"
        else {"type": "function", "function": {"name": tool["name"]}}})
    assert r.status_code == 200, r.text
    if route == "/v1/chat/completions":
        [call] = [c["function"] for c in r.json()["choices"][0]["message"]["tool_calls"]]
    else:
        [call] = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert call["name"] == tool["name"]
    jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])


@pytest.mark.slow
@pytest.mark.parametrize("limit", [2, 8])
def test_a_call_cut_by_the_token_limit_leaves_no_markup_behind(server, limit):
    body = {"model": "SmolLM2-135M-Instruct", "input": "What is the weather in Hangzhou? Use the tool.",
            "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_output_tokens": limit}
    resp = HTTP.post(server.url + "/lmsp/v1/responses", json=body, timeout=600).json()
    assert resp["status"] == "incomplete" and resp["usage"]["output_tokens"] == limit
    assert [o["type"] for o in resp["output"]] == ["message"] and message_text(resp) == ""
    chat = HTTP.post(server.url + "/v1/chat/completions", timeout=600, json={
        "model": body["model"], "messages": [{"role": "user", "content": body["input"]}], "temperature": 0,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": "required", "max_tokens": limit}).json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["choices"][0]["message"]["content"] == ""


@pytest.mark.slow
def test_tool_choice_none_after_a_call_continues_the_live_kv_and_calls_nothing(server):
    body = {"model": "SmolLM2-135M-Instruct", "tools": [WEATHER], "temperature": 0, "max_output_tokens": 60}
    question = {"role": "user", "content": "What is the weather in Hangzhou? Use the tool."}
    first = HTTP.post(server.url + "/lmsp/v1/responses", timeout=600,
                       json={**body, "input": [question], "tool_choice": "required"}).json()
    [call] = [o for o in first["output"] if o["type"] == "function_call"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'}
    answer = {}
    sources = lookups_during(server, lambda: answer.update(HTTP.post(server.url + "/lmsp/v1/responses", timeout=600,
                             json={**body, "input": [question, call, result], "tool_choice": "none"}).json()))
    assert [o["type"] for o in answer["output"]] == ["message"] and "<tool_call>" not in message_text(answer)
    assert sources == {"visible": 1}  # the tools stayed in the prompt
    assert answer["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]


@pytest.mark.slow
def test_strict_schemas_that_leave_objects_open_are_read_as_closed(server):
    """OpenAI's strict mode allows no keys beyond an object's properties; open, this model
    wrote keys until the limit for a tool without arguments (MCP's `properties: {}`)."""
    ping = {"type": "function", "name": "ping", "description": "Ping the server.",
            "parameters": {"type": "object", "properties": {}}}
    r = HTTP.post(server.url + "/v1/responses", timeout=600, json={
        "model": "SmolLM2-135M-Instruct", "input": "Ping the server please.", "tools": [ping], "tool_choice": "required",
        "temperature": 0, "max_output_tokens": 40}).json()
    assert r["status"] == "completed" and [(o["name"], o["arguments"]) for o in r["output"]] == [("ping", "{}")]
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    r = HTTP.post(server.url + "/v1/responses", timeout=600, json={
        "model": "SmolLM2-135M-Instruct", "input": "Name a city as JSON.", "temperature": 0, "max_output_tokens": 60,
        "text": {"format": {"type": "json_schema", "name": "c", "schema": city, "strict": True}}}).json()
    assert r["status"] == "completed" and list(json.loads(message_text(r))) == ["city"]


@pytest.mark.slow
def test_allowed_tools_narrow_the_calls_and_keep_the_prompt(server):
    clock = {"type": "function", "name": "get_time", "description": "Current time in a time zone",
             "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                            "required": ["zone"], "additionalProperties": False}}
    body = {"model": "SmolLM2-135M-Instruct", "input": "What is the weather in Hangzhou? Use the tool.",
            "tools": [WEATHER, clock], "temperature": 0, "max_output_tokens": 60}
    free = HTTP.post(server.url + "/v1/responses", json={**body, "tool_choice": "required"}, timeout=600).json()
    [picked] = [o["name"] for o in free["output"] if o["type"] == "function_call"]
    other = "get_time" if picked == "get_weather" else "get_weather"  # greedy, it picks the same one every time
    narrowed = HTTP.post(server.url + "/v1/responses", json={**body, "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": other}]}}, timeout=600).json()
    assert [o["name"] for o in narrowed["output"] if o["type"] == "function_call"] == [other]
    assert narrowed["usage"]["input_tokens"] == free["usage"]["input_tokens"]  # both tools still in the prompt
    bad = HTTP.post(server.url + "/v1/responses", json={**body, "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_news"}]}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice.tools"
    malformed = HTTP.post(server.url + "/v1/responses", json={**body, "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": ["get_time"]}]}}, timeout=60)
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "tool_choice.tools[0].name"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json", "call"])
def test_a_reply_whose_grammar_closes_on_the_limits_last_token_is_completed(server, kind):
    """Greedy, so the same reply every time: with room to spare it takes n tokens (the end of
    the turn not counted); a limit of exactly n still gives the whole reply, `completed`,
    because the grammar allowed nothing after it; n - 1 cuts it, `incomplete`."""
    body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_output_tokens": 200}
    if kind == "json":
        body.update(input="Reply with an example value as JSON.", response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["flat object"]}})
    else:
        body.update(input="What is the weather in Hangzhou? Use the tool.", tools=[WEATHER], tool_choice="required")

    def ask(limit: int) -> dict:
        return HTTP.post(server.url + "/lmsp/v1/responses", json={**body, "max_output_tokens": limit}, timeout=600).json()

    free = ask(200)
    n = free["usage"]["output_tokens"]
    assert free["status"] == "completed"
    exact = ask(n)
    assert exact["status"] == "completed" and exact["incomplete_details"] is None, exact
    assert [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in exact["output"]] == \
        [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in free["output"]]
    assert ask(n - 1)["status"] == "incomplete"


def test_a_reasoning_model_reasons_freely_then_answers_in_json(start_server, scripted_dir):  # noqa: F811
    server = start_server("--model", str(scripted_dir), "--model-id", "tiny")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    resp = HTTP.post(server.url + "/lmsp/v1/responses", json={
        "model": "tiny", "input": "Is it on?", "temperature": 0, "max_output_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, timeout=120).json()
    reasoning = [o for o in resp["output"] if o["type"] == "reasoning"]
    assert reasoning and reasoning[0]["summary"][0]["text"] == " the"  # the script's reasoning, untouched
    jsonschema.validate(json.loads(message_text(resp)), schema)


PATCH = {"type": "custom", "name": "apply_patch", "description": "Edits files with a patch.",
         "format": {"type": "grammar", "syntax": "lark",
                    "definition": 'start: "*** Begin Patch\\n" line{1,4} "*** End Patch"\nline: /[+-][a-z ]{1,30}\\n/\n'}}
PATCH_TEXT = re.compile(r"\*\*\* Begin Patch\n([+-][a-z ]{1,30}\n){1,4}\*\*\* End Patch")


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0, 1])
def test_a_custom_tool_call_follows_its_lark_grammar(server, temperature):
    body = {"model": "SmolLM2-135M-Instruct", "input": "Add a line saying hello to the readme.", "tools": [PATCH],
            "tool_choice": {"type": "custom", "name": "apply_patch"}, "temperature": temperature, "max_output_tokens": 200}
    resp = HTTP.post(server.url + "/v1/responses", json=body, timeout=600).json()
    [call] = [o for o in resp["output"] if o["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["call_id"].startswith("call_") and call["id"].startswith("ctc_")
    assert PATCH_TEXT.fullmatch(call["input"]), call["input"]
    # The client runs it and sends the result back: the next turn continues the live KV.
    nxt = HTTP.post(server.url + "/v1/responses", json={
        **body, "tool_choice": "auto",
        "input": [{"role": "user", "content": body["input"]}, call,
                  {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done."}]}, timeout=600).json()
    assert nxt["status"] in ("completed", "incomplete")
    assert nxt["usage"]["input_tokens_details"]["cached_tokens"] > resp["usage"]["input_tokens"]


@pytest.mark.slow
def test_a_custom_tool_call_streams_its_input(server):
    body = {"model": "SmolLM2-135M-Instruct", "input": "Remove the old line.", "tools": [PATCH], "stream": True,
            "tool_choice": "required", "temperature": 0, "max_output_tokens": 200}
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=600) as r:
        events = [e for e in read_sse(list(r.iter_lines())) if "event" in e]
    deltas = "".join(e["data"]["delta"] for e in events if e["event"] == "response.custom_tool_call_input.delta")
    [done] = [e["data"] for e in events if e["event"] == "response.custom_tool_call_input.done"]
    assert deltas == done["input"] and PATCH_TEXT.fullmatch(done["input"])


@pytest.mark.slow
def test_custom_tools_are_v1_only_and_a_bad_grammar_is_400(server):
    r = HTTP.post(server.url + "/lmsp/v1/responses", json={
        "model": "SmolLM2-135M-Instruct", "input": "x", "tools": [PATCH]})
    assert r.status_code == 400 and r.json()["code"] == "unsupported_capability"
    bad = {**PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: undefined_rule\n"}}
    r = HTTP.post(server.url + "/v1/responses", json={"model": "SmolLM2-135M-Instruct", "input": "x", "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


@pytest.mark.slow
@pytest.mark.parametrize("route, field", [("/lmsp/v1/responses", "response_format"), ("/v1/responses", "text")])
def test_json_object_means_any_json_object(server, route, field):
    fmt = {"type": "json_object"}
    # An unbounded schema: the prompt keeps the 135M model from rambling a string forever.
    body = {"model": "SmolLM2-135M-Instruct", "input": 'Reply with the JSON object {"ok": true} and nothing else.',
            "temperature": 0,
            "max_output_tokens": 120, field: fmt if field == "response_format" else {"format": fmt}}
    resp = HTTP.post(server.url + route, json=body, timeout=600).json()
    assert resp["status"] == "completed" and isinstance(json.loads(message_text(resp)), dict)


@pytest.mark.slow
def test_a_tool_schema_that_cannot_be_enforced_is_400_only_when_strict_was_asked(server):
    lookaround = {"type": "object", "properties": {"q": {"type": "string", "pattern": "(?<=a)b"}}}
    tool = {"type": "function", "name": "search", "description": "Search.", "parameters": lookaround}
    body = {"model": "SmolLM2-135M-Instruct", "input": "Search for cats.", "temperature": 0, "max_output_tokens": 30}
    r = HTTP.post(server.url + "/lmsp/v1/responses", json={**body, "tools": [{**tool, "strict": True}]}, timeout=600)
    assert r.status_code == 400 and r.json()["param"] == "tools[0].parameters"
    assert "JSON pointer '/properties/q'" in r.json()["detail"]
    # Strict by default only: the tool stays callable with any object as its arguments.
    r = HTTP.post(server.url + "/lmsp/v1/responses", json={**body, "tools": [tool]}, timeout=600)
    assert r.status_code == 200, r.text
