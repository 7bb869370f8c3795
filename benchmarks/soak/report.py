"""The soak's output: soak.csv (a row per request kind), soak.timeline.csv (the scrapes) and
soak.md (the Markdown report, printed too)."""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from benchmarks.common import Provenance, percentile, shown_path, write_rows
from benchmarks.soak.clients import LATENCY_IS, Run

TIMELINE_FIELDS = ["t_s", "rss_mib", "kv_resident_mib", "kv_sessions", "mlx_active_mib", "mlx_cache_mib",
                   "batch_sequences", "queue_depth", "busy", "generations", "http_5xx", "http_429", "output_tokens"]


@dataclass
class Soak:
    """A finished run: everything its report is written from."""

    args: argparse.Namespace  # the run's flags
    mix: dict[str, int]  # the request kinds the clients picked from
    folder: Path  # the run's temp directory, kept: server.log, the store, KV checkpoints and key
    run: Run
    scrapes: list[dict]  # every /metrics scrape, in order
    load_s: float  # from the clients' start to their stop
    rss_warm: float | None  # MiB at the end of the warm-up, at the end of the load, drained
    rss_end: float | None
    rss_drained: float | None
    at_warm: dict | None  # the scrapes at those moments (None where one failed)
    at_end: dict | None
    final: dict | None
    drained_after: float | None  # seconds from the end of the load to an empty batch and queue
    statuses: dict  # kind -> Counter of the statuses the final GETs found
    not_terminal: list[str]
    store: dict  # "responses" / "tasks" -> Counter of statuses in the store
    store_bad: list[str]
    fate: Counter  # what the store says of the requests whose clients timed out
    logged: dict  # checks.read_log()
    exit_code: int | str  # the server's, after SIGINT


@dataclass(frozen=True)
class KindRow:
    """soak.csv's row of one request kind (the percentiles as printed: "-" for none)."""

    kind: str
    count: int
    ok: int
    refused_429: int
    errors_5xx: int
    rejected_4xx: int
    broken: int
    transport: int
    abandoned: int
    errors: int
    latency_p50_s: str
    latency_p95_s: str
    ttft_p50_s: str
    ttft_p95_s: str
    output_tokens: int
    latency_is: str
    statuses: str


KIND_FIELDS = [f.name for f in fields(KindRow)]


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def kind_rows(run: Run, mix: dict[str, int]) -> list[KindRow]:
    """One row per kind of the mix, in the mix's order."""
    by_kind: dict = defaultdict(list)
    for op in run.ops:
        by_kind[op["kind"]].append(op)
    rows = []
    for kind in mix:
        ops = by_kind.get(kind, [])
        ok = [o for o in ops if o["outcome"] == "ok"]
        lat = [x for o in ok for x in o.get("latencies", [o["latency"]])]
        ttft = [o["ttft"] for o in ok if o.get("ttft") is not None]
        out = Counter(o["outcome"] for o in ops)
        rows.append(KindRow(
            kind=kind, count=len(ops), ok=out["ok"], refused_429=out["refused"],
            errors_5xx=out["error_5xx"], rejected_4xx=out["rejected_4xx"], broken=out["broken"],
            transport=out["transport"], abandoned=out["abandoned"],
            errors=out["error_5xx"] + out["rejected_4xx"] + out["broken"] + out["transport"],
            latency_p50_s=fmt(percentile(lat, 0.5), 3), latency_p95_s=fmt(percentile(lat, 0.95), 3),
            ttft_p50_s=fmt(percentile(ttft, 0.5), 3), ttft_p95_s=fmt(percentile(ttft, 0.95), 3),
            output_tokens=sum(o.get("output_tokens", 0) for o in ok), latency_is=LATENCY_IS[kind],
            statuses=" ".join(f"{k}:{v}" for k, v in sorted(Counter(str(o.get("status")) for o in ok).items())),
        ))
    return rows


def server_log_line(folder: Path) -> str:
    """Where the run's log is, for a committed report: relative to the repository, or (a
    temp directory) without its absolute path, which the run prints instead."""
    where = shown_path(folder)
    if where is not None:
        return f"Server log: `{where}/server.log` (store, KV and key beside it)."
    return ("Server log: `server.log` in the run's temp directory, kept with its store, KV and key "
            "(the run prints its path).")


def kinds_table(rows: list[KindRow]) -> list[str]:
    md = ["| kind | ops | ok | 429 | 5xx | other 4xx | broken | transport | abandoned | p50 s | p95 s | "
          "TTFT p50 s | TTFT p95 s | latency is | final statuses (ok ops) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        md.append(f"| {r.kind} | {r.count} | {r.ok} | {r.refused_429} | {r.errors_5xx} | "
                  f"{r.rejected_4xx} | {r.broken} | {r.transport} | {r.abandoned} | {r.latency_p50_s} | "
                  f"{r.latency_p95_s} | {r.ttft_p50_s} | {r.ttft_p95_s} | {r.latency_is} | "
                  f"{r.statuses} |")
    return md


def target(good: bool) -> str:
    return "ok" if good else "**MISSED**"


def _faults(s: Soak, rss_series: list[float]) -> list[str]:
    """The faults the run was under (`--memory-budget-mb`, `--kv-disk-full-mb`, `--stalled`)."""
    a, logged = s.args, s.logged
    rows = []
    if a.memory_budget_mb:
        # The budget bounds what the models hold; the runtime's own (Python, MLX, Quart, the
        # tokenizer) is the RSS at the first scrape less the weights.
        peak, first = max(rss_series, default=None), (s.scrapes[0]["rss_mib"] if s.scrapes else None)
        runtime = first - logged["weights_mib"] if first and logged.get("weights_mib") else None
        limit = a.memory_budget_mb + runtime if runtime is not None else None
        rows.append(f"| peak RSS during the load against `--memory-budget-mb` plus the runtime's own | "
                    f"{fmt(peak, 1)} of {a.memory_budget_mb:g} + {fmt(runtime, 1)} MiB; "
                    f"{logged.get('memory_waits', 0)} sequences waited for memory | within: "
                    f"{target(peak is not None and limit is not None and peak <= limit)} |")
    if a.kv_disk_full_mb:
        rows.append(f"| KV disk full (a {a.kv_disk_full_mb:g} MiB tmpfs) | {logged.get('disk_full', 0)} checkpoint "
                    "writes failed with ENOSPC | served on |")
    if a.stalled:
        rows.append(f"| clients that never read their stream | {a.stalled} | served on |")
    return rows


def measures_table(s: Soak) -> list[str]:
    """The run's measures against its targets."""
    run, scrapes, final, logged = s.run, s.scrapes, s.final, s.logged
    stream_ttft = [o["ttft"] for o in run.ops if o["outcome"] == "ok" and o["kind"] in ("stream_chat", "stream_v1")
                   and o.get("ttft") is not None]
    served = sum(final["requests"].values()) if final else None
    http = final["http"] if final else {}
    http_5xx = sum(v for k, v in http.items() if k >= "500")
    during = [r for r in scrapes if s.at_warm and s.at_end and s.at_warm["t_s"] <= r["t_s"] <= s.at_end["t_s"]]
    rss_series = [r["rss_mib"] for r in during if r["rss_mib"]]
    growth = (s.rss_end / s.rss_warm - 1) if s.rss_warm and s.rss_end else None
    tokens = (s.at_end["output_tokens"] - scrapes[0]["output_tokens"]) if s.at_end and scrapes else None
    client_5xx = sum(v for k, v in run.codes.items() if k >= 500)
    drained = (f"after {fmt(s.drained_after, 1)} s" if s.drained_after is not None
               else f"NOT within {s.args.drain_timeout} s")
    return ["| measure | value | target |", "|---|---:|---|",
            f"| client operations (all kinds) | {len(run.ops)} in {s.load_s:.0f} s | |",
            f"| generations served (`lmsp_requests_total`) | {served} "
            f"({', '.join(f'{k} {v}' for k, v in sorted((final or {}).get('requests', {}).items()))}) | |",
            f"| HTTP replies (`lmsp_http_responses_total`) | "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(http.items()))} | |",
            f"| 5xx (server metric / seen by clients) | {http_5xx} / {client_5xx} | 0: {target(http_5xx == 0 == client_5xx)} |",
            f"| 429 refusals seen by clients | {run.codes.get(429, 0)} | expected under load |",
            f"| output tokens during the load (metric) | {tokens} ({fmt(tokens / s.load_s if tokens else None, 1)} tok/s) | |",
            f"| p95 time to first token, streams (chat + /v1, {len(stream_ttft)}) | "
            f"{fmt(percentile(stream_ttft, 0.95), 3)} s (p50 {fmt(percentile(stream_ttft, 0.5), 3)} s) | |",
            f"| peak batch sequences / queue depth (scrapes) | "
            f"{max((r['batch_sequences'] for r in scrapes), default=None)} / "
            f"{max((r['queue_depth'] for r in scrapes), default=None)} | |",
            f"| RSS at warm-up end ({s.args.warmup:g} s) / end of load / drained | {fmt(s.rss_warm, 1)} / "
            f"{fmt(s.rss_end, 1)} / {fmt(s.rss_drained, 1)} MiB | |",
            f"| RSS change, warm-up end to end of load | {fmt(100 * growth if growth is not None else None, 1)} % "
            f"(range in between {fmt(min(rss_series, default=None), 1)}-{fmt(max(rss_series, default=None), 1)} MiB) | "
            f"within 10%: {target(growth is not None and abs(growth) <= 0.10)} |",
            *_faults(s, rss_series),
            f"| drained (batch 0, queue 0) | {drained}"
            f" (last scrape: batch {(final or {}).get('batch_sequences')}, queue {(final or {}).get('queue_depth')}) | "
            f"{target(s.drained_after is not None)} |",
            f"| objects created and fetched again | {len(run.created)} ({len(s.not_terminal)} not terminal) | "
            f"0 not terminal: {target(not s.not_terminal)} |",
            f"| store scan: responses / tasks | {sum(s.store['responses'].values())} / {sum(s.store['tasks'].values())} "
            f"({len(s.store_bad)} not terminal) | 0: {target(not s.store_bad)} |",
            f"| sync requests the client timed out, in the store | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(s.fate.items())) or 'none'} | cancelled |",
            f"| tracebacks in the server log | {logged['tracebacks']} | 0: {target(logged['tracebacks'] == 0)} |",
            f"| ERROR lines in the server log | {len(logged['errors'])} | 0 |",
            f"| server exit after SIGINT | {s.exit_code} | 0 |",
            ""]


def kv_and_log(s: Soak) -> list[str]:
    """What the server's log and its KV directory say."""
    logged, last_scrape = s.logged, (s.scrapes[-1] if s.scrapes else {})
    max_kv = max((r["kv_resident_mib"] for r in s.scrapes), default=None)
    kv_files = list((s.folder / "kv").rglob("*.safetensors"))
    md = ["## KV cache (from the log)", "",
          f"- cache sources: {', '.join(f'{k} {v}' for k, v in logged['sources'].most_common())}",
          f"- prompt tokens {logged['prompt_tokens']}, of them cached {logged['cached_tokens']} "
          f"({fmt(100 * logged['cached_tokens'] / logged['prompt_tokens'] if logged['prompt_tokens'] else None, 1)} %)",
          f"- memory evictions (`kv memory: evicting`): {logged['evictions']}; checkpoints: "
          f"{', '.join(f'{k} {v}' for k, v in logged['checkpoints'].items()) or 'none'}; disk restores: "
          f"{logged['restores']}; disk evictions: {logged['disk_evictions']}; checkpoint files at the end: "
          f"{len(kv_files)} ({sum(f.stat().st_size for f in kv_files) / 2**20:.1f} MiB)",
          f"- cold starts because the matching session was in use: {logged['in_use_cold']}; "
          f"sequences stepped outside the batch: {logged['outside_batch']}",
          f"- resident KV sessions at the end (`lmsp_kv_sessions`, last scrape): {last_scrape.get('kv_sessions')}, "
          f"{last_scrape.get('kv_resident_mib')} MiB; {logged['shutdown_sessions']} of them were checkpointed at "
          f"shutdown ({logged['shutdown_tokens']} tokens, {logged['shutdown_mib']:.1f} MiB); the evictions above are "
          f"the sessions pushed out of `--kv-memory-mb` ({s.args.kv_memory_mb or 'default 2048'} MiB). Running "
          f"sequences cannot be evicted, so the resident KV peaked at {max_kv} MiB during the load",
          "", "## Server log", "",
          f"- {logged['lines']} lines; request lines by status: "
          f"{', '.join(f'{k} {v}' for k, v in logged['statuses'].most_common())}; by route: "
          f"{', '.join(f'{k} {v}' for k, v in logged['routes'].most_common())}",
          f"- generation failed: {logged['generation_failed']}",
          ]
    if logged["warnings"]:
        md.append("- warnings: " + "; ".join(f"{v}x `{k}`" for k, v in logged["warnings"].most_common(8)))
    if logged["errors"]:
        md += ["", "ERROR lines (first 10):", "", "```", *logged["errors"][:10], "```"]
    if logged["traceback_samples"]:
        md += ["", "Tracebacks (first 3):", ""]
        for sample in logged["traceback_samples"]:
            md += ["```", sample, "```"]
    return md


def problems_and_statuses(s: Soak) -> list[str]:
    """What went wrong on the clients' side, what is not terminal, and the final statuses."""
    md = []
    if s.run.problems:
        md += ["", f"## Client-side problems ({len(s.run.problems)}, first 20)", ""]
        md += [f"- {p}" for p in s.run.problems[:20]]
    if s.not_terminal or s.store_bad:
        md += ["", "## Not terminal", ""] + [f"- {b}" for b in (s.not_terminal + s.store_bad)[:30]]
    md += ["", "## Statuses on the final GET, per kind", ""]
    md += [f"- {kind}: {', '.join(f'{k} {v}' for k, v in sorted(c.items()))}" for kind, c in s.statuses.items()]
    md += [f"- store: responses {dict(s.store['responses'])}; tasks {dict(s.store['tasks'])}"]
    return md


def markdown(s: Soak, rows: list[KindRow], provenance: Provenance) -> str:
    a = s.args
    md = [f"# Soak run: {a.clients} clients, {a.minutes:g} min, seed {a.seed}", "",
          f"Commit {provenance.commit}, {provenance.date_utc}, {provenance.machine}, MLX {provenance.mlx_version}.",
          "", server_log_line(s.folder), ""]
    md += kinds_table(rows) + [""] + measures_table(s) + kv_and_log(s) + problems_and_statuses(s)
    return "\n".join(md) + "\n"


def write(s: Soak, provenance: Provenance, out: Path, append: bool) -> None:
    """soak.csv and soak.timeline.csv (added to with `append`), soak.md (this run's); the
    report is printed too."""
    rows = kind_rows(s.run, s.mix)
    write_rows("soak", [asdict(r) for r in rows], provenance, out=out, append=append, fields=KIND_FIELDS)
    write_rows("soak.timeline", s.scrapes, provenance, out=out, append=append, fields=TIMELINE_FIELDS)
    text = markdown(s, rows, provenance)
    (out / "soak.md").write_text(text)
    print("\n" + text)
    print(f"wrote {out / 'soak.csv'}, {out / 'soak.timeline.csv'}, {out / 'soak.md'}; "
          f"server log kept at {s.folder / 'server.log'}")
