"""Function tools (section 6.5) through a real server: calls out, results in, and the turn
after a call continuing the live KV with only the tool result prefilled.

The scripted model reasons (" the"), then calls get_weather and get_time in one turn,
every turn, whatever it is told: the tests are about the protocol and the KV, not wit.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import HTTP, source_of
from tests.tiny_model import CALLS, build_scripted_model

# strict: false: the scripted model samples each whole call as one artificial token, which
# spans the call marker and the JSON body; llguidance cannot follow a token across that
# lexeme boundary. Strict enforcement is tested on real tokenizers in test_structured.py.
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city.", "strict": False,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "get_time", "description": "Time in a zone.", "strict": False,
     "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]
QUESTION = {"role": "user", "content": "Weather and time in Paris?"}


@pytest.fixture
def caller(start_server, caller_dir):
    return start_server("--model", str(caller_dir), "--model-id", "tiny")


def post(server, body: dict, route: str = "/lmsp/v1/responses") -> httpx.Response:
    """The request, its cache source recorded on `server.sources` (conftest.source_of)."""
    return source_of(server, lambda: HTTP.post(server.url + route, timeout=120, json={
        "model": "tiny", "temperature": 0, "max_output_tokens": 40, **body}))


def outputs_for(calls: list[dict]) -> list[dict]:
    return [{"type": "function_call_output", "call_id": c["call_id"], "output": json.dumps({"ok": c["name"]})}
            for c in calls]


def cached(resp: dict) -> int:
    return resp["usage"]["input_tokens_details"]["cached_tokens"]


def test_a_turn_with_reasoning_and_two_calls(caller):
    resp = post(caller, {"input": [QUESTION], "tools": TOOLS}).json()
    assert resp["status"] == "completed"
    kinds = [item["type"] for item in resp["output"]]
    assert kinds == ["reasoning", "function_call", "function_call"]
    assert resp["output"][0]["summary"] == [{"type": "summary_text", "text": " the"}]
    reasoning = resp["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert 2 <= reasoning < resp["usage"]["output_tokens"]  # " the" and the closing tag, not the calls
    weather, time_ = resp["output"][1:]
    assert (weather["name"], json.loads(weather["arguments"])) == ("get_weather", {"city": "Paris"})
    assert (time_["name"], json.loads(time_["arguments"])) == ("get_time", {"zone": "CET"})
    assert weather["id"].startswith("fc_") and weather["call_id"].startswith("call_")
    assert weather["call_id"] != time_["call_id"]


def test_the_turn_after_the_calls_prefills_only_the_tool_results(caller):
    first = post(caller, {"input": [QUESTION], "tools": TOOLS}).json()
    held = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]  # its end-of-turn token is prefilled next
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    # Stateless replay of everything, reasoning item included (what the OpenAI SDK's docs say).
    replay = post(caller, {"input": [QUESTION, *first["output"], *outputs_for(calls)], "tools": TOOLS}).json()
    assert cached(replay) == held
    results = "".join(o["output"] for o in outputs_for(calls))
    # Prefilled: the two results and their markup (this tokenizer has almost one token per byte).
    assert replay["usage"]["input_tokens"] - cached(replay) < len(results) + 100
    # Tool-output-only: the live turn is found by call id.
    calls2 = [i for i in replay["output"] if i["type"] == "function_call"]
    held2 = replay["usage"]["input_tokens"] + replay["usage"]["output_tokens"]
    only = post(caller, {"input": outputs_for(calls2), "tools": TOOLS}).json()
    assert cached(only) == held2
    assert caller.sources == ["cold", "visible", "tool-output"]


def test_parallel_tool_calls_false_ends_the_turn_at_its_first_call(caller):
    first = post(caller, {"input": [QUESTION], "tools": TOOLS, "parallel_tool_calls": False}).json()
    assert first["status"] == "completed"
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather"]  # the script's second call is never sampled
    # The KV holds exactly that one call, so the replay with its result continues it.
    replay = post(caller, {"input": [QUESTION, *first["output"], *outputs_for(calls)], "tools": TOOLS,
                           "parallel_tool_calls": False}).json()
    assert caller.sources[-1] == "visible"
    # (all but the call's last token: sampled last, it was never fed, and is prefilled now)
    assert cached(replay) >= first["usage"]["input_tokens"] + first["usage"]["output_tokens"] - 1


def test_allowed_tools_without_a_grammar_still_parse_only_the_allowed_calls(caller):
    # strict: false, so nothing stops the script from writing both calls: the one not
    # allowed stays text instead of becoming a call the client did not allow.
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]}
    resp = post(caller, {"input": [QUESTION], "tools": TOOLS, "tool_choice": choice}).json()
    assert [o["name"] for o in resp["output"] if o["type"] == "function_call"] == ["get_time"]
    assert "get_weather" in "".join(p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"])


def test_exact_replay_renders_the_sampled_call_text(caller, caller_dir):
    from lmsp_mlx.cache.calls import CallMemory, CallTurn
    from lmsp_mlx.engine.render import to_chat_messages
    from lmsp_mlx.protocol.requests import parse_request

    first = post(caller, {"input": [QUESTION], "tools": TOOLS}).json()
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    items = parse_request({"model": "tiny", "input": [QUESTION, *calls]}).items()
    # Without the server's memory the calls are re-serialised; with it, byte-identical.
    memory = CallMemory()
    memory.remember(CallTurn(tuple(c["call_id"] for c in calls), "".join(CALLS), (QUESTION, *calls)))
    sampled = to_chat_messages(items, memory=memory)[-1]["content"]
    assert sampled == "".join(CALLS)
    rebuilt = to_chat_messages(items)[-1]["content"]
    assert json.loads(rebuilt.split("\n")[1]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    # A client that edited the turn gets what it sent rendered, not the remembered text.
    edited = [{**calls[0], "arguments": json.dumps({"city": "Berlin"})}, calls[1]]
    items = parse_request({"model": "tiny", "input": [QUESTION, *edited]}).items()
    assert "Berlin" in to_chat_messages(items, memory=memory)[-1]["content"]


def test_streamed_calls_follow_section_6_5(caller):
    with HTTP.stream("POST", caller.url + "/lmsp/v1/responses", timeout=120, json={
        "model": "tiny", "input": [QUESTION], "tools": TOOLS, "stream": True, "temperature": 0,
    }) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    names = [e["type"] for i, e in enumerate(events) if i == 0 or e["type"] != events[i - 1]["type"]
             or not e["type"].endswith(".delta")]  # runs of deltas count once
    assert names == [
        "response.created",
        "response.output_item.added", "response.reasoning_summary_text.delta", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    done = [e for e in events if e["type"] == "response.output_item.done"][1]["item"]
    assert done["type"] == "function_call" and json.loads(done["arguments"]) == {"city": "Paris"}
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))


def test_v1_stream_and_the_openai_sdk_see_function_calls(caller):
    from openai import OpenAI

    client = OpenAI(base_url=caller.url + "/v1", api_key="unused")
    resp = client.responses.create(model="tiny", input=[QUESTION], tools=TOOLS, temperature=0)
    assert [o.type for o in resp.output] == ["reasoning", "function_call", "function_call"]
    call = resp.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    with client.responses.stream(model="tiny", input=[QUESTION], tools=TOOLS, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.done") == 2
    assert kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "function_call", "function_call"]
    # The next turn through the SDK, replaying the output as the docs show.
    follow = client.responses.create(
        model="tiny", tools=TOOLS, temperature=0,
        input=[QUESTION, *[o.model_dump(exclude_none=True) for o in final.output],
               *outputs_for([o.model_dump() for o in final.output if o.type == "function_call"])],
    )
    # Everything the streamed turn left in the KV (its hidden reasoning included) is reused;
    # only the two tool results are prefilled.
    held = final.usage.input_tokens + final.usage.output_tokens  # its end-of-turn token is prefilled next
    assert follow.usage.input_tokens_details.cached_tokens == held
    assert follow.usage.input_tokens - held < 200


def test_unknown_call_ids_and_missing_reasoning_are_refused(caller):
    orphan = {"type": "function_call_output", "call_id": "call_nobody", "output": "{}"}
    r = post(caller, {"input": [orphan], "tools": TOOLS})
    assert r.status_code == 400 and r.json()["code"] == "unknown_call_id"
    r = post(caller, {"input": [QUESTION, orphan], "tools": TOOLS})
    assert r.status_code == 400 and r.json()["code"] == "unknown_call_id"
    # A reasoning model's tool-call turn replayed without its reasoning item, for a call
    # the server never made (no live or disk state): 400; with the item: 200.
    call = {"type": "function_call", "call_id": "call_elsewhere", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}
    result = {"type": "function_call_output", "call_id": "call_elsewhere", "output": "rain"}
    r = post(caller, {"input": [QUESTION, call, result], "tools": TOOLS})
    assert r.status_code == 400 and r.json()["code"] == "reasoning_state_missing"
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Oslo first."}]}
    assert post(caller, {"input": [QUESTION, reasoning, call, result], "tools": TOOLS}).status_code == 200


def test_another_tokens_call_ids_are_unknown_to_it(start_server, caller_dir, tmp_path):
    # A call id must not open another token's conversation: sending only the outputs would
    # continue its KV (hidden reasoning and all) and leak what it holds into the reply.
    everything = ["responses:write", "responses:read", "models:read"]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": everything, "mallory": everything, "ops": ["admin"]}))
    server = start_server("--model", str(caller_dir), "--model-id", "tiny", "--tokens", str(tokens))

    def as_(who: str, body: dict) -> httpx.Response:
        return HTTP.post(server.url + "/lmsp/v1/responses", headers={"Authorization": f"Bearer {who}"}, timeout=120,
                          json={"model": "tiny", "temperature": 0, "max_output_tokens": 40, "tools": TOOLS, **body})

    first = as_("alice", {"input": [QUESTION]}).json()
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    r = as_("mallory", {"input": outputs_for(calls)})
    assert r.status_code == 400 and r.json()["code"] == "unknown_call_id", r.text
    # Replaying alice's call without its reasoning does not borrow her state either.
    r = as_("mallory", {"input": [QUESTION, *calls, *outputs_for(calls)]})
    assert r.status_code == 400 and r.json()["code"] == "reasoning_state_missing", r.text
    own = source_of(server, lambda: as_("alice", {"input": outputs_for(calls)}), headers={"Authorization": "Bearer ops"})
    assert own.status_code == 200 and cached(own.json()) > 0
    assert server.sources == ["tool-output"]


def test_tool_output_only_after_the_live_state_was_replaced_is_409(start_server, caller_dir):
    server = start_server("--model", str(caller_dir), "--model-id", "tiny", "--kv-memory-mb", "0.001", "--no-kv-disk")
    first = post(server, {"input": [QUESTION], "tools": TOOLS}).json()
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    post(server, {"input": [{"role": "user", "content": "Something else entirely, " * 20}]})  # evicts it
    r = post(server, {"input": outputs_for(calls), "tools": TOOLS})
    assert r.status_code == 409 and r.json()["code"] == "continuation_state_unavailable"


def test_tool_types_and_choices(caller):
    r = post(caller, {"input": [QUESTION], "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["code"] == "unsupported_capability" and "web_search" in r.json()["detail"]
    # /v1 accepts the hosted types Codex lists and flattens namespace groups.
    codex_tools = [{"type": "web_search"}, {"type": "web_search_2025_08_26"},  # dated versions too
                   {"type": "namespace", "name": "fs", "tools": [TOOLS[0]]}, TOOLS[1]]
    r = post(caller, {"input": [QUESTION], "tools": codex_tools}, route="/v1/responses")
    assert r.status_code == 200, r.text
    r = post(caller, {"input": [QUESTION], "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}})
    assert r.status_code == 400 and r.json()["param"] == "tool_choice.name"
    # none: the tools stay in the prompt, but the grammar keeps the script from opening its calls.
    r = post(caller, {"input": [QUESTION], "tools": TOOLS, "tool_choice": "none"}).json()
    assert r["status"] == "completed" and "function_call" not in [o["type"] for o in r["output"]]
    assert "<tool_call>" not in json.dumps(r["output"])


def test_the_model_listing_advertises_tools_and_reasoning(caller):
    caps = HTTP.get(caller.url + "/lmsp/v1/models/tiny").json()["capabilities"]
    assert "tools" in caps and "reasoning" in caps


CITY = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"], "additionalProperties": False}}


@pytest.mark.parametrize("choice, names", [
    ({"type": "function", "name": "get_time"}, {"get_time"}),
    ("required", {"get_weather", "get_time"}),
])
def test_required_and_named_choices_are_enforced_while_decoding(client, choice, names):
    # The tiny random model has no idea what a tool is; the grammar decides the shape.
    for text in ("Hello there", "Count these tokens, the whole prompt"):
        r = client.post("/lmsp/v1/responses", json={
            "model": "tiny", "input": text, "tools": [CITY, CLOCK], "tool_choice": choice,
            "temperature": 0.8, "max_output_tokens": 200,  # one byte per token here
        })
        assert r.status_code == 200, r.text
        [call] = [o for o in r.json()["output"] if o["type"] == "function_call"]
        assert call["name"] in names
        args = json.loads(call["arguments"])
        assert args in ({"city": "Paris"}, {"city": "Oslo"}, {"zone": "CET"}, {"zone": "UTC"})
        assert set(args) == ({"zone"} if call["name"] == "get_time" else {"city"})


def test_a_schema_the_engine_cannot_enforce_is_400_before_generation(client):
    bad = {**CITY, "parameters": {"type": "object", "properties": {"city": {"type": "strange"}}}}
    r = client.post("/lmsp/v1/responses", json={"model": "tiny", "input": "x", "tools": [bad], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text


def test_a_tool_loop_resumes_after_a_restart(start_server, caller_dir, tmp_path):
    args = ["--model", str(caller_dir), "--model-id", "tiny", "--kv-disk-dir", str(tmp_path / "kv")]
    before = start_server(*args)
    first = post(before, {"input": [QUESTION], "tools": TOOLS}).json()
    before.wait_for_log("kv checkpoint reason=tool-call")
    before.stop()
    held = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    calls = [i for i in first["output"] if i["type"] == "function_call"]

    after = start_server(*args)
    # Only the tool outputs: the new process knows the calls from the checkpoint.
    only = post(after, {"input": outputs_for(calls), "tools": TOOLS}).json()
    assert cached(only) == held
    assert after.sources == ["tool-output"]


CODEX_BODY = {  # the shape of a Codex CLI request (0.4x, wire_api = "responses")
    "model": "tiny",
    "instructions": "You are Codex, a coding agent based on GPT-5. You and the user share the same workspace.",
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write</permissions instructions>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/work</cwd>\n  <shell>bash</shell>\n</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files here."}]},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"},
             "timeout_ms": {"type": "number"}}, "required": ["command"], "additionalProperties": False}},
        {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
         "parameters": {"type": "object", "properties": {"plan": {"type": "array", "items": {"type": "object"}}},
                        "required": ["plan"], "additionalProperties": False}},
        {"type": "namespace", "name": "mcp__files", "description": "A file server.",
         "tools": [{"type": "function", "name": "read", "description": "Reads a file.", "strict": False,
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
        {"type": "web_search"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a1b2-7c3d-7e4f-8a9b-0c1d2e3f4a5b",
    "text": {"verbosity": "medium"},
}


def test_a_codex_request_is_accepted_streaming_and_not(caller):
    r = post(caller, {**CODEX_BODY, "max_output_tokens": 40}, route="/v1/responses")
    assert r.status_code == 200, r.text
    # The scripted model calls get_weather, which Codex did not offer: no invented call (the
    # tools are not strict here, so the call is sampled, then kept as text).
    assert [o["type"] for o in r.json()["output"]] == ["reasoning", "message"]
    assert "get_weather" in r.json()["output"][1]["content"][0]["text"]
    assert "malformed tool call kept as text" in caller.log()
    with HTTP.stream("POST", caller.url + "/v1/responses", json={**CODEX_BODY, "stream": True}, timeout=120) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["type"] == "response.completed"


QWEN_CODER_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def test_a_model_specific_call_syntax_goes_through_mlx_lm_s_parser(start_server, tmp_path):
    # Qwen3-Coder's XML-style calls: the tokenizer names mlx-lm's qwen3_coder parser.
    model = build_scripted_model(tmp_path / "coder", script=["Ċ", QWEN_CODER_CALL, "<|im_end|>"],
                                 words=(QWEN_CODER_CALL,), tokenizer_config={"tool_parser_type": "qwen3_coder"})
    server = start_server("--model", str(model), "--model-id", "tiny")
    resp = post(server, {"input": [QUESTION], "tools": TOOLS}).json()
    [call] = resp["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}


TRICKY_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hangzhou}}</tool_call>Colored:"}}\n</tool_call>'


def test_a_call_whose_argument_holds_the_closing_marker_is_one_call(start_server, tmp_path):
    """A strict grammar lets a string argument hold any text, the closing marker included
    (a sampled reply at temperature 1 put `}}</tool_call>Colored:` in a city name): the
    call still ends where its JSON does, so it is one call with that argument, not text."""
    script = ["Ċ", "<think>", "Ġt", "h", "e", "</think>", TRICKY_CALL, "<|im_end|>"]
    model = build_scripted_model(tmp_path / "tricky", script=script, words=(TRICKY_CALL,))
    server = start_server("--model", str(model), "--model-id", "tiny")
    resp = post(server, {"input": [QUESTION], "tools": TOOLS}).json()
    calls = [(c["name"], json.loads(c["arguments"])) for c in resp["output"] if c["type"] == "function_call"]
    assert calls == [("get_weather", {"city": "Hangzhou}}</tool_call>Colored:"})]
    assert not [o for o in resp["output"] if o["type"] == "message"], resp["output"]
