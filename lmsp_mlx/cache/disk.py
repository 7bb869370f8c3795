"""KV checkpoints on disk: one `.safetensors` file per session state, found by text prefix.

Format `lmsp-kv-1` (also described in docs/kv-checkpoints.md):
- tensors `<layer>.<path>`: the array leaves of each layer cache's state (`KVCache`: keys
  and values cut to the valid positions), float as computed;
- `__metadata__` (strings): `format`, `model` (the model fingerprint), `kind` (`visible`:
  keyed by the visible transcript a client replays, the KV may hold hidden reasoning;
  `token`: keyed by the text the tokens decode to), `key_sha256` and `key_chars` (the key's
  hash and length in characters), `tail` (visible kind: text to prefill before the request's
  suffix), `token_count`, `tokens` (JSON ids), `classes` (JSON: the mlx-lm cache class of
  each layer), `scalars` (JSON: the state's non-array leaves), and fixed-width decimal
  `created`, `last_used` (Unix seconds) and `hits`, which are updated in place.

The file name is `<kind>-<sha256 of key>.safetensors`, in a folder per model fingerprint.
Writes go to a hidden temp file that is renamed into place, so a crash mid-write leaves
no file that loads (temp files are swept at start). A file that fails any check (foreign
model, unknown format, truncated, corrupt) is removed with a warning and never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from .session import Binding, Session, prefix_state, restore

log = logging.getLogger("lmsp_mlx.cache")

FORMAT = "lmsp-kv-1"
SUFFIX = ".safetensors"


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint for this model."""


def key_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


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

    def score(self, now: float) -> float:
        """Higher is kept longer: often hit, recently used, long contexts."""
        idle_hours = max(0.0, now - self.last_used) / 3600
        return (1 + self.hits) * math.log2(2 + self.tokens) / (1 + idle_hours)


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
    def __init__(self, root: Path, fingerprint: str, budget_bytes: int) -> None:
        self.fingerprint = fingerprint
        self.dir = root / fingerprint[:16]
        self.budget = budget_bytes
        self.entries: dict[Path, Entry] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".tmp-*"):
            stale.unlink(missing_ok=True)  # a write that never finished
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            if not path.name.startswith("."):  # pathlib's glob matches hidden files too
                self._index(path)
        log.info("kv disk %s: %d checkpoints, %.1f MiB", self.dir, len(self.entries), self.total / 2**20)

    @property
    def total(self) -> int:
        return sum(e.size for e in self.entries.values())

    def _reject(self, path: Path, why: str) -> None:
        log.warning("kv disk: skipping and removing %s: %s", path.name, why)
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
            )
        except (OSError, CheckpointError, KeyError, ValueError, TypeError) as exc:
            self._reject(path, str(exc) or type(exc).__name__)
            return None
        self.entries[path] = entry
        return entry

    def find(self, text: str, longer_than: int = 0) -> Entry | None:
        """The checkpoint with the most tokens whose key is a prefix of `text`."""
        hashes: dict[int, str] = {}
        best = None
        for e in self.entries.values():
            if e.key_chars > len(text) or e.tokens <= longer_than or (best and e.tokens <= best.tokens):
                continue
            if e.key_chars not in hashes:
                hashes[e.key_chars] = key_hash(text[: e.key_chars])
            if hashes[e.key_chars] == e.key_sha256:
                best = e
        return best

    def load(self, entry: Entry, key: str) -> Session | None:
        """The session in `entry` (its key text is `key`), or None after removing a bad file."""
        try:
            arrays, meta = mx.load(str(entry.path), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("model") != self.fingerprint:
                raise CheckpointError("metadata changed since indexing")
            tokens = json.loads(meta["tokens"])
            classes = [getattr(mlx_cache, name) for name in json.loads(meta["classes"])]
            leaves = list(arrays.items()) + list(json.loads(meta["scalars"]).items())
            layers = tree_unflatten(leaves)
            if not isinstance(layers, list) or len(layers) != len(classes) or len(tokens) != entry.tokens:
                raise CheckpointError("layer or token count does not match")
            session = Session(cache=restore(tuple(classes), tuple(layers)), tokens=tokens)
            if session.positions() != len(tokens):
                raise CheckpointError(f"holds {session.positions()} positions for {len(tokens)} tokens")
        except Exception as exc:  # anything wrong with the file means it is not loaded
            self._reject(entry.path, f"{type(exc).__name__}: {exc}")
            return None
        if entry.kind == "visible":
            session.binding = Binding(key=key, tail=meta.get("tail", ""))
        session.saved_tokens = len(tokens)
        self._touch(entry)
        return session

    def save(self, session: Session, kind: str, key: str, tail: str = "") -> Path:
        """Write the session's state under `key` (replacing a file with the same key)."""
        n = len(session.tokens)
        arrays, scalars = {}, {}
        for i, c in enumerate(session.cache):
            for path, leaf in tree_flatten(prefix_state(c, n)):
                name = f"{i}.{path}"
                if isinstance(leaf, mx.array):
                    arrays[name] = leaf
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
        final = self.dir / f"{kind}-{meta['key_sha256'][:40]}{SUFFIX}"
        temp = self.dir / f".tmp-{uuid.uuid4().hex}{SUFFIX}"
        try:
            mx.save_safetensors(str(temp), arrays, meta)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        self.entries.pop(final, None)
        self._index(final)
        session.saved_tokens = n
        self.enforce_budget(keep=final)
        return final

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

    def enforce_budget(self, keep: Path | None = None) -> None:
        """Remove the lowest-scoring files until the total fits; the newest file stays."""
        now = time.time()
        newest = max(self.entries.values(), key=lambda e: (e.created, e.path == keep), default=None)
        while self.total > self.budget and len(self.entries) > 1:
            victims = [e for e in self.entries.values() if e is not newest and e.path != keep]
            if not victims:
                break
            worst = min(victims, key=lambda e: e.score(now))
            log.info("kv disk: evicting %s (%d tokens, %d hits) to stay under %.0f MiB",
                     worst.path.name, worst.tokens, worst.hits, self.budget / 2**20)
            self.entries.pop(worst.path)
            worst.path.unlink(missing_ok=True)
