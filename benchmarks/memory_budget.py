"""The memory budget under long prompts: 8 clients at once, each with a prompt of 3,200
tokens, against the default model with `--memory-budget-mb 1400`, and the server's RSS
sampled throughout.

    python -m benchmarks.memory_budget [--budget-mb 1400] [--clients 8] [--prompt-tokens 3200]
                                       [--max-tokens 32] [--out DIR] [--append]

Without the budget's KV admission, these prompts took the process from 717 MiB to 2,056
MiB. With it, each sequence joins the batch only when its KV (prompt plus output limit)
fits beside the weights and the others': the rest wait, and every request is answered.
Writes benchmarks/results/memory_budget.csv (one row per run) with the run's provenance:
the statuses, the peak RSS against the budget plus the runtime's own (Python, MLX, Quart,
the tokenizer: the RSS at start less the weights, about 250 MiB here), MLX's active and
cached memory at their peaks, the peak of the memory outside MLX's (the RSS less both, read
together), and the waits /metrics counted.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import Provenance, output_arguments, own_state, server_command, serving, write_rows
from benchmarks.soak.monitor import rss_mib

FIELDS = ("budget_mib", "clients", "prompt_tokens", "max_tokens", "answered_200", "statuses", "rss_start_mib",
          "runtime_mib", "rss_peak_mib", "rss_limit_mib", "within", "mlx_active_peak_mib", "mlx_cache_peak_mib", "outside_mlx_peak_mib", "memory_waits",
          "weights_mib", "seconds")


def prompt(i: int, tokens: int) -> str:
    """About `tokens` tokens of text, distinct for each client (no KV reuse between them)."""
    words = [f"client{i} counts {n} sheep under a quiet moon." for n in range(tokens // 12 + 1)]
    return " ".join(words)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-mb", type=float, default=1400)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=3200)
    p.add_argument("--max-tokens", type=int, default=32)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    folder = Path(tempfile.mkdtemp(prefix="memory-budget-"))
    cmd = server_command("lmsp-mlx", "--memory-budget-mb", args.budget_mb, *own_state(folder, kv_disk=True))
    with serving(cmd, folder / "server.log") as server:
        pid = server.proc.pid
        start_rss = rss_mib(pid)
        peak = [start_rss]
        done = threading.Event()

        mlx = {"active": [0.0], "cache": [0.0], "outside": [0.0]}

        def sample() -> None:
            while not done.wait(0.1):
                if (now := rss_mib(pid)) is not None:
                    peak.append(now)
                try:
                    active = metric(server.url, "lmsp_mlx_active_bytes") / 2**20
                    cache = metric(server.url, "lmsp_mlx_cache_bytes") / 2**20
                except httpx.HTTPError:
                    continue
                mlx["active"].append(active)
                mlx["cache"].append(cache)
                if now is not None:  # the process's memory outside MLX's: Python, the heap, host copies
                    mlx["outside"].append(now - active - cache)

        statuses: list[int] = []

        def client(i: int) -> None:
            r = httpx.post(server.url + "/v1/completions", timeout=1800, json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt(i, args.prompt_tokens),
                "max_tokens": args.max_tokens, "temperature": 0})
            statuses.append(r.status_code)

        sampler = threading.Thread(target=sample)
        sampler.start()
        began = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - began
        done.set()
        sampler.join()
        waits = metric(server.url, "lmsp_memory_waits_total")
        weights = metric(server.url, 'lmsp_memory_held_bytes{kind="weights"}') / 2**20
    runtime = (start_rss or 0) - weights
    limit = args.budget_mb + runtime
    row = {"budget_mib": args.budget_mb, "clients": args.clients, "prompt_tokens": args.prompt_tokens,
           "max_tokens": args.max_tokens, "answered_200": statuses.count(200),
           "statuses": " ".join(map(str, sorted(statuses))), "rss_start_mib": round(start_rss or 0), "runtime_mib": round(runtime),
           "rss_peak_mib": round(max(x for x in peak if x is not None)), "rss_limit_mib": round(limit),
           "within": max(x for x in peak if x is not None) <= limit, "mlx_active_peak_mib": round(max(mlx["active"])),
           "mlx_cache_peak_mib": round(max(mlx["cache"])), "outside_mlx_peak_mib": round(max(mlx["outside"])),
           "memory_waits": int(waits),
           "weights_mib": round(weights), "seconds": round(seconds, 1)}
    write_rows("memory_budget", [row], provenance, out=args.out, append=args.append, fields=FIELDS)
    print(row)


if __name__ == "__main__":
    main()
