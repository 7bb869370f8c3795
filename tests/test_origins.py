"""Browser pages as clients: loopback pages and --cors-origin ones get CORS; without tokens,
any other page is refused before anything runs (its WebSocket included)."""

from __future__ import annotations

import httpx
import pytest
from tests.helpers import HTTP, ask

EVIL = "https://evil.example"
UI = "http://localhost:5173"  # a local web UI's dev server


def test_a_foreign_page_cannot_drive_a_server_without_tokens(tiny_server):
    before = tiny_server.log().count("request route=")
    for headers in ({"Origin": EVIL}, {"Origin": EVIL, "Content-Type": "text/plain"},
                    {"Origin": "http://localhost.evil.example"}):
        r = HTTP.post(tiny_server.url + "/v1/responses", json=ask(), headers=headers, timeout=60)
        assert r.status_code == 403 and "--cors-origin" in r.json()["error"]["message"]
        assert "access-control-allow-origin" not in r.headers
    # Any page can send null from a sandboxed frame: the advice is not to allow it.
    for origin in ("null", "http://evil.example#@localhost"):
        r = HTTP.post(tiny_server.url + "/v1/responses", json=ask(), headers={"Origin": origin}, timeout=60)
        assert r.status_code == 403 and "--cors-origin" not in r.json()["error"]["message"]
    assert tiny_server.log().count("request route=") == before  # nothing was generated
    r = httpx.options(tiny_server.url + "/v1/responses",
                      headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_a_foreign_page_cannot_open_the_websocket(tiny_server):
    websockets = pytest.importorskip("websockets")
    from websockets.sync.client import connect

    url = tiny_server.url.replace("http", "ws") + "/v1/responses"
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        connect(url, origin=EVIL)
    assert refused.value.response.status_code == 403
    with connect(url, origin=UI) as ws:  # a loopback page may
        ws.send('{"type": "response.create", "model": "tiny", "input": "hi", "max_output_tokens": 1}')
        assert '"response.created"' in ws.recv(timeout=60)


def test_a_loopback_page_gets_cors_and_its_preflight_answered(tiny_server):
    asked = "authorization, content-type, x-stainless-os"
    pre = httpx.options(tiny_server.url + "/v1/chat/completions", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == UI
    assert pre.headers["access-control-allow-headers"] == asked and "POST" in pre.headers["access-control-allow-methods"]
    r = HTTP.post(tiny_server.url + "/lmsp/v1/responses", json=ask(), headers={"Origin": UI}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    assert "Origin" in r.headers["vary"] and "Retry-After" in r.headers["access-control-expose-headers"]
    with HTTP.stream("POST", tiny_server.url + "/v1/responses", json={**ask(), "stream": True},
                      headers={"Origin": "http://127.0.0.1:8080"}, timeout=60) as s:
        assert s.headers["access-control-allow-origin"] == "http://127.0.0.1:8080"  # streams too
        s.read()


def test_with_tokens_the_named_origins_get_cors_and_the_token_guards_the_rest(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--api-key", "k",
                          "--cors-origin", "HTTPS://UI.example:443/")  # as a browser sends it: https://ui.example
    token = {"Authorization": "Bearer k"}
    pre = httpx.options(server.url + "/v1/responses", headers={  # a preflight carries no token
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://ui.example"
    r = HTTP.post(server.url + "/v1/responses", json=ask(), headers={**token, "Origin": "https://ui.example"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    other = HTTP.post(server.url + "/v1/responses", json=ask(), headers={**token, "Origin": EVIL}, timeout=60)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert HTTP.post(server.url + "/v1/responses", json=ask(), headers={"Origin": "https://ui.example"},
                      timeout=60).status_code == 401
