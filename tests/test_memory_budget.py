"""One memory budget (--memory-budget-mb) for a model's weights, the KV of its running
sequences and its resident KV sessions: a sequence joins the batch only when its KV,
grown to its output limit, fits; until then it waits (and is served); the resident
sessions give way first; a request that could never fit is a 507 naming both figures.

The tiny model's figures, measured at load as the server measures them: 431,360 bytes of
weights, and a KV of 128 KiB per 256 tokens."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from tests.helpers import HTTP, ask
from tests.test_families import on_the_mlx_runner
from tests.tiny_model import ENDLESS, FAMILIES, build_tiny_family_model

from lmsp_mlx.engine.footprint import estimate_bytes, kv_growth
from lmsp_mlx.engine.loader import check_model_dir, load_model

MiB = 2**20
LONG = 2000  # output tokens: a few tenths of a second on the tiny model, long enough for the others to arrive


@pytest.fixture(scope="module")
def figures(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    weights = estimate_bytes(tiny_model_dir, check_model_dir(tiny_model_dir), "cpu")
    return weights, kv_growth(lm)


@pytest.fixture(scope="module")
def tight(start_module_server, tiny_model_dir, figures):
    """Room beside the weights for two sequences of LONG output tokens, not three."""
    weights, kv = figures
    need = kv.bytes_for(len(ENDLESS) + LONG + 64)
    budget = weights + 2 * need + need // 2
    # The in-process server shares this process with pytest and its clients, whose memory
    # is not the server's: the budget counts what the model holds only (tests/servers.py).
    server = start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny",
                                 "--memory-budget-mb", f"{budget / MiB:.6f}")
    server.budget, server.need = budget, need
    return server


@pytest.fixture(scope="module")
def roomy(start_module_server, tiny_model_dir, figures):
    """A budget with 160 MiB beside the weights, counting the whole process (the server's
    default; this process's other memory holds still while the test runs)."""
    weights, _ = figures
    budget = weights + 160 * MiB
    server = start_module_server("--model", str(tiny_model_dir), "--model-id", "tiny",
                                 "--memory-budget-mb", f"{budget / MiB:.6f}", "--memory-budget-scope", "process")
    return server


def metrics(server) -> dict[str, float]:
    out = {}
    for line in HTTP.get(server.url + "/metrics").text.splitlines():
        if line.startswith("lmsp_memory"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_requests_beyond_the_budget_wait_their_turn_and_all_answer(tight, figures):
    weights, _ = figures
    results: list[int] = []

    def one():
        r = HTTP.post(tight.url + "/lmsp/v1/responses", json=ask(max_output_tokens=LONG), timeout=120)
        results.append(r.status_code)

    # Two run (each stream's first delta has come), then two more ask: they wait their turn.
    with HTTP.stream("POST", tight.url + "/lmsp/v1/responses", timeout=60,
                     json=ask(max_output_tokens=LONG, stream=True)) as a, \
            HTTP.stream("POST", tight.url + "/lmsp/v1/responses", timeout=60,
                        json=ask(max_output_tokens=LONG, stream=True)) as b:
        streams = [r.iter_lines() for r in (a, b)]  # kept: a closed line iterator closes its stream
        for lines in streams:
            next(line for line in lines if "output_text.delta" in line)
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for lines in streams:
            assert any("response.completed" in line or "response.incomplete" in line for line in lines)
    assert results == [200] * 2
    m = metrics(tight)
    # The third waited for one of the two; the fourth too, unless both ended at the same step.
    assert m["lmsp_memory_waits_total"] in (1, 2)
    assert m["lmsp_memory_budget_bytes"] == pytest.approx(tight.budget, abs=1)
    assert m['lmsp_memory_held_bytes{kind="weights"}'] == weights
    log = tight.log()
    assert log.count("memory: a request waits for memory") == m["lmsp_memory_waits_total"]
    # The finished sessions stay resident until a waiting request needs their room.
    assert "memory budget: evicting a session" in log


def test_a_request_that_could_never_fit_is_a_507_naming_both_figures(tight):
    r = HTTP.post(tight.url + "/lmsp/v1/responses", json=ask(max_output_tokens=12_000), timeout=60)
    assert r.status_code == 507, r.text
    detail = r.json()["detail"]
    assert "KV cache grows to about" in detail and "of the" in detail and "memory budget" in detail
    ok = HTTP.post(tight.url + "/lmsp/v1/responses", json=ask(), timeout=60)  # the server goes on
    assert ok.status_code == 200
    chat = HTTP.post(tight.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": ENDLESS}], "max_tokens": 12_000})
    assert chat.status_code == 507 and chat.json()["error"]["code"] == "insufficient_memory"


def test_a_request_with_no_output_limit_gets_what_the_budget_holds(tight):
    """Not a 507: a reply that sets no limit may grow only as far as memory allows alone."""
    body = ask()
    del body["max_output_tokens"]
    r = HTTP.post(tight.url + "/lmsp/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "incomplete"  # the endless reply ran into the room it had
    assert "memory: a request with no output limit may write up to" in tight.log()
    written = out["usage"]["output_tokens"]
    assert 0 < written and f"may write up to {written} tokens" in tight.log()


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_familys_kv_growth_is_measured_on_the_mlx_runner(arch, tmp_path):
    """The load's probe takes every cache kind: a KV cache grows with the tokens, a recurrent
    state or a sliding window holds a fixed part."""
    patch = on_the_mlx_runner()
    try:
        lm = load_model(build_tiny_family_model(tmp_path / arch, arch))
    finally:
        patch.undo()
    kv = kv_growth(lm)
    assert kv.fixed > 0 and kv.bytes_for(4096) >= kv.bytes_for(256) >= kv.fixed
    if arch in ("llama", "deepseek_v3"):  # only full-attention caches: they grow block by block
        assert kv.per_token > 0 and kv.bytes_for(257) > kv.bytes_for(256)


def test_the_processs_memory_outside_mlx_takes_room_from_the_budget(roomy):
    """Memory the process grew outside MLX's (here 512 MiB this process holds, as a server's
    requests, store and objects would) leaves no room for a second sequence: it waits for the
    first to end. Once that memory is freed, two run at once again."""
    def while_one_runs(then):
        with HTTP.stream("POST", roomy.url + "/lmsp/v1/responses", timeout=60,
                         json=ask(max_output_tokens=20_000, stream=True)) as first:
            lines = first.iter_lines()  # kept: a closed line iterator closes the stream
            next(line for line in lines if "output_text.delta" in line)  # it runs
            return then()

    # Freed memory: two sequences run at once, none waits.
    waits = metrics(roomy)["lmsp_memory_waits_total"]
    second = while_one_runs(lambda: HTTP.post(roomy.url + "/lmsp/v1/responses", json=ask(), timeout=60))
    assert second.status_code == 200 and metrics(roomy)["lmsp_memory_waits_total"] == waits

    ballast = np.ones(512 * MiB, dtype=np.uint8)  # touched: resident
    results: list[int] = []

    def second_waits():
        asked = threading.Thread(target=lambda: results.append(
            HTTP.post(roomy.url + "/lmsp/v1/responses", json=ask(), timeout=60).status_code))
        asked.start()
        deadline = time.monotonic() + 30
        while metrics(roomy)["lmsp_memory_waits_total"] == waits and time.monotonic() < deadline:
            time.sleep(0.05)
        held = metrics(roomy)
        return asked, held  # the first ends as its stream closes: then the second runs

    asked, held = while_one_runs(second_waits)
    asked.join()
    assert results == [200]
    assert held["lmsp_memory_waits_total"] == waits + 1
    assert held['lmsp_memory_held_bytes{kind="host"}'] >= 450 * MiB
    assert "host growth" in roomy.log()
    del ballast

    after = while_one_runs(lambda: HTTP.post(roomy.url + "/lmsp/v1/responses", json=ask(), timeout=60))
    assert after.status_code == 200 and metrics(roomy)["lmsp_memory_waits_total"] == waits + 1
