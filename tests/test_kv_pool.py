"""The session pool and the checkpoint store in-process, on the tiny model: every cache
path gives the logits of a cold run, and checkpoints survive only when they are sound."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from lmsp_mlx.cache.disk import CheckpointStore, read_header
from lmsp_mlx.cache.pool import SessionPool, Start
from lmsp_mlx.engine.batch import generate
from lmsp_mlx.engine.generate import GenerationParams, prefill
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.render import render, turn_binding
from lmsp_mlx.settings import CacheSettings

STORY = "The ferry crossed twice a day, and the keeper wrote down every passenger. "


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(tiny_model_dir)


def checkpoint(pool: SessionPool, session) -> None:
    pool.checkpoint(session, "test")
    pool.disk.flush()  # written by the background writer


def new_pool(lm, disk_dir: Path | None = None, budget: int = 2**30, **policy) -> SessionPool:
    disk = CheckpointStore(disk_dir, lm.fingerprint, budget) if disk_dir else None
    return SessionPool(lm.model, lm.tokenizer, CacheSettings(**{"checkpoint_min_tokens": 10**9, **policy}), disk)


def turn(pool: SessionPool, lm, messages: list[dict], max_tokens: int = 10) -> tuple[Start, str, int]:
    """One request as the worker runs it: look up, generate greedily, record the turn.
    Returns the start, the reply and how many tokens the session then holds."""
    prompt = render(lm.tokenizer, messages)
    start = pool.start(prompt.text, prompt.tokens, limit=lm.context_length - 1)
    pieces, sampled = [], []
    done = generate(
        lm, GenerationParams(prompt=start.tokens, cached=start.cached, max_tokens=max_tokens, temperature=0),
        lambda e: pieces.append(getattr(e, "text", "")), lambda: False, cache=start.session.cache, sampled=sampled,
    )
    reply = "".join(pieces)
    ended = lm.tokenizer.decode(sampled[-1:]) if done.reason == "stop" else ""
    binding = turn_binding(lm.tokenizer, messages + [{"role": "assistant", "content": reply}], ended)
    pool.finish(start, sampled, ok=True, binding=binding)
    return start, reply, len(start.session.tokens)


def matches_cold(pool: SessionPool, lm, messages: list[dict]) -> Start:
    """Look up, prefill the suffix, and compare the next-token logits with a cold pass over
    the same tokens."""
    prompt = render(lm.tokenizer, messages)
    start = pool.start(prompt.text, prompt.tokens, limit=lm.context_length - 1)
    prefill(lm, start.tokens[start.cached : -1], start.session.cache, 64, lambda done, total: None)
    got = lm.model(mx.array([start.tokens[-1:]]), cache=start.session.cache)[0, -1]
    want = lm.model(mx.array([start.tokens]))[0, -1]
    assert mx.abs(got - want).max().item() < 1e-3 * mx.abs(want).max().item()
    assert mx.array_equal(mx.argmax(got), mx.argmax(want))
    assert lm.tokenizer.decode(start.tokens) == lm.tokenizer.decode(prompt.tokens) or start.source == "visible"
    pool.finish(start, [], ok=True, binding=None)
    return start


def conversation(first_reply: str) -> list[dict]:
    return [
        {"role": "user", "content": STORY * 3},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "Who crossed last?"},
    ]


def test_every_cache_path_gives_the_cold_logits(lm, tmp_path):
    pool = new_pool(lm, tmp_path)
    first, reply, held = turn(pool, lm, [{"role": "user", "content": STORY * 3}])
    assert first.source == "cold"
    checkpoint(pool, first.session)
    visible = matches_cold(pool, lm, conversation(reply))
    assert (visible.source, visible.cached) == ("visible", held)

    # exact token prefix: a session that holds only a prompt
    pool = new_pool(lm)
    _, _, prompt_only = turn(pool, lm, [{"role": "user", "content": STORY}], max_tokens=1)
    exact = matches_cold(pool, lm, [{"role": "user", "content": STORY}, {"role": "assistant", "content": "x"},
                                    {"role": "user", "content": "y"}])
    assert (exact.source, exact.cached) == ("token", prompt_only)

    # common prefix, copied: a different question after the same opening
    partial = matches_cold(pool, lm, [{"role": "user", "content": STORY + "Different."}])
    assert partial.source == "token" and 0 < partial.cached < prompt_only

    # disk: a new pool on the same folder, as after a restart
    restored = matches_cold(new_pool(lm, tmp_path), lm, conversation(reply))
    assert (restored.source, restored.cached) == ("disk", held)


def test_text_prefix_keeps_live_tokens_across_a_bpe_boundary(lm):
    pool = new_pool(lm)
    messages = [{"role": "user", "content": STORY}]
    prompt = render(lm.tokenizer, messages)
    # The live session ends in " t" + "h" + "e" as three tokens; " the" is one when fresh.
    pieces = lm.tokenizer.encode(prompt.text, add_special_tokens=False) + [
        lm.tokenizer.encode(" t", add_special_tokens=False)[0], *lm.tokenizer.encode("he", add_special_tokens=False)]
    start = pool.start(prompt.text, prompt.tokens, limit=10**6)
    prefill(lm, pieces, start.session.cache, 64, lambda d, t: None)
    pool.finish(Start(start.session, "cold", 0, pieces), [], ok=True, binding=None)
    text = prompt.text + " the cat sat"
    fresh = lm.tokenizer.encode(text, add_special_tokens=False)
    assert fresh[: len(pieces)] != pieces  # a fresh tokenization merges across the boundary
    hit = pool.start(text, fresh, limit=10**6)
    assert (hit.source, hit.cached) == ("text", len(pieces))
    assert lm.tokenizer.decode(hit.tokens) == text


def test_checkpoint_round_trip_keeps_tokens_and_state(lm, tmp_path):
    pool = new_pool(lm, tmp_path)
    start, _, _ = turn(pool, lm, [{"role": "user", "content": STORY * 2}])
    session = start.session
    checkpoint(pool, session)
    [entry] = CheckpointStore(tmp_path, lm.fingerprint, 2**30).entries.values()
    _, meta = read_header(entry.path)
    assert meta["format"] == "lmsp-kv-1" and meta["kind"] == "visible" and meta["model"] == lm.fingerprint
    assert int(meta["token_count"]) == len(session.tokens)
    loaded = CheckpointStore(tmp_path, lm.fingerprint, 2**30).load(entry, session.binding.key)
    assert loaded.tokens == session.tokens and loaded.binding == session.binding
    for a, b in zip(loaded.cache, session.cache):
        ka, va = a.state[:2]
        kb, vb = b.state[0][..., : b.offset, :], b.state[1][..., : b.offset, :]
        assert mx.array_equal(ka[..., : a.offset, :], kb) and mx.array_equal(va[..., : a.offset, :], vb)


def _valid_checkpoint(lm, folder: Path) -> tuple[Path, str]:
    pool = new_pool(lm, folder)
    start, reply, _ = turn(pool, lm, [{"role": "user", "content": STORY}])
    checkpoint(pool, start.session)
    [path] = pool.disk.entries
    return path, reply


def test_bad_checkpoints_are_skipped_removed_and_never_loaded(lm, tmp_path, caplog):
    good, _ = _valid_checkpoint(lm, tmp_path)
    folder = good.parent
    data = good.read_bytes()
    (folder / "token-truncated.safetensors").write_bytes(data[: len(data) // 2])
    (folder / "token-garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[:64])
    foreign, _ = _valid_checkpoint(lm, tmp_path / "other")  # same model, then relabelled as another
    foreign_bytes = foreign.read_bytes().replace(lm.fingerprint.encode(), b"f" * len(lm.fingerprint), 1)
    (folder / "visible-foreign.safetensors").write_bytes(foreign_bytes)
    (folder / "visible-future.safetensors").write_bytes(data.replace(b"lmsp-kv-1", b"lmsp-kv-9", 1))
    (folder / ".tmp-interrupted.safetensors").write_bytes(data[:100])
    with caplog.at_level(logging.WARNING, logger="lmsp_mlx.cache"):
        store = CheckpointStore(tmp_path, lm.fingerprint, 2**30)
    assert list(store.entries) == [good]
    assert sorted(p.name for p in folder.iterdir()) == [good.name]
    for why in ("truncated", "header is not JSON", "another model", "unknown format 'lmsp-kv-9'"):
        assert why in caplog.text


def test_a_checkpoint_that_fails_to_load_falls_back_to_cold(lm, tmp_path, caplog):
    good, reply = _valid_checkpoint(lm, tmp_path)
    # A complete file whose token list disagrees with its count: refused at load, not half-used.
    arrays, meta = mx.load(str(good), return_metadata=True)
    mx.save_safetensors(str(good), arrays, {**meta, "tokens": "[1, 2, 3]"})
    pool = new_pool(lm, tmp_path)
    prompt = render(lm.tokenizer, [{"role": "user", "content": STORY}, {"role": "assistant", "content": reply},
                                   {"role": "user", "content": "y"}])
    with caplog.at_level(logging.WARNING, logger="lmsp_mlx.cache"):
        start = pool.start(prompt.text, prompt.tokens, limit=10**6)
    assert (start.source, start.cached) == ("cold", 0)
    assert not good.exists() and "layer or token count" in caplog.text


def _restart_and_replay(lm, folder: Path, reply: str):
    pool = new_pool(lm, folder)
    prompt = render(lm.tokenizer, [{"role": "user", "content": STORY}, {"role": "assistant", "content": reply},
                                   {"role": "user", "content": "y"}])
    return pool.start(prompt.text, prompt.tokens, limit=10**6)


def test_a_checkpoint_whose_tensor_data_was_damaged_is_recomputed_not_loaded(lm, tmp_path, caplog):
    # A valid header over damaged data loads as garbage KV (every reply after it was
    # <|endoftext|>): the data's checksum, written with it, refuses it.
    good, reply = _valid_checkpoint(lm, tmp_path)
    with open(good, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(os.urandom(2048))
    with caplog.at_level(logging.WARNING, logger="lmsp_mlx.cache"):
        start = _restart_and_replay(lm, tmp_path, reply)
    assert (start.source, start.cached) == ("cold", 0)
    assert not good.exists() and "checksum" in caplog.text


def test_a_checkpoint_with_a_token_id_outside_the_vocabulary_is_refused(lm, tmp_path, caplog):
    good, reply = _valid_checkpoint(lm, tmp_path)
    arrays, meta = mx.load(str(good), return_metadata=True)
    tokens = json.loads(meta["tokens"])
    mx.save_safetensors(str(good), arrays, {**meta, "tokens": json.dumps([-3, *tokens[1:]])})
    with caplog.at_level(logging.WARNING, logger="lmsp_mlx.cache"):
        start = _restart_and_replay(lm, tmp_path, reply)
    assert (start.source, start.cached) == ("cold", 0)
    assert not good.exists() and "outside the vocabulary" in caplog.text


def test_a_session_whose_turn_cannot_be_recorded_is_dropped(lm, monkeypatch, caplog):
    # Half-recorded (tokens grown, texts stale) it would match unrelated requests by text.
    pool = new_pool(lm)
    start, _, _ = turn(pool, lm, [{"role": "user", "content": STORY}])
    assert start.session in pool.sessions
    monkeypatch.setattr(pool, "_decode", lambda tokens: (_ for _ in ()).throw(OverflowError("bad id")))
    with caplog.at_level(logging.ERROR, logger="lmsp_mlx.cache"):
        pool.finish(start, [1, 2], ok=True, binding=None)
    assert start.session not in pool.sessions and "dropped" in caplog.text


def test_the_same_request_after_a_restart_starts_from_the_checkpoint_of_its_turn(lm, tmp_path):
    # The checkpoint's key holds the reply too, so it is no prefix of the request that
    # asked for it; its prompt part is: a retry after a restart is not prefilled cold.
    pool = new_pool(lm, tmp_path)
    messages = [{"role": "user", "content": STORY * 3}]
    start, _, _ = turn(pool, lm, messages)
    prompt_tokens = len(start.tokens)
    checkpoint(pool, start.session)
    again = matches_cold(new_pool(lm, tmp_path), lm, messages)  # a new process, the same folder
    assert (again.source, again.cached) == ("disk", prompt_tokens - 1)  # one token is fed again


@pytest.mark.parametrize("room", [True, False])
def test_a_turns_checkpoint_waits_for_eviction_where_the_memory_budget_has_no_room_for_its_copy(lm, tmp_path, caplog,
                                                                                                room):
    """The end of a turn's checkpoint copies a session that stays resident: under a full
    memory budget (`copy_room` says no) it is written when the session is evicted instead,
    and a restart still starts from it."""
    asked = []
    disk = CheckpointStore(tmp_path, lm.fingerprint, 2**30)
    pool = SessionPool(lm.model, lm.tokenizer, CacheSettings(checkpoint_min_tokens=1), disk,
                       copy_room=lambda nbytes: asked.append(nbytes) or room)
    messages = [{"role": "user", "content": STORY * 3}]
    with caplog.at_level(logging.INFO, "lmsp_mlx.cache"):
        start, _, _ = turn(pool, lm, messages)
        disk.flush()
        assert asked == [start.session.nbytes]
        assert len(list(tmp_path.rglob("*.safetensors"))) == (1 if room else 0)
        assert ("kv checkpoint reason=prefill deferred" in caplog.text) is not room
        pool.shed(1)  # the memory budget wants the room: the session goes, to disk where it is not yet there
        disk.flush()
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1
    assert ("already on disk" if room else "checkpointed") in caplog.text
    prompt_tokens = len(start.tokens)
    again = matches_cold(new_pool(lm, tmp_path), lm, messages)  # a new process, the same folder
    assert (again.source, again.cached) == ("disk", prompt_tokens - 1)


def test_disk_budget_keeps_the_hit_and_the_newest(lm, tmp_path):
    pool = new_pool(lm, tmp_path)
    paths = []
    for i in range(3):
        start, _, _ = turn(pool, lm, [{"role": "user", "content": f"{i} " + STORY}])
        checkpoint(pool, start.session)
        paths.append(max(pool.disk.entries, key=lambda p: p.stat().st_mtime_ns))
        if i == 0:  # the first one is used twice
            for _ in range(2):
                pool.disk._touch(pool.disk.entries[paths[0]])
    size = max(e.size for e in pool.disk.entries.values())
    store = CheckpointStore(tmp_path, lm.fingerprint, int(size * 2.5))
    assert store.entries[paths[0]].hits == 2  # hit counts live in the file's header
    store.enforce_budget()
    assert sorted(store.entries) == sorted([paths[0], paths[2]])  # the unhit middle one went
    assert not paths[1].exists()


WRITER = """
import sys, lmsp_mlx, mlx.core as mx
from pathlib import Path
from lmsp_mlx.cache.disk import CheckpointStore
from lmsp_mlx.cache.session import Session
from mlx_lm.models.cache import KVCache
cache = [KVCache() for _ in range(4)]
for c in cache:
    c.update_and_fetch(mx.ones((1, 4, 16384, 128)), mx.ones((1, 4, 16384, 128)))
mx.eval([c.state for c in cache])
store = CheckpointStore(Path(sys.argv[1]), "fp", 2**40)
print("writing", flush=True)
store.save(Session(cache=cache, tokens=list(range(16384))), "token", "key")
store.flush()
print("written", flush=True)
"""


@pytest.mark.slow
def test_a_write_killed_midway_leaves_nothing_that_loads(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    folder = tmp_path / "fp"
    deadline = time.monotonic() + 60
    while not list(folder.glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p.name[:5] for p in folder.iterdir()] == [".tmp-"]  # killed while writing it
    assert CheckpointStore(tmp_path, "fp", 2**40).entries == {}
    assert list(folder.iterdir()) == []  # the temp file is swept at start


def test_a_sliding_window_cache_goes_back_to_its_turn_snapshot(tiny_model_dir, tmp_path):
    from mlx_lm.models.cache import RotatingKVCache

    lm = load_model(tiny_model_dir)  # its own instance: the cache factory changes below
    lm.model.make_cache = lambda: [RotatingKVCache(max_size=64) for _ in lm.model.layers]
    pool = new_pool(lm, tmp_path)
    first, reply, held = turn(pool, lm, [{"role": "user", "content": STORY * 3}])
    session = first.session
    assert not session.trimmable  # more tokens than the 64-position window
    assert [s.tokens for s in session.snapshots] == [held]
    checkpoint(pool, session)
    second, _, held2 = turn(pool, lm, conversation(reply))
    assert second.source == "visible" and second.session is session

    # A branch that shares turn 1 and a few tokens more with the session: the window
    # cannot be trimmed back, so the request starts from the snapshot at turn 1's end.
    tokens = session.tokens[: held + 5] + lm.tokenizer.encode("Who crossed first?", add_special_tokens=False)
    start = pool.start(lm.tokenizer.decode(tokens) + "\ue002", tokens, limit=10**6)  # no text or disk key matches
    assert (start.source, start.cached) == ("token", held) and held + 5 < held2
    assert start.session is not session and start.session.positions() == held

    # The window's checkpoint round-trips with its rotation state.
    restored = new_pool(lm, tmp_path).start(*_texts(lm, conversation(reply)), limit=10**6)
    assert (restored.source, restored.cached) == ("disk", held)
    assert [type(c) for c in restored.session.cache] == [RotatingKVCache] * len(lm.model.layers)
    assert restored.session.positions() == held


def _texts(lm, messages):
    prompt = render(lm.tokenizer, messages)
    return prompt.text, prompt.tokens


def test_a_running_branch_is_matched_by_its_own_text_only(lm):
    """A request that reuses part of a session runs on a copy of that prefix. While it runs
    (before its turn is recorded) another lookup sees the copy: it must match by what the
    copy's tokens say, never take an unrelated prompt as continuing it."""
    pool = new_pool(lm)
    first = [{"role": "user", "content": STORY}]
    turn(pool, lm, first)
    prompt = render(lm.tokenizer, [{"role": "user", "content": STORY[:40] + " and then it sank."}])
    branched = pool.start(prompt.text, prompt.tokens, limit=lm.context_length - 1)
    assert branched.source == "token" and 0 < branched.cached < len(prompt.tokens)  # a copy of the shared prefix
    other = render(lm.tokenizer, [{"role": "user", "content": "Something else entirely."}])
    start = pool.start(other.text, other.tokens, limit=lm.context_length - 1)
    assert start.tokens == other.tokens  # its own prompt, no other session's tokens in front of it
    assert start.source in ("token", "cold") and start.cached < len(other.tokens)
