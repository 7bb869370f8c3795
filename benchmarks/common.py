"""What the benchmarks share: a server's lifecycle, SSE reading, percentiles, and result rows
that say where they came from.

Every benchmark runs from the repository root as a module, `python -m benchmarks.<name>`,
and writes its rows through write_rows(): to `benchmarks/results/<name>.csv` (or `--out`),
each row followed by the run's Provenance (commit, date, machine, MLX version), replacing
the file or, with `--append`, adding to its history.

httpx is imported where a server is started: the GPU benchmarks write their results
through this module on machines that lack the server's dependencies.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# -- provenance ----------------------------------------------------------------------------

# MLX's backend wheels: which one is installed says what the version runs on.
MLX_BACKENDS = ("mlx-cpu", "mlx-cuda", "mlx-metal")


@dataclass(frozen=True)
class Provenance:
    """Where a run's rows come from, gathered once when the run starts; write_rows() adds
    these four fields as the last columns of every row."""

    commit: str  # `git rev-parse --short HEAD`, "+dirty" when the code has uncommitted changes
    date_utc: str  # ISO-8601, UTC, to the second
    machine: str  # cores, arch and OS, CPU model (and the NVIDIA GPUs, where nvidia-smi lists some)
    mlx_version: str  # the mlx distribution's version and its backend wheel, e.g. "0.32.4 (mlx-cpu)"

    @classmethod
    def gather(cls) -> Provenance:
        return cls(commit=git_commit(), date_utc=utc_now(), machine=machine(), mlx_version=mlx_version())

    def columns(self) -> dict[str, str]:
        return asdict(self)


PROVENANCE_FIELDS = tuple(f.name for f in fields(Provenance))


def _run(*cmd: str) -> str:
    """A command's stripped stdout; raises OSError or CalledProcessError where it cannot run."""
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def git_commit() -> str:
    """The short commit of HEAD, with "+dirty" when the tree differs from it. Result files
    do not count: a benchmark's own earlier output must not mark the next run dirty."""
    unknown = "unknown (not a git checkout)"
    try:
        # A copy of the tree inside some other checkout (a lent machine's) must not report that one.
        if Path(_run("git", "rev-parse", "--show-toplevel")).resolve() != ROOT.resolve():
            return unknown
        head = _run("git", "rev-parse", "--short", "HEAD")
        changed = _run("git", "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return unknown
    return head + ("+dirty" if changed else "")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo on Linux, sysctl on macOS, else platform.processor()."""
    system = platform.system()
    try:
        if system == "Linux":
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        elif system == "Darwin":
            return _run("sysctl", "-n", "machdep.cpu.brand_string")
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "CPU model unknown"


def nvidia_gpus() -> list[str]:
    """The names nvidia-smi lists, none where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        return _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()
    except (OSError, subprocess.SubprocessError):
        return []


def machine() -> str:
    """E.g. "2 cores x86_64 Linux, AMD EPYC" (", GPU NVIDIA H200" where one is listed)."""
    parts = [f"{os.cpu_count()} cores {platform.machine()} {platform.system()}", cpu_model()]
    if gpus := nvidia_gpus():
        parts.append("GPU " + " + ".join(gpus))
    return ", ".join(parts)


def mlx_version() -> str:
    """The mlx distribution's version and its backend wheels, read from the installed
    metadata (importing mlx.core would bind its BLAS before a benchmark's accelerate())."""
    try:
        version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
    backends = sorted(n for n in names if n.startswith(MLX_BACKENDS))
    return f"{version} ({', '.join(backends)})" if backends else version


# -- result files --------------------------------------------------------------------------

APPEND_HELP = "add this run's rows to the existing CSV (its history) instead of replacing it"


def output_arguments(parser: argparse.ArgumentParser, append_help: str = APPEND_HELP) -> None:
    """--out (where the results go, default benchmarks/results) and --append."""
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default: %(default)s)")
    parser.add_argument("--append", action="store_true", help=append_help)


def csv_header(path: Path) -> list[str] | None:
    """The first line of a CSV file as its column names; None for a missing or empty file."""
    if not path.exists():
        return None
    with open(path, newline="") as f:
        return next(csv.reader(f), None)


def appendable(name: str, fields: Sequence[str], out: Path = RESULTS) -> bool:
    """Whether `out/<name>.csv` exists to take rows of `fields` (and the provenance columns)
    after its own; a file with other columns ends the run with a one-line error. A long
    benchmark asks before it measures; write_rows() asks again before it writes."""
    path, header = out / f"{name}.csv", [*fields, *PROVENANCE_FIELDS]
    existing = csv_header(path)
    if existing is not None and existing != header:
        only_file = ",".join(c for c in existing if c not in header) or "none"
        only_run = ",".join(c for c in header if c not in existing) or "none"
        raise SystemExit(f"--append: {path} has other columns than this run writes (only in the file: {only_file}; "
                         f"only in this run: {only_run}; else their order): move it aside or run without --append")
    return existing is not None


def write_rows(name: str, rows: Sequence[Mapping[str, Any]], provenance: Provenance, *, out: Path = RESULTS,
               append: bool = False, fields: Sequence[str] | None = None, notes: Sequence[str] = ()) -> Path:
    """Writes `rows` to `out/<name>.csv`: the columns `fields` (default: the first row's keys;
    other keys are left out), then the provenance columns, on every row; then each of `notes`
    as a `# ` line. Without `append` the file is replaced (no rows, where `fields` names the
    columns, leave a header alone). With `append` the rows go after the file's existing ones,
    the header only into a new file; a file whose header is not this run's ends the run with
    a one-line error and is left as it was. Returns the path."""
    if not rows and fields is None:
        raise SystemExit(f"{name}: no rows to write")
    fields = list(fields if fields is not None else rows[0])
    adding = append and appendable(name, fields, out)
    path = out / f"{name}.csv"
    out.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if adding else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*fields, *PROVENANCE_FIELDS], extrasaction="ignore")
        if not adding:
            writer.writeheader()
        writer.writerows({**row, **provenance.columns()} for row in rows)
        f.writelines(f"# {note}\n" for note in notes)
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV this module wrote (`# ` lines skipped), numbers as numbers (float()
    reads the nan of a case that measured nothing), other values as text."""
    def value(text: str) -> Any:
        if text.lstrip("-").isdigit():
            return int(text)
        try:
            return float(text)
        except ValueError:
            return text

    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()}
                for row in csv.DictReader(line for line in f if not line.startswith("#"))]


def shown_path(path: Path) -> str | None:
    """`path` relative to the repository, for a committed report; None for a path outside it
    (a temp directory's name says nothing to a reader and must not be committed)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return None


# -- servers -------------------------------------------------------------------------------

ServerKind = Literal["lmsp-mlx", "mlx_lm.server"]

# Started as `python -c MLX_LM_WRAPPER ARGS`: mlx_lm.server with the same CPU math as lmsp-mlx.
MLX_LM_WRAPPER = """
import sys
from lmsp_mlx.cpu_blas import accelerate
accelerate()  # routes MLX's float32 matmuls to OpenBLAS before mlx.core loads
from pathlib import Path

import mlx.nn as nn
import mlx_lm.server as server
from lmsp_mlx.engine import cpu_math
from lmsp_mlx.engine.model_ops import build
from lmsp_mlx.engine.runners import choose


class Runs(nn.Module):
    # The peer's model: its passes go through lmsp-mlx's runner (the compiled CPU steps
    # where they take the model), everything else to the model itself.
    def __init__(self, runner):
        super().__init__()
        self.inner = runner.model
        self._runner = runner

    def __call__(self, inputs, cache=None, input_embeddings=None):
        if cache is None or input_embeddings is not None:
            return self.inner(inputs, cache=cache, input_embeddings=input_embeddings)
        return self._runner.forward(inputs, cache)

    def __getattr__(self, key):
        if key in ("inner", "_runner"):
            return super().__getattr__(key)
        return getattr(self.inner, key)


def load(path, adapter_path=None, return_config=False, **kwargs):
    built = build(Path(path), "cpu", None)  # lmsp-mlx's CPU math bound in its copy of the model's module
    cpu_math.wrap_ropes(built.model)
    model = Runs(choose(built.model, "cpu", str(path)))
    return (model, built.tokenizer, built.config) if return_config else (model, built.tokenizer)


server.load = load
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
server.main()
"""


def server_command(kind: ServerKind, *args: object) -> list[str]:
    """The command line of an lmsp-mlx server or of the mlx_lm.server peer (through the
    wrapper that gives it lmsp-mlx's CPU math), with `args` after it."""
    head = ["-m", "lmsp_mlx.serve"] if kind == "lmsp-mlx" else ["-c", MLX_LM_WRAPPER]
    return [sys.executable, *head, *map(str, args)]


def own_state(folder: Path, kv_disk: bool) -> list[str]:
    """lmsp-mlx flags that keep its store, state key and KV checkpoints (or none, where
    `kv_disk` is false) in `folder`: a benchmark leaves nothing in the user's folders."""
    kv = ["--kv-disk-dir", str(folder / "kv")] if kv_disk else ["--no-kv-disk"]
    return ["--store", str(folder / "store.sqlite3"), "--state-key-file", str(folder / "state.key"), *kv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: Path, *, ready: str = "/v1/models", timeout: float = 600) -> subprocess.Popen:
    """Starts `cmd` in the repository root, its output into `log`; returns once GET
    `url + ready` answers at all. A process that exits first, or is not ready within
    `timeout` seconds, ends the run with the log's tail."""
    import httpx

    with open(log, "w") as out:  # a session of its own: stop() reaches what it starts (mlx.launch's ranks)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            httpx.get(url + ready, timeout=2)
            return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    stop(proc)
    raise SystemExit(f"the server was not ready within {timeout:g} s:\n{log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen, *, sig: int = signal.SIGTERM, grace: float = 60) -> int | str:
    """Sends `sig` to the process and everything it started, waits up to `grace` seconds,
    then kills them all: the exit code, or what a kill ended with."""
    _signal_group(proc, sig)
    try:
        code: int | str = proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        code = f"killed after {grace:g} s"
    _signal_group(proc, signal.SIGKILL)  # what outlived it (mlx.launch leaves its ranks running)
    proc.wait()
    return code


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class Server:
    """A started server: where it answers, its process, and the file its output goes to."""

    url: str
    proc: subprocess.Popen
    log: Path


@contextmanager
def serving(cmd: list[str], log: Path, *, ready: str = "/v1/models", timeout: float = 600) -> Iterator[Server]:
    """`cmd --port <a free port>` started as start() does; stopped as stop() does when the
    block ends, however it ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start([*cmd, "--port", str(port)], url, log, ready=ready, timeout=timeout)
    try:
        yield Server(url, proc, log)
    finally:
        stop(proc)


# -- streams and statistics ----------------------------------------------------------------


class SseEvent(NamedTuple):
    name: str | None  # its `event:` field
    data: Any  # its `data:` lines parsed as JSON, else the text (`[DONE]`)


def sse_events(lines: Iterable[str], check: Callable[[], None] | None = None) -> Iterator[SseEvent]:
    """The events of a server-sent event stream's lines, each once its blank line arrives
    (the servers write an event in one piece); keep-alive comments skipped. `check` is
    called as each line arrives: it raises to end a stream that ran too long."""
    def event(name: str | None, data: list[str]) -> SseEvent:
        raw = "\n".join(data)
        try:
            return SseEvent(name, json.loads(raw))
        except json.JSONDecodeError:
            return SseEvent(name, raw)

    name, data = None, []
    for line in lines:
        if check is not None:
            check()
        if line == "":
            if data:
                yield event(name, data)
            name, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event(name, data)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0 to 1) of `values`, linear between the closest ranks (numpy's
    default method); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
