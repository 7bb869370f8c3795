"""Stored responses and previous_response_id: a real server, a real SQLite file."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from tests.helpers import HTTP, ask, source_of
from tests.test_kv_cache import assistant, cached, kv_after, user, visible_prompt

WRITER = {"Authorization": "Bearer writer-token"}
OTHER = {"Authorization": "Bearer other-token"}


@pytest.fixture(scope="module")
def stored(start_module_server, tiny_model_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.json"
    everything = ["responses:write", "responses:read", "models:read"]
    tokens.write_text(json.dumps({"writer-token": everything, "other-token": everything}))
    return start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--tokens", str(tokens))


def post(server, body, headers=WRITER, route="/lmsp/v1/responses") -> dict:
    r = HTTP.post(server.url + route, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_stored_response_is_returned_to_its_token_only(stored):
    resp = post(stored, ask("Keep this one.", store=True))
    got = HTTP.get(f"{stored.url}/lmsp/v1/responses/{resp['id']}", headers=WRITER)
    assert got.status_code == 200 and got.json() == resp
    other = HTTP.get(f"{stored.url}/lmsp/v1/responses/{resp['id']}", headers=OTHER)
    assert other.status_code == 404 and other.json()["code"] == "response_not_found"
    unstored = post(stored, ask("Not this one."))  # LMSP's default is store: false
    assert HTTP.get(f"{stored.url}/lmsp/v1/responses/{unstored['id']}", headers=WRITER).status_code == 404


def test_idempotency_keys_belong_to_their_token(stored):
    key = {"Idempotency-Key": "shared-key"}
    mine = HTTP.post(stored.url + "/lmsp/v1/responses", json=ask("One."), headers={**WRITER, **key}, timeout=60)
    theirs = HTTP.post(stored.url + "/lmsp/v1/responses", json=ask("Two."), headers={**OTHER, **key}, timeout=60)
    assert mine.status_code == theirs.status_code == 200  # not 422: another token's key is another key
    assert mine.json()["id"] != theirs.json()["id"] and "Idempotent-Replayed" not in theirs.headers


def test_another_token_cannot_continue_a_stored_response(stored):
    resp = post(stored, ask("Mine.", store=True))
    r = HTTP.post(stored.url + "/lmsp/v1/responses", json=ask("Yours?", previous_response_id=resp["id"]),
                   headers=OTHER, timeout=60)
    assert r.status_code == 404 and r.json()["code"] == "response_not_found"


def test_previous_response_id_continues_the_chain_and_prefills_only_the_new_turn(start_server, scripted_dir):
    # The scripted model reasons (" the", hidden by its template in later turns), then says "OK".
    server = start_server("--model", str(scripted_dir), "--model-id", "tiny")
    first = source_of(server, lambda: post(server, ask("What does the lamp say?", store=True), headers={}))
    second = source_of(server, lambda: post(server, ask("Why?", store=True, previous_response_id=first["id"]), headers={}))
    third = source_of(server, lambda: post(server, ask("And then?", store=True, previous_response_id=second["id"]),
                                           headers={}))
    assert [o["type"] for o in third["output"]] == ["reasoning", "message"]
    # Each continuation starts from everything the KV held after the response before it...
    assert cached(second) == kv_after(first) and cached(third) == kv_after(second)
    assert server.sources == ["cold", "visible", "visible"]
    # ...and its prompt is the stored chain as a stateless client would replay it, plus the
    # 5 hidden reasoning tokens of each earlier turn that only the live KV holds.
    history = [user("What does the lamp say?"), assistant("OK"), user("Why?"), assistant("OK"), user("And then?")]
    assert third["usage"]["input_tokens"] == len(visible_prompt(scripted_dir, history)) + 2 * 5
    stored = HTTP.get(f"{server.url}/lmsp/v1/responses/{second['id']}").json()
    assert stored == second


def test_v1_stores_by_default_and_continues_with_previous_response_id(stored):
    first = post(stored, {"model": "tiny", "input": "Count the boats.", "temperature": 0, "max_output_tokens": 6},
                 route="/v1/responses")
    assert first["store"] is True
    got = HTTP.get(f"{stored.url}/v1/responses/{first['id']}", headers=WRITER).json()
    assert got["id"] == first["id"] and got["output"] == first["output"] and got["usage"] == first["usage"]
    second = post(stored, {"model": "tiny", "input": "Again.", "temperature": 0, "max_output_tokens": 6,
                           "previous_response_id": first["id"], "store": False}, route="/v1/responses")
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]
    assert HTTP.get(f"{stored.url}/v1/responses/{second['id']}", headers=WRITER).status_code == 404


@pytest.mark.slow  # waits out a 2 s retention
def test_stored_responses_past_retention_are_swept(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store-retention", "2s")
    resp = post(server, ask("Short-lived.", store=True), headers={})
    assert HTTP.get(f"{server.url}/lmsp/v1/responses/{resp['id']}").status_code == 200
    deadline = time.monotonic() + 30
    while HTTP.get(f"{server.url}/lmsp/v1/responses/{resp['id']}").status_code == 200:
        assert time.monotonic() < deadline, "never swept"
        time.sleep(0.3)
    assert "store sweep: 1 responses" in server.log()
    r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask("Next.", previous_response_id=resp["id"]), timeout=60)
    assert r.status_code == 404 and r.json()["code"] == "response_not_found"


def test_a_stored_conversation_continues_from_its_checkpoint_after_a_restart(start_server, scripted_dir, tmp_path):
    args = ("--model", str(scripted_dir), "--model-id", "tiny", "--store", str(tmp_path / "store.sqlite3"),
            "--kv-disk-dir", str(tmp_path / "kv"))
    before = start_server(*args)
    first = post(before, ask("What does the lamp say?", store=True), headers={})
    before.stop()  # SIGTERM: the live KV is checkpointed, the store is on disk
    after = start_server(*args)
    nxt = source_of(after, lambda: post(after, ask("Why?", previous_response_id=first["id"]), headers={}))
    assert after.sources == ["disk"]
    assert cached(nxt) == kv_after(first)  # the hidden reasoning came back from disk too


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
def test_a_stored_response_running_when_the_server_stops_is_kept(start_server, tiny_model_dir, tmp_path, stop):
    # SIGTERM: it ends cancelled, with what it had said; SIGKILL: nothing runs at the end,
    # but it was kept in_progress from the start and is failed at the next start.
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(tmp_path / "store.sqlite3"))
    server = start_server(*args, process=True)
    lines = []
    try:
        with HTTP.stream("POST", server.url + "/lmsp/v1/responses", timeout=120,
                          json=ask(max_output_tokens=20000, store=True, stream=True)) as r:
            for line in r.iter_lines():  # the client stays: its leaving would end the run itself
                lines.append(line)
                if line == "event: response.output_text.delta" and lines.count(line) == 5:
                    server.proc.send_signal(getattr(signal, stop))  # once: a second one exits at once
    except httpx.RemoteProtocolError:  # killed mid-stream
        assert stop == "SIGKILL"
    server.proc.wait(timeout=60)
    response_id = json.loads(lines[2].removeprefix("data: "))["response_id"]
    again = start_server(*args)
    got = HTTP.get(f"{again.url}/lmsp/v1/responses/{response_id}")
    assert got.status_code == 200, got.text
    if stop == "SIGKILL":
        assert got.json()["status"] == "failed" and got.json()["error"]["code"] == "internal_error"
        assert "marked failed" in again.log()
    else:
        assert got.json()["status"] == "cancelled" and got.json()["output"][0]["content"][0]["text"]


def test_the_store_and_the_checkpoints_are_private_to_their_owner(start_server, tiny_model_dir, tmp_path):
    import stat

    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(tmp_path / "s.sqlite3"),
                          "--kv-disk-dir", str(tmp_path / "kv"))
    post(server, ask("Keep this one.", store=True), headers={})
    assert stat.S_IMODE((tmp_path / "s.sqlite3").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "s.sqlite3-wal").stat().st_mode) == 0o600
    [folder] = (tmp_path / "kv").iterdir()  # one per model
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


SCHEMA_1_TASKS = """
CREATE TABLE tasks (id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, response_id TEXT NOT NULL,
    created_at REAL NOT NULL, ended_at REAL, last_event_id INTEGER NOT NULL DEFAULT 0,
    events_expired INTEGER NOT NULL DEFAULT 0, request TEXT NOT NULL, response TEXT);
CREATE TABLE task_events (task_id TEXT NOT NULL, id INTEGER NOT NULL, event TEXT NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (task_id, id)) WITHOUT ROWID;
PRAGMA user_version=1;
"""


def test_a_store_of_the_first_schema_is_upgraded_and_keeps_its_tasks(start_server, tiny_model_dir, tmp_path):
    import sqlite3
    from contextlib import closing

    store = tmp_path / "old.sqlite3"
    final = {"type": "response.completed", "sequence_number": 1, "response_id": "resp_old", "status": "completed"}
    with closing(sqlite3.connect(store)) as db:
        db.executescript(SCHEMA_1_TASKS)
        db.execute("INSERT INTO tasks VALUES ('task_old', 'local', 'completed', 'resp_old', ?, ?, 1, 0, ?, ?)",
                   (time.time(), time.time(), json.dumps({"model": "tiny", "input": []}),
                    json.dumps({"id": "resp_old", "status": "completed"})))
        db.execute("INSERT INTO task_events VALUES ('task_old', 1, 'response.completed', ?)", (json.dumps(final),))
        db.commit()
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(store))
    assert HTTP.get(server.url + "/lmsp/v1/tasks/task_old").json()["status"] == "completed"
    r = HTTP.get(server.url + "/lmsp/v1/tasks/task_old/events")
    assert r.status_code == 200 and "response.completed" in r.text
    started = post(server, {**ask(max_output_tokens=2), "background": True}, headers={}, route="/v1/responses")
    with HTTP.stream("GET", f"{server.url}/v1/responses/{started['id']}", params={"stream": "true"}) as r:
        assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
    with closing(sqlite3.connect(store)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
