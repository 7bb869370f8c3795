"""POST /v1/messages (Anthropic's Messages API) against a real server: its shapes, sync and
streamed, on the same engine, KV sessions and tool-call continuation as /v1/responses.

The scripted model (tests/tiny_model.py) reasons " the", then calls get_weather and
get_time in one turn, every turn; the tiny random model answers free text.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import HTTP, source_of
from tests.tiny_model import ENDLESS
from tests.tiny_model import build_scripted_model

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "description": "Time in a zone.",
     "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]
QUESTION = {"role": "user", "content": "Weather and time in Paris?"}
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=cli; cch={};"


def post(server, body: dict, path: str = "/v1/messages", **kw) -> httpx.Response:
    """The request, its cache source recorded on `server.sources` (conftest.source_of)."""
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, **body}
    return source_of(server, lambda: HTTP.post(server.url + path, json=body, timeout=120, **kw))


def events(r: httpx.Response) -> list[tuple[str, dict]]:
    """An SSE body's (event, data) pairs; keep-alive comments are skipped."""
    out = []
    for frame in r.text.split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if lines:
            name = next(line[7:] for line in lines if line.startswith("event: "))
            out.append((name, json.loads(next(line[6:] for line in lines if line.startswith("data: ")))))
    return out


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == kind, doc
    return doc["error"]["message"]


@pytest.fixture(scope="module")
def caller(start_module_server, caller_dir):
    return start_module_server("--model", str(caller_dir), "--model-id", "tiny")


def tool_results(reply: dict) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": f"ok {b['name']}"}
                                        for b in reply["content"] if b["type"] == "tool_use"]}


# -- shapes ---------------------------------------------------------------------------------------


def test_a_reply_has_anthropics_shape_and_counts_input_without_the_cached_part(tiny_server):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Shapes. " + ENDLESS,
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "max_tokens": 12, "metadata": {"user_id": "u1"}}
    first = post(tiny_server, body, headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x-2025-01-01"}).json()
    assert first["id"].startswith("msg_") and first["type"] == "message" and first["role"] == "assistant"
    assert first["model"] == "tiny" and first["stop_reason"] == "max_tokens" and first["stop_sequence"] is None
    assert [b["type"] for b in first["content"]] == ["text"] and first["content"][0]["text"]
    counted = post(tiny_server, body, "/v1/messages/count_tokens").json()["input_tokens"]
    # Anthropic counts input_tokens without the part read from the cache (on this shared
    # server another test's prompt may share the first one's opening tokens).
    u = first["usage"]
    assert u == {"input_tokens": counted - u["cache_read_input_tokens"], "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": u["cache_read_input_tokens"], "output_tokens": 12}
    assert u["cache_read_input_tokens"] < counted / 2
    # The same conversation again: all of it but its last token comes from the cache.
    again = post(tiny_server, body, params={"beta": "true"}).json()
    u = again["usage"]
    assert u["cache_read_input_tokens"] == counted - 1 and u["input_tokens"] == 1
    assert again["content"] == first["content"]


def test_a_stream_has_anthropics_events_and_the_sync_reply(tiny_server):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": ENDLESS}]}], "max_tokens": 10}
    sync = post(tiny_server, body).json()
    r = post(tiny_server, {**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    seen = events(r)
    names = [n for n, _ in seen]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in seen)
    start = seen[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    text = "".join(d["delta"]["text"] for n, d in seen if n == "content_block_delta")
    assert text == sync["content"][0]["text"]
    delta = seen[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10
    assert (delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
            == start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"])


def test_a_stop_sequence_ends_the_text_and_is_named(tiny_server):
    body = {"messages": [{"role": "user", "content": ENDLESS}], "max_tokens": 30}
    text = post(tiny_server, body).json()["content"][0]["text"]
    stop = text[10:13]
    for stream in (False, True):
        r = post(tiny_server, {**body, "stop_sequences": ["never seen", stop], "stream": stream})
        if stream:
            seen = events(r)
            got = "".join(d["delta"]["text"] for n, d in seen if n == "content_block_delta")
            end = seen[-2][1]["delta"]
        else:
            reply = r.json()
            got, end = reply["content"][0]["text"], reply
        assert got == text[: text.index(stop)]
        assert end["stop_reason"] == "stop_sequence" and end["stop_sequence"] == stop


def test_top_k_1_samples_the_greedy_reply(tiny_server):
    body = {"messages": [{"role": "user", "content": ENDLESS}], "max_tokens": 8}
    greedy = post(tiny_server, body).json()["content"]
    assert post(tiny_server, {**body, "temperature": 1.0, "top_k": 1}).json()["content"] == greedy


# -- tools and thinking ---------------------------------------------------------------------------


def test_a_tool_loop_continues_the_live_kv_with_only_the_results_prefilled(caller):
    first = post(caller, {"messages": [QUESTION], "tools": TOOLS}).json()
    assert [b["type"] for b in first["content"]] == ["thinking", "tool_use", "tool_use"]
    assert first["stop_reason"] == "tool_use"
    thinking, weather, clock = first["content"]
    assert thinking["thinking"] == " the" and thinking["signature"].startswith("lmsp1.")
    assert (weather["name"], weather["input"]) == ("get_weather", {"city": "Paris"})
    assert (clock["name"], clock["input"]) == ("get_time", {"zone": "CET"})
    turn = [QUESTION, {"role": "assistant", "content": first["content"]}, tool_results(first)]
    second = post(caller, {"messages": turn, "tools": TOOLS}).json()
    assert caller.sources[-2:] == ["cold", "visible"]
    u = second["usage"]
    held = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]  # its end-of-turn token is prefilled next
    assert u["cache_read_input_tokens"] == held and 0 < u["input_tokens"] < held / 4
    # A failed call's result reaches the model as one: "Error: " leads it (7 byte tokens here).
    failed = tool_results(first)
    failed["content"][0]["is_error"] = True
    count = lambda last: post(caller, {"messages": [*turn[:2], last], "tools": TOOLS},  # noqa: E731
                              "/v1/messages/count_tokens").json()["input_tokens"]
    assert count(failed) - count(turn[2]) == 7


def test_a_streamed_tool_use_has_its_input_as_json_deltas_and_the_signature_last(caller):
    r = post(caller, {"messages": [QUESTION], "tools": TOOLS, "stream": True})
    seen = events(r)
    starts = [d["content_block"] for n, d in seen if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use", "tool_use"]
    assert starts[1]["input"] == {} and starts[1]["id"].startswith("call_")
    deltas = [(d["index"], d["delta"]) for n, d in seen if n == "content_block_delta"]
    *thought, signed = [d for i, d in deltas if i == 0]
    assert "".join(d["thinking"] for d in thought) == " the" and signed["type"] == "signature_delta"
    assert json.loads("".join(d["partial_json"] for i, d in deltas if i == 1)) == {"city": "Paris"}
    assert seen[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_thinking_disabled_or_omitted(caller):
    hidden = post(caller, {"messages": [QUESTION], "tools": TOOLS, "thinking": {"type": "disabled"}}).json()
    assert [b["type"] for b in hidden["content"]] == ["tool_use", "tool_use"]
    omitted = post(caller, {"messages": [QUESTION], "tools": TOOLS, "max_tokens": 2000,
                            "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}).json()
    thinking = omitted["content"][0]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "" and thinking["signature"].startswith("lmsp1.")


@pytest.mark.parametrize("choice, names", [
    ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, {"get_time"}),
    ({"type": "any"}, {"get_weather", "get_time"}),
])
def test_any_and_named_tool_choices_are_enforced_while_decoding(tiny_server, choice, names):
    # The tiny random model has no idea what a tool is; the grammar decides the shape.
    tools = [{**TOOLS[0], "input_schema": {**TOOLS[0]["input_schema"], "additionalProperties": False}},
             {**TOOLS[1], "input_schema": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
                                           "required": ["zone"], "additionalProperties": False}}]
    r = post(tiny_server, {"messages": [{"role": "user", "content": "Hello there"}], "tools": tools,
                           "tool_choice": choice, "temperature": 0.8, "max_tokens": 200})
    assert r.status_code == 200, r.text
    reply = r.json()
    [use] = [b for b in reply["content"] if b["type"] == "tool_use"]
    assert use["name"] in names and reply["stop_reason"] == "tool_use"
    assert set(use["input"]) == ({"zone"} if use["name"] == "get_time" else {"city"})


def test_tool_choice_none_calls_nothing(caller):
    none = post(caller, {"messages": [QUESTION], "tools": TOOLS, "tool_choice": {"type": "none"}}).json()
    assert not [b for b in none["content"] if b["type"] == "tool_use"] and none["stop_reason"] != "tool_use"


def test_a_signature_replayed_to_a_cold_server_renders_the_true_history(start_server, caller_dir, tmp_path):
    key = tmp_path / "state.key"
    live = start_server("--model", str(caller_dir), "--model-id", "tiny", "--state-key-file", str(key))
    first = post(live, {"messages": [QUESTION], "tools": TOOLS}).json()
    replay = [QUESTION, {"role": "assistant", "content": first["content"]}, tool_results(first)]
    fresh = start_server("--model", str(caller_dir), "--model-id", "tiny", "--state-key-file", str(key),
                         "--no-kv-disk")
    cold = post(fresh, {"messages": replay, "tools": TOOLS}).json()
    assert fresh.sources == ["cold"] and cold["stop_reason"] == "tool_use"
    blind = [QUESTION, {"role": "assistant", "content": first["content"][1:]}, tool_results(first)]
    without = post(fresh, {"messages": blind, "tools": TOOLS}).json()
    # The true history holds the reasoning the template drops: <think>, Ġthe, </think>.
    assert cold["usage"]["input_tokens"] + cold["usage"]["cache_read_input_tokens"] \
        - without["usage"]["input_tokens"] - without["usage"]["cache_read_input_tokens"] == 3
    # An altered signature, or one of another purpose, is a 400 naming the block.
    sig = first["content"][0]["signature"]
    for forged in (sig[:-6] + ("AAAAAA" if not sig.endswith("AAAAAA") else "BBBBBB"), "EqQBCkgIARAB"):
        content = [{**first["content"][0], "signature": forged}, *first["content"][1:]]
        r = post(fresh, {"messages": [QUESTION, {"role": "assistant", "content": content}, tool_results(first)],
                         "tools": TOOLS})
        message = anthropic_error(r, 400, "invalid_request_error")
        assert message.startswith("messages[1].content[0]") and "thinking block whose signature" in message


# -- Claude Code's billing line -------------------------------------------------------------------


def claude_code_turn(nonce: str) -> dict:
    return {"system": [{"type": "text", "text": BILLING.format(nonce[:3], nonce)},
                       {"type": "text", "text": "You are a coding agent. " * 20}],
            "messages": [{"role": "user", "content": ENDLESS}, {"role": "system", "content": "Today is Monday."}],
            "max_tokens": 4}


def test_the_billing_line_does_not_reach_the_prompt_so_the_kv_is_reused(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny")
    first = post(server, claude_code_turn("a1b2c")).json()
    second = post(server, claude_code_turn("f9e8d")).json()
    whole = second["usage"]["input_tokens"] + second["usage"]["cache_read_input_tokens"]
    # All of it but the last token, which is run again for the first token's logits.
    assert first["usage"]["cache_read_input_tokens"] == 0 and second["usage"]["cache_read_input_tokens"] == whole - 1
    assert server.log().count("x-anthropic-billing-header line is left out") == 1
    peer = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--keep-billing-header")
    post(peer, claude_code_turn("a1b2c"))
    kept = post(peer, claude_code_turn("f9e8d")).json()["usage"]
    assert kept["cache_read_input_tokens"] < 100 < kept["input_tokens"]  # the prompts differ from the nonce on


# -- models, auth and bad input -------------------------------------------------------------------


def test_claude_code_model_names_map_through_an_alias(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--model-alias", "claude-*=tiny")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(server, {**body, "model": "claude-haiku-4-5-20251001"})
    assert r.status_code == 200 and r.json()["model"] == "claude-haiku-4-5-20251001"
    message = anthropic_error(post(server, {**body, "model": "gpt-9"}), 404, "not_found_error")
    assert "'gpt-9'" in message and "'tiny'" in message


def test_keys_as_anthropic_clients_send_them(start_server, tiny_model_dir, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"writer": ["responses:write"], "reader": ["responses:read"]}))
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--tokens", str(tokens))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def send(**headers):
        return HTTP.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)

    assert send(**{"x-api-key": "writer"}).status_code == 200
    assert send(Authorization="Bearer writer").status_code == 200
    anthropic_error(send(**{"x-api-key": "wrong"}), 401, "authentication_error")
    anthropic_error(send(), 401, "authentication_error")
    anthropic_error(send(**{"x-api-key": "reader"}), 403, "permission_error")


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "CET"}}


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
     "messages[1]"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [TOOL_USE]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [TOOL_USE]},
                   {"role": "user", "content": "and?"}]}, "messages[1].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"name": "f", "description": "no schema"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048}, "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]}, "messages[0].content[0]"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": []}, "messages"),
])
def test_bad_input_is_400_naming_the_field(client, body, field):
    base = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    r = client.post("/v1/messages", json={k: v for k, v in {**base, **body}.items() if v is not None})
    assert field in anthropic_error(r, 400, "invalid_request_error")


def test_an_oversized_body_is_413_in_anthropics_shape(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-body-mb", "0.01")
    r = HTTP.post(server.url + "/v1/messages", timeout=60,
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 20000}]})
    anthropic_error(r, 413, "request_too_large")
    assert HTTP.get(server.url + "/healthz").status_code == 200


@pytest.mark.slow  # decodes 1,200 tokens, then more
def test_a_thinking_budget_closes_the_think_block(start_server, tmp_path):
    # A model that would think " the the the ..." until max_tokens.
    ponder = build_scripted_model(tmp_path / "ponder", script=["Ċ", "<think>", "Ġt", "h", "e", "Ġt", None,
                                                                "</think>", "O", "K", "<|im_end|>"])
    server = start_server("--model", str(ponder), "--model-id", "tiny")
    body = {"messages": [{"role": "user", "content": "Think."}], "max_tokens": 3000}
    endless = post(server, {**body, "max_tokens": 1200}).json()
    assert endless["stop_reason"] == "max_tokens" and endless["content"][0]["type"] == "thinking"
    capped = post(server, {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}).json()
    assert capped["stop_reason"] == "end_turn"
    thinking = capped["content"][0]
    assert thinking["type"] == "thinking" and thinking["thinking"] == (" the" * 342)[:1024 // 3 * 4 + 2]
    assert capped["content"][1] == {"type": "text", "text": "OK"}
    # 1,024 tokens of thinking, its closing tag, the reply, then the end of the turn.
    assert capped["usage"]["output_tokens"] == 1028
    # The Responses form of the same budget (an extension of `reasoning`).
    r = HTTP.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "Think.", "reasoning": {"budget_tokens": 5}, "max_output_tokens": 100})
    out = r.json()
    assert out["status"] == "completed"
    assert [i["summary"][0]["text"] for i in out["output"] if i["type"] == "reasoning"] == [" the th"]  # Ġt h e Ġt h


@pytest.mark.slow
def test_a_stream_cut_by_shutdown_ends_with_an_overloaded_error_event(start_server, tiny_model_dir):
    import signal

    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", process=True)
    body = {"model": "tiny", "max_tokens": 30000, "stream": True, "messages": [{"role": "user", "content": ENDLESS}]}
    with HTTP.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        frames, signalled = [], False
        for line in r.iter_lines():
            frames.append(line)
            if '"text_delta"' in line and not signalled:
                server.proc.send_signal(signal.SIGTERM)  # once; the stream goes on to its end
                signalled = True
    last = json.loads(next(line[6:] for line in reversed(frames) if line.startswith("data: ")))
    assert [line for line in frames if line][-2] == "event: error"
    assert last == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}
    assert server.proc.wait(timeout=30) == 0


def test_a_client_that_leaves_stops_its_generation(tiny_server):
    import time

    body = {"model": "tiny", "max_tokens": 30000, "stream": True, "messages": [{"role": "user", "content": ENDLESS}],
            "metadata": {"user_id": "leaves"}}
    with HTTP.stream("POST", tiny_server.url + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"text_delta"' in line:
                break
    deadline = time.monotonic() + 30
    while not any("route=messages" in line and "status=cancelled" in line for line in tiny_server.log().splitlines()):
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
