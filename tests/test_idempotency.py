"""Idempotency-Key: a retried POST never generates twice (docs/api.md, Idempotent retries)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.helpers import HTTP, ask, read_sse


@pytest.fixture(scope="module")
def server(start_module_server, tiny_model_dir):
    return start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny")


def generations(server) -> int:
    """Requests the worker has finished, from /metrics."""
    text = HTTP.get(server.url + "/metrics").text
    return sum(int(n) for n in re.findall(r"^lmsp_requests_total\{[^}]*\} (\d+)$", text, re.M))


def post(server, body, key, route="/lmsp/v1/responses") -> httpx.Response:
    return HTTP.post(server.url + route, json=body, headers={"Idempotency-Key": key}, timeout=120)


def test_concurrent_duplicates_generate_once_and_get_the_same_response(server):
    before = generations(server)
    body = ask(max_output_tokens=30)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: post(server, body, "key-concurrent"), range(4)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert len({r.json()["id"] for r in replies}) == 1
    assert [r.headers.get("Idempotent-Replayed") for r in replies].count("true") == 3
    assert replies[0].json() == replies[1].json()
    later = post(server, body, "key-concurrent")  # after it ended: the stored result
    assert later.json() == replies[0].json() and later.headers["Idempotent-Replayed"] == "true"
    assert generations(server) == before + 1


def test_the_same_key_with_another_body_is_422(server):
    assert post(server, ask("First body."), "key-reused").status_code == 200
    r = post(server, ask("Second body."), "key-reused")
    assert r.status_code == 422 and r.json()["code"] == "idempotency_key_reused"


def test_a_streamed_retry_re_attaches_to_the_same_events(server):
    before = generations(server)
    body = ask(max_output_tokens=20, stream=True)
    first = post(server, body, "key-stream")
    again = post(server, body, "key-stream")
    assert first.headers.get("Idempotent-Replayed") is None and again.headers["Idempotent-Replayed"] == "true"
    a, b = read_sse(first.text.splitlines()), read_sse(again.text.splitlines())
    assert a == b and a[-1]["event"] == "response.incomplete"
    assert generations(server) == before + 1


def test_a_task_retry_gets_the_same_task(server):
    body = {"request": ask(max_output_tokens=5)}
    first = HTTP.post(server.url + "/lmsp/v1/tasks", json=body, headers={"Idempotency-Key": "key-task"})
    again = HTTP.post(server.url + "/lmsp/v1/tasks", json=body, headers={"Idempotency-Key": "key-task"})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    other = HTTP.post(server.url + "/lmsp/v1/tasks", json={"request": ask(max_output_tokens=6)},
                       headers={"Idempotency-Key": "key-task"})
    assert other.status_code == 422


def test_a_refused_request_does_not_use_up_its_key(server):
    r = post(server, ask(model="nope"), "key-refused")
    assert r.status_code == 404
    r = post(server, ask(), "key-refused")
    assert r.status_code == 200 and "Idempotent-Replayed" not in r.headers
