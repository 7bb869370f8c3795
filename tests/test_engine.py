"""The worker: disconnects stop generation, the bounded queue answers 429, shutdown ends every stream."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from tests.helpers import HTTP, ask, lookups_during
from tests.tiny_model import ENDLESS, FINISHES


def cancelled_line(server, after: int) -> str:
    """The first `status=cancelled` request log line logged after `after` lines."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [l for l in server.log().splitlines() if "request route=" in l][after:]
        for line in lines:
            if "status=cancelled" in line:
                return line
        time.sleep(0.05)
    raise AssertionError("no cancelled request logged:\n" + server.log()[-2000:])


def request_lines(server) -> int:
    return sum("request route=" in l for l in server.log().splitlines())


def test_disconnect_during_decode_stops_generation(tiny_server):
    before = request_lines(tiny_server)
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        with c.stream("POST", "/lmsp/v1/responses", json=ask(max_output_tokens=30000, stream=True)) as r:
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: response.output_text.delta")
                if deltas == 3:
                    break
    line = cancelled_line(tiny_server, before)
    produced = int(re.search(r"output_tokens=(\d+)", line).group(1))
    assert 3 <= produced < 30000
    # The server keeps serving.
    r = HTTP.post(tiny_server.url + "/lmsp/v1/responses", json=ask(FINISHES, max_output_tokens=50), timeout=60)
    assert r.json()["status"] == "completed"


def test_disconnect_during_prefill_stops_within_a_chunk(tiny_server):
    before = request_lines(tiny_server)
    progress = tiny_server.log().count("prefill ")
    long_prompt = "many words " * 2500  # about 28k tokens: 100+ prefill chunks
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        with c.stream("POST", "/lmsp/v1/responses", json=ask(long_prompt, stream=True)) as r:
            lines = r.iter_lines()  # kept: a closed line iterator closes the stream, and the client leaves
            next(line for line in lines if line.startswith("event: response.created"))
            deadline = time.monotonic() + 60  # leave mid-prefill, not while it is still queued
            while tiny_server.log().count("prefill ") == progress:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    line = cancelled_line(tiny_server, before)
    done, total = map(int, re.search(r"prefilled=(\d+)/(\d+)", line).groups())
    assert total > 20000 and 0 < done < total
    assert "output_tokens=0" in line


def test_sync_client_disconnect_cancels_too(tiny_server):
    before = request_lines(tiny_server)
    try:
        HTTP.post(tiny_server.url + "/lmsp/v1/responses", json=ask(max_output_tokens=30000), timeout=1.5)
    except httpx.TimeoutException:
        pass
    line = cancelled_line(tiny_server, before)
    assert int(re.search(r"output_tokens=(\d+)", line).group(1)) < 30000


@pytest.mark.parametrize("route, stream", [("/v1/responses", False), ("/v1/responses", True),
                                           ("/v1/chat/completions", False)])
def test_a_client_that_closes_as_it_sends_its_request_generates_nothing(tiny_server, route, stream):
    # Its disconnect comes with the body's last bytes; Python 3.11's asyncio.wait_for in the
    # body read used to swallow that cancellation, and the whole reply was generated.
    import json
    import socket

    body = {"model": "tiny", "max_tokens": 20000, "stream": stream,
            "messages": [{"role": "user", "content": ENDLESS}]} if "chat" in route else \
        {**ask(max_output_tokens=20000), "stream": stream}
    raw = json.dumps(body).encode()
    before = len(tiny_server.log())
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (route.encode(), len(raw)) + raw[:-1])
        time.sleep(0.3)  # the server now waits in the body read for the last byte
        s.sendall(raw[-1:])  # which arrives with the close: the body ends as the client leaves
    time.sleep(0.3)
    # The next request waits for the model: behind a 20,000-token reply if one is running.
    assert HTTP.post(tiny_server.url + "/lmsp/v1/responses", json=ask(max_output_tokens=1),
                      timeout=120).status_code == 200
    assert "output_tokens=20000" not in tiny_server.log()[before:]


def wait_for_metric(server, line: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in HTTP.get(server.url + "/metrics").text.splitlines():
            return
        time.sleep(0.05)
    raise AssertionError(f"/metrics never showed {line!r}")


class BusyStream(threading.Thread):
    """Keeps one long streaming generation running (and read) until `stop()`."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.generating = threading.Event()
        self._finish = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            with c.stream("POST", "/lmsp/v1/responses", json=ask(max_output_tokens=30000, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("event: response.output_text.delta"):
                        self.generating.set()
                    if self._finish.is_set():
                        return

    def stop(self) -> None:
        self._finish.set()
        self.join(timeout=60)


def test_full_queue_answers_429_with_retry_after(start_server, tiny_model_dir):
    # One sequence at a time: the stream holds the batch, the waiter the one queue place.
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-batch", "1", "--max-queue", "1")
    queued: dict = {}

    def wait_in_queue():
        queued["r"] = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(FINISHES, max_output_tokens=20), timeout=120)

    busy = BusyStream(server.url)
    busy.start()
    try:
        assert busy.generating.wait(timeout=60)
        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_for_metric(server, "lmsp_queue_depth 1")  # the waiter's request holds the one slot
        r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(), timeout=30)
        assert r.status_code == 429
        assert r.headers["Retry-After"].isdigit()
        assert r.json()["code"] == "queue_full" and r.json()["detail"].startswith("1 request is already waiting")
        assert "queue_full" in HTTP.post(server.url + "/v1/responses", json=ask(), timeout=30).text
        for stream in (False, True):  # Anthropic's shape, streamed or not: the status line says it
            m = HTTP.post(server.url + "/v1/messages", timeout=30, json={
                "model": "tiny", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "Hi"}]})
            assert m.status_code == 429 and m.headers["Retry-After"].isdigit()
            assert m.json()["type"] == "error" and m.json()["error"]["type"] == "rate_limit_error"
    finally:
        busy.stop()
    waiter.join(timeout=120)
    assert queued["r"].status_code == 200
    assert queued["r"].json()["status"] == "completed"
    metrics = HTTP.get(server.url + "/metrics").text
    assert 'lmsp_requests_total{status="cancelled"} 1' in metrics
    assert 'lmsp_requests_total{status="completed"} 1' in metrics
    assert "lmsp_queue_depth 0" in metrics
    assert 'lmsp_http_responses_total{code="429"} 4' in metrics  # refusals are counted too
    assert "request GET /metrics status=200" in server.log()  # and every request has its line


@pytest.mark.slow
def test_shutdown_ends_streams_with_a_final_event(start_server, tiny_model_dir):
    import signal

    from tests.helpers import read_sse

    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", process=True)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/lmsp/v1/responses", json=ask(max_output_tokens=30000, stream=True)) as r:
            lines, signalled = [], False
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("event: response.output_text.delta") and not signalled:
                    server.proc.send_signal(signal.SIGTERM)  # once; the stream goes on to its end
                    signalled = True
    events = read_sse(lines)
    assert events[-1]["event"] == "response.cancelled"
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    assert server.proc.wait(timeout=30) == 0
    log = server.log()
    assert "Traceback" not in log and "Exception in thread" not in log


@pytest.mark.slow
def test_shutdown_during_a_long_prefill_chunk_ends_the_stream_before_the_chunk(start_server):
    # One 3,000-token chunk takes the CPU seconds: the stream ends as cancelled at once
    # (within Hypercorn's grace period), the worker finishes its chunk, and the process exits.
    import signal

    from tests.helpers import DEFAULT_MODEL_ID, read_sse

    server = start_server("--prefill-chunk", "8192", process=True)
    body = {"model": DEFAULT_MODEL_ID, "input": " hello" * 3000, "max_output_tokens": 4, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/lmsp/v1/responses", json=body) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line == "event: response.created":
                    time.sleep(0.5)  # into the chunk
                    server.proc.send_signal(signal.SIGTERM)
            ended_before_the_chunk = "status=cancelled" not in server.log()
    events = read_sse(lines)
    assert [e.get("event") for e in events] == ["response.created", "response.cancelled"], lines
    assert ended_before_the_chunk
    assert server.proc.wait(timeout=300) == 0
    log = server.log()
    assert "status=cancelled prefilled=" in log and "Traceback" not in log


@pytest.mark.slow
def test_shutdown_marks_the_item_it_cut_incomplete_on_v1(start_server, tiny_model_dir):
    # As the stored response has it: the message the shutdown cut is not `completed`.
    import json
    import signal

    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", process=True)
    body = {**ask(max_output_tokens=30000), "stream": True}
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        events, signalled = [], False
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta" and not signalled:
                    server.proc.send_signal(signal.SIGTERM)
                    signalled = True
    [done] = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["status"] == "incomplete" and done["content"][0]["text"]
    assert server.proc.wait(timeout=60) == 0


def test_metrics_show_the_resident_kv_and_mlx_memory(tiny_server):
    """A reply's session stays resident: /metrics counts it, in bytes that MLX's active
    memory (which holds the model and every KV array) contains."""
    r = HTTP.post(tiny_server.url + "/lmsp/v1/responses", json=ask(FINISHES, max_output_tokens=8), timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 30  # the worker counts once the sequence's bookkeeping is done
    while True:
        gauges = dict(line.split(" ") for line in HTTP.get(tiny_server.url + "/metrics").text.splitlines()
                      if line.startswith(("lmsp_kv_", "lmsp_mlx_")))
        if int(gauges["lmsp_kv_sessions"]) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert int(gauges["lmsp_kv_sessions"]) >= 1
    assert 0 < int(gauges["lmsp_kv_resident_bytes"]) <= int(gauges["lmsp_mlx_active_bytes"])
    assert int(gauges["lmsp_mlx_cache_bytes"]) >= 0
    one = lookups_during(tiny_server, lambda: HTTP.post(tiny_server.url + "/lmsp/v1/responses",
                                                        json=ask(FINISHES, max_output_tokens=2), timeout=60))
    assert sum(one.values()) == 1 and set(one) <= {"visible", "token", "text", "disk", "cold"}  # one lookup, by source
