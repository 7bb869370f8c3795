"""--api-key / LMSP_API_KEY: every route but /healthz needs the bearer token."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from conftest import ROOT, ask


@pytest.fixture(scope="module")
def locked(start_server, tiny_model_dir):
    return start_server("--model", str(tiny_model_dir), "--model-id", "tiny", env={"LMSP_API_KEY": "s3cret"})


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
        r = httpx.request(method, locked.url + path, json=body, headers=headers)
        assert r.status_code == 401
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert r.headers["LMSP-Version"] == "1.0"
        assert r.json()["code"] == "unauthorized"
    r = httpx.post(locked.url + "/v1/responses", json=ask(), headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_right_token_is_served(locked):
    auth = {"Authorization": "Bearer s3cret"}
    r = httpx.post(locked.url + "/lmsp/v1/responses", json=ask(), headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 8
    assert httpx.get(locked.url + "/v1/models", headers=auth).status_code == 200


def test_healthz_needs_no_token(locked):
    assert httpx.get(locked.url + "/healthz").status_code == 200


def test_no_key_refuses_a_non_loopback_host(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "lmsp_mlx.serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "0.0.0.0" in done.stderr and "--api-key" in done.stderr
    assert "Traceback" not in done.stderr
