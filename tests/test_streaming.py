"""Streaming (sections 6.3-6.4): event names, integer ids, data fields, the final event."""

from __future__ import annotations

import httpx
import pytest
from tests.helpers import HTTP, ask, read_sse
from tests.tiny_model import FINISHES


@pytest.fixture(scope="module")
def fresh_server(start_module_server, tiny_model_dir):
    # Its own KV: the tiny random model's greedy reply to FINISHES ends early from a
    # cold prefill, but can run on after a session other tests left is reused (a prefix
    # continued from a cache sums in another order, and this model's logits are near ties).
    return start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny")


@pytest.fixture
def client(fresh_server):
    with httpx.Client(base_url=fresh_server.url, timeout=120) as c:
        yield c


def stream(client, body, path="/lmsp/v1/responses"):
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["LMSP-Version"] == "1.0"
        return read_sse(r.iter_lines())


def test_event_sequence_ids_and_fields(client):
    events = stream(client, ask(FINISHES, max_output_tokens=100))
    names = [e["event"] for e in events]
    assert names[0] == "response.created"
    assert names[1] == "response.output_item.added"
    assert names[-2] == "response.output_item.done"
    assert names[-1] == "response.completed"
    assert set(names[2:-2]) == {"response.output_text.delta"}
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    response_id = events[0]["data"]["response_id"]
    for e in events:
        data = e["data"]
        assert data["type"] == e["event"]
        assert data["sequence_number"] == int(e["id"])
        assert data["response_id"] == response_id
    assert events[0]["data"]["status"] == "in_progress"
    added = events[1]["data"]
    assert added["output_index"] == 0
    assert added["item"]["type"] == "message" and added["item"]["content"] == []
    deltas = [e["data"] for e in events if e["event"] == "response.output_text.delta"]
    assert all(d["item_id"] == added["item"]["id"] and d["delta"] for d in deltas)
    done = events[-2]["data"]["item"]
    assert done["id"] == added["item"]["id"]
    assert done["content"][0]["text"] == "".join(d["delta"] for d in deltas)
    final = events[-1]["data"]
    assert final["status"] == "completed"
    assert final["usage"]["total_tokens"] == final["usage"]["input_tokens"] + final["usage"]["output_tokens"]


def test_stream_matches_the_sync_response(client):
    body = ask(max_output_tokens=12)
    sync = client.post("/lmsp/v1/responses", json=body).json()
    events = stream(client, body)
    assert events[-2]["data"]["item"]["content"] == sync["output"][0]["content"]
    # The same tokens in and out; how many came from the KV cache depends on what ran before.
    counts = lambda u: {k: u[k] for k in ("input_tokens", "output_tokens", "total_tokens")}  # noqa: E731
    assert counts(events[-1]["data"]["usage"]) == counts(sync["usage"])


def test_token_limit_ends_with_response_incomplete(client):
    events = stream(client, ask(max_output_tokens=3))
    final = events[-1]
    assert final["event"] == "response.incomplete"
    assert final["data"]["status"] == "incomplete"
    assert final["data"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["data"]["usage"]["output_tokens"] == 3
    finals = [e for e in events if e["event"] in ("response.completed", "response.incomplete", "response.failed")]
    assert len(finals) == 1


def test_v1_stream_uses_open_responses_framing(client):
    with client.stream("POST", "/v1/responses", json=ask(max_output_tokens=6, stream=True)) as r:
        lines = list(r.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    events = read_sse(lines)
    data = [e["data"] for e in events if isinstance(e.get("data"), dict)]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(e["event"] == e["data"]["type"] for e in events if isinstance(e.get("data"), dict))
    types = [d["type"] for d in data]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]
    # queued only while another request still holds the model (a shared test server's)
    assert data[0]["response"]["status"] in ("in_progress", "queued") and data[1]["response"]["status"] == "in_progress"
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    assert all(d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    final = data[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "".join(d["delta"] for d in deltas)
    assert final["usage"]["output_tokens"] == 6


@pytest.mark.slow  # waits out a 1 s task before its stream answers
def test_a_stream_waiting_for_the_model_sends_keepalive_comments(start_server, tiny_model_dir):
    # Queued behind a task, the stream has nothing to send for a while: comment lines keep
    # idle timeouts of clients and proxies from cutting it, and clients read past them.
    import threading

    from openai import OpenAI

    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--sse-keepalive", "0.05",
                          "--max-batch", "1")

    def hold_the_model() -> None:
        task = HTTP.post(server.url + "/lmsp/v1/tasks", json={"request": ask(max_output_tokens=100000)}).json()
        threading.Timer(1.0, httpx.post, (f"{server.url}/lmsp/v1/tasks/{task['id']}/cancel",)).start()

    hold_the_model()
    with HTTP.stream("POST", server.url + "/lmsp/v1/responses", json={**ask(max_output_tokens=4), "stream": True},
                      timeout=120) as r:
        lines = list(r.iter_lines())
    assert lines.count(": keep-alive") >= 5
    events = read_sse(lines)
    assert [e["event"] for e in events][-1] == "response.incomplete"
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))

    hold_the_model()
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    events = list(client.responses.create(model="tiny", input="Say hello", max_output_tokens=4, temperature=0,
                                          stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 4
