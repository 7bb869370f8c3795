"""The harness of the paired decode benchmarks (structured.py, task_events.py).

One server process on a free port with a throwaway store; each run's decode rate read from
the worker's own log line (`output_tokens=... decode_tps=...`), so HTTP timing noise stays
out; pairs of (reference, variant) runs summarised as the median of their ratios.
"""

from __future__ import annotations

import argparse
import csv
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def arguments(doc: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model: Path | None, prefix: str) -> Iterator[tuple[str, str, Path]]:
    """(url, model id, log) of a started `lmsp_mlx.serve`; stopped when the block ends."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    log, port = folder / "server.log", _free_port()
    cmd = [sys.executable, "-m", "lmsp_mlx.serve", "--port", str(port), "--store", str(folder / "store.sqlite3"),
           "--state-key-file", str(folder / "state.key"), "--no-kv-disk", *(["--model", str(model)] if model else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                model_id = httpx.get(url + "/lmsp/v1/models", timeout=2).json()["data"][0]["id"]
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield url, model_id, log
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _runs(log: Path) -> list[tuple[int, float]]:
    return [(int(n), float(r)) for n, r in re.findall(r"output_tokens=(\d+) prefill_tps=[\d.]+ decode_tps=([\d.]+)",
                                                       log.read_text())]


def runs_so_far(log: Path) -> int:
    return len(_runs(log))


def run_after(log: Path, n: int) -> tuple[int, float]:
    """(output tokens, decode tok/s) of request number `n` once its log line is written."""
    while len(runs := _runs(log)) <= n:
        time.sleep(0.05)
    return runs[n]


def report(rows: list[dict], path: Path, kinds: tuple[str, str]) -> tuple[float, float, float]:
    """Write the rows as CSV; medians of both kinds' rates and of the pairs' ratios
    (rows alternate kinds[0], kinds[1])."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ratios = [rows[i + 1]["decode_tps"] / rows[i]["decode_tps"] for i in range(0, len(rows), 2)]
    first, second = (statistics.median(r["decode_tps"] for r in rows if r["kind"] == k) for k in kinds)
    return first, second, statistics.median(ratios)
