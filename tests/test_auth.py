"""--api-key / LMSP_API_KEY: every route but /healthz needs the bearer token."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.helpers import HTTP, ask
from tests.servers import ROOT


@pytest.fixture(scope="module")
def locked(start_module_server, tiny_model_dir):
    """A server whose key comes from $LMSP_API_KEY (in this process: its flags are read as it starts)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LMSP_API_KEY", "s3cret")
        return start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
     {"Authorization": "Bearer s\u00e9cret".encode("utf-8")}],
)
def test_missing_or_wrong_token_is_401(locked, headers):
    for method, path, body in [
        ("POST", "/lmsp/v1/responses", ask()),
        ("GET", "/lmsp/v1/models", None),
        ("GET", "/lmsp/v1", None),
    ]:
        r = HTTP.request(method, locked.url + path, json=body, headers=headers)
        assert r.status_code == 401
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert r.headers["LMSP-Version"] == "1.0"
        assert r.json()["code"] == "unauthorized"
    r = HTTP.post(locked.url + "/v1/responses", json=ask(), headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_right_token_is_served(locked):
    auth = {"Authorization": "Bearer s3cret"}
    r = HTTP.post(locked.url + "/lmsp/v1/responses", json=ask(), headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 8
    assert HTTP.get(locked.url + "/v1/models", headers=auth).status_code == 200


def test_healthz_needs_no_token(locked):
    assert HTTP.get(locked.url + "/healthz").status_code == 200


@pytest.mark.slow
def test_no_key_refuses_a_non_loopback_host(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "lmsp_mlx.serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "0.0.0.0" in done.stderr and "--api-key" in done.stderr
    assert "Traceback" not in done.stderr


# Every route and the scope it needs (docs/api.md, Tokens and scopes).
ROUTES = [
    ("GET", "/lmsp/v1", None, "models:read"),
    ("GET", "/lmsp/v1/models", None, "models:read"),
    ("GET", "/lmsp/v1/models/tiny", None, "models:read"),
    ("GET", "/lmsp/v1/openapi.json", None, "models:read"),
    ("GET", "/v1/models", None, "models:read"),
    ("GET", "/v1/models/tiny", None, "models:read"),
    ("POST", "/lmsp/v1/responses", ask(), "responses:write"),
    ("POST", "/v1/responses", ask(), "responses:write"),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     "responses:write"),
    ("POST", "/lmsp/v1/responses/compact", ask(max_output_tokens=2), "responses:write"),
    ("POST", "/v1/responses/compact", ask(max_output_tokens=2), "responses:write"),
    ("POST", "/lmsp/v1/tasks", {"request": ask()}, "responses:write"),
    ("POST", "/lmsp/v1/tasks/task_x/cancel", None, "responses:write"),
    ("GET", "/lmsp/v1/responses/resp_x", None, "responses:read"),
    ("GET", "/v1/responses/resp_x", None, "responses:read"),
    ("GET", "/v1/responses/resp_x/input_items", None, "responses:read"),
    ("DELETE", "/v1/responses/resp_x", None, "responses:write"),
    ("POST", "/v1/responses/resp_x/cancel", None, "responses:write"),
    ("POST", "/v1/responses/input_tokens", {"input": "hi"}, "responses:write"),
    ("GET", "/lmsp/v1/tasks/task_x", None, "responses:read"),
    ("GET", "/lmsp/v1/tasks/task_x/events", None, "responses:read"),
    ("GET", "/metrics", None, "admin"),
]
SCOPES = ["responses:write", "responses:read", "models:read", "admin"]


@pytest.fixture(scope="module")
def scoped(start_module_server, tiny_model_dir, tmp_path_factory):
    import json

    tokens = tmp_path_factory.mktemp("tokens") / "tokens.json"
    # One token per scope, each holding every scope but that one.
    tokens.write_text(json.dumps({f"without-{s}": [o for o in SCOPES if o != s] for s in SCOPES}))
    return start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--tokens", str(tokens))


@pytest.mark.parametrize("method, path, body, scope", ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_a_token_without_the_routes_scope_is_403(scoped, method, path, body, scope):
    r = HTTP.request(method, scoped.url + path, json=body, headers={"Authorization": f"Bearer without-{scope}"},
                      timeout=60)
    assert r.status_code == 403
    code = r.json()["error"]["code"] if path.startswith("/v1") else r.json()["code"]
    assert code == "insufficient_scope"
    # A token that has the scope gets past the check (to the route's own answer).
    other = next(s for s in SCOPES if s != scope)
    r = HTTP.request(method, scoped.url + path, json=body, headers={"Authorization": f"Bearer without-{other}"},
                      timeout=60)
    assert r.status_code in (200, 202, 404), r.text


@pytest.mark.slow
@pytest.mark.parametrize("content, needle", [
    ('{"t": ["tools:execute"]}', "tools:execute"),
    ('{"t": ["everything"]}', "unknown scope"),
    ('["t"]', "JSON object"),
    ("{not json", "cannot read"),
    ("{}", "no tokens"),
    ('{"": ["admin"]}', "empty"),
])
def test_a_bad_tokens_file_refuses_to_start(tiny_model_dir, tmp_path, content, needle):
    path = tmp_path / "tokens.json"
    path.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "lmsp_mlx.serve", "--model", str(tiny_model_dir), "--tokens", str(path),
         "--store", str(tmp_path / "store.sqlite3")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0 and needle in done.stderr and "Traceback" not in done.stderr
