"""kill -9 in the middle of the server's writes, then a restart on the same files: every
stored response and task is terminal, the SQLite file is intact, and no temp file is left.

The other writes have their own kill tests: a checkpoint's (tests/test_kv_pool.py,
`test_a_write_killed_midway_leaves_nothing_that_loads`: the half-written file is never
read, and is swept at the next start) and a task's event appends
(tests/test_tasks.py, `test_a_task_running_when_the_server_is_killed_is_failed_after_restart`).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.helpers import HTTP, ask

pytestmark = pytest.mark.slow

TERMINAL = {"completed", "incomplete", "failed", "cancelled"}


def kill(server) -> None:
    server.proc.kill()  # SIGKILL: no shutdown path runs
    server.proc.wait()


def intact(store: Path) -> tuple[list[str], list[str]]:
    """The SQLite file passes its own check; the statuses of its responses and tasks."""
    db = sqlite3.connect(store)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = [row[0] for row in db.execute("SELECT json_extract(response, '$.status') FROM responses")]
        tasks = [row[0] for row in db.execute("SELECT status FROM tasks")]
    finally:
        db.close()
    return statuses, tasks


def no_temp_files(*folders: Path) -> None:
    left = [p for f in folders if f.exists() for p in f.rglob("*") if p.name.startswith((".tmp-", ".convert-"))]
    assert not left, left


def test_a_batch_of_8_killed_mid_decode(start_server, tiny_model_dir, tmp_path):
    store, kv = tmp_path / "store.sqlite3", tmp_path / "kv"
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(store), "--kv-disk-dir", str(kv),
            "--max-batch", "8")
    server = start_server(*args, process=True)
    started: list[str] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        body = {**ask(f"Story {i}: count these tokens, the whole prompt", max_output_tokens=30000), "store": True,
                "stream": True}
        try:
            with HTTP.stream("POST", server.url + "/lmsp/v1/responses", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"response.output_text.delta"' in line:
                        with lock:
                            started.append(line)
        except httpx.HTTPError:
            pass  # killed mid-stream

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    task = HTTP.post(server.url + "/lmsp/v1/tasks", json={"request": ask(max_output_tokens=30000, store=True)},
                     timeout=60).json()
    deadline = time.monotonic() + 60
    while len(started) < 200:  # all eight decode together by now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    kill(server)
    for t in threads:
        t.join()
    again = start_server(*args)
    statuses, tasks = intact(store)
    assert len(statuses) == 9 and set(statuses) <= TERMINAL, statuses  # eight responses and the task's
    assert tasks == ["failed"]
    assert HTTP.get(f"{again.url}/lmsp/v1/tasks/{task['id']}").json()["status"] == "failed"
    no_temp_files(kv)


def test_sqlite_writes_killed_under_load_leave_an_intact_store(start_server, tiny_model_dir, tmp_path):
    store = tmp_path / "store.sqlite3"
    args = ("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(store), "--max-queue", "64")
    server = start_server(*args, process=True)
    stop = threading.Event()
    done: list[int] = []

    def write() -> None:  # short stored responses and tasks, one after another: a write every few ms
        while not stop.is_set():
            try:
                HTTP.post(server.url + "/lmsp/v1/responses", json=ask(max_output_tokens=2, store=True), timeout=30)
                HTTP.post(server.url + "/lmsp/v1/tasks", json={"request": ask(max_output_tokens=2, store=True)},
                          timeout=30)
                done.append(1)
            except httpx.HTTPError:
                return

    writers = [threading.Thread(target=write) for _ in range(4)]
    for w in writers:
        w.start()
    deadline = time.monotonic() + 60
    while len(done) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    kill(server)
    stop.set()
    for w in writers:
        w.join()
    start_server(*args)
    statuses, tasks = intact(store)
    assert len(statuses) >= 40 and set(statuses) <= TERMINAL
    assert set(tasks) <= TERMINAL
    no_temp_files(tmp_path)


def test_a_model_load_killed_midway_is_swept_and_done_again(start_server, tmp_path):
    """The default model's first start fetches and converts it into the store: killed then,
    the next start removes what the conversion left and converts it again."""
    models = tmp_path / "models"
    args = ("--models-dir", str(models), "--store", str(tmp_path / "store.sqlite3"))
    from tests.servers import ProcessServer  # started by hand: killed before it is ready

    server = ProcessServer(list(args), tmp_path / "first.log", None)
    deadline = time.monotonic() + 300
    while not (models.exists() and list(models.glob(".convert-*"))):
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        time.sleep(0.005)
    kill(server)
    assert list(models.glob(".convert-*"))  # what the kill left
    again = start_server(*args, process=True)
    assert HTTP.post(again.url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                                         "max_tokens": 2}, timeout=120).status_code == 200
    assert "left by a conversion that did not finish" in again.log()
    no_temp_files(models)
