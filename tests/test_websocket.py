"""WebSocket mode on /v1/responses, driven by the official OpenAI SDK (`responses.connect`)."""

from __future__ import annotations

import json

import openai
import pytest
from tests.helpers import ask

websockets = pytest.importorskip("websockets", reason="the SDK's WebSocket mode needs the websockets package")


@pytest.fixture
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def run_one(connection, **fields) -> tuple[list, object]:
    """Send one response.create and read its events up to the final one."""
    connection.response.create(**fields)
    events = []
    for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events, event
    raise AssertionError("the connection closed before a final event")


def test_several_responses_and_a_chain_on_one_connection(sdk):
    with sdk.responses.connect() as connection:
        events, final = run_one(connection, model="tiny", input="Count these tokens, the whole prompt", temperature=0,
                                max_output_tokens=8, store=False)
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        first = final.response
        assert first.status == "incomplete" and first.usage.output_tokens == 8
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert first.output_text == text
        # store: false, yet the next response on this connection continues it, from the live KV.
        _, final = run_one(connection, model="tiny", input="And again.", previous_response_id=first.id, temperature=0,
                           max_output_tokens=8)
        second = final.response
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # it was never stored
        sdk.responses.retrieve(first.id)


def test_a_bad_message_gets_an_error_event_and_the_connection_stays_open(sdk, tiny_server):
    from websockets.sync.client import connect

    with connect(tiny_server.url.replace("http", "ws") + "/v1/responses") as ws:
        ws.send("{not json")
        assert json.loads(ws.recv())["type"] == "error"
        ws.send('{"type": "response.create", "input": ' + "[" * 5000 + "]" * 5000 + "}")  # too deep to decode
        error = json.loads(ws.recv())
        assert error["type"] == "error" and error["status"] == 400 and "deeply" in error["message"]
        ws.send(json.dumps({"type": "response.create", **ask(model="nope")}))
        error = json.loads(ws.recv())
        assert error["type"] == "error" and error["code"] == "model_not_found"
        ws.send(json.dumps({"type": "response.create", **ask(background=True)}))  # HTTP only, as on OpenAI
        error = json.loads(ws.recv())
        assert error["type"] == "error" and error["param"] == "background"
        ws.send(json.dumps({"type": "response.create", **ask(max_output_tokens=2)}))
        while (event := json.loads(ws.recv()))["type"] not in ("response.completed", "response.incomplete"):
            pass
        assert event["response"]["usage"]["output_tokens"] == 2


def test_the_socket_needs_a_token_when_the_server_has_one(start_server, tiny_model_dir):
    from websockets.sync.client import connect

    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--api-key", "s3cret")
    url = server.url.replace("http", "ws") + "/v1/responses"
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        connect(url)
    assert refused.value.response.status_code == 401
    with connect(url, additional_headers={"Authorization": "Bearer s3cret"}) as ws:
        ws.send(json.dumps({"type": "response.create", **ask(max_output_tokens=2)}))
        assert json.loads(ws.recv())["type"] == "response.created"


def test_a_failed_continuation_evicts_what_it_continued(tiny_server):
    """Open Responses' websocket-failed-continuation-evicts-cache: a `store: false` turn, a
    continuation of it that fails (a tool output for a call it never made), then the same
    previous_response_id again: previous_response_not_found, not a continuation."""
    from websockets.sync.client import connect

    def send(ws, **fields) -> list[dict]:
        ws.send(json.dumps({"type": "response.create", **fields}))
        events = []
        while True:
            events.append(json.loads(ws.recv()))
            if events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                return events

    with connect(tiny_server.url.replace("http", "ws") + "/v1/responses") as ws:
        first = send(ws, model="tiny", input="Hello there", max_output_tokens=4, temperature=0, store=False)[-1]
        assert first["type"] in ("response.completed", "response.incomplete")
        first_id = first["response"]["id"]
        failed = send(ws, model="tiny", previous_response_id=first_id, max_output_tokens=4,
                      input=[{"type": "function_call_output", "call_id": "call_never_made", "output": "42"}])[-1]
        assert failed["type"] == "error" and failed["code"] == "unknown_call_id"
        again = send(ws, model="tiny", input="And then?", previous_response_id=first_id, max_output_tokens=4)[-1]
        assert again["type"] == "error" and again["code"] == "previous_response_not_found"
        assert again["status"] == 404
        # the connection still serves: a fresh turn answers
        assert send(ws, model="tiny", input="Hi", max_output_tokens=2, store=False)[-1]["type"] != "error"
