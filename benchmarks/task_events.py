"""What persisting a task's events costs the decode rate, measured in one run.

    python benchmarks/task_events.py [--model PATH] [--tokens 128] [--pairs 4]

The same greedy request runs against one server, alternately as a plain LMSP stream and
as a task (POST /lmsp/v1/tasks, then following its events), in back-to-back pairs. The
decode rate of each run is the worker's own (`decode_tps=` in the server log), so HTTP
timing noise stays out. Target: the task's rate at least 0.95 of the plain stream's
(median of the pairs' ratios). Writes benchmarks/results/task_events.csv.
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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Count from 1 to 300, separated by commas: 1, 2, 3,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_rates(log: Path) -> list[float]:
    return [float(x) for x in re.findall(r"request route=lmsp .*decode_tps=([\d.]+)", log.read_text())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="task-events-"))
    log, port = folder / "server.log", free_port()
    cmd = [sys.executable, "-m", "lmsp_mlx.serve", "--port", str(port), "--store", str(folder / "store.sqlite3"),
           "--no-kv-disk", *(["--model", str(args.model)] if args.model else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                model = httpx.get(url + "/lmsp/v1/models", timeout=2).json()["data"][0]["id"]
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.5)
        body = {"model": model, "input": PROMPT, "temperature": 0, "max_output_tokens": args.tokens}
        rows = []
        with httpx.Client(base_url=url, timeout=600) as client:
            client.post("/lmsp/v1/responses", json=body)  # warm-up
            for pair in range(args.pairs):
                for kind in ("stream", "task"):
                    n = len(decode_rates(log))
                    if kind == "stream":
                        with client.stream("POST", "/lmsp/v1/responses", json={**body, "stream": True}) as r:
                            events = sum(1 for line in r.iter_lines() if line.startswith("id: "))
                    else:
                        task = client.post("/lmsp/v1/tasks", json={"request": body}).json()
                        with client.stream("GET", f"/lmsp/v1/tasks/{task['id']}/events") as r:
                            events = sum(1 for line in r.iter_lines() if line.startswith("id: "))
                    while len(decode_rates(log)) == n:
                        time.sleep(0.05)
                    rate = decode_rates(log)[n]
                    rows.append({"pair": pair, "kind": kind, "events": events, "decode_tps": rate})
                    print(f"pair {pair} {kind:>6}: {rate:6.1f} tok/s, {events} events", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "task_events.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ratios = [rows[i + 1]["decode_tps"] / rows[i]["decode_tps"] for i in range(0, len(rows), 2)]
    plain = statistics.median(r["decode_tps"] for r in rows if r["kind"] == "stream")
    task = statistics.median(r["decode_tps"] for r in rows if r["kind"] == "task")
    print(f"\n| decode, {args.tokens} tokens | plain stream | task (events persisted) | ratio (median of pairs) | target |")
    print("|---|---:|---:|---:|---:|")
    print(f"| {model} | {plain:.1f} tok/s | {task:.1f} tok/s | {statistics.median(ratios):.3f} | ≥ 0.95 |")


if __name__ == "__main__":
    main()
