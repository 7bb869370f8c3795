"""A store that cannot be written mid-run: another process holds the SQLite file's write
lock past the busy timeout. Requests with `store: true` answer 503 `store_unavailable`;
the others are served; nothing already stored is lost; the store is used again once the
lock goes."""

from __future__ import annotations

import sqlite3

from tests.helpers import HTTP, ask


def test_a_locked_store_refuses_stored_work_serves_the_rest_and_recovers(start_server, tiny_model_dir, tmp_path):
    store = tmp_path / "store.sqlite3"
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(store))
    kept = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60).json()
    other = sqlite3.connect(store, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process writes, and holds the lock
    try:
        refused = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(store=True), timeout=60)
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "store_unavailable" and refused.headers["Retry-After"] == "5"
        served = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(), timeout=60)
        assert served.status_code == 200
        v1 = HTTP.post(server.url + "/v1/responses", json={**ask(), "store": True}, timeout=60)
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
