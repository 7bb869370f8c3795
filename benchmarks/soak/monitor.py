"""What the soak reads off the server while it runs: /metrics and its resident memory."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx

def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str) -> dict:
    out: dict = {"requests": {}, "http": {}}
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(\w+)=\"([^\"]*)\"\})?\s+(\S+)$", line)
        if not m:
            continue
        name, _, label, value = m.groups()
        if name == "lmsp_requests_total":
            out["requests"][label] = int(float(value))
        elif name == "lmsp_http_responses_total":
            out["http"][label] = int(float(value))
        else:
            out[name] = float(value)
    return out


class Scraper(threading.Thread):
    """Scrapes /metrics and the server's RSS every few seconds."""

    def __init__(self, url: str, pid: int, every: float, started: float):
        super().__init__(daemon=True)
        self.url, self.pid, self.every, self.started = url, pid, every, started
        self.rows: list[dict] = []
        self.failures = 0
        self.stop = threading.Event()

    def scrape(self) -> dict | None:
        try:
            m = parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)
        except httpx.HTTPError:
            self.failures += 1
            return None
        row = {"t_s": round(time.monotonic() - self.started, 1), "rss_mib": rss_mib(self.pid),
               "batch_sequences": int(m.get("lmsp_batch_sequences", -1)),
               "queue_depth": int(m.get("lmsp_queue_depth", -1)), "busy": int(m.get("lmsp_busy", -1)),
               "generations": sum(m["requests"].values()), "http_5xx": sum(v for k, v in m["http"].items() if k >= "500"),
               "http_429": m["http"].get("429", 0), "output_tokens": int(m.get("lmsp_output_tokens_total", 0)),
               **{f"{name}_mib": round(float(m.get(f"lmsp_{name}_bytes", -1)) / 2**20, 1)
                  for name in ("kv_resident", "mlx_active", "mlx_cache")},
               "kv_sessions": int(m.get("lmsp_kv_sessions", -1)),
               "requests": m["requests"], "http": m["http"]}
        self.rows.append(row)
        return row

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.scrape()
