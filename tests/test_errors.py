"""Bad input gets a problem document with the right status (docs/api.md, Problem codes), never a 500."""

from __future__ import annotations

import json
import socket
import time

import pytest
from tests.helpers import HTTP, ask

PROBLEM_FIELDS = {"type", "title", "status", "detail", "code"}


def problem(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.headers["LMSP-Version"] == "1.0"
    doc = r.json()
    assert PROBLEM_FIELDS <= set(doc)
    assert doc["status"] == status and doc["code"] == code
    assert doc["type"] == f"urn:lmsp:problem:{code}"
    return doc


def test_malformed_json(client):
    r = client.post("/lmsp/v1/responses", content=b'{"model": "tiny", "input": ', headers={"content-type": "application/json"})
    problem(r, 400, "invalid_request")


def test_body_must_be_an_object(client):
    problem(client.post("/lmsp/v1/responses", json=["tiny"]), 400, "invalid_request")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi"}, "model"),
        ({"model": "tiny"}, "input"),
        ({"model": 5, "input": "hi"}, "model"),
        ({"model": "tiny", "input": 5}, "input"),
        ({"model": "tiny", "input": "hi", "stream": "yes"}, "stream"),
        ({"model": "tiny", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "tiny", "input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
        ({"model": "tiny", "input": "hi", "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "input": "hi", "temperature": -1}, "temperature"),
        ({"model": "tiny", "input": "hi", "top_p": 1.5}, "top_p"),
        ({"model": "tiny", "input": "hi", "store": "yes"}, "store"),
        ({"model": "tiny", "input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "tiny", "input": [{"type": "message", "role": "user"}]}, "input[0].content"),
        ({"model": "tiny", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]},
         "input[0].content[0].text"),
    ],
)
def test_missing_and_ill_typed_fields(client, body, param):
    doc = problem(client.post("/lmsp/v1/responses", json=body), 400, "invalid_request")
    assert doc["param"] == param
    assert param.split(".")[-1].split("[")[0] in doc["detail"]


def test_unknown_item_type(client):
    doc = problem(client.post("/lmsp/v1/responses", json=ask(input=[{"type": "telepathy"}])), 400, "invalid_request")
    assert "telepathy" in doc["detail"] and doc["param"] == "input[0]"


def test_unknown_content_type(client):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_smell", "text": "x"}]}]
    doc = problem(client.post("/lmsp/v1/responses", json=ask(input=items)), 400, "invalid_request")
    assert "input_smell" in doc["detail"] and doc["param"] == "input[0].content[0]"


def test_reserved_content_types_are_unsupported(client):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    doc = problem(client.post("/lmsp/v1/responses", json=ask(input=items)), 400, "unsupported_capability")
    assert "input_image" in doc["detail"]


def test_json_nested_too_deeply(client):
    r = client.post("/lmsp/v1/responses", content=b"[" * 100000, headers={"content-type": "application/json"})
    problem(r, 400, "invalid_request")


def test_text_that_is_not_unicode(client, tiny_server):
    body = b'{"model": "tiny", "input": "\\ud800 lone surrogate"}'
    doc = problem(client.post("/lmsp/v1/responses", content=body, headers={"content-type": "application/json"}),
                  400, "invalid_request")
    assert "surrogate" in doc["detail"]
    # Half a pair anywhere a string goes, on every route: 400, never a 500 (the tokenizer and
    # the store cannot take it); a whole pair (an emoji) is text.
    for route, raw in [("/v1/responses", b'{"model": "tiny", "input": "ok", "instructions": "\\udc00"}'),
                       ("/v1/completions", b'{"model": "tiny", "prompt": ["\\udfff"]}'),
                       ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}')]:
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], (route, r.text)
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "\U0001F600", "max_tokens": 1}).status_code == 200
    websockets = pytest.importorskip("websockets")
    from websockets.sync.client import connect

    with connect(tiny_server.url.replace("http", "ws") + "/v1/responses") as ws:
        ws.send('{"type": "response.create", "model": "tiny", "input": "\\ud800"}')
        error = json.loads(ws.recv(timeout=60))
        assert error["type"] == "error" and "surrogate" in error["message"]


def test_tool_choice_must_be_known(client):
    doc = problem(client.post("/lmsp/v1/responses", json=ask(tool_choice="banana")), 400, "invalid_request")
    assert doc["param"] == "tool_choice"


def test_reasoning_items_of_another_model_are_accepted_and_not_shown_to_this_one(client):
    # Clients replay reasoning items they got (perhaps from another model); this model's
    # template has no place for them.
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "secret plan"}]},
             {"type": "message", "role": "assistant", "content": "hello"},
             {"type": "message", "role": "user", "content": "again"}]
    r = client.post("/lmsp/v1/responses", json=ask(input=items))
    assert r.status_code == 200, r.text


def test_a_tool_output_for_an_unknown_call(client):
    items = [{"type": "function_call_output", "call_id": "call_1", "output": "{}"}]
    doc = problem(client.post("/lmsp/v1/responses", json=ask(input=items)), 400, "unknown_call_id")
    assert doc["param"] == "input[0].call_id"
    # After a stored conversation the param still counts the request's own input.
    first = client.post("/lmsp/v1/responses", json=ask(store=True)).json()
    later = [{"type": "message", "role": "user", "content": "and?"}, *items]
    doc = problem(client.post("/lmsp/v1/responses", json=ask(input=later, previous_response_id=first["id"])),
                  400, "unknown_call_id")
    assert doc["param"] == "input[1].call_id"


def test_a_tool_name_offered_twice(client):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    doc = problem(client.post("/lmsp/v1/responses", json=ask(tools=[tool, {**tool, "description": "again"}])),
                  400, "invalid_request")
    assert doc["param"] == "tools[1].name" and "'f'" in doc["detail"]


def test_unknown_model(client):
    doc = problem(client.post("/lmsp/v1/responses", json=ask(model="gpt-9")), 404, "model_not_found")
    assert "gpt-9" in doc["detail"]


def test_prompt_over_the_context(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--ctx", "64")
    r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask("word " * 100))
    doc = problem(r, 400, "context_length_exceeded")
    assert "64" in doc["detail"]
    prompt_tokens = [int(w) for w in doc["detail"].split() if w.isdigit() and int(w) != 64]
    assert prompt_tokens and prompt_tokens[0] > 64
    # A prompt that fits is clamped to the room left, never past the context.
    ok = HTTP.post(server.url + "/lmsp/v1/responses", json=ask("hi", max_output_tokens=1000), timeout=60).json()
    assert ok["status"] == "incomplete"
    assert ok["incomplete_details"] == {"reason": "context_length"}
    assert ok["usage"]["total_tokens"] == 64
    # truncation "auto" (/v1): the oldest items go until the output asked for fits.
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "word " * 20},
            {"role": "assistant", "content": "word " * 20}, {"role": "user", "content": "hi"}]
    body = {**ask(input=talk, max_output_tokens=8), "truncation": "auto"}
    cut = HTTP.post(server.url + "/v1/responses", json=body, timeout=60).json()
    assert cut["truncation"] == "auto" and cut["usage"]["input_tokens"] + 8 <= 64, cut
    assert cut["usage"]["output_tokens"] == 8
    assert "dropped the 2 oldest items (of 4)" in server.log()  # the oldest user message, then the assistant's
    refused = HTTP.post(server.url + "/v1/responses", json={**body, "truncation": "disabled"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    alone = HTTP.post(server.url + "/v1/responses", json={**body, "input": "word " * 100}, timeout=60)
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "context_length_exceeded"


def test_unsupported_lmsp_version(client):
    r = client.post("/lmsp/v1/responses", json=ask(), headers={"LMSP-Version": "2.0"})
    doc = problem(r, 400, "unsupported_version")
    assert "2.0" in doc["detail"]
    # A second header (a proxy's) does not slip past the check.
    twice = client.post("/lmsp/v1/responses", json=ask(), headers=[("LMSP-Version", "1.0"), ("LMSP-Version", "2.0")])
    assert problem(twice, 400, "unsupported_version")
    assert client.post("/lmsp/v1/responses", json=ask(), headers={"LMSP-Version": "1.0"}).status_code == 200
    # Not an LMSP route: liveness answers whatever version a prober sends.
    assert client.get("/healthz", headers={"LMSP-Version": "2.0"}).status_code == 200


def test_a_refusal_from_the_headers_keeps_the_connection(tiny_server):
    # The client sends its headers, then its body a moment later, as httpcore does in two
    # writes. The refusal (made from the headers alone) must wait for that body: a response
    # that ends first makes Hypercorn close the connection, and the next request on it is lost.
    body = json.dumps(ask()).encode()
    head = (f"POST /lmsp/v1/responses HTTP/1.1\r\nHost: x\r\nLMSP-Version: 2.0\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    host, port = tiny_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        time.sleep(0.3)
        sock.sendall(body)
        replies = sock.makefile("rb")
        assert b" 400 " in replies.readline()
        _skip_reply(replies)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 200 " in replies.readline()


def _skip_reply(replies) -> None:
    length = 0
    while (line := replies.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    replies.read(length)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ],
)
def test_capabilities_the_model_lacks(client, fields, param):
    doc = problem(client.post("/lmsp/v1/responses", json=ask(**fields)), 400, "unsupported_capability")
    assert doc["param"] == param


def test_oversized_body(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-body-mb", "0.01")
    r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask("x" * 20000))
    problem(r, 413, "payload_too_large")
    # The unread body ends the connection: the reply says so, and a pooling client's next
    # request takes a new one instead of failing on the closed one.
    assert r.headers["Connection"] == "close"
    assert all(HTTP.post(server.url + "/lmsp/v1/responses", json=ask("x" * 20000)).status_code == 413
               for _ in range(20))


def test_unknown_route_and_method(client):
    problem(client.get("/lmsp/v1/nothing-here"), 404, "not_found")
    r = client.put("/lmsp/v1/responses", json=ask())
    problem(r, 405, "method_not_allowed")
    assert "POST" in r.headers["Allow"]


def test_v1_errors_are_openai_shaped(client):
    r = client.post("/v1/responses", json=ask(model="gpt-9"))
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"] and err["param"] == "model"
    assert err["type"] == "invalid_request_error"  # OpenAI's type for its 404s too
    r = client.post("/v1/responses", json=ask(previous_response_id="resp_gone"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    for field, value in (("conversation", "conv_123"), ("prompt", {"id": "pmpt_1"}), ("top_logprobs", 21)):
        r = client.post("/v1/responses", json=ask(**{field: value}))  # refused, not silently ignored
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for bad in ({"metadata": {f"k{i}": "v" for i in range(17)}}, {"metadata": {"k": "v" * 513}},
                {"reasoning": {"effort": "bogus"}}, {"text": {"format": "json"}}):
        r = client.post("/v1/responses", json={**ask(), **bad})
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == next(iter(bad)), r.text
    r = client.post("/v1/responses", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_errors_leave_the_server_serving(client):
    for _ in range(3):
        client.post("/lmsp/v1/responses", content=b"nope")
    assert client.post("/lmsp/v1/responses", json=ask()).status_code == 200


def test_unstored_response_is_not_found(client):
    doc = problem(client.get("/lmsp/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"), 404, "response_not_found")
    assert "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF" in doc["detail"]
    r = client.post("/lmsp/v1/responses", json=ask(previous_response_id="resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"))
    assert problem(r, 404, "response_not_found")["param"] == "previous_response_id"


def test_a_url_cannot_forge_log_lines(client, tiny_server):
    # Decoded, %0d%0a would end the request's log line and start one the URL wrote.
    problem(client.get("/lmsp/v1/tasks/x%0d%0a2026-01-01 INFO lmsp_mlx: forged%00"), 404, "task_not_found")
    log = tiny_server.log()
    assert not any(line.startswith("2026-01-01 INFO lmsp_mlx: forged") for line in log.splitlines())
    assert "\x00" not in log and "x\\x0d\\x0a2026-01-01" in log
    # The line says why a request was refused.
    problem(client.post("/lmsp/v1/responses", json=ask(max_output_tokens=0)), 400, "invalid_request")
    assert "param=max_output_tokens detail=" in tiny_server.log()


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(client, constant):
    body = b'{"model": "tiny", "input": "hi", "temperature": ' + constant.encode() + b"}"
    doc = problem(client.post("/lmsp/v1/responses", content=body, headers={"content-type": "application/json"}),
                  400, "invalid_request")
    assert "not a JSON number" in doc["detail"]
