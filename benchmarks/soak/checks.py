"""The soak's end-of-run checks: every object the clients created fetched again, the store
scanned read-only, and the server's log read."""

from __future__ import annotations

import re
import sqlite3
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from benchmarks.soak.clients import TERMINAL

def terminal_check(url: str, created: list[dict]) -> tuple[dict, list[str]]:
    """GET every object the clients created: statuses per kind, and what is not terminal."""
    paths = {"task": "/lmsp/v1/tasks/{}", "v1": "/v1/responses/{}", "lmsp": "/lmsp/v1/responses/{}"}
    statuses: dict = defaultdict(Counter)
    bad: list[str] = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for obj in created:
            try:
                r = http.get(paths[obj["where"]].format(obj["id"]))
            except httpx.HTTPError as e:
                bad.append(f"{obj['kind']} {obj['id']}: GET failed: {type(e).__name__}: {e}")
                continue
            if r.status_code != 200:
                statuses[obj["kind"]][f"HTTP {r.status_code}"] += 1
                bad.append(f"{obj['kind']} {obj['where']} {obj['id']}: HTTP {r.status_code} {r.text[:200]}")
                continue
            status = r.json().get("status")
            label = status if obj["expect"] is None else f"{status} (cancel asked)"
            statuses[obj["kind"]][label] += 1
            if status not in TERMINAL:
                bad.append(f"{obj['kind']} {obj['where']} {obj['id']}: status {status}")
    return statuses, bad


def store_scan(path: Path, abandoned: list[dict]) -> tuple[dict, list[str], Counter]:
    """Read-only look at the store: statuses of every response and task, and what became of
    the requests whose clients timed out (found by their metadata tag)."""
    counts: dict = {"responses": Counter(), "tasks": Counter()}
    bad: list[str] = []
    fate: Counter = Counter()
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as e:
        return counts, [f"the store could not be opened: {e}"], fate
    try:
        by_tag = {}
        for rid, status, tag in conn.execute(
                "SELECT id, json_extract(response, '$.status'), json_extract(request, '$.metadata.soak') FROM responses"):
            counts["responses"][status] += 1
            if status not in TERMINAL:
                bad.append(f"stored response {rid} ({tag}): status {status}")
            if tag:
                by_tag[tag] = status
        for tid, status, framing in conn.execute("SELECT id, status, framing FROM tasks"):
            counts["tasks"][f"{status} ({framing})"] += 1
            if status not in TERMINAL:
                bad.append(f"task {tid} ({framing}): status {status}")
        for a in abandoned:
            fate[by_tag.get(a["tag"], "not in the store")] += 1
    except sqlite3.Error as e:
        bad.append(f"the store could not be read: {e}")
    finally:
        conn.close()
    return counts, bad, fate


def read_log(log: Path) -> dict:
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    out = {
        "lines": len(lines),
        "tracebacks": text.count("Traceback"),
        "memory_waits": text.count("memory: a request waits for memory"),
        "disk_full": text.count("No space left on device"),
        "weights_mib": float(m.group(1)) if (m := re.search(r"about ([\d.]+) MiB once loaded", text)) else None,
        "errors": [ln for ln in lines if " ERROR " in ln],
        "warnings": Counter(re.sub(r"\d+(\.\d+)?", "N", ln.split(": ", 1)[-1])[:120]
                            for ln in lines if " WARNING " in ln),
        "statuses": Counter(re.findall(r"^.* request route=\S+ .* status=(\S+)", text, re.M)),
        "routes": Counter(re.findall(r" request route=(\S+) ", text)),
        "sources": Counter(re.findall(r"cache_source=(\S+?)(?: ids=\d+)? cached=", text)),
        "evictions": len(re.findall(r"kv memory: evicting", text)),
        "evicted_to_disk": len(re.findall(r"kv memory: evicting .*(checkpoint|disk)", text)),
        "checkpoints": Counter(re.findall(r"kv checkpoint reason=(\S+)", text)),
        "restores": len(re.findall(r"kv disk: restored", text)),
        "disk_evictions": len(re.findall(r"kv disk: evicting", text)),
        "outside_batch": len(re.findall(r"a sequence steps outside the batch", text)),
        "generation_failed": len(re.findall(r"generation failed", text)),
        "in_use_cold": len(re.findall(r"the matching session is in use", text)),
    }
    # Shutdown checkpoints every resident session not yet on disk: a floor on what was resident at the end.
    wrote = {f: float(m) for f, m in re.findall(r"kv disk: wrote (\S+) \(\d+ tokens, ([\d.]+) MiB\)", text)}
    shut = re.findall(r"kv checkpoint reason=shutdown kind=\S+ tokens=(\d+) file=(\S+)", text)
    out["shutdown_sessions"] = len(shut)
    out["shutdown_tokens"] = sum(int(t) for t, _ in shut)
    out["shutdown_mib"] = sum(wrote.get(f, 0.0) for _, f in shut)
    cached = [(int(c), int(p)) for c, p in re.findall(r"cache_source=\S+(?: ids=\d+)? cached=(\d+) prompt=(\d+)", text)]
    out["cached_tokens"] = sum(c for c, _ in cached)
    out["prompt_tokens"] = sum(p for _, p in cached)
    tb = [i for i, ln in enumerate(lines) if "Traceback" in ln]
    out["traceback_samples"] = ["\n".join(lines[max(0, i - 2): i + 25]) for i in tb[:3]]
    return out
