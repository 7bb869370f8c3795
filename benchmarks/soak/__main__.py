"""A soak run: one lmsp-mlx server under a mixed client load for minutes, then checked.

    python -m benchmarks.soak [--minutes 10] [--clients 16] [--seed 0] [--warmup 30]
                              [--scrape-every 5] [--max-batch N] [--kv-memory-mb MB] [--kinds K,...]
                              [--memory-budget-mb MB] [--kv-disk-full-mb MB] [--stalled N]
                              [--out DIR] [--append]

One server (the embedded default model) is started on a free loopback port with its own
store, state key and KV directory in a temp directory that is kept afterwards (its log,
`server.log`, is the record of the run). `--clients` threads then loop for `--minutes`,
each over a mix of request kinds picked by its own seeded random generator (so a run
repeats its sequence of requests): sync `/v1/responses` and `/lmsp/v1/responses` (short
and medium prompts, 16-128 output tokens, temperature 0 or 0.7 with a seed); streamed
`/v1/chat/completions` and `/v1/responses` read to the end; tasks (`POST /lmsp/v1/tasks`)
polled or followed through their events, some cancelled; `background: true` responses
polled, some cancelled; a 2-4 turn tool loop (`get_weather`, `tool_choice: "required"`,
then the `function_call_output` either alone with `previous_response_id` or in the full
replayed conversation); streams dropped after a few events; and sync requests whose
client gives up after 0.5-3 s (the server must cancel them). Every request has a bounded
timeout and the run ends by itself. A 429 is a refusal (the client waits its Retry-After),
not an error; any 5xx is an error. (clients.py)

Every `--scrape-every` seconds `/metrics` is scraped (batch sequences, queue depth,
generations by status, HTTP replies by code) and the server's resident memory read from
/proc/PID/status (monitor.py). When the clients stop and the batch and queue are empty,
every task and every stored or background response the clients created is fetched again
and must be in a terminal state (completed, incomplete, failed, cancelled); the store file
is scanned read-only for any that is not, and the requests the clients abandoned are looked
up there (by their `metadata`) to see that the server cancelled them. Then the server is
stopped with SIGINT and its log is read: tracebacks, errors, KV cache sources, evictions
and checkpoints (checks.py).

Faults, each on request: `--memory-budget-mb` (a tight budget: sequences wait for memory),
`--kv-disk-full-mb` (the KV directory on a tmpfs of that size, mounted for the run: the disk
really fills, and checkpoint writes fail with ENOSPC; needs root), `--stalled` (clients that
open a stream and never read it, for the whole run).

Targets: no 5xx, no traceback, nothing left non-terminal, the batch drained, resident
memory at the end within 10% of what it was at the end of the `--warmup` (resident KV
sessions count in it and grow until they fill `--kv-memory-mb`, 2048 MiB by default, so a
smaller budget, one the warm-up fills, separates them from a leak). Writes (report.py)
benchmarks/results/soak.csv (one row per request kind: count, refusals, errors, latency or
time to first token p50/p95), soak.timeline.csv (the scrapes), both with the run's
provenance columns and added to with `--append`, and soak.md (the printed Markdown report
of this run).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import Provenance, appendable, free_port, output_arguments, own_state, server_command, start, stop
from benchmarks.soak import report
from benchmarks.soak.checks import read_log, store_scan, terminal_check
from benchmarks.soak.clients import MIX, OP_TIMEOUT, Client, Run
from benchmarks.soak.monitor import Scraper, rss_mib
from benchmarks.soak.report import KIND_FIELDS, TIMELINE_FIELDS, Soak, fmt


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10, help="how long the clients send requests (warm-up included)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=30, help="seconds of load before the first RSS reading")
    p.add_argument("--scrape-every", type=float, default=5)
    p.add_argument("--report-every", type=float, default=30, help="seconds between progress lines")
    p.add_argument("--grace", type=float, default=OP_TIMEOUT, help="seconds the last operations get after --minutes")
    p.add_argument("--drain-timeout", type=float, default=300)
    p.add_argument("--max-batch", type=int, help="passed to the server (its default: 8 on CPU)")
    p.add_argument("--kv-memory-mb", type=float, help="passed to the server (its default: 2048); resident KV "
                   "sessions grow the RSS until they fill it, so a budget the warm-up fills makes the RSS comparable")
    p.add_argument("--kinds", help=f"comma-separated subset of the mix (default all: {','.join(MIX)})")
    p.add_argument("--memory-budget-mb", type=float, help="passed to the server: a tight budget makes requests wait")
    p.add_argument("--kv-disk-full-mb", type=float, help="put the KV directory on a tmpfs this small (root): it fills")
    p.add_argument("--stalled", type=int, default=0, help="clients that open a stream and never read it")
    output_arguments(p, append_help="add this run's rows to soak.csv and soak.timeline.csv (their history); "
                                    "soak.md is this run's report")
    return p.parse_args()


@dataclass
class Load:
    """The load phase as it ended: the clients' record and the readings around it."""

    run: Run
    scraper: Scraper
    load_s: float
    rss_warm: float | None
    rss_end: float | None
    at_warm: dict | None
    at_end: dict | None
    ended: float  # time.monotonic() when the clients stopped


def first_request(url: str, args: argparse.Namespace) -> str:
    """The server's model id, after one short request (its first load and warm-up)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    first = httpx.post(url + "/v1/responses", timeout=300, json={
        "model": model, "input": "Say hi.", "max_output_tokens": 8, "temperature": 0, "store": False})
    print(f"model {model}, first request HTTP {first.status_code}; "
          f"{args.clients} clients for {args.minutes:g} min", flush=True)
    return model


def progress(run: Run, scraper: Scraper, t0: float) -> None:
    with run.lock:
        done, bad = len(run.ops), sum(o["outcome"] not in ("ok", "refused") for o in run.ops)
    last = scraper.rows[-1] if scraper.rows else {}
    print(f"  {time.monotonic() - t0:5.0f} s: {done} ops, {bad} not ok, batch {last.get('batch_sequences')}, "
          f"queue {last.get('queue_depth')}, RSS {fmt(last.get('rss_mib'), 1)} MiB (KV "
          f"{last.get('kv_resident_mib')} MiB in {last.get('kv_sessions')} sessions, MLX active "
          f"{last.get('mlx_active_mib')} / cache {last.get('mlx_cache_mib')} MiB)", flush=True)


def load(args: argparse.Namespace, mix: dict[str, int], url: str, model: str, pid: int) -> Load:
    """`--clients` client threads for `--minutes` (then `--grace` for their last operations,
    then the hard stop), scraped all along; RSS read at the end of the warm-up and of the load."""
    t0 = time.monotonic()
    run = Run(url, model, t0 + 60 * args.minutes, t0 + 60 * args.minutes + args.grace)
    scraper = Scraper(url, pid, args.scrape_every, t0)
    scraper.scrape()
    scraper.start()
    clients = [Client(run, i, args.seed, t0, mix) for i in range(args.clients)]
    threads = [threading.Thread(target=c.loop, name=f"client-{c.index}", daemon=True) for c in clients]
    for t in threads:
        t.start()

    for i in range(args.stalled):
        threading.Thread(target=stall, args=(url, model, run.end), name=f"stalled-{i}", daemon=True).start()
    time.sleep(max(0.0, min(args.warmup, 60 * args.minutes - 1)))
    rss_warm = rss_mib(pid)
    at_warm = scraper.scrape()
    print(f"warm-up done at {time.monotonic() - t0:.0f} s: RSS {fmt(rss_warm, 1)} MiB", flush=True)
    while time.monotonic() < run.end:
        time.sleep(min(args.report_every, max(0.0, run.end - time.monotonic())))
        progress(run, scraper, t0)
    for t in threads:
        t.join(timeout=max(0.0, run.hard_end - time.monotonic()))
    if any(t.is_alive() for t in threads):
        run.hard.set()
        for t in threads:
            t.join(timeout=30)
    ended = time.monotonic()
    rss_end = rss_mib(pid)
    at_end = scraper.scrape()
    print(f"clients stopped at {ended - t0:.0f} s: RSS {fmt(rss_end, 1)} MiB; draining", flush=True)
    return Load(run, scraper, ended - t0, rss_warm, rss_end, at_warm, at_end, ended)


def stall(url: str, model: str, until: float) -> None:
    """A client that opens a long stream and never reads it until the run ends (its socket's
    buffers fill; the server must serve the others regardless)."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=httpx.Timeout(30, read=None), json={
                "model": model, "messages": [{"role": "user", "content": "Write a very long story."}],
                "max_tokens": 4000, "stream": True}):
            time.sleep(max(0.0, until - time.monotonic()))
    except httpx.HTTPError as e:
        print(f"the stalled client's stream ended: {type(e).__name__}: {e}", flush=True)


def drain(scraper: Scraper, ended: float, timeout: float) -> float | None:
    """Seconds after `ended` at which two scrapes in a row saw no batch and no queue; None
    where that did not come within `timeout`."""
    quiet = 0
    while time.monotonic() < ended + timeout:
        row = scraper.scrape()
        if row and row["batch_sequences"] == 0 and row["queue_depth"] == 0:
            quiet += 1
            if quiet >= 2:
                return time.monotonic() - ended
        else:
            quiet = 0
        time.sleep(1)
    return None


def main() -> None:
    args = arguments()
    provenance = Provenance.gather()
    mix = MIX if not args.kinds else {k: MIX[k] for k in args.kinds.split(",")}
    if args.append:  # asked first: a header mismatch found after the run would cost the run
        appendable("soak", KIND_FIELDS, args.out)
        appendable("soak.timeline", TIMELINE_FIELDS, args.out)

    tmp = Path(tempfile.mkdtemp(prefix="lmsp-soak-"))
    log = tmp / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command("lmsp-mlx", "--port", port, *own_state(tmp, kv_disk=True))
    if args.max_batch:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.kv_memory_mb:
        cmd += ["--kv-memory-mb", f"{args.kv_memory_mb:g}"]
    if args.memory_budget_mb:
        cmd += ["--memory-budget-mb", f"{args.memory_budget_mb:g}"]
    mounted = None
    if args.kv_disk_full_mb:
        mounted = tmp / "kv"
        mounted.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.kv_disk_full_mb:g}m", "tmpfs", str(mounted)],
                       check=True)
    print(f"server: {' '.join(cmd)}\nlog: {log}", flush=True)
    proc = start(cmd, url, log)
    try:
        done = load(args, mix, url, first_request(url, args), proc.pid)
        drained_after = drain(done.scraper, done.ended, args.drain_timeout)
        done.scraper.stop.set()
        rss_drained = rss_mib(proc.pid)
        final = done.scraper.scrape()
        statuses, not_terminal = terminal_check(url, done.run.created)
        store, store_bad, fate = store_scan(tmp / "store.sqlite3", done.run.abandoned_tags)
    finally:
        code = stop(proc, sig=signal.SIGINT, grace=90)
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=False)
    report.write(Soak(args=args, mix=mix, folder=tmp, run=done.run, scrapes=done.scraper.rows, load_s=done.load_s,
                      rss_warm=done.rss_warm, rss_end=done.rss_end, rss_drained=rss_drained, at_warm=done.at_warm,
                      at_end=done.at_end, final=final, drained_after=drained_after, statuses=statuses,
                      not_terminal=not_terminal, store=store, store_bad=store_bad, fate=fate, logged=read_log(log),
                      exit_code=code), provenance, args.out, args.append)


if __name__ == "__main__":
    main()
