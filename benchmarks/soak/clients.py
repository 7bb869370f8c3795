"""The soak's clients: what they share (Run), and one client thread's loop over the request
kinds (Client), each kind a method named as in MIX that returns what it measured or raises
what went wrong (Refused, ServerError, Rejected, Broken, Abandoned)."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator

import httpx

from benchmarks.common import SseEvent, sse_events
from benchmarks.soak.prompts import ASKS, CITIES, NOTES, SHORT_PROMPTS, WEATHER

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

    def sse(self, r: httpx.Response, deadline: float) -> Iterator[SseEvent]:
        """(event name, parsed data) for each event of an SSE reply; raw strings for non-JSON
        data. Past `deadline`, or at the run's hard stop, reading it raises."""
        return sse_events(r.iter_lines(), lambda: self.check_time(deadline))

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
