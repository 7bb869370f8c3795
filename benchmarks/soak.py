"""A soak run: one lmsp-mlx server under a mixed client load for minutes, then checked.

    python benchmarks/soak.py [--minutes 10] [--clients 16] [--seed 0] [--warmup 30]
                              [--scrape-every 5] [--max-batch N] [--kv-memory-mb MB] [--kinds K,...]
                              [--out DIR]

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
not an error; any 5xx is an error.

Every `--scrape-every` seconds `/metrics` is scraped (batch sequences, queue depth,
generations by status, HTTP replies by code) and the server's resident memory read from
/proc/PID/status. When the clients stop and the batch and queue are empty, every task and
every stored or background response the clients created is fetched again and must be in a
terminal state (completed, incomplete, failed, cancelled); the store file is scanned
read-only for any that is not, and the requests the clients abandoned are looked up there
(by their `metadata`) to see that the server cancelled them. Then the server is stopped
with SIGINT and its log is read: tracebacks, errors, KV cache sources, evictions and
checkpoints.

Targets: no 5xx, no traceback, nothing left non-terminal, the batch drained, resident
memory at the end within 10% of what it was at the end of the `--warmup` (resident KV
sessions count in it and grow until they fill `--kv-memory-mb`, 2048 MiB by default, so a
smaller budget, one the warm-up fills, separates them from a leak). Writes
benchmarks/results/soak.csv (one row per request kind: count, refusals, errors, latency or
time to first token p50/p95), soak.timeline.csv (the scrapes) and soak.md (the printed
Markdown report).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_loop import free_port, start  # noqa: E402

TERMINAL = {"completed", "incomplete", "failed", "cancelled"}
FINAL_EVENTS = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
OP_TIMEOUT = 240.0  # the longest one client operation (all its requests) may take
POLL = 0.5  # seconds between polls of a task or a background response

# Request kinds and how often each client picks them.
MIX = {
    "sync_v1": 2, "sync_lmsp": 2, "stream_chat": 2, "stream_v1": 2, "task_poll": 1, "task_events": 1,
    "background": 1, "tool_loop": 2, "stream_drop": 1, "sync_timeout": 1,
}
LATENCY_IS = {
    "sync_v1": "request to reply", "sync_lmsp": "request to reply",
    "stream_chat": "request to [DONE]", "stream_v1": "request to final event",
    "task_poll": "create to terminal poll", "task_events": "create to final event",
    "background": "create to terminal poll", "tool_loop": "per turn, request to reply",
    "stream_drop": "request to the client's close", "sync_timeout": "request to the client's timeout",
}

SHORT_PROMPTS = [
    "What is the capital of France?", "Say hello in three languages.", "Name three primary colours.",
    "What is 17 times 23?", "Write a haiku about the sea.", "Give me a synonym for happy.",
    "Why is the sky blue? One sentence.", "List four planets.", "What does a compiler do?",
    "Tell me a short joke about cats.", "How many legs does a spider have?", "Translate 'good morning' to Spanish.",
]
NOTES = [
    "The committee met on Tuesday to review the harbour renovation plan.",
    "Costs rose by twelve percent because steel prices climbed over the winter.",
    "The north pier will close for six weeks starting in early spring.",
    "Fishing boats will be moved to the temporary moorings near the lighthouse.",
    "A new ferry schedule will run every forty minutes during the works.",
    "Local shops asked for extra parking spaces along the promenade.",
    "The engineers found that the old timber pilings were weaker than expected.",
    "Divers will inspect the seawall before any heavy machinery arrives.",
    "The town council approved a grant to cover half of the additional costs.",
    "Residents complained about noise from night shifts at the boatyard.",
    "A public meeting is planned for the first Monday of next month.",
    "The museum will host an exhibition about the history of the harbour.",
    "Storm damage last autumn destroyed part of the breakwater.",
    "Contractors expect the dredging to take about three weeks.",
    "The sailing club will move its races to the bay until the summer.",
    "Water quality tests will be published every week on the council website.",
    "A second crane will be hired if the schedule slips further.",
    "The harbour master wants new lights installed on the outer wall.",
    "Tourist numbers are expected to fall slightly during the closure.",
    "The final report will be presented to the council in June.",
]
ASKS = ["Summarize the notes above in two sentences.", "What are the three main risks in these notes?",
        "Write a short email to residents based on these notes.", "List the dates and durations mentioned."]
CITIES = ["Paris", "Hangzhou", "Oslo", "Lima", "Nairobi", "Toronto", "Kyoto", "Lisbon", "Cairo", "Perth"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


class Refused(Exception):
    """A 429: the server is full; not an error."""

    def __init__(self, retry_after: float, text: str):
        super().__init__(text)
        self.retry_after = retry_after


class ServerError(Exception):
    """A 5xx."""


class Rejected(Exception):
    """A 4xx other than 429: unexpected for the requests this run sends."""


class Broken(Exception):
    """A reply that is not what the protocol promises (no final event, a missing call, ...)."""


class Abandoned(Exception):
    """The run's hard stop came while this operation was still going."""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


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


class Run:
    """What the clients share: the server's address, the stop signals, and what they recorded."""

    def __init__(self, url: str, model: str, end: float, hard_end: float):
        self.url, self.model, self.end, self.hard_end = url, model, end, hard_end
        self.hard = threading.Event()
        self.lock = threading.Lock()
        self.ops: list[dict] = []
        self.codes: Counter = Counter()  # every HTTP reply the clients got, by code
        self.created: list[dict] = []  # {"kind", "where": task|v1|lmsp, "id", "expect"}
        self.abandoned_tags: list[dict] = []  # requests whose client left: {"kind", "tag", "id"}
        self.problems: list[str] = []  # 5xx bodies, broken replies, unexpected exceptions

    def record(self, op: dict) -> None:
        with self.lock:
            self.ops.append(op)
            if op["outcome"] not in ("ok", "refused") and len(self.problems) < 200:
                self.problems.append(f"{op['kind']} (client {op['client']}, t={op['t']:.0f}s): "
                                     f"{op['outcome']}: {op.get('detail', '')}")

    def created_object(self, kind: str, where: str, obj_id: str, expect: str | None = None) -> None:
        with self.lock:
            self.created.append({"kind": kind, "where": where, "id": obj_id, "expect": expect})


class Client:
    """One client thread's loop and its request kinds."""

    def __init__(self, run: Run, index: int, seed: int, started: float, mix: dict[str, int]):
        self.run, self.index, self.started, self.mix = run, index, started, mix
        self.rng = random.Random(seed * 1000 + index)
        self.http = httpx.Client(base_url=run.url, timeout=httpx.Timeout(180, connect=10))
        self.n = 0

    # -- helpers ---------------------------------------------------------------------

    def deadline(self) -> float:
        return min(time.monotonic() + OP_TIMEOUT, self.run.hard_end)

    def check_time(self, deadline: float) -> None:
        if self.run.hard.is_set():
            raise Abandoned("the run's hard stop")
        if time.monotonic() > deadline:
            raise Broken(f"ran past its {OP_TIMEOUT:.0f} s operation deadline")

    def checked(self, r: httpx.Response, want: tuple[int, ...] = (200,)) -> httpx.Response:
        with self.run.lock:
            self.run.codes[r.status_code] += 1
        if r.status_code in want:
            return r
        if not r.is_stream_consumed:
            r.read()
        text = r.text[:400]
        if r.status_code == 429:
            try:
                after = float(r.headers.get("Retry-After", "1"))
            except ValueError:
                after = 1.0
            if "Retry-After" not in r.headers:
                raise Broken(f"429 without Retry-After: {text}")
            raise Refused(after, text)
        if r.status_code >= 500:
            raise ServerError(f"HTTP {r.status_code}: {text}")
        raise Rejected(f"HTTP {r.status_code}: {text}")

    def post(self, path: str, body: dict, want: tuple[int, ...] = (200,), **kw) -> httpx.Response:
        return self.checked(self.http.post(path, json=body, **kw), want)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.checked(self.http.get(path, timeout=30, **kw))

    def prompt(self) -> str:
        if self.rng.random() < 0.6:
            return self.rng.choice(SHORT_PROMPTS)
        notes = self.rng.sample(NOTES, self.rng.randint(6, len(NOTES)))
        return "Notes:\n" + "\n".join(f"- {s}" for s in notes) + "\n\n" + self.rng.choice(ASKS)

    def sampling(self, low: int = 16, high: int = 128) -> dict:
        body = {"max_output_tokens": self.rng.randint(low, high)}
        if self.rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.7, seed=self.rng.randrange(1, 2**31))
        return body

    def tag(self, kind: str) -> dict:
        return {"soak": f"{kind}/{self.index}/{self.n}"}

    def sse(self, r: httpx.Response, deadline: float):
        """(event name, parsed data) for each event of an SSE reply; raw strings for non-JSON data."""
        event, data = None, []
        for line in r.iter_lines():
            self.check_time(deadline)
            if line == "":
                if data:
                    raw = "\n".join(data)
                    try:
                        yield event, json.loads(raw)
                    except json.JSONDecodeError:
                        yield event, raw
                event, data = None, []
            elif line.startswith(":"):
                continue  # keep-alive
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data:
            raw = "\n".join(data)
            try:
                yield event, json.loads(raw)
            except json.JSONDecodeError:
                yield event, raw

    def read_response_stream(self, events, began: float, stop_after: int | None = None):
        """Reads a Responses stream (/v1 or LMSP or a task's events) from `events`, an
        iterator from sse() that a second call goes on reading; returns
        (ttft, final event type, final response, response id, events seen)."""
        ttft, final, response, rid, seen = None, None, None, None, 0
        for event, data in events:
            seen += 1
            kind = (data.get("type") if isinstance(data, dict) else None) or event or ""
            if isinstance(data, dict):
                rid = rid or (data.get("response") or {}).get("id") or data.get("response_id")
            if kind.endswith(".delta") and ttft is None:
                ttft = time.monotonic() - began
            if kind == "error":
                raise Broken(f"error event: {json.dumps(data)[:300]}")
            if kind in FINAL_EVENTS:
                final = kind
                # /v1 finals hold the response; LMSP ones its status and usage themselves.
                response = (data.get("response") or data) if isinstance(data, dict) else None
            if stop_after is not None and seen >= stop_after:
                break
        return ttft, final, response, rid, seen

    # -- request kinds ---------------------------------------------------------------

    def sync_v1(self) -> dict:
        body = {"model": self.run.model, "input": self.prompt(), **self.sampling(), "metadata": self.tag("sync_v1")}
        began = time.monotonic()
        resp = self.post("/v1/responses", body).json()
        latency = time.monotonic() - began
        self.run.created_object("sync_v1", "v1", resp["id"])  # /v1 stores by default
        if resp["status"] not in TERMINAL:
            raise Broken(f"a sync reply with status {resp['status']}")
        return {"latency": latency, "status": resp["status"], "output_tokens": resp["usage"]["output_tokens"]}

    def sync_lmsp(self) -> dict:
        store = self.rng.random() < 0.5
        body = {"model": self.run.model, "input": self.prompt(), **self.sampling(), "store": store}
        began = time.monotonic()
        resp = self.post("/lmsp/v1/responses", body).json()
        latency = time.monotonic() - began
        if store:
            self.run.created_object("sync_lmsp", "lmsp", resp["id"])
        if resp["status"] not in TERMINAL:
            raise Broken(f"a sync reply with status {resp['status']}")
        return {"latency": latency, "status": resp["status"], "output_tokens": resp["usage"]["output_tokens"]}

    def stream_chat(self) -> dict:
        s = self.sampling()
        body = {"model": self.run.model, "messages": [{"role": "user", "content": self.prompt()}],
                "max_tokens": s.pop("max_output_tokens"), **s, "stream": True,
                "stream_options": {"include_usage": True}}
        began, deadline = time.monotonic(), self.deadline()
        ttft, done, finish, usage = None, False, None, None
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            self.checked(r)
            for _, data in self.sse(r, deadline):
                if data == "[DONE]":
                    done = True
                    break
                if not isinstance(data, dict):
                    continue
                if "error" in data:
                    raise Broken(f"stream error: {json.dumps(data)[:300]}")
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if ttft is None and (delta.get("content") or delta.get("tool_calls")
                                         or delta.get("reasoning_content")):
                        ttft = time.monotonic() - began
                    finish = choice.get("finish_reason") or finish
                usage = data.get("usage") or usage
        if not done or finish is None:
            raise Broken(f"the chat stream ended without [DONE] or a finish_reason (done={done}, finish={finish})")
        return {"latency": time.monotonic() - began, "ttft": ttft, "status": finish,
                "output_tokens": (usage or {}).get("completion_tokens", 0)}

    def stream_v1(self) -> dict:
        body = {"model": self.run.model, "input": self.prompt(), **self.sampling(), "stream": True,
                "metadata": self.tag("stream_v1")}
        began, deadline = time.monotonic(), self.deadline()
        with self.http.stream("POST", "/v1/responses", json=body) as r:
            self.checked(r)
            ttft, final, response, rid, _ = self.read_response_stream(self.sse(r, deadline), began)
        if rid:
            self.run.created_object("stream_v1", "v1", rid)
        if final is None:
            raise Broken("the stream ended without a final event")
        return {"latency": time.monotonic() - began, "ttft": ttft, "status": (response or {}).get("status", final),
                "output_tokens": ((response or {}).get("usage") or {}).get("output_tokens", 0)}

    def _poll(self, path: str, deadline: float) -> dict:
        while True:
            self.check_time(deadline)
            obj = self.get(path).json()
            if obj["status"] in TERMINAL:
                return obj
            time.sleep(POLL)

    def task_poll(self) -> dict:
        cancel = self.rng.random() < 0.3
        wait = self.rng.uniform(0.2, 3.0)
        body = {"request": {"model": self.run.model, "input": self.prompt(), **self.sampling()}}
        began, deadline = time.monotonic(), self.deadline()
        task = self.post("/lmsp/v1/tasks", body, want=(202,)).json()
        self.run.created_object("task_poll", "task", task["id"], "cancelled" if cancel else None)
        if cancel:
            time.sleep(wait)
            self.post(f"/lmsp/v1/tasks/{task['id']}/cancel", {})
        ended = self._poll(f"/lmsp/v1/tasks/{task['id']}", deadline)
        usage = (ended.get("response") or {}).get("usage") or {}
        return {"latency": time.monotonic() - began, "status": ended["status"], "cancel": cancel,
                "output_tokens": usage.get("output_tokens", 0)}

    def task_events(self) -> dict:
        cancel_after = self.rng.randint(3, 10) if self.rng.random() < 0.3 else None
        body = {"request": {"model": self.run.model, "input": self.prompt(), **self.sampling()}}
        began, deadline = time.monotonic(), self.deadline()
        task = self.post("/lmsp/v1/tasks", body, want=(202,)).json()
        self.run.created_object("task_events", "task", task["id"], "cancelled" if cancel_after else None)
        with self.http.stream("GET", f"/lmsp/v1/tasks/{task['id']}/events") as r:
            self.checked(r)
            events = self.sse(r, deadline)
            ttft, final, response, _, seen = self.read_response_stream(events, began, stop_after=cancel_after)
            if cancel_after is not None and final is None:
                self.post(f"/lmsp/v1/tasks/{task['id']}/cancel", {})  # on a second connection
                more_ttft, final, response, _, more = self.read_response_stream(events, began)
                ttft, seen = ttft or more_ttft, seen + more
        if final is None:
            raise Broken(f"the task's events ended without a final event after {seen}")
        status = (response or {}).get("status") or final.removeprefix("response.")
        return {"latency": time.monotonic() - began, "ttft": ttft, "status": status, "cancel": cancel_after is not None,
                "output_tokens": ((response or {}).get("usage") or {}).get("output_tokens", 0)}

    def background(self) -> dict:
        cancel = self.rng.random() < 0.3
        wait = self.rng.uniform(0.2, 3.0)
        body = {"model": self.run.model, "input": self.prompt(), **self.sampling(), "background": True,
                "metadata": self.tag("background")}
        began, deadline = time.monotonic(), self.deadline()
        resp = self.post("/v1/responses", body).json()
        if resp["status"] not in ("queued", "in_progress", *TERMINAL):
            raise Broken(f"a background response started as {resp['status']}")
        self.run.created_object("background", "v1", resp["id"], "cancelled" if cancel else None)
        if cancel:
            time.sleep(wait)
            after = self.post(f"/v1/responses/{resp['id']}/cancel", {}).json()
            if after["status"] not in TERMINAL:
                raise Broken(f"a cancelled background response answered with status {after['status']}")
        ended = self._poll(f"/v1/responses/{resp['id']}", deadline)
        return {"latency": time.monotonic() - began, "status": ended["status"], "cancel": cancel,
                "output_tokens": (ended.get("usage") or {}).get("output_tokens", 0)}

    def tool_loop(self) -> dict:
        turns = self.rng.randint(2, 4)
        mode = self.rng.choice(["previous", "replay"])
        lmsp = self.rng.random() < 0.3
        route = "/lmsp/v1/responses" if lmsp else "/v1/responses"
        question = {"role": "user", "content": f"What is the weather in {self.rng.choice(CITIES)}? Use the tool."}
        base = {"model": self.run.model, "tools": [WEATHER], "max_output_tokens": 128}
        if self.rng.random() < 0.5:
            base["temperature"] = 0
        else:
            base.update(temperature=0.7, seed=self.rng.randrange(1, 2**31))
        if lmsp:
            base["store"] = True  # previous_response_id needs it there
        else:
            base["metadata"] = self.tag("tool_loop")
        history, previous, latencies, tokens, calls_made, status = [question], None, [], 0, 0, None
        for turn in range(turns):
            body = dict(base, tool_choice="required" if turn < turns - 1 else "auto")
            if turn == 0:
                body["input"] = [question]
            elif mode == "previous":
                body.update(input=outputs, previous_response_id=previous["id"])
            else:
                body["input"] = history
            began = time.monotonic()
            resp = self.post(route, body).json()
            latencies.append(time.monotonic() - began)
            self.run.created_object("tool_loop", "lmsp" if lmsp else "v1", resp["id"])
            tokens += resp["usage"]["output_tokens"]
            status = resp["status"]
            calls = [o for o in resp["output"] if o["type"] == "function_call"]
            calls_made += len(calls)
            if body["tool_choice"] == "required" and not calls:
                raise Broken(f"turn {turn + 1} of {turns} ({mode}, {route}): tool_choice required but no call, "
                             f"status {resp['status']}, output {json.dumps(resp['output'])[:300]}")
            if not calls:
                break  # the last turn answered in text
            outputs = []
            for c in calls:
                if c.get("name") != "get_weather":
                    raise Broken(f"a call to {c.get('name')!r}, not offered")
                args = json.loads(c["arguments"])  # the grammar makes this valid JSON
                outputs.append({"type": "function_call_output", "call_id": c["call_id"],
                                "output": json.dumps({"city": args.get("city"), "unit": args.get("unit"),
                                                      "temperature": self.rng.randint(-5, 35),
                                                      "sky": self.rng.choice(["clear", "rain", "cloudy"])})})
            history = [*history, *resp["output"], *outputs]
            previous = resp
        return {"latency": statistics.mean(latencies), "latencies": latencies, "status": status,
                "output_tokens": tokens, "turns": len(latencies), "calls": calls_made, "mode": mode}

    def stream_drop(self) -> dict:
        route = self.rng.choice(["/v1/responses", "/v1/chat/completions", "/lmsp/v1/responses"])
        stop_after = self.rng.randint(3, 8)
        limit = self.rng.randint(128, 256)
        if route == "/v1/chat/completions":
            body = {"model": self.run.model, "messages": [{"role": "user", "content": self.prompt()}],
                    "max_tokens": limit, "temperature": 0, "stream": True}
        else:
            body = {"model": self.run.model, "input": self.prompt(), "max_output_tokens": limit, "temperature": 0,
                    "stream": True}
            if route == "/v1/responses":
                body["metadata"] = self.tag("stream_drop")
        began, deadline = time.monotonic(), self.deadline()
        ttft, final, rid = None, None, None
        with self.http.stream("POST", route, json=body) as r:
            self.checked(r)
            if route == "/v1/chat/completions":
                seen = 0
                for _, data in self.sse(r, deadline):
                    seen += 1
                    if isinstance(data, dict) and ttft is None and any(
                            (c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                        ttft = time.monotonic() - began
                    if data == "[DONE]":
                        final = "done"
                    if seen >= stop_after or final:
                        break
            else:
                ttft, final, _, rid, _ = self.read_response_stream(self.sse(r, deadline), began, stop_after=stop_after)
        # Leaving the block closed the connection mid-stream.
        if rid and route == "/v1/responses":
            self.run.created_object("stream_drop", "v1", rid, None if final else "cancelled")
        return {"latency": time.monotonic() - began, "ttft": ttft, "status": "ended" if final else "dropped",
                "output_tokens": 0}

    def sync_timeout(self) -> dict:
        wait = self.rng.uniform(0.5, 3.0)
        tag = self.tag("sync_timeout")
        body = {"model": self.run.model, "input": self.prompt(), "max_output_tokens": self.rng.randint(256, 512),
                "temperature": 0, "metadata": tag}
        began = time.monotonic()
        try:
            r = self.http.post("/v1/responses", json=body, timeout=httpx.Timeout(wait, connect=10))
        except httpx.ReadTimeout:
            with self.run.lock:
                self.run.abandoned_tags.append({"kind": "sync_timeout", "tag": tag["soak"]})
            return {"latency": time.monotonic() - began, "status": "timed_out", "output_tokens": 0}
        resp = self.checked(r).json()
        self.run.created_object("sync_timeout", "v1", resp["id"])
        return {"latency": time.monotonic() - began, "status": "finished:" + resp["status"],
                "output_tokens": resp["usage"]["output_tokens"]}

    # -- the loop --------------------------------------------------------------------

    def loop(self) -> None:
        kinds, weights = list(self.mix), list(self.mix.values())
        try:
            while time.monotonic() < self.run.end and not self.run.hard.is_set():
                kind = self.rng.choices(kinds, weights)[0]
                self.n += 1
                op = {"kind": kind, "client": self.index, "t": time.monotonic() - self.started}
                began = time.monotonic()
                try:
                    op.update(getattr(self, kind)(), outcome="ok")
                except Refused as e:
                    op.update(outcome="refused", retry_after=e.retry_after)
                    self.run.record(op)
                    pause = min(e.retry_after, 10) * self.rng.uniform(0.5, 1.0)
                    self.run.hard.wait(min(pause, max(0.0, self.run.end - time.monotonic())))
                    continue
                except ServerError as e:
                    op.update(outcome="error_5xx", detail=str(e))
                except Rejected as e:
                    op.update(outcome="rejected_4xx", detail=str(e))
                except Abandoned as e:
                    op.update(outcome="abandoned", detail=str(e))
                except Broken as e:
                    op.update(outcome="broken", detail=str(e))
                except httpx.HTTPError as e:
                    op.update(outcome="transport", detail=f"{type(e).__name__}: {e}")
                except Exception as e:  # a reply of the wrong shape, or a bug here
                    op.update(outcome="broken", detail=f"{type(e).__name__}: {e}: "
                              + traceback.format_exc(limit=3).replace("\n", " | ")[-400:])
                op.setdefault("latency", time.monotonic() - began)
                self.run.record(op)
        finally:
            self.http.close()


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


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    mix = MIX if not args.kinds else {k: MIX[k] for k in args.kinds.split(",")}

    tmp = Path(tempfile.mkdtemp(prefix="lmsp-soak-"))
    log = tmp / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lmsp_mlx.serve", "--port", str(port), "--store", str(tmp / "store.sqlite3"),
           "--state-key-file", str(tmp / "state.key"), "--kv-disk-dir", str(tmp / "kv")]
    if args.max_batch:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.kv_memory_mb:
        cmd += ["--kv-memory-mb", f"{args.kv_memory_mb:g}"]
    print(f"server: {' '.join(cmd)}\nlog: {log}", flush=True)
    proc = start(cmd, url, log)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        first = httpx.post(url + "/v1/responses", timeout=300, json={
            "model": model, "input": "Say hi.", "max_output_tokens": 8, "temperature": 0, "store": False})
        print(f"model {model}, first request HTTP {first.status_code}; "
              f"{args.clients} clients for {args.minutes:g} min", flush=True)

        t0 = time.monotonic()
        run = Run(url, model, t0 + 60 * args.minutes, t0 + 60 * args.minutes + args.grace)
        scraper = Scraper(url, proc.pid, args.scrape_every, t0)
        scraper.scrape()
        scraper.start()
        clients = [Client(run, i, args.seed, t0, mix) for i in range(args.clients)]
        threads = [threading.Thread(target=c.loop, name=f"client-{c.index}", daemon=True) for c in clients]
        for t in threads:
            t.start()

        time.sleep(max(0.0, min(args.warmup, 60 * args.minutes - 1)))
        rss_warm = rss_mib(proc.pid)
        at_warm = scraper.scrape()
        print(f"warm-up done at {time.monotonic() - t0:.0f} s: RSS {fmt(rss_warm, 1)} MiB", flush=True)
        while time.monotonic() < run.end:
            time.sleep(min(args.report_every, max(0.0, run.end - time.monotonic())))
            with run.lock:
                done, bad = len(run.ops), sum(o["outcome"] not in ("ok", "refused") for o in run.ops)
            last = scraper.rows[-1] if scraper.rows else {}
            print(f"  {time.monotonic() - t0:5.0f} s: {done} ops, {bad} not ok, batch {last.get('batch_sequences')}, "
                  f"queue {last.get('queue_depth')}, RSS {fmt(last.get('rss_mib'), 1)} MiB (KV "
                  f"{last.get('kv_resident_mib')} MiB in {last.get('kv_sessions')} sessions, MLX active "
                  f"{last.get('mlx_active_mib')} / cache {last.get('mlx_cache_mib')} MiB)", flush=True)
        for t in threads:
            t.join(timeout=max(0.0, run.hard_end - time.monotonic()))
        if any(t.is_alive() for t in threads):
            run.hard.set()
            for t in threads:
                t.join(timeout=30)
        load_end = time.monotonic()
        rss_end = rss_mib(proc.pid)
        at_end = scraper.scrape()
        print(f"clients stopped at {load_end - t0:.0f} s: RSS {fmt(rss_end, 1)} MiB; draining", flush=True)

        drained_at, quiet = None, 0
        while time.monotonic() < load_end + args.drain_timeout:
            row = scraper.scrape()
            if row and row["batch_sequences"] == 0 and row["queue_depth"] == 0:
                quiet += 1
                if quiet >= 2:
                    drained_at = time.monotonic()
                    break
            else:
                quiet = 0
            time.sleep(1)
        scraper.stop.set()
        rss_drained = rss_mib(proc.pid)
        final = scraper.scrape()
        statuses, not_terminal = terminal_check(url, run.created)
        store, store_bad, fate = store_scan(tmp / "store.sqlite3", run.abandoned_tags)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = f"killed after 90 s ({proc.wait()})"
    logged = read_log(log)

    # -- the report ------------------------------------------------------------------
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
        rows.append({
            "kind": kind, "count": len(ops), "ok": out["ok"], "refused_429": out["refused"],
            "errors_5xx": out["error_5xx"], "rejected_4xx": out["rejected_4xx"], "broken": out["broken"],
            "transport": out["transport"], "abandoned": out["abandoned"],
            "errors": out["error_5xx"] + out["rejected_4xx"] + out["broken"] + out["transport"],
            "latency_p50_s": fmt(percentile(lat, 0.5), 3), "latency_p95_s": fmt(percentile(lat, 0.95), 3),
            "ttft_p50_s": fmt(percentile(ttft, 0.5), 3), "ttft_p95_s": fmt(percentile(ttft, 0.95), 3),
            "output_tokens": sum(o.get("output_tokens", 0) for o in ok), "latency_is": LATENCY_IS[kind],
            "statuses": " ".join(f"{k}:{v}" for k, v in sorted(Counter(str(o.get("status")) for o in ok).items())),
        })
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "soak.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    timeline = [r for r in scraper.rows]
    with open(args.out / "soak.timeline.csv", "w", newline="") as f:
        fields = ["t_s", "rss_mib", "kv_resident_mib", "kv_sessions", "mlx_active_mib", "mlx_cache_mib",
                  "batch_sequences", "queue_depth", "busy", "generations", "http_5xx", "http_429", "output_tokens"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(timeline)

    stream_ttft = [o["ttft"] for o in run.ops if o["outcome"] == "ok" and o["kind"] in ("stream_chat", "stream_v1")
                   and o.get("ttft") is not None]
    load_s = load_end - t0
    served = sum(final["requests"].values()) if final else None
    http = final["http"] if final else {}
    http_5xx = sum(v for k, v in http.items() if k >= "500")
    during = [r for r in scraper.rows if at_warm and at_end and at_warm["t_s"] <= r["t_s"] <= at_end["t_s"]]
    rss_series = [r["rss_mib"] for r in during if r["rss_mib"]]
    last_scrape = scraper.rows[-1] if scraper.rows else {}
    max_kv = max((r["kv_resident_mib"] for r in scraper.rows), default=None)
    growth = (rss_end / rss_warm - 1) if rss_warm and rss_end else None
    tokens = (at_end["output_tokens"] - scraper.rows[0]["output_tokens"]) if at_end and scraper.rows else None
    client_5xx = sum(v for k, v in run.codes.items() if k >= 500)
    kv_files = list((tmp / "kv").rglob("*.safetensors"))

    md = [f"# Soak run: {args.clients} clients, {args.minutes:g} min, seed {args.seed}", "",
          f"Server log: `{log}` (store, KV and key in `{tmp}`).", "",
          "| kind | ops | ok | 429 | 5xx | other 4xx | broken | transport | abandoned | p50 s | p95 s | "
          "TTFT p50 s | TTFT p95 s | latency is | final statuses (ok ops) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        md.append(f"| {r['kind']} | {r['count']} | {r['ok']} | {r['refused_429']} | {r['errors_5xx']} | "
                  f"{r['rejected_4xx']} | {r['broken']} | {r['transport']} | {r['abandoned']} | {r['latency_p50_s']} | "
                  f"{r['latency_p95_s']} | {r['ttft_p50_s']} | {r['ttft_p95_s']} | {r['latency_is']} | "
                  f"{r['statuses']} |")
    target = lambda good: "ok" if good else "**MISSED**"  # noqa: E731
    md += ["", "| measure | value | target |", "|---|---:|---|",
           f"| client operations (all kinds) | {len(run.ops)} in {load_s:.0f} s | |",
           f"| generations served (`lmsp_requests_total`) | {served} "
           f"({', '.join(f'{k} {v}' for k, v in sorted((final or {}).get('requests', {}).items()))}) | |",
           f"| HTTP replies (`lmsp_http_responses_total`) | "
           f"{', '.join(f'{k}: {v}' for k, v in sorted(http.items()))} | |",
           f"| 5xx (server metric / seen by clients) | {http_5xx} / {client_5xx} | 0: {target(http_5xx == 0 == client_5xx)} |",
           f"| 429 refusals seen by clients | {run.codes.get(429, 0)} | expected under load |",
           f"| output tokens during the load (metric) | {tokens} ({fmt(tokens / load_s if tokens else None, 1)} tok/s) | |",
           f"| p95 time to first token, streams (chat + /v1, {len(stream_ttft)}) | "
           f"{fmt(percentile(stream_ttft, 0.95), 3)} s (p50 {fmt(percentile(stream_ttft, 0.5), 3)} s) | |",
           f"| peak batch sequences / queue depth (scrapes) | "
           f"{max((r['batch_sequences'] for r in scraper.rows), default=None)} / "
           f"{max((r['queue_depth'] for r in scraper.rows), default=None)} | |",
           f"| RSS at warm-up end ({args.warmup:g} s) / end of load / drained | {fmt(rss_warm, 1)} / {fmt(rss_end, 1)} / "
           f"{fmt(rss_drained, 1)} MiB | |",
           f"| RSS change, warm-up end to end of load | {fmt(100 * growth if growth is not None else None, 1)} % "
           f"(range in between {fmt(min(rss_series, default=None), 1)}-{fmt(max(rss_series, default=None), 1)} MiB) | "
           f"within 10%: {target(growth is not None and abs(growth) <= 0.10)} |",
           f"| drained (batch 0, queue 0) | "
           f"{'after ' + fmt(drained_at - load_end, 1) + ' s' if drained_at else 'NOT within ' + str(args.drain_timeout) + ' s'}"
           f" (last scrape: batch {(final or {}).get('batch_sequences')}, queue {(final or {}).get('queue_depth')}) | "
           f"{target(drained_at is not None)} |",
           f"| objects created and fetched again | {len(run.created)} ({len(not_terminal)} not terminal) | "
           f"0 not terminal: {target(not not_terminal)} |",
           f"| store scan: responses / tasks | {sum(store['responses'].values())} / {sum(store['tasks'].values())} "
           f"({len(store_bad)} not terminal) | 0: {target(not store_bad)} |",
           f"| sync requests the client timed out, in the store | "
           f"{', '.join(f'{k} {v}' for k, v in sorted(fate.items())) or 'none'} | cancelled |",
           f"| tracebacks in the server log | {logged['tracebacks']} | 0: {target(logged['tracebacks'] == 0)} |",
           f"| ERROR lines in the server log | {len(logged['errors'])} | 0 |",
           f"| server exit after SIGINT | {code} | 0 |",
           ""]
    md += ["## KV cache (from the log)", "",
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
           f"the sessions pushed out of `--kv-memory-mb` ({args.kv_memory_mb or 'default 2048'} MiB). Running "
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
        for s in logged["traceback_samples"]:
            md += ["```", s, "```"]
    if run.problems:
        md += ["", f"## Client-side problems ({len(run.problems)}, first 20)", ""]
        md += [f"- {p}" for p in run.problems[:20]]
    if not_terminal or store_bad:
        md += ["", "## Not terminal", ""] + [f"- {b}" for b in (not_terminal + store_bad)[:30]]
    md += ["", "## Statuses on the final GET, per kind", ""]
    md += [f"- {kind}: {', '.join(f'{k} {v}' for k, v in sorted(c.items()))}" for kind, c in statuses.items()]
    md += [f"- store: responses {dict(store['responses'])}; tasks {dict(store['tasks'])}"]
    text = "\n".join(md) + "\n"
    (args.out / "soak.md").write_text(text)
    print("\n" + text)
    print(f"wrote {args.out / 'soak.csv'}, {args.out / 'soak.timeline.csv'}, {args.out / 'soak.md'}; "
          f"server log kept at {log}")


if __name__ == "__main__":
    main()
