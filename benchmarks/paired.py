"""The harness of the paired decode benchmarks (structured, task_events).

One server process on a free port with a throwaway store; each run's decode rate read from
the worker's own log line (`output_tokens=... decode_tps=...`), so HTTP timing noise stays
out; pairs of (reference, variant) runs summarised as the median of their ratios.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from benchmarks.common import Provenance, output_arguments, own_state, server_command, serving, write_rows


def arguments(doc: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=4)
    output_arguments(p)
    return p.parse_args()


@contextmanager
def server(model: Path | None, prefix: str) -> Iterator[tuple[str, str, Path]]:
    """(url, model id, log) of a started `lmsp_mlx.serve`; stopped when the block ends."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    log = folder / "server.log"
    cmd = server_command("lmsp-mlx", *own_state(folder, kv_disk=False), *(["--model", model] if model else []))
    with serving(cmd, log, ready="/lmsp/v1/models", timeout=900) as running:
        model_id = httpx.get(running.url + "/lmsp/v1/models", timeout=10).json()["data"][0]["id"]
        yield running.url, model_id, log


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


def report(name: str, rows: list[dict], args: argparse.Namespace, provenance: Provenance,
           kinds: tuple[str, str]) -> tuple[float, float, float]:
    """Write the rows to `args.out/<name>.csv` (`--append` as asked); medians of both kinds'
    rates and of the pairs' ratios (rows alternate kinds[0], kinds[1])."""
    write_rows(name, rows, provenance, out=args.out, append=args.append)
    ratios = [rows[i + 1]["decode_tps"] / rows[i]["decode_tps"] for i in range(0, len(rows), 2)]
    first, second = (statistics.median(r["decode_tps"] for r in rows if r["kind"] == k) for k in kinds)
    return first, second, statistics.median(ratios)
