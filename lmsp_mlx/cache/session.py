"""A resident KV session: mlx-lm's per-layer cache objects and the tokens they hold.

MLX arrays are values, but `KVCache` writes new positions with slice assignment, which
updates the array object in place: a copy that must not change (a snapshot, a branch) holds
its own array objects (`mx.array(a)`), never the live ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

from ..protocol.auth import LOCAL_OWNER


@dataclass(frozen=True)
class Binding:
    """How a client's replay of this session's last turn continues it.

    `key` is the visible transcript through the end of the assistant turn as the chat
    template renders it when the client replays the turn (hidden reasoning dropped where
    the template drops it), up to where the next turn's own text starts. `tail` is the text
    the KV still lacks to reach the end of `key` (the turn's closing markup)."""

    key: str
    tail: str


@dataclass(frozen=True)
class Snapshot:
    """A cache's state at a turn boundary, for caches that cannot be trimmed."""

    tokens: int
    classes: tuple[type, ...]
    states: tuple[Any, ...]


def _copy_state(state: Any) -> Any:
    return tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, state)


# Caches whose state can be cut to any shorter length by slicing.
_CUTTABLE = (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def seen(c: Any) -> int | None:
    """Tokens a layer cache has taken in (a rotating cache holds fewer), if it counts them."""
    offset = getattr(c, "offset", None)
    return offset if isinstance(offset, int) else None


def prefix_state(c: Any, n: int, copy: bool = True) -> Any:
    """The state of layer cache `c` holding its first `n` tokens.

    KVCache's own `state` is its padded 256-step buffer; here keys and values are cut to
    `n`, which is also what a checkpoint stores. Other caches are taken whole, so `n` must
    be all they have seen. With `copy=False` the arrays are views of the live ones, only
    to be read at once (a checkpoint copies them to host memory)."""
    own = (lambda a: mx.array(a)) if copy else (lambda a: a)
    if type(c) is mlx_cache.KVCache:
        if c.keys is None:
            return (None, None, 0)
        return (own(c.keys[..., :n, :]), own(c.values[..., :n, :]), n)
    if type(c) is mlx_cache.QuantizedKVCache:
        if c.keys is None:
            return (None, None, 0, c.group_size, c.bits)
        cut = lambda parts: tuple(own(p[..., :n, :]) for p in parts)  # noqa: E731
        return (cut(c.keys), cut(c.values), n, c.group_size, c.bits)
    if seen(c) not in (None, n):
        raise ValueError(f"{type(c).__name__} has seen {seen(c)} tokens, not {n}")
    return _copy_state(c.state) if copy else c.state


def _with_room(a: mx.array, n: int) -> mx.array:
    """A KVCache buffer holding `a`'s `n` positions, padded to the next multiple of mlx-lm's
    256-position step: the branch's or restore's first decode step then writes into room
    it has, instead of growing (copying) the whole cache again."""
    step = mlx_cache.KVCache.step
    room = (n // step + 1) * step - n
    return mx.concatenate([a[..., :n, :], mx.zeros((*a.shape[:2], room, a.shape[3]), a.dtype)], axis=2)


def restore(classes: tuple[type, ...], states: tuple[Any, ...]) -> list:
    """Fresh cache objects from states (copied, so the source stays unchanged)."""
    caches = []
    for cls, state in zip(classes, states):
        if cls is mlx_cache.KVCache and state[0] is not None:
            keys, values, n = state
            obj = cls()
            obj.keys, obj.values, obj.offset = _with_room(keys, n), _with_room(values, n), n
            caches.append(obj)
        elif cls is mlx_cache.QuantizedKVCache:
            obj = cls.__new__(cls)
            obj.keys, obj.values, obj.offset, obj.group_size, obj.bits = _copy_state(state)
            caches.append(obj)
        else:
            caches.append(cls.from_state(_copy_state(state)))
    return caches


@dataclass
class Session:
    cache: list
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # what `tokens` decode to (hidden reasoning included)
    prompt_tokens: int = 0  # the last request's prompt: the turn boundary
    prompt_text: str = ""
    binding: Binding | None = None
    owner: str = LOCAL_OWNER  # the token whose turn the binding records (lmsp_mlx/http/auth.py)
    calls: Any = None  # calls.CallTurn of the last turn, when it made tool calls
    snapshots: list[Snapshot] = field(default_factory=list)
    saved_tokens: int = 0  # tokens in the newest checkpoint of this session's current line
    last_used: float = field(default_factory=time.monotonic)
    in_use: bool = False  # a running sequence writes into `cache` (SessionPool.start until finish)

    @property
    def nbytes(self) -> int:
        total = sum(c.nbytes for c in self.cache if not c.empty())
        for snap in self.snapshots:
            total += sum(a.nbytes for _, a in tree_flatten(list(snap.states)) if isinstance(a, mx.array))
        return total

    @property
    def trimmable(self) -> bool:
        return mlx_cache.can_trim_prompt_cache(self.cache)

    @property
    def needs_snapshots(self) -> bool:
        """Sliding-window and recurrent caches cannot (always) be trimmed back to a turn."""
        return any(type(c) not in _CUTTABLE for c in self.cache)

    def positions(self) -> int | None:
        """Tokens the cache has taken in: the first layer that counts them (all agree);
        None for caches that count nothing (recurrent layers only)."""
        for c in self.cache:
            if (n := seen(c)) is not None:
                return n
        return None

    def snapshot(self) -> None:
        """Keep the current state as a turn boundary, for caches that cannot be trimmed."""
        if not self.needs_snapshots or not self.tokens:
            return
        states = tuple(prefix_state(c, len(self.tokens)) for c in self.cache)
        self.snapshots.append(Snapshot(len(self.tokens), tuple(type(c) for c in self.cache), states))
        del self.snapshots[:-4]  # the last few turns are what edits and retries go back to

    def prefix(self, n: int) -> "Session | None":
        """A new session holding the first `n` tokens, or None where no state that short
        exists (a cache that cannot be trimmed and has no snapshot at or before `n`)."""
        classes = tuple(type(c) for c in self.cache)
        if self.trimmable:
            full = len(self.tokens)
            states = tuple(prefix_state(c, n if type(c) in _CUTTABLE else full) for c in self.cache)
            cache = restore(classes, states)
            for c in cache:
                if type(c) not in _CUTTABLE and (extra := (seen(c) or n) - n) > 0:
                    c.trim(extra)
            return Session(cache=cache, tokens=self.tokens[:n])
        usable = [s for s in self.snapshots if s.tokens <= n]
        if not usable:
            return None
        snap = max(usable, key=lambda s: s.tokens)
        return Session(cache=restore(snap.classes, snap.states), tokens=self.tokens[: snap.tokens],
                       snapshots=[s for s in self.snapshots if s.tokens <= snap.tokens])

    def cut(self, n: int) -> bool:
        """Keep only the first `n` positions in place; False if this cache cannot be trimmed."""
        if not self.trimmable:
            return False
        mlx_cache.trim_prompt_cache(self.cache, self.positions() - n)
        del self.tokens[n:]
        self.snapshots = [s for s in self.snapshots if s.tokens <= n]
        return True
