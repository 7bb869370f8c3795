"""Real servers for the tests: Hypercorn on a free loopback port, in this process or in a child.

`InProcessServer` runs `serve.build` and `serve.serve` on a thread of the test process: the
same app, engine, store and Hypercorn as `python -m lmsp_mlx.serve`, without the 3 s a new
interpreter takes to import MLX and Quart. Its log is a file holding the records of its own
threads. `ProcessServer` is `python -m lmsp_mlx.serve` itself, for what needs a process:
signals, kill -9, environment variables and the exit status.

Both have `url`, `port`, `args`, `log()`, `wait_for_log()` and `stop()`, and `sources`: the
cache sources the tests' request helpers recorded (tests.helpers.source_of); a process also has `proc`.

`ROUTES` records which of the app's routes the in-process servers answered, for
`pytest --routes` (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from lmsp_mlx import flags, serve
from lmsp_mlx.settings import Settings
from tests.helpers import HTTP

ROOT = Path(__file__).resolve().parents[1]


class RouteLog:
    """The routes (method, rule) the in-process apps have, and those a request reached.

    A request counts once the app matched it to a route and the auth and origin hooks let
    it through, whatever the route then answered: a 400 still ran the route's own code."""

    IGNORED = frozenset({"HEAD", "OPTIONS"})  # answered by Quart for every route

    def __init__(self) -> None:
        self.served: set[tuple[str, str]] = set()  # (method, endpoint)
        self.reached: set[tuple[str, str]] = set()
        self.rules: dict[str, str] = {}  # endpoint -> its first rule, for the report
        self._lock = threading.Lock()

    def watch(self, app) -> None:
        """Record `app`'s routes, and every request that reaches one of them."""
        from quart import request, websocket  # only the tests that watch an app need Quart

        for rule in app.url_map.iter_rules():
            if rule.endpoint == "static":
                continue
            methods = {"WEBSOCKET"} if rule.websocket else set(rule.methods or ()) - self.IGNORED
            self.served |= {(m, rule.endpoint) for m in methods}  # two rules of one handler are one route
            self.rules.setdefault(rule.endpoint, rule.rule)

        async def on_request() -> None:
            if request.url_rule is not None:
                with self._lock:
                    self.reached.add((request.method, request.url_rule.endpoint))

        async def on_websocket() -> None:
            if websocket.url_rule is not None:
                with self._lock:
                    self.reached.add(("WEBSOCKET", websocket.url_rule.endpoint))

        app.before_request(on_request)
        app.before_websocket(on_websocket)

    def missed(self) -> list[str]:
        """'METHOD rule' of each route no request reached."""
        return sorted(f"{method} {self.rules[endpoint]}" for method, endpoint in self.served - self.reached)


ROUTES = RouteLog()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_args(args: list[str], where: Path) -> list[str]:
    """`args` with the KV directory, store and state key under `where`, never the user's own,
    and the model kept loaded however long the tests leave it idle."""
    if "--kv-disk-dir" not in args and "--no-kv-disk" not in args:
        args = [*args, "--kv-disk-dir", str(where / "kv")]
    if "--store" not in args:
        args = [*args, "--store", str(where / "store.sqlite3")]
    if "--state-key-file" not in args:
        args = [*args, "--state-key-file", str(where / "state.key")]
    if "--keep-alive" not in args:  # a server a module shares idles between its tests: it must not unload
        args = [*args, "--keep-alive", "-1"]
    return args


class _LogFile:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.sources: list[str] = []  # tests.helpers.source_of

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


class ProcessServer(_LogFile):
    """`python -m lmsp_mlx.serve ARGS` in a subprocess (in a session of its own), its log in
    a file; `launcher` goes before it (`mlx.launch -n 2 ... --`)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, launcher: list[str] = ()) -> None:
        super().__init__(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = private_args(args, log_path.parent)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "lmsp_mlx.serve", "--port", str(self.port), *self.args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=bool(launcher),
        )

    def wait_ready(self, timeout: float = 600) -> "ProcessServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if HTTP.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.proc.pid and self.proc.args[0] != sys.executable:  # a launcher's ranks: its whole session
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


class _OwnThreads(logging.Filter):
    """Passes the records of one server's threads: while it builds, any thread started since;
    then those threads, its serving thread and its executor (named after it)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name_prefix = name
        self.before = {t.ident for t in threading.enumerate()}
        self.owned: set[int] | None = None  # fixed once built

    def settle(self) -> None:
        self.owned = {t.ident for t in threading.enumerate()} - self.before

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName.startswith(self.name_prefix):
            return True
        return record.thread not in self.before if self.owned is None else record.thread in self.owned


class InProcessServer(_LogFile):
    """`build` and `serve` on a thread of this process, with a loop of its own.

    Servers start one at a time (`start` returns once it answers), which is what lets the
    log filter tell this server's worker threads from the others'."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        super().__init__(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = private_args(args, log_path.parent)
        if "--memory-budget-scope" not in self.args:  # this process is pytest's and its clients' too
            self.args = [*self.args, "--memory-budget-scope", "models"]
        self.name = f"srv{self.port}"
        settings = flags.parse(["--port", str(self.port), *self.args])
        self._handler = logging.FileHandler(log_path)
        self._handler.setFormatter(logging.Formatter(serve.LOG_FORMAT))
        self._handler.setLevel(settings.server.log_level.upper())
        self._filter = _OwnThreads(self.name)
        self._handler.addFilter(self._filter)
        root = logging.getLogger()
        root.addHandler(self._handler)
        root.setLevel(min(root.getEffectiveLevel(), self._handler.level))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()  # bound to the server's loop on first use
        self._service: serve.Service | None = None
        self._failed: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(settings,), name=self.name, daemon=True)

    @property
    def engine(self):
        """The server's engine (its models' slots, for tests that hand a model a runner of theirs)."""
        return self._service.engine

    def start(self, timeout: float = 600) -> "InProcessServer":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"server not built after {timeout}s:\n{self.log()}")
        if self._failed is not None:
            self._detach()
            raise RuntimeError(f"server did not start: {self._failed}\n{self.log()}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                self._detach()
                raise RuntimeError(f"server stopped before it answered:\n{self.log()}")
            try:
                if HTTP.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.02)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def _run(self, settings: Settings) -> None:
        try:
            self._service = serve.build(settings)
            ROUTES.watch(self._service.app)
        except BaseException as exc:  # StartError, or a bug: the test sees it either way
            self._failed = exc
            return
        finally:
            self._filter.settle()
            self._ready.set()
        loop = self._loop = asyncio.new_event_loop()
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix=self.name))
        try:
            loop.run_until_complete(serve.serve(self._service, self._stop))
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        if self._service is not None:
            self._service.close()
            self._service = None
        self._detach()

    def _detach(self) -> None:
        logging.getLogger().removeHandler(self._handler)
        self._handler.close()
