"""Fixtures: real servers (Hypercorn on a free loopback port, tests/servers.py) on real models."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
import pytest

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)

sys.path.insert(0, str(Path(__file__).parent))
from servers import InProcessServer, ProcessServer  # noqa: E402
from tiny_model import ENDLESS, build_tiny_model  # noqa: E402

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Leave without C++ static destructors once MLX ran on in-process servers' threads: they
    can abort at exit ("terminate called without an active exception", ml-explore/mlx#3126),
    as `python -m lmsp_mlx.serve` avoids too. Every report has been written by now."""
    if InProcessServer.started and EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])


class Starter:
    """Starts real servers and stops them when its fixture's scope ends.

    `start(*args)` serves in this process; `process=True` (or `env=`, which a process needs)
    runs `python -m lmsp_mlx.serve` instead, for signals, kill -9 and exit statuses."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self.started: list[InProcessServer | ProcessServer] = []

    def __call__(self, *args: str, env: dict | None = None, process: bool = False) -> InProcessServer | ProcessServer:
        log = self._tmp.mktemp("server") / "server.log"
        if process or env is not None:
            server = ProcessServer(list(args), log, env)
            self.started.append(server)
            return server.wait_ready()
        server = InProcessServer(list(args), log)
        self.started.append(server)
        return server.start()

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


@pytest.fixture
def start_server(tmp_path_factory):
    """Servers for one test, stopped at its end."""
    starter = Starter(tmp_path_factory)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory):
    """Servers for a module's fixtures, stopped after its last test."""
    starter = Starter(tmp_path_factory)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="session")
def start_session_server(tmp_path_factory):
    starter = Starter(tmp_path_factory)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="session")
def tiny_server(start_session_server, tiny_model_dir) -> InProcessServer:
    return start_session_server("--model", str(tiny_model_dir), "--model-id", "tiny")


@pytest.fixture(scope="session")
def serial_server(start_session_server, tiny_model_dir) -> InProcessServer:
    """One sequence at a time (`--max-batch 1`): a second request waits behind the first,
    for the tests of what a client sees while its request is queued."""
    return start_session_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-batch", "1")


@pytest.fixture(scope="session")
def default_server(start_session_server) -> InProcessServer:
    """The embedded default model, fetched and converted into models/ on first use."""
    return start_session_server()


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
    """Where the server's requests found their KV so far, by cache source (/metrics), with
    "tool-output" counting the requests whose tool outputs alone continued live calls."""
    text = httpx.get(server.url + "/metrics", headers=headers or {}, timeout=30).text
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r'^lmsp_kv_lookups_total\{source="(\w+)"\} (\d+)$',
                                                               text, re.M)}
    counts["tool-output"] = int(re.search(r"^lmsp_kv_live_continuations_total (\d+)$", text, re.M).group(1))
    return counts


def lookups_during(server, call) -> dict[str, int]:
    """The cache sources of the requests `call()` made (none other may run meanwhile)."""
    before = kv_lookups(server)
    call()
    after = kv_lookups(server)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def source_of(server, call, headers: dict | None = None):
    """`call()`'s result, with the cache source of the one request it made recorded on
    `server.sources` (none is where it failed before its lookup): a lookup kind, or
    "tool-output" where its tool outputs alone continued the live calls. `headers`: what
    /metrics needs (the admin scope) on a server with tokens."""
    result = None

    def run():
        nonlocal result
        result = call()

    before = kv_lookups(server, headers)
    run()
    after = kv_lookups(server, headers)
    found = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    if "tool-output" in found:
        found = {"tool-output": 1} if sum(found.values()) == 2 else found
    assert sum(found.values()) <= 1, f"one request, several lookups: {found}"
    server.sources.extend(found)
    return result


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
