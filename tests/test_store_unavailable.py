"""A store that cannot be written mid-run: another process holds the SQLite file's write
lock past the busy timeout. Requests with `store: true` answer 503 `store_unavailable`;
the others are served; nothing already stored is lost; the store is used again once the
lock goes."""

from __future__ import annotations

import sqlite3
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.helpers import HTTP, ask


@pytest.mark.slow  # waits out SQLite's busy timeout
def test_a_locked_store_refuses_stored_work_serves_the_rest_and_recovers(start_server, tiny_model_dir, tmp_path):
    store = tmp_path / "store.sqlite3"
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(store))
    kept = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60).json()
    other = sqlite3.connect(store, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process writes, and holds the lock
    try:  # the two stored requests wait out the busy timeout (in turn: one store writer); the unstored one is served meanwhile
        with ThreadPoolExecutor(2) as pool:
            refused = pool.submit(HTTP.post, server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60)
            v1 = pool.submit(HTTP.post, server.url + "/v1/responses", json={**ask(), "store": True}, timeout=60)
            served = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(), timeout=60)
            assert served.status_code == 200 and not refused.done() and not v1.done()
            refused, v1 = refused.result(), v1.result()
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "store_unavailable" and refused.headers["Retry-After"] == "5"
        assert v1.status_code == 503 and v1.json()["error"]["code"] == "store_unavailable"
    finally:
        other.execute("ROLLBACK")
        other.close()
    again = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60)
    assert again.status_code == 200
    for r in (kept, again.json()):  # nothing stored was lost, and the store is written again
        got = HTTP.get(server.url + f"/lmsp/v1/responses/{r['id']}", timeout=60)
        assert got.status_code == 200 and got.json()["output"] == r["output"]
    assert "store unavailable: the store" in server.log() and "database is locked" in server.log()


@pytest.mark.slow
def test_a_full_disk_refuses_stored_work_and_recovers_once_space_returns(start_server, tiny_model_dir, tmp_path):
    """The store on a small filesystem of its own (a tmpfs: root only), filled up mid-run."""
    folder = tmp_path / "small"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root: the full-disk case is not run here")
    try:
        store = folder / "store.sqlite3"
        server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(store),
                              "--no-kv-disk")
        kept = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60).json()
        filler = folder / "filler"
        with open(filler, "wb") as f:  # everything the filesystem has left
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        refused = [HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True, max_output_tokens=64),
                             timeout=60) for _ in range(3)]
        assert 503 in [r.status_code for r in refused], [r.text for r in refused]
        assert all(r.status_code in (200, 503) for r in refused)
        assert HTTP.post(server.url + "/lmsp/v1/responses", json=ask(), timeout=60).status_code == 200
        filler.unlink()
        again = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60)
        assert again.status_code == 200
        for r in (kept, again.json()):
            assert HTTP.get(server.url + f"/lmsp/v1/responses/{r['id']}", timeout=60).json()["output"] == r["output"]
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)  # lazily: the server still holds the file
