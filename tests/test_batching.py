"""Many requests at once: the worker decodes them together, each on its own KV session
with its own settings, and each gets the tokens it gets alone.

Tolerance of the token comparisons: none. On these models the batched step (the CPU's
compiled `batch_step`) sums every row in the same order as the one-sequence step, so a
sequence's logits are bitwise the ones it gets alone (tests/test_cpu_decode.py checks
that); no near-tie can flip.
"""

from __future__ import annotations

import re
import signal
import threading

import httpx
import pytest
from tests.helpers import HTTP, ask, read_sse
from tests.test_engine import BusyStream, wait_for_metric
from tests.tiny_model import CALLS, ENDLESS, FINISHES, TOOL_SCRIPT, build_scripted_model

from lmsp_mlx.engine.batch import Batch, chunk_size, generate, next_prefill
from lmsp_mlx.engine.constrain import Constraint
from lmsp_mlx.engine.generate import GenerationParams, Penalties
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.sequence import Phase, Sequence
from mlx_lm.models.cache import make_prompt_cache


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


def settings(lm) -> list[GenerationParams]:
    """Prompts of different lengths, each with other settings: greedy, seeded sampling with
    top_p, penalties and logit_bias, a grammar, a prompt several chunks long."""
    enc = lambda text: list(lm.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return [
        GenerationParams(prompt=enc(ENDLESS), max_tokens=20, temperature=0.0),
        GenerationParams(prompt=enc("a seeded one " * 3), max_tokens=20, temperature=1.5, top_p=0.9, seed=7),
        GenerationParams(prompt=enc("penalised"), max_tokens=16, temperature=0.0,
                         penalties=Penalties(presence=0.5, frequency=0.3, bias=((40, 5.0),))),
        GenerationParams(prompt=enc("yes or no?"), max_tokens=12, temperature=0.0,
                         constraint=Constraint(lm.tokenizer, 'start: ("yes" | "no")+')),
        GenerationParams(prompt=enc("long " * 300), max_tokens=10, temperature=0.0, prefill_step=64),
    ]


def alone(lm, params: GenerationParams) -> list[int]:
    sampled: list[int] = []
    generate(lm, params, emit=lambda e: None, sampled=sampled)
    return sampled


def together(lm, seqs: list[Sequence]) -> dict[Sequence, Exception]:
    """Step the sequences as the worker does (one prompt chunk, then one decode step for
    all) until each is done."""
    failed: dict[Sequence, Exception] = {}
    batch = Batch(lm)
    while live := [s for s in seqs if s.phase is not Phase.DONE and s not in failed]:
        if (s := next_prefill(live)) is not None:
            s.prefill_chunk(chunk_size(s, s.params.prefill_step, len(live) > 1))
        failed |= batch.step([s for s in live if s.phase is Phase.DECODE])
        for s in seqs:
            if s.phase is Phase.DONE or s in failed:
                batch.release(s)
    return failed


def test_a_short_request_prefills_whole_and_a_long_prompt_yields_in_half_chunks(tiny_lm):
    """The schedule behind a short request's first token while a long prompt prefills: the
    long one runs half chunks beside others, so the short one that arrives waits for at
    most half a chunk of it, then prefills whole (no decode step between its chunks)."""
    enc = tiny_lm.tokenizer.encode
    new = lambda text, n: Sequence(tiny_lm, GenerationParams(prompt=enc(text * n)[:n], max_tokens=4,  # noqa: E731
                                                             temperature=0.0, prefill_step=64),
                                   make_prompt_cache(tiny_lm.model), emit=lambda e: None)
    long = new("long ", 400)
    assert chunk_size(long, 64, others=False) == 64
    assert chunk_size(long, 64, others=True) == 32
    long.prefill_chunk(chunk_size(long, 64, others=False))  # alone: a whole chunk
    short = new("short ", 100)  # arrives now: 100 tokens, under 2 chunks
    assert chunk_size(short, 64, others=True) == short.to_prefill
    seqs, batch, long_before = [long, short], Batch(tiny_lm), None
    while short.first is None:
        s = next_prefill(seqs)
        done = long.cursor
        s.prefill_chunk(chunk_size(s, 64, others=True))
        if long_before is None and s is short:
            long_before = done
        batch.step([x for x in seqs if x.phase is Phase.DECODE])
    assert long_before == 64  # the short one took the next chunk: SRPT, nothing of the long one in between
    assert long.cursor == 64 and short.phase is Phase.DECODE
    while long.phase is Phase.PREFILL:  # then the long one advances half a chunk per step
        before = long.cursor
        long.prefill_chunk(chunk_size(long, 64, others=True))
        assert 0 < long.cursor - before <= 32


def test_each_sequence_of_a_batch_gets_the_tokens_it_gets_alone(tiny_lm):
    expected = [alone(tiny_lm, p) for p in settings(tiny_lm)]  # each constraint is fresh: settings() again below
    seqs = [Sequence(tiny_lm, p, make_prompt_cache(tiny_lm.model), emit=lambda e: None) for p in settings(tiny_lm)]
    assert together(tiny_lm, seqs) == {}
    assert [s.sampled for s in seqs] == expected
    assert all(len(s.sampled) > 1 for s in seqs)
    grammar = tiny_lm.tokenizer.decode(seqs[3].sampled)
    assert re.fullmatch(r"(yes|no)+", grammar.replace("<|im_end|>", "")), grammar


def test_through_mlx_the_merged_batch_gives_the_tokens_each_gets_alone(tiny_model_dir, monkeypatch, caplog):
    """Without the compiled step (as on Metal and CUDA) the sequences' KVCaches are merged
    into mlx-lm's BatchKVCache. Tolerance: the padded batch sums in another order, so the
    logits differ in the last bits; the tiny model's greedy tokens have no near-tie."""
    monkeypatch.setenv("LMSP_CPU_DECODE", "0")
    lm = load_model(tiny_model_dir)
    assert lm.runner.batch is None
    params = [p for p in settings(lm) if p.constraint is None]
    expected = [alone(lm, p) for p in params]
    seqs = [Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None) for p in params]
    with caplog.at_level("INFO", logger="lmsp_mlx.engine"):
        assert together(lm, seqs) == {}
    assert [s.sampled for s in seqs] == expected
    assert "steps outside the batch" not in caplog.text
    assert all(type(c).__name__ == "KVCache" for s in seqs for c in s.cache)  # handed back as each one's own


def test_an_unseeded_sequence_beside_a_seeded_one_leaves_it_unchanged(tiny_lm):
    seeded, free = settings(tiny_lm)[1], settings(tiny_lm)[1]
    free.seed = None
    expected = alone(tiny_lm, seeded)
    seqs = [Sequence(tiny_lm, p, make_prompt_cache(tiny_lm.model), emit=lambda e: None)
            for p in (free, settings(tiny_lm)[1])]
    assert together(tiny_lm, seqs) == {}
    assert seqs[1].sampled == expected


def test_a_sequence_that_fails_fails_alone(tiny_lm):
    params = settings(tiny_lm)
    expected = [alone(tiny_lm, p) for p in params[:3]]

    def broken(event):
        raise RuntimeError("a client callback broke")

    seqs = [Sequence(tiny_lm, p, make_prompt_cache(tiny_lm.model), emit=lambda e: None) for p in settings(tiny_lm)[:3]]
    bad = Sequence(tiny_lm, settings(tiny_lm)[0], make_prompt_cache(tiny_lm.model), emit=broken)
    failed = together(tiny_lm, [seqs[0], bad, *seqs[1:]])
    assert list(failed) == [bad] and "callback broke" in str(failed[bad])
    assert [s.sampled for s in seqs] == expected


# -- through the server ------------------------------------------------------------------------

def reply(url: str, body: dict) -> dict:
    r = HTTP.post(url + "/lmsp/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])


def test_concurrent_requests_get_what_they_get_alone_and_decode_together(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-batch", "4", "--no-kv-disk")
    # Long enough that four decode together for a while: the poll below must see them at once.
    bodies = [ask(f"{ENDLESS} {i}" * (1 + i), max_output_tokens=240 + 4 * i) for i in range(6)]
    first = [reply(server.url, b) for b in bodies]  # one at a time
    got: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, reply(server.url, bodies[i]))) for i in range(6)]
    busy = BusyStream(server.url)  # keeps the batch occupied while they run
    busy.start()
    try:
        assert busy.generating.wait(timeout=60)
        for t in threads:
            t.start()
        wait_for_metric(server, "lmsp_batch_sequences 4")  # the stream and three of them; two wait
        for t in threads:
            t.join(timeout=120)
    finally:
        busy.stop()
    assert [text_of(got[i]) for i in range(6)] == [text_of(r) for r in first]
    assert all(text_of(r) for r in first)


def test_a_disconnect_mid_batch_frees_its_slot_and_the_others_go_on(tiny_server):
    body = ask(FINISHES + " and more", max_output_tokens=40)
    expected = text_of(reply(tiny_server.url, body))
    got: dict[int, dict] = {}
    others = [threading.Thread(target=lambda i=i: got.__setitem__(i, reply(tiny_server.url, body))) for i in range(2)]
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        with c.stream("POST", "/lmsp/v1/responses", json=ask(max_output_tokens=30000, stream=True)) as r:
            for t in others:
                t.start()
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: response.output_text.delta")
                if deltas == 5:
                    break  # leaves while the others decode beside it
    for t in others:
        t.join(timeout=120)
    assert [text_of(got[i]) for i in range(2)] == [expected, expected]
    wait_for_metric(tiny_server, "lmsp_batch_sequences 0")


def test_beyond_the_batch_requests_wait_and_beyond_the_queue_get_429(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-batch", "2", "--max-queue", "1")
    streams = [BusyStream(server.url) for _ in range(2)]
    waiting: dict = {}
    waiter = threading.Thread(target=lambda: waiting.setdefault("r", reply(server.url, ask(FINISHES))))
    try:
        for s in streams:
            s.start()
            assert s.generating.wait(timeout=60)
        wait_for_metric(server, "lmsp_batch_sequences 2")
        waiter.start()
        wait_for_metric(server, "lmsp_queue_depth 1")
        r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(FINISHES), timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["code"] == "queue_full"
    finally:
        for s in streams:
            s.stop()
    waiter.join(timeout=60)
    assert waiting["r"]["status"] == "completed"


class Endless(threading.Thread):
    """A text completion that ignores end-of-turn (vLLM's ignore_eos) and runs until
    `stop()`: a sequence that keeps decoding beside the others, whatever the model says."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__()
        self.body = {"model": model, "prompt": "go\n", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        self.url = url
        self._finish = threading.Event()

    def run(self) -> None:
        with HTTP.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
            for _ in r.iter_lines():
                if self._finish.is_set():
                    return

    def stop(self) -> None:
        self._finish.set()
        self.join(timeout=60)


def test_a_tool_loop_continues_its_live_state_while_others_decode(start_server, tmp_path):
    from tests.test_tools import TOOLS, outputs_for

    model = build_scripted_model(tmp_path / "caller", script=TOOL_SCRIPT, words=CALLS)
    server = start_server("--model", str(model), "--model-id", "tiny", "--kv-checkpoint-min-tokens", "8")
    busy = [Endless(server.url, "tiny") for _ in range(2)]
    try:
        for b in busy:
            b.start()
        wait_for_metric(server, "lmsp_batch_sequences 2")
        ask_ = {"model": "tiny", "temperature": 0, "max_output_tokens": 40, "tools": TOOLS}
        first = reply(server.url, {**ask_, "input": "Weather and time in Paris?"})
        calls = [i for i in first["output"] if i["type"] == "function_call"]
        assert len(calls) == 2, first["output"]
        second = reply(server.url, {**ask_, "input": outputs_for(calls)})  # tool outputs alone: by call id
        assert second["usage"]["input_tokens_details"]["cached_tokens"] == (
            first["usage"]["input_tokens"] + first["usage"]["output_tokens"])  # its end-of-turn token comes next
        log = server.log()
        assert "lmsp_kv_live_continuations_total 1" in HTTP.get(server.url + "/metrics").text.splitlines()
        assert "kv checkpoint reason=tool-call" in log  # written while the two others decoded
        assert "lmsp_batch_sequences 2" in HTTP.get(server.url + "/metrics").text.splitlines()  # still running
    finally:
        for b in busy:
            b.stop()


@pytest.mark.slow
def test_shutdown_with_a_full_batch_ends_every_stream_cancelled_and_checkpoints(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-batch", "3", process=True)
    results: dict[int, list[dict]] = {}
    ready = [threading.Event() for _ in range(3)]

    def stream(i: int) -> None:
        with HTTP.stream("POST", server.url + "/lmsp/v1/responses", timeout=60,
                          json=ask(f"{ENDLESS} {i}", max_output_tokens=30000, stream=True)) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("event: response.output_text.delta"):
                    ready[i].set()
        results[i] = read_sse(lines)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(timeout=60) for e in ready)
    wait_for_metric(server, "lmsp_batch_sequences 3")
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    assert [results[i][-1]["event"] for i in range(3)] == ["response.cancelled"] * 3
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert log.count("status=cancelled") == 3 and log.count("kv checkpoint reason=shutdown") == 3, log[-3000:]
    assert "Traceback" not in log


def test_the_default_output_limit_applies_where_a_request_sets_none(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--max-output-tokens", "7")
    unset = reply(server.url, {"model": "tiny", "input": ENDLESS, "temperature": 0})
    assert unset["status"] == "incomplete" and unset["usage"]["output_tokens"] == 7
    assert unset["incomplete_details"]["reason"] == "max_output_tokens"
    assert reply(server.url, ask(max_output_tokens=12))["usage"]["output_tokens"] == 12  # a request's own limit wins
    # (the listing also holds the model store's models: models/ gets the default model once a run fetched it)
    [model] = [m for m in HTTP.get(server.url + "/lmsp/v1/models").json()["data"] if m["id"] == "tiny"]
    assert model["default_max_output_tokens"] == 7
    chat = HTTP.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": ENDLESS}], "temperature": 0}).json()
    assert chat["usage"]["completion_tokens"] == 7 and chat["choices"][0]["finish_reason"] == "length"
