"""Fixtures: real server processes (Hypercorn on a free loopback port) on real models."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import ENDLESS, build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m lmsp_mlx.serve ARGS` in a subprocess, its log in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        if "--kv-disk-dir" not in args and "--no-kv-disk" not in args:  # never the user's cache dir
            args = [*args, "--kv-disk-dir", str(log_path.parent / "kv")]
        if "--store" not in args:  # never the user's data dir
            args = [*args, "--store", str(log_path.parent / "store.sqlite3")]
        if "--state-key-file" not in args:
            args = [*args, "--state-key-file", str(log_path.parent / "state.key")]
        self.args = args
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmsp_mlx.serve", "--port", str(self.port), *args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 600) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, needle: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            if needle in text:
                return text
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not logged within {timeout}s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    started: list[Server] = []

    def start(*args: str, env: dict | None = None) -> Server:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = Server(list(args), log, env)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tiny_server(start_server, tiny_model_dir) -> Server:
    return start_server("--model", str(tiny_model_dir), "--model-id", "tiny")


@pytest.fixture(scope="session")
def serial_server(start_server, tiny_model_dir) -> Server:
    """One sequence at a time (`--max-batch 1`): a second request waits behind the first,
    for the tests of what a client sees while its request is queued."""
    return start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-batch", "1")


@pytest.fixture(scope="session")
def default_server(start_server) -> Server:
    """The embedded default model, fetched and converted into models/ on first use."""
    return start_server()


@pytest.fixture
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        yield c


def ask(text: str = ENDLESS, **fields) -> dict:
    """A /lmsp/v1/responses body for the tiny model: greedy, 8 tokens unless told."""
    body = {"model": "tiny", "input": text, "temperature": 0, "max_output_tokens": 8}
    body.update(fields)
    return body


def kv_lookups(server, headers: dict | None = None) -> dict[str, int]:
    """Where the server's requests found their KV so far, by cache source (/metrics)."""
    text = httpx.get(server.url + "/metrics", headers=headers or {}, timeout=30).text
    return {m.group(1): int(m.group(2)) for m in re.finditer(r'^lmsp_kv_lookups_total\{source="(\w+)"\} (\d+)$',
                                                             text, re.M)}


def lookups_during(server, call) -> dict[str, int]:
    """The cache sources of the requests `call()` made (none other may run meanwhile)."""
    before = kv_lookups(server)
    call()
    after = kv_lookups(server)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def read_sse(lines) -> list[dict]:
    """Parse an SSE stream into [{'id':..., 'event':..., 'data':...}] records."""
    import json

    events, current = [], {}
    for line in lines:
        if line == "":
            if current:
                events.append(current)
                current = {}
            continue
        if line.startswith(":"):  # a comment (the server's keep-alive): SSE clients ignore it
            continue
        field, _, value = line.partition(": ")
        if field == "data" and value != "[DONE]":
            value = json.loads(value)
        current[field] = value
    if current:
        events.append(current)
    return events
