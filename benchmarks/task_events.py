"""What persisting a task's events costs the decode rate, measured in one run.

    python -m benchmarks.task_events [--model PATH] [--tokens 128] [--pairs 4] [--out DIR] [--append]

The same greedy request runs against one server, alternately as a plain LMSP stream and
as a task (POST /lmsp/v1/tasks, then following its events), in back-to-back pairs. The
decode rate of each run is the worker's own (`decode_tps=` in the server log), so HTTP
timing noise stays out. Target: the task's rate at least 0.95 of the plain stream's
(median of the pairs' ratios). Writes benchmarks/results/task_events.csv (with the run's
provenance columns; `--append` adds to its history).
"""

from __future__ import annotations

import httpx

from benchmarks.common import Provenance
from benchmarks.paired import arguments, report, run_after, runs_so_far, server

PROMPT = "Count from 1 to 300, separated by commas: 1, 2, 3,"


def events(client: httpx.Client, method: str, path: str, **kwargs) -> int:
    with client.stream(method, path, **kwargs) as r:
        return sum(1 for line in r.iter_lines() if line.startswith("id: "))


def main() -> None:
    args = arguments(__doc__)
    provenance = Provenance.gather()
    rows = []
    with server(args.model, "task-events-") as (url, model, log):
        body = {"model": model, "input": PROMPT, "temperature": 0, "max_output_tokens": args.tokens}
        with httpx.Client(base_url=url, timeout=600) as client:
            client.post("/lmsp/v1/responses", json=body)  # warm-up
            for pair in range(args.pairs):
                for kind in ("stream", "task"):
                    n = runs_so_far(log)
                    if kind == "stream":
                        count = events(client, "POST", "/lmsp/v1/responses", json={**body, "stream": True})
                    else:
                        task = client.post("/lmsp/v1/tasks", json={"request": body}).json()
                        count = events(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events")
                    _, rate = run_after(log, n)
                    rows.append({"pair": pair, "kind": kind, "events": count, "decode_tps": rate})
                    print(f"pair {pair} {kind:>6}: {rate:6.1f} tok/s, {count} events", flush=True)
    plain, task, ratio = report("task_events", rows, args, provenance, ("stream", "task"))
    print(f"\n| decode, {args.tokens} tokens | plain stream | task (events persisted) | ratio (median of pairs) | target |")
    print("|---|---:|---:|---:|---:|")
    print(f"| {model} | {plain:.1f} tok/s | {task:.1f} tok/s | {ratio:.3f} | ≥ 0.95 |")


if __name__ == "__main__":
    main()
