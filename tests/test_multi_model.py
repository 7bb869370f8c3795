"""Several models from one server, loaded on demand (engine/models.py): the listing, loads
and LRU eviction with the evicted model's KV checkpointed, per-model KV reuse after a
switch, fair turns, idle unloads, pinning, the admin routes, and the refusals (memory, a
broken model) that fail one request and leave the loaded models serving."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
from tests.helpers import HTTP, ask
from tests.tiny_model import ENDLESS
from tests.tiny_model import build_tiny_model

LONG = " ".join(["Tell me about the weather in Paris and in Rome."] * 8)


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("second") / "second", seed=12)


def listing(server) -> dict[str, dict]:
    return {m["id"]: m for m in HTTP.get(server.url + "/lmsp/v1/models").json()["data"]}


def respond(server, model: str, text: str = ENDLESS, tokens: int = 4, **fields) -> httpx.Response:
    return HTTP.post(server.url + "/lmsp/v1/responses", timeout=120,
                      json=ask(text, model=model, max_output_tokens=tokens, **fields))


def wait_until(check, timeout: float = 20.0) -> None:
    """The state a background timer (--keep-alive) brings about, within `timeout`."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.1)


def test_a_request_for_another_model_loads_it_evicting_the_idle_one(start_server, tiny_model_dir, second_dir,
                                                                     tmp_path):
    server = start_server("--model", str(tiny_model_dir), "--model", str(second_dir), "--keep-alive", "-1",
                          "--models-dir", str(tmp_path / "store"))
    models = listing(server)
    assert list(models)[:2] == ["tiny", "second"]
    assert models["tiny"]["loaded"] is True and models["second"] == {
        "id": "second", "object": "model", "reasoning": False, "loaded": False, "state": "unloaded", "pinned": False}
    first = respond(server, "tiny", LONG)
    assert first.status_code == 200, first.text
    switched = respond(server, "second", LONG)
    assert switched.status_code == 200 and switched.json()["model"] == "second", switched.text
    models = listing(server)
    assert models["second"]["loaded"] is True and models["tiny"]["loaded"] is False
    log = server.log()
    assert "model tiny: unloaded, evicted for second (KV sessions checkpointed" in log
    # Back to the first: its session comes back from the checkpoint its eviction wrote.
    back = respond(server, "tiny", LONG)
    assert back.status_code == 200
    assert back.json()["usage"]["input_tokens_details"]["cached_tokens"] >= first.json()["usage"]["input_tokens"] - 1
    assert HTTP.get(server.url + "/v1/models").json()["data"][0] == {
        "id": "tiny", "object": "model", "created": 0, "owned_by": "lmsp-mlx", "loaded": True,
        "type": "model", "display_name": "tiny", "created_at": "1970-01-01T00:00:00Z"}  # and Anthropic's fields


def test_work_for_two_models_alternates_and_one_load_serves_both_requests(start_server, tiny_model_dir, second_dir):
    server = start_server("--model", str(tiny_model_dir), "--model", str(second_dir), "--keep-alive", "-1")
    results: dict[str, httpx.Response] = {}

    def send(name: str, model: str, tokens: int) -> None:
        results[name] = respond(server, model, tokens=tokens)

    threads = [threading.Thread(target=send, args=("a1", "tiny", 60))]
    threads[0].start()
    time.sleep(0.3)  # a1 runs on tiny; the next ones come while it does
    for name, model in (("b1", "second"), ("b2", "second"), ("a2", "tiny")):
        threads.append(threading.Thread(target=send, args=(name, model, 4)))
        threads[-1].start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=120)
    assert {k: r.status_code for k, r in results.items()} == {"a1": 200, "b1": 200, "b2": 200, "a2": 200}
    log = server.log()
    assert log.count("model second: loading on demand") == 1  # two requests, one load
    # a2 came while second's requests waited for room: it waited its turn (tiny took no new
    # work), so second was loaded, served, and evicted again for it.
    assert log.index("model second: loaded in") < log.index("model second: unloaded, evicted for tiny")


@pytest.mark.slow  # waits out a 1 s keep-alive, then 2 s more
def test_an_idle_model_unloads_after_keep_alive_and_a_pinned_one_stays(start_server, tiny_model_dir, second_dir,
                                                                       tmp_path):
    server = start_server("--model", str(tiny_model_dir), "--model", str(second_dir), "--keep-alive", "1s",
                          "--max-loaded-models", "2")
    assert respond(server, "second").status_code == 200
    assert listing(server)["second"]["loaded"] is True
    wait_until(lambda: not listing(server)["second"]["loaded"])
    wait_until(lambda: not listing(server)["tiny"]["loaded"])
    # A retiring model is listed unloaded while the worker still checkpoints it: its line follows.
    server.wait_for_log("model second: unloaded, idle for 1 s (--keep-alive)")
    assert respond(server, "tiny").status_code == 200  # and loads again when asked
    shutil.copytree(second_dir, tmp_path / "store" / "other")
    pinned = start_server("--model", str(tiny_model_dir), "--keep-alive", "1s", "--pin",
                          "--models-dir", str(tmp_path / "store"))
    assert respond(pinned, "tiny").status_code == 200
    time.sleep(2.0)
    assert listing(pinned)["tiny"] | {} and listing(pinned)["tiny"]["loaded"] is True
    assert listing(pinned)["tiny"]["pinned"] is True
    # The pinned model takes the one place: another is refused for that, not for memory.
    other = respond(pinned, "other")
    assert other.status_code == 503 and other.json()["code"] == "model_limit_reached", other.text
    assert "--max-loaded-models 1" in other.json()["detail"] and other.json()["param"] == "model"
    kept = HTTP.post(pinned.url + "/lmsp/v1/models/tiny/unload", timeout=60)
    assert kept.status_code == 400 and kept.json()["param"] == "model" and "pinned" in kept.json()["detail"]


def test_the_admin_routes_load_and_unload_with_the_admin_scope(start_server, tiny_model_dir, second_dir, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"writer": ["responses:write", "models:read"], "root": ["admin", "models:read"]}))
    server = start_server("--model", str(tiny_model_dir), "--model", str(second_dir), "--tokens", str(tokens),
                          "--keep-alive", "-1")
    writer, root = {"Authorization": "Bearer writer"}, {"Authorization": "Bearer root"}
    refused = HTTP.post(server.url + "/lmsp/v1/models/second/load", headers=writer)
    assert refused.status_code == 403 and refused.json()["code"] == "insufficient_scope"
    loaded = HTTP.post(server.url + "/lmsp/v1/models/second/load", headers=root, timeout=60)
    assert loaded.status_code == 200 and loaded.json()["loaded"] is True and loaded.json()["context_length"] == 32768
    gone = HTTP.post(server.url + "/lmsp/v1/models/second/unload", headers=root, timeout=60)
    assert gone.status_code == 200 and gone.json()["loaded"] is False
    missing = HTTP.post(server.url + "/lmsp/v1/models/nope/load", headers=root)
    assert missing.status_code == 404 and missing.json()["code"] == "model_not_found"
    openapi = HTTP.get(server.url + "/lmsp/v1/openapi.json", headers=root).json()
    assert {"/lmsp/v1/models/{model_id}/load", "/lmsp/v1/models/{model_id}/unload"} <= set(openapi["paths"])


def test_a_model_that_cannot_fit_or_load_fails_its_request_alone(start_server, tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    wide = build_tiny_model(store / "wide", head_dim=64)  # larger weights than tiny's
    broken = store / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    tiny_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert (wide / "model.safetensors").stat().st_size > 1.5 * tiny_bytes
    budget = 1.3 * tiny_bytes / 2**20  # tiny fits, wide does not even alone
    server = start_server("--model", str(tiny_model_dir), "--models-dir", str(store), "--memory-budget-mb",
                          f"{budget:.3f}", "--keep-alive", "-1")
    assert set(listing(server)) >= {"tiny", "wide", "broken"}
    too_big = respond(server, "wide")
    assert too_big.status_code == 507 and too_big.json()["code"] == "insufficient_memory", too_big.text
    assert "wide needs about" in too_big.json()["detail"] and too_big.json()["param"] == "model"
    failed = respond(server, "broken")
    assert failed.status_code == 503 and failed.json()["code"] == "model_load_failed", failed.text
    assert "broken" in failed.json()["detail"]
    served = respond(server, "tiny")
    assert served.status_code == 200 and listing(server)["tiny"]["loaded"] is True


def test_a_stream_starts_while_its_model_loads_with_keep_alives(start_server, tiny_model_dir, second_dir, tmp_path):
    store = tmp_path / "store"
    build_tiny_model(store / "wide", head_dim=64)
    budget = 1.3 * (tiny_model_dir / "model.safetensors").stat().st_size / 2**20
    server = start_server("--model", str(tiny_model_dir), "--model", str(second_dir), "--keep-alive", "-1",
                          "--sse-keepalive", "0.001", "--models-dir", str(store), "--memory-budget-mb", f"{budget:.3f}")
    with HTTP.stream("POST", server.url + "/lmsp/v1/responses", timeout=120,
                      json=ask(model="second", max_output_tokens=4, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    # The load (tokenizer, weights, compiled CPU paths) takes far longer than 10 ms.
    assert lines.index(": keep-alive") < next(i for i, l in enumerate(lines) if l.startswith("event: response.created"))
    assert any(l in ("event: response.completed", "event: response.incomplete") for l in lines), lines[-6:]
    # A refusal after the stream began is its error event: Open Responses' error, then [DONE].
    with HTTP.stream("POST", server.url + "/v1/responses", timeout=120,
                      json={"model": "wide", "input": "Hi", "stream": True}) as r:
        assert r.status_code == 200
        data = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: {")]
        assert data[-1]["type"] == "error" and data[-1]["code"] == "insufficient_memory"
    # On LMSP, section 6.3's order: created, then the one final event.
    with HTTP.stream("POST", server.url + "/lmsp/v1/responses", timeout=120,
                      json=ask(model="wide", max_output_tokens=4, stream=True)) as r:
        names = [l[7:] for l in r.iter_lines() if l.startswith("event: ")]
    assert names == ["response.created", "response.failed"], names


@pytest.mark.parametrize("argv, needle", [
    (["--keep-alive", "soon"], "is not a duration"),
    (["--max-loaded-models", "0"], "--max-loaded-models must be at least 1"),
    (["--model", "a", "--model", "b", "--pin"], "--pin keeps 2 models loaded but --max-loaded-models is 1"),
])
def test_bad_model_flags_are_one_line_errors(argv, needle, capsys):
    from lmsp_mlx import flags

    with pytest.raises(SystemExit) as exit:
        flags.parse(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and needle in err and err.startswith("lmsp-mlx: error:") and err.count("\n") == 1


def test_a_store_model_removed_while_loaded_serves_until_unloaded(start_server, tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny_model_dir, store / "copy")
    server = start_server("--model", str(tiny_model_dir), "--models-dir", str(store), "--max-loaded-models", "2")
    assert respond(server, "copy").status_code == 200
    shutil.rmtree(store / "copy")
    assert listing(server)["copy"]["loaded"] is True
    assert respond(server, "copy").status_code == 200
    root = HTTP.post(server.url + "/lmsp/v1/models/copy/unload", timeout=60)
    assert root.status_code == 200 and root.json()["loaded"] is False
    assert "copy" not in listing(server)
    assert respond(server, "copy").status_code == 404


def stream_lines(server, path: str, body: dict) -> list[str]:
    """A stream's non-empty lines, its status line 200."""
    with HTTP.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        return [l for l in r.iter_lines() if l]


def unload(server, model: str) -> None:
    assert HTTP.post(f"{server.url}/lmsp/v1/models/{model}/unload", timeout=60).json()["loaded"] is False


def test_a_chat_stream_starts_while_its_model_loads(start_server, tiny_model_dir, second_dir):
    # A reload of a tiny model can take about 10 ms: keep-alives every millisecond come before its end.
    server = start_server("--model", str(tiny_model_dir), "--model", str(second_dir), "--keep-alive", "-1",
                          "--sse-keepalive", "0.001")
    body = {"model": "second", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    lines = stream_lines(server, "/v1/chat/completions", body)
    assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines if l.startswith("data: {")]
    assert chunks[0]["model"] == "second" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    missing = HTTP.post(server.url + "/v1/chat/completions", json={**body, "model": "nope"})
    assert missing.status_code == 404  # an unknown model is no load: still its status line
    # Anthropic's Messages stream too: keep-alives while the load runs, then its events.
    unload(server, "second")
    lines = stream_lines(server, "/v1/messages", body)
    assert lines[0] == ": keep-alive" and lines[-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']
    assert lines[lines.index("event: message_start") - 1] == ": keep-alive"
    missing = HTTP.post(server.url + "/v1/messages", json={**body, "model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # Text completions too, and a refusal after the load is OpenAI's error frame, then [DONE].
    unload(server, "second")
    text = {"model": "second", "prompt": "Once upon", "max_tokens": 4, "stream": True}
    lines = stream_lines(server, "/v1/completions", text)
    assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines if l.startswith("data: {")]
    assert chunks[0]["object"] == "text_completion" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    unload(server, "second")
    lines = stream_lines(server, "/v1/completions", {**text, "prompt": [10**9]})
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]
