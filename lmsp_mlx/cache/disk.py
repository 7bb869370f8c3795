"""KV checkpoints on disk: one `.safetensors` file per session state, found by text prefix.

Format `lmsp-kv-1` (also described in docs/kv-cache.md, "Checkpoints on disk"):
- tensors `<layer>.<path>`: the array leaves of each layer cache's state (`KVCache`: keys
  and values cut to the valid positions), float as computed;
- `__metadata__` (strings): `format`, `model` (the model fingerprint), `kind` (`visible`:
  keyed by the visible transcript a client replays, the KV may hold hidden reasoning;
  `token`: keyed by the text the tokens decode to), `key_sha256` and `key_chars` (the key's
  hash and length in characters), `key_text` (compaction checkpoints only: the key),
  `tail` (visible kind: text to prefill before the request's suffix), `prompt_sha256`,
  `prompt_chars` and `prompt_tokens` (the last turn's prompt as its tokens decode: a retry
  of that request starts from it), `owner` (visible kind: the token hash whose transcript
  keys it; only that token's requests match it), `token_count`, `tokens` (JSON ids), `classes` (JSON: the mlx-lm cache class of
  each layer), `scalars` (JSON: the state's non-array leaves), `data_sha256` (SHA-256 of
  the tensor data, checked on load), and fixed-width decimal `created`, `last_used` (Unix
  seconds) and `hits`, which are updated in place.

The file name is `<kind>-<sha256 of key>.safetensors`, in a folder per model fingerprint.
Writes go to a hidden temp file that is renamed into place, so a crash mid-write leaves
no file that loads (temp files are swept at start). A file that fails any check (foreign
model, unknown format, truncated, corrupt) is removed with a warning and never loaded.

Writing is off the worker's path: `save` copies the state into host memory (a memcpy)
and a writer thread writes the file, which is plain file I/O on bytes, no MLX; an agent's
next turn does not wait for a 100 MB checkpoint. `flush` waits for pending writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from ..protocol.auth import LOCAL_OWNER
from .calls import CallMemory, CallTurn
from .heap import trim_heap
from .session import Binding, Session, prefix_state, restore

log = logging.getLogger("lmsp_mlx.cache")

FORMAT = "lmsp-kv-1"
SUFFIX = ".safetensors"


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint for this model."""


def key_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Match:
    """A checkpoint found for a text: its first `tokens` hold the text's first `chars`
    characters; `whole`: by its key (all of it), else by its last prompt."""

    entry: "Entry"
    tokens: int
    chars: int
    whole: bool


@dataclass
class Entry:
    path: Path
    kind: str
    key_sha256: str
    key_chars: int
    tokens: int
    size: int
    created: int
    last_used: int
    hits: int
    # The last turn's prompt, as its tokens decode (the rendered prompt, hidden reasoning
    # included): a retry of that request after a restart starts from it.
    prompt_sha256: str = ""
    prompt_chars: int = 0
    prompt_tokens: int = 0
    owner: str = LOCAL_OWNER  # visible kind: the token whose transcript keys it

    def score(self, now: float) -> float:
        """Higher is kept longer: often hit, recently used, long contexts."""
        idle_hours = max(0.0, now - self.last_used) / 3600
        return (1 + self.hits) * math.log2(2 + self.tokens) / (1 + idle_hours)


# mx dtype -> (safetensors dtype, the numpy dtype its bytes are copied as)
_DTYPES = {
    mx.float32: ("F32", np.float32), mx.float16: ("F16", np.float16), mx.bfloat16: ("BF16", np.uint16),
    mx.uint32: ("U32", np.uint32), mx.int32: ("I32", np.int32), mx.uint8: ("U8", np.uint8),
    mx.int64: ("I64", np.int64), mx.uint16: ("U16", np.uint16), mx.int8: ("I8", np.int8),
}


def to_host(a: mx.array) -> tuple[str, np.ndarray]:
    """The array's bytes in host memory, with its safetensors dtype (bfloat16 as raw uint16)."""
    tag, np_dtype = _DTYPES[a.dtype]
    return tag, np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, dtype=np_dtype, copy=True)


def data_hash(tensors: dict[str, tuple[str, np.ndarray]]) -> str:
    """SHA-256 of the tensor bytes in file order: a file whose data was damaged (bad
    sectors, a partial copy, a stray write) fails it and is recomputed instead of loaded."""
    h = hashlib.sha256()
    for _, data in tensors.values():
        h.update(memoryview(np.ascontiguousarray(data)).cast("B"))
    return h.hexdigest()


def file_data_hash(path: Path, start: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, (tag, data) in tensors.items():
        header[name] = {"dtype": tag, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, data in tensors.values():
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def read_header(path: Path) -> tuple[dict, dict]:
    """(tensor table, metadata) of a safetensors file, checking it is complete."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 256 * 2**20):
            raise CheckpointError("header length beyond the file")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError("header is not an object")
    meta = header.pop("__metadata__", None) or {}
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end != size:
        raise CheckpointError(f"{size} bytes on disk, the header describes {8 + n + end} (truncated?)")
    return header, meta


class CheckpointStore:
    def __init__(self, root: Path, fingerprint: str, budget_bytes: int, calls: CallMemory | None = None,
                 vocab_size: int = 2**31) -> None:
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size  # token ids in a checkpoint must be below it
        self.dir = root / fingerprint[:16]
        self.budget = budget_bytes
        self.entries: dict[Path, Entry] = {}
        self._lock = threading.Lock()  # entries: read by the worker, updated by the writer
        self.calls = calls  # tool-call turns found in checkpoints are remembered for exact replay
        self._writes: queue.Queue = queue.Queue()
        self.pending = 0  # bytes of host copies queued for writing (they count against the memory budget)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # checkpoints hold conversations: the owner's alone
        for stale in self.dir.glob(".tmp-*"):
            stale.unlink(missing_ok=True)  # a write that never finished
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            if not path.name.startswith("."):  # pathlib's glob matches hidden files too
                self._index(path)
        log.info("kv disk %s: %d checkpoints, %.1f MiB", self.dir, len(self.entries), self.total / 2**20)
        self.enforce_budget()  # a smaller --kv-disk-space-mb than the last run's holds from the start
        threading.Thread(target=self._write_loop, name="lmsp-kv-writer", daemon=True).start()

    @property
    def total(self) -> int:
        return sum(e.size for e in self.entries.values())

    def _reject(self, path: Path, why: str) -> None:
        log.warning("kv disk: skipping and removing %s: %s", path.name, why)
        with self._lock:
            self.entries.pop(path, None)
        path.unlink(missing_ok=True)

    def _index(self, path: Path) -> Entry | None:
        try:
            _, meta = read_header(path)
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"unknown format {meta.get('format')!r}")
            if meta.get("model") != self.fingerprint:
                raise CheckpointError("written for another model or quantization")
            entry = Entry(
                path=path, kind=meta["kind"], key_sha256=meta["key_sha256"], key_chars=int(meta["key_chars"]),
                tokens=int(meta["token_count"]), size=path.stat().st_size, created=int(meta["created"]),
                last_used=int(meta["last_used"]), hits=int(meta["hits"]),
                prompt_sha256=meta.get("prompt_sha256", ""), prompt_chars=int(meta.get("prompt_chars", 0)),
                prompt_tokens=int(meta.get("prompt_tokens", 0)), owner=meta.get("owner", LOCAL_OWNER),
            )
            if self.calls is not None and meta.get("calls"):
                turn = json.loads(meta["calls"])
                self.calls.remember(CallTurn(tuple(turn["call_ids"]), turn["visible"], tuple(turn["items"]),
                                             turn.get("head", ""),
                                             # before owners were kept: the one owner of a server without tokens
                                             turn.get("owner", LOCAL_OWNER)))
        except (OSError, CheckpointError, KeyError, ValueError, TypeError) as exc:
            self._reject(path, str(exc) or type(exc).__name__)
            return None
        with self._lock:
            self.entries[path] = entry
        return entry

    def find(self, text: str, owner: str, longer_than: int = 0) -> "Match | None":
        """The checkpoint that holds the most tokens of `text`: one whose key is a prefix of
        it (a visible-transcript key only for its owner: the KV holds what the transcript
        does not show), or else one whose last prompt is (the same request again)."""
        hashes: dict[int, str] = {}

        def prefix_of_text(sha: str, chars: int) -> bool:
            if chars > len(text):
                return False
            if chars not in hashes:
                hashes[chars] = key_hash(text[:chars])
            return hashes[chars] == sha

        best: Match | None = None
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            if e.kind == "visible" and e.owner != owner:
                continue
            if e.tokens > max(longer_than, best.tokens if best else 0) and prefix_of_text(e.key_sha256, e.key_chars):
                best = Match(e, e.tokens, e.key_chars, whole=True)
        for e in entries:
            if e.prompt_tokens > max(longer_than, best.tokens if best else 0) \
                    and prefix_of_text(e.prompt_sha256, e.prompt_chars):
                best = Match(e, e.prompt_tokens, e.prompt_chars, whole=False)
        return best

    def load(self, entry: Entry, key: str) -> Session | None:
        """The session in `entry` (its key text is `key`), or None after removing a bad file."""
        try:
            arrays, meta = mx.load(str(entry.path), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("model") != self.fingerprint:
                raise CheckpointError("metadata changed since indexing")
            if "data_sha256" in meta:  # files written before it was kept are loaded unchecked
                with open(entry.path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                if file_data_hash(entry.path, 8 + n) != meta["data_sha256"]:
                    raise CheckpointError("its tensor data does not match the checksum written with it")
            tokens = json.loads(meta["tokens"])
            if not all(type(t) is int and 0 <= t < self.vocab_size for t in tokens):
                raise CheckpointError(f"a token id outside the vocabulary (0..{self.vocab_size - 1})")
            classes = [getattr(mlx_cache, name) for name in json.loads(meta["classes"])]
            leaves = list(arrays.items()) + list(json.loads(meta["scalars"]).items())
            layers = tree_unflatten(leaves)
            if not isinstance(layers, list) or len(layers) != len(classes) or len(tokens) != entry.tokens:
                raise CheckpointError("layer or token count does not match")
            session = Session(cache=restore(tuple(classes), tuple(layers)), tokens=tokens)
            if session.positions() not in (None, len(tokens)):
                raise CheckpointError(f"holds {session.positions()} positions for {len(tokens)} tokens")
        except Exception as exc:  # anything wrong with the file means it is not loaded
            self._reject(entry.path, f"{type(exc).__name__}: {exc}")
            return None
        if entry.kind == "visible":
            session.binding = Binding(key=key, tail=meta.get("tail", ""))
            session.owner = entry.owner
        session.saved_tokens = len(tokens)
        self._touch(entry)
        return session

    def save(self, session: Session, kind: str, key: str, tail: str = "", keep_key: bool = False) -> Path:
        """Queue the session's state for writing under `key` (replacing a file with the
        same key); returns the file's path. The copy to host memory happens here.
        `keep_key`: store the key text itself (`key_text`), for a compaction's text."""
        n = len(session.tokens)
        tensors, scalars = {}, {}
        for i, c in enumerate(session.cache):
            for path, leaf in tree_flatten(prefix_state(c, n, copy=False)):  # one copy: to host
                name = f"{i}.{path}"
                if isinstance(leaf, mx.array):
                    tensors[name] = to_host(leaf)
                else:
                    scalars[name] = leaf
        now = int(time.time())
        meta = {
            "format": FORMAT,
            "model": self.fingerprint,
            "kind": kind,
            "key_sha256": key_hash(key),
            "key_chars": str(len(key)),
            "tail": tail,
            "token_count": str(n),
            "tokens": json.dumps(session.tokens),
            "classes": json.dumps([type(c).__name__ for c in session.cache]),
            "scalars": json.dumps(scalars),
            "created": f"{now:012d}",
            "last_used": f"{now:012d}",
            "hits": f"{0:010d}",
        }
        if keep_key:
            meta["key_text"] = key
        if kind == "visible":
            meta["owner"] = session.owner
        if 0 < session.prompt_tokens < n and session.prompt_text:
            meta.update(prompt_sha256=key_hash(session.prompt_text), prompt_chars=str(len(session.prompt_text)),
                        prompt_tokens=str(session.prompt_tokens))
        if session.calls is not None:
            c = session.calls
            meta["calls"] = json.dumps({"call_ids": list(c.call_ids), "visible": c.visible, "items": list(c.items),
                                        **({"head": c.head} if c.head else {}), "owner": c.owner})
        final = self.dir / f"{kind}-{meta['key_sha256'][:40]}{SUFFIX}"
        with self._lock:
            self.pending += sum(a.nbytes for _, a in tensors.values())
        self._writes.put((final, tensors, meta))
        session.saved_tokens = n
        return final

    def flush(self) -> None:
        """Wait until every queued checkpoint is on disk (or has failed)."""
        self._writes.join()

    def _write_loop(self) -> None:
        while True:
            final, tensors, meta = self._writes.get()
            temp = self.dir / f".tmp-{uuid.uuid4().hex}{SUFFIX}"
            began = time.perf_counter()
            try:
                write_safetensors(temp, tensors, {**meta, "data_sha256": data_hash(tensors)})
                os.replace(temp, final)
                with self._lock:
                    self.entries.pop(final, None)
                if self._index(final):
                    log.info("kv disk: wrote %s (%s tokens, %.1f MiB) in %.2fs", final.name, meta["token_count"],
                             final.stat().st_size / 2**20, time.perf_counter() - began)
                self.enforce_budget(spare=final)
            except Exception as exc:  # a full disk must not take the server down
                log.warning("kv disk: cannot write %s: %s: %s", final.name, type(exc).__name__, exc)
            finally:
                temp.unlink(missing_ok=True)
                with self._lock:
                    self.pending -= sum(a.nbytes for _, a in tensors.values())
                del tensors  # the host copy goes now, not when the next write replaces it
                trim_heap()  # and its pages back to the OS: it was made in the worker's heap arena (cache/heap.py)
                self._writes.task_done()

    def _touch(self, entry: Entry) -> None:
        """Count a hit and the use time, patching the fixed-width header fields in place."""
        entry.hits += 1
        entry.last_used = int(time.time())
        try:
            with open(entry.path, "r+b") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = f.read(n)
                for field, value in (("hits", f"{entry.hits:010d}"), ("last_used", f"{entry.last_used:012d}")):
                    m = re.search(rb'"%s":"(\d{%d})"' % (field.encode(), len(value)), header)
                    if m:
                        f.seek(8 + m.start(1))
                        f.write(value.encode())
        except OSError as exc:
            log.warning("kv disk: cannot update %s: %s", entry.path.name, exc)

    def enforce_budget(self, spare: Path | None = None) -> None:
        """Remove the lowest-scoring files until the total fits; the newest file stays."""
        now = time.time()
        with self._lock:
            newest = max(self.entries.values(), key=lambda e: (e.created, e.path == spare), default=None)
            while self.total > self.budget and len(self.entries) > 1:
                victims = [e for e in self.entries.values() if e is not newest and e.path != spare]
                if not victims:
                    break
                worst = min(victims, key=lambda e: e.score(now))
                log.info("kv disk: evicting %s (%d tokens, %d hits) to stay under %.0f MiB",
                         worst.path.name, worst.tokens, worst.hits, self.budget / 2**20)
                self.entries.pop(worst.path)
                worst.path.unlink(missing_ok=True)
