"""Tasks (section 6.4): background work whose events a client can resume, on a real SQLite file."""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import closing

import httpx
import pytest
from tests.helpers import HTTP, ask, read_sse

FINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}


@pytest.fixture(scope="module")
def tasks_server(start_module_server, tiny_model_dir):
    return start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny")


def create(server, body: dict, headers: dict | None = None) -> httpx.Response:
    return HTTP.post(server.url + "/lmsp/v1/tasks", json={"request": body}, headers=headers or {}, timeout=60)


def events(server, task_id: str, headers: dict | None = None, params: dict | None = None, stop_after: int | None = None):
    """The task's events as read_sse records; with `stop_after`, disconnect once that id arrived."""
    lines = []
    with HTTP.stream("GET", f"{server.url}/lmsp/v1/tasks/{task_id}/events", headers=headers or {},
                      params=params, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
            if stop_after is not None and line == "" and f"id: {stop_after}" in lines:
                break  # event `stop_after` has arrived whole
    out = read_sse(lines)
    return [e for e in out if "data" in e] if stop_after is None else out[:stop_after]


def wait_ended(server, task_id: str) -> dict:
    deadline = time.monotonic() + 120
    while (task := HTTP.get(f"{server.url}/lmsp/v1/tasks/{task_id}").json())["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return task


def test_a_task_runs_and_its_events_end_with_the_final_one(tasks_server):
    r = create(tasks_server, ask(max_output_tokens=12))
    assert r.status_code == 202
    task = r.json()
    assert task["object"] == "task" and task["status"] in ("queued", "in_progress", "completed", "incomplete")
    assert r.headers["Location"] == f"/lmsp/v1/tasks/{task['id']}"
    stream = events(tasks_server, task["id"])
    assert [int(e["id"]) for e in stream] == list(range(1, len(stream) + 1))
    assert stream[0]["event"] == "response.created" and stream[-1]["event"] == "response.incomplete"
    assert all(e["data"]["response_id"] == task["response_id"] for e in stream)
    ended = wait_ended(tasks_server, task["id"])
    assert ended["status"] == "incomplete" and ended["response"]["id"] == task["response_id"]
    assert ended["response"]["usage"]["output_tokens"] == 12
    text = "".join(e["data"]["delta"] for e in stream if e["event"] == "response.output_text.delta")
    assert ended["response"]["output"][0]["content"][0]["text"] == text


@pytest.mark.parametrize("how", ["Last-Event-ID", "after", "both"])
def test_a_dropped_stream_resumes_without_gaps_or_duplicates(tasks_server, how):
    task = create(tasks_server, ask(max_output_tokens=40)).json()
    k = 4
    head = events(tasks_server, task["id"], stop_after=k)  # then the client drops the connection
    assert [int(e["id"]) for e in head] == [1, 2, 3, 4]
    if how == "Last-Event-ID":
        rest = events(tasks_server, task["id"], headers={"Last-Event-ID": str(k)})
    elif how == "after":
        rest = events(tasks_server, task["id"], params={"after": k})
    else:  # `after` wins over the header
        rest = events(tasks_server, task["id"], headers={"Last-Event-ID": "1"}, params={"after": k})
    uninterrupted = events(tasks_server, task["id"])
    assert head + rest == uninterrupted
    assert rest[-1]["event"] in FINAL and int(rest[0]["id"]) == k + 1


def test_a_bad_after_is_400(tasks_server):
    task = create(tasks_server, ask(max_output_tokens=2)).json()
    url = f"{tasks_server.url}/lmsp/v1/tasks/{task['id']}/events"
    for params, headers, where in (({"after": "two"}, {}, "after"), ({"after": "-1"}, {}, "after"),
                                   ({"after": "9" * 20}, {}, "after"), ({}, {"Last-Event-ID": "9" * 26}, "Last-Event-ID")):
        r = HTTP.get(url, params=params, headers=headers)
        assert r.status_code == 400 and r.json()["param"] == where, r.text


def test_cancel_ends_the_stream_with_response_cancelled(tasks_server):
    task = create(tasks_server, ask(max_output_tokens=20000)).json()
    r = HTTP.post(f"{tasks_server.url}/lmsp/v1/tasks/{task['id']}/cancel", timeout=30)
    assert r.status_code == 200 and r.json()["id"] == task["id"]
    assert r.json()["status"] == "cancelled"  # the reply says the cancel took effect
    stream = events(tasks_server, task["id"])
    assert stream[-1]["event"] == "response.cancelled" and stream[-1]["data"]["status"] == "cancelled"
    assert wait_ended(tasks_server, task["id"])["status"] == "cancelled"


def test_a_queued_task_is_cancelled_at_once(serial_server):
    running = create(serial_server, ask(max_output_tokens=20000)).json()
    waiting = create(serial_server, ask(max_output_tokens=20000)).json()
    assert HTTP.get(f"{serial_server.url}/lmsp/v1/tasks/{waiting['id']}").json()["status"] == "queued"
    started = time.monotonic()
    r = HTTP.post(f"{serial_server.url}/lmsp/v1/tasks/{waiting['id']}/cancel", timeout=30)
    assert r.json()["status"] == "cancelled" and time.monotonic() - started < 2  # not after the running one
    assert events(serial_server, waiting["id"])[-1]["event"] == "response.cancelled"
    assert HTTP.get(f"{serial_server.url}/lmsp/v1/tasks/{running['id']}").json()["status"] == "in_progress"
    HTTP.post(f"{serial_server.url}/lmsp/v1/tasks/{running['id']}/cancel", timeout=30)
    assert "withdrawn from the queue" in serial_server.log()


def test_a_stored_tasks_response_is_in_progress_until_it_ends(tasks_server):
    task = create(tasks_server, ask(max_output_tokens=20000, store=True)).json()
    url = f"{tasks_server.url}/lmsp/v1/responses/{task['response_id']}"
    running = HTTP.get(url)
    assert running.status_code == 200 and running.json()["status"] == "in_progress", running.text
    HTTP.post(f"{tasks_server.url}/lmsp/v1/tasks/{task['id']}/cancel", timeout=30)
    wait_ended(tasks_server, task["id"])
    assert HTTP.get(url).json()["status"] == "cancelled"
    unstored = create(tasks_server, ask(max_output_tokens=20000)).json()
    assert HTTP.get(f"{tasks_server.url}/lmsp/v1/responses/{unstored['response_id']}").status_code == 404
    HTTP.post(f"{tasks_server.url}/lmsp/v1/tasks/{unstored['id']}/cancel", timeout=30)


def test_a_chain_from_a_running_stored_response_waits_for_it(tasks_server):
    # A client that chains right after creating a task: the id is known (GET says
    # in_progress), so the continuation waits for the response to be stored, not 404.
    task = create(tasks_server, ask(max_output_tokens=40, store=True)).json()
    r = HTTP.post(tasks_server.url + "/lmsp/v1/responses", timeout=120,
                   json=ask("And then?", max_output_tokens=2, previous_response_id=task["response_id"]))
    assert r.status_code == 200, r.text
    first = wait_ended(tasks_server, task["id"])["response"]
    assert first["usage"]["output_tokens"] == 40
    assert r.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 40  # its whole history


def test_unknown_tasks_are_404(tasks_server):
    for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
        r = HTTP.request(method, f"{tasks_server.url}/lmsp/v1/tasks/task_nothing{path}")
        assert r.status_code == 404 and r.json()["code"] == "task_not_found"


def test_a_bad_task_body_is_400_and_no_task(tasks_server):
    r = HTTP.post(tasks_server.url + "/lmsp/v1/tasks", json=ask())  # not wrapped in {"request": ...}
    assert r.status_code == 400 and r.json()["param"] == "request"
    r = create(tasks_server, ask(temperature="hot"))
    assert r.status_code == 400 and r.json()["code"] == "invalid_request"


@pytest.mark.slow  # waits out a 1 s event retention
def test_events_past_retention_are_410_and_the_result_stays(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--event-retention", "1s")
    task = create(server, ask(max_output_tokens=3)).json()
    background = HTTP.post(server.url + "/v1/responses", json={**ask(max_output_tokens=3), "background": True}).json()
    assert events(server, task["id"])[-1]["event"] == "response.incomplete"
    deadline = time.monotonic() + 30
    while (r := HTTP.get(f"{server.url}/lmsp/v1/tasks/{task['id']}/events")).status_code == 200:
        assert time.monotonic() < deadline, "events never expired"
        time.sleep(0.2)
    assert r.status_code == 410 and r.json()["code"] == "event_history_expired"
    assert HTTP.get(f"{server.url}/lmsp/v1/tasks/{task['id']}").json()["response"]["usage"]["output_tokens"] == 3
    # On /v1 the 410 points to what a /v1 client can GET (it never sees the task). The
    # background response may have ended after the task: its events expire a little later.
    while (r := HTTP.get(f"{server.url}/v1/responses/{background['id']}", params={"stream": "true"})).status_code == 200:
        assert time.monotonic() < deadline, "the background response's events never expired"
        time.sleep(0.2)
    assert r.status_code == 410 and f"GET /v1/responses/{background['id']}" in r.json()["error"]["message"]


def stored_events(store: str, task_id: str) -> int:
    with closing(sqlite3.connect(store)) as db:
        return db.execute("SELECT count(*) FROM task_events WHERE task_id = ?", (task_id,)).fetchone()[0]


@pytest.mark.slow
def test_a_task_running_when_the_server_is_killed_is_failed_after_restart(start_server, tiny_model_dir, tmp_path):
    store = str(tmp_path / "store.sqlite3")
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", store)
    server = start_server(*args, process=True)
    task = create(server, ask(max_output_tokens=20000, store=True)).json()
    seen = events(server, task["id"], stop_after=6)
    deadline = time.monotonic() + 60  # until a flush put those events on disk (a busy machine may be slow)
    while stored_events(store, task["id"]) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    sent: list[int] = []  # what a live follower was sent, up to the kill: ahead of the store's batches

    def follow():
        try:
            with HTTP.stream("GET", f"{server.url}/lmsp/v1/tasks/{task['id']}/events", timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        sent.append(int(line[4:]))
        except httpx.HTTPError:
            pass

    follower = threading.Thread(target=follow)
    follower.start()
    while len(sent) < 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.proc.kill()  # SIGKILL: no shutdown path runs
    server.proc.wait()
    follower.join()
    again = start_server(*args)
    ended = HTTP.get(f"{again.url}/lmsp/v1/tasks/{task['id']}").json()
    assert ended["status"] == "failed"
    assert ended["response"]["error"]["code"] == "internal_error" and "restarted" in ended["response"]["error"]["detail"]
    stored = events(again, task["id"])
    assert stored[:6] == seen
    # The final response holds what the stored events had streamed.
    text = "".join(e["data"]["delta"] for e in stored if e["event"] == "response.output_text.delta")
    assert text and ended["response"]["output"][0]["content"] == [{"type": "output_text", "text": text}]
    # It was stored: its response is there, failed, for a client that polls it rather than the task.
    assert HTTP.get(f"{again.url}/lmsp/v1/responses/{task['response_id']}").json() == ended["response"]
    ids = [int(e["id"]) for e in stored]
    assert ids[:-1] == list(range(1, len(ids))) and stored[-1]["event"] == "response.failed"
    # The last batch a follower was sent may not have reached the store: the final event is
    # numbered past it, so a follower resuming after anything it saw still hears the end.
    resumed = events(again, task["id"], params={"after": sent[-1]})
    assert resumed[-1]["event"] == "response.failed" and all(int(e["id"]) > sent[-1] for e in resumed)


@pytest.mark.slow
def test_a_v1_background_stream_running_when_the_server_is_killed_ends_failed_after_restart(
        start_server, tiny_model_dir, tmp_path):
    store = str(tmp_path / "store.sqlite3")
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", store)
    server = start_server(*args, process=True)
    lines = []
    with HTTP.stream("POST", server.url + "/v1/responses", timeout=120,
                      json={**ask(max_output_tokens=20000), "background": True, "stream": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len([e for e in read_sse(lines) if "data" in e]) == 6 and line == "":
                break
    seen = [e["data"] for e in read_sse(lines) if "data" in e]
    response_id = seen[0]["response"]["id"]
    with closing(sqlite3.connect(store)) as db:
        task_id = db.execute("SELECT id FROM tasks WHERE response_id = ?", (response_id,)).fetchone()[0]
    deadline = time.monotonic() + 60
    while stored_events(store, task_id) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server.proc.kill()
    server.proc.wait()
    again = start_server(*args)
    polled = HTTP.get(f"{again.url}/v1/responses/{response_id}").json()
    assert polled["status"] == "failed" and polled["error"]["code"] == "internal_error" and polled["background"]
    with HTTP.stream("GET", f"{again.url}/v1/responses/{response_id}", params={"stream": "true"}) as r:
        replayed = [e["data"] for e in read_sse(list(r.iter_lines())) if isinstance(e.get("data"), dict)]
    assert replayed[:6] == seen
    numbers = [e["sequence_number"] for e in replayed]
    assert numbers[:-1] == list(range(len(numbers) - 1)) and numbers[-1] > numbers[-2]
    assert replayed[-1]["type"] == "response.failed" and replayed[-1]["response"] == polled
    text = "".join(e["delta"] for e in replayed if e["type"] == "response.output_text.delta")
    assert text and polled["output"][0]["content"][0]["text"] == text


@pytest.mark.slow
def test_a_v1_background_response_killed_while_queued_still_streams_from_its_start(start_server, tiny_model_dir,
                                                                                  tmp_path):
    store = str(tmp_path / "store.sqlite3")
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", store, "--max-batch", "1")
    server = start_server(*args, process=True)
    endless = {**ask(max_output_tokens=20000), "background": True}
    HTTP.post(server.url + "/v1/responses", json=endless, timeout=60)
    waiting = HTTP.post(server.url + "/v1/responses", json=endless, timeout=60).json()
    assert waiting["status"] == "queued"
    with HTTP.stream("GET", f"{server.url}/v1/responses/{waiting['id']}", params={"stream": "true"}) as r:
        lines = []
        for line in r.iter_lines():  # its stream so far: created, and nothing more while it waits
            lines.append(line)
            if line == "":
                break
    [created] = [e["data"] for e in read_sse(lines) if "data" in e]
    assert created["type"] == "response.created" and created["response"]["status"] == "queued"
    time.sleep(1.0)  # a quiet stream's events are stored within FLUSH_SECONDS all the same
    server.proc.kill()
    server.proc.wait()
    again = start_server(*args)
    with HTTP.stream("GET", f"{again.url}/v1/responses/{waiting['id']}", params={"stream": "true"}) as r:
        replayed = [e["data"] for e in read_sse(list(r.iter_lines())) if isinstance(e.get("data"), dict)]
    assert [e["type"] for e in replayed] == ["response.created", "response.failed"]  # as the SDK needs it
    assert replayed[0] == created


def test_a_task_running_at_a_normal_shutdown_ends_cancelled(start_server, tiny_model_dir, tmp_path):
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(tmp_path / "store.sqlite3"))
    server = start_server(*args)
    task = create(server, ask(max_output_tokens=20000)).json()
    events(server, task["id"], stop_after=3)  # it is generating
    server.stop()  # SIGTERM
    again = start_server(*args)
    assert HTTP.get(f"{again.url}/lmsp/v1/tasks/{task['id']}").json()["status"] == "cancelled"
    assert events(again, task["id"])[-1]["event"] == "response.cancelled"
    assert "running when the service stopped" not in again.log()  # it ended properly, nothing to recover


def test_a_recovered_task_ends_past_every_event_its_followers_may_have_been_sent(tmp_path):
    # Followers are sent each event before its batch is stored: a crash may have kept up to
    # FLUSH_EVERY fewer than a follower saw. The final event must still reach that follower.
    from lmsp_mlx.service.tasks import FLUSH_EVERY, Tasks
    from lmsp_mlx.store import Database, IdempotencyKeys, StoredEvent, StoredResponses, TaskLog

    db = Database(tmp_path / "store.sqlite3")
    log = TaskLog(db)
    log.create("task_x", "local", "resp_x", {"model": "tiny", "input": [], "store": False})
    log.append("task_x", [StoredEvent(i, "response.output_text.delta", {"output_index": 0, "delta": "a"})
                          for i in range(1, 11)], "in_progress")
    assert Tasks(log, IdempotencyKeys(db)).recover(StoredResponses(db)) == 1
    last_seen = 10 + FLUSH_EVERY  # the most a follower can have been sent
    [final] = log.events_after("task_x", last_seen)
    assert final.event == "response.failed" and final.data["sequence_number"] == final.id
    assert log.get("local", "task_x").status == "failed"
