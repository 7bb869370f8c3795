"""Fixtures: real servers (Hypercorn on a free loopback port, tests/servers.py) on real models;
and the tiers' rules (docs/testing.md).

Two markers, registered in pyproject.toml, sort the suite: `slow` (npm clients, the default
model, SIMT emulations and compiler builds, a server in a process of its own) and `gpu`
(needs Metal or CUDA). `pytest -m "not slow"` is the inner loop. The rules are checked here,
so that the fast tier stays fast: a test that uses the default model or starts a server
process without `slow` fails, and a `gpu` test is skipped, with the reason, on a build
without Metal or CUDA.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)

from tests.servers import ROUTES, InProcessServer, ProcessServer  # noqa: E402
from tests.tiny_model import CALLS, TOOL_SCRIPT, build_scripted_model, build_tiny_model  # noqa: E402

EXIT_STATUS = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items) -> None:
    from lmsp_mlx import kernels

    backend = kernels.backend()
    for item in items:
        if "default_server" in item.fixturenames and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid} uses the default model: mark it slow (docs/testing.md)")
        if item.get_closest_marker("gpu") and backend is None:
            item.add_marker(pytest.mark.skip(reason="needs Metal or CUDA: this MLX build is the CPU one"))


class Running:
    """The test being run, for the rules checked when a server starts."""

    item: pytest.Item | None = None


def pytest_runtest_setup(item) -> None:
    Running.item = item


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same MLX random state, whichever tests ran before it in
    this process: random inputs compared within a tolerance must not pass in one selection
    of the suite and fail in another."""
    import mlx.core as mx

    mx.random.seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory) -> Path:
    """The tiny model scripted to answer SCRIPTED_REPLY greedily (tests/tiny_model.py)."""
    return build_scripted_model(tmp_path_factory.mktemp("models") / "scripted")


@pytest.fixture(scope="session")
def caller_dir(tmp_path_factory) -> Path:
    """A scripted reasoning model: it reasons " the", then calls get_weather and get_time (TOOL_SCRIPT)."""
    return build_scripted_model(tmp_path_factory.mktemp("models") / "caller", script=TOOL_SCRIPT, words=CALLS)


def pytest_addoption(parser) -> None:
    parser.addoption("--routes", action="store_true",
                     help="fail unless the in-process servers' requests reached every route of the app")


def pytest_sessionfinish(session, exitstatus) -> None:
    if session.config.getoption("--routes") and exitstatus == 0:
        missed = ROUTES.missed()
        reached = len(ROUTES.served) - len(missed)
        lines = [f"routes reached on in-process servers: {reached} of {len(ROUTES.served)}"]
        lines += [f"  not reached: {route}" for route in missed]
        session.config.pluginmanager.get_plugin("terminalreporter").write_line("\n" + "\n".join(lines))
        if missed or not ROUTES.served:
            exitstatus = session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Leave without C++ static destructors once MLX may have run on threads other than the
    main one (in-process servers' workers, the tests' own threads): they can abort at exit
    ("terminate called without an active exception", ml-explore/mlx#3126), as `python -m
    lmsp_mlx.serve` avoids too. Every report has been written by now."""
    if EXIT_STATUS in config.stash:
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
            if Running.item is not None and Running.item.get_closest_marker("slow") is None:
                pytest.fail(f"{Running.item.nodeid} starts a server process: mark it slow (docs/testing.md)")
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
