"""The resident sessions and the one lookup order that picks where a request starts.

For each request, in this order (the first that applies wins; a common token prefix that
must be trimmed gives way to a text prefix or a checkpoint that reuses more tokens):

1. `visible`: a session's binding key (the visible transcript of its last turn) is a prefix
   of the request's rendered text (as a visible-only replay renders it, where the request
   revealed sealed hidden reasoning: lmsp_mlx/service/sealing.py). The KV, with any hidden reasoning
   the client did not replay, is continued; only the binding's tail and the new text are
   prefilled.
2. `token`: a session's tokens are a prefix of the request's tokens (exact), or share a
   common prefix with them (the prefix is copied, the session stays for its own client).
3. `text`: a session's text (or its last prompt's text) is a prefix of the request's text.
   The live tokens are kept and only the new text is tokenized: BPE may merge across the
   boundary differently in a fresh tokenization, so token matching alone would stop short.
4. `disk`: the checkpoint with the longest key that is a prefix of the request's text (or
   its visible-only rendering), when it holds more tokens than the best of 2-3.
5. `cold`: a new session.

A session that a running sequence holds (`in_use`: the worker decodes several at once) is
never continued in place by a second request: that request branches a copy of the prefix
it reuses, so two running sequences never share a cache.

Each decision is logged as one line: `cache_source=<kind> cached=<N> prompt=<M>`.
Sessions are bounded by bytes (`--kv-memory-mb`); the least recently used go first, to
disk when the policy says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Literal

from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from .disk import CheckpointStore
from ..protocol.auth import LOCAL_OWNER
from ..settings import CacheSettings
from .session import Binding, Session

log = logging.getLogger("lmsp_mlx.cache")


# Where a request's KV came from, in the lookup order (module docstring), as the
# `cache_source=` log line names it.
CacheSource = Literal["visible", "token", "text", "disk", "cold"]


@dataclass
class Start:
    session: Session
    source: CacheSource
    cached: int  # tokens already in the KV
    tokens: list[int]  # what the KV holds once the prompt is prefilled: cached + suffix
    made: bool = False  # the lookup made this session (cold, a copied prefix, a restore)
    # A visible-transcript start: the cached tokens hold the visible text's first
    # `key_chars` characters (hidden reasoning included), and `tail` was prefilled after them.
    key_chars: int = 0
    tail: str = ""
    owner: str = LOCAL_OWNER  # the token whose request this is: it owns the session's binding after the turn


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionPool:
    def __init__(self, model, tokenizer, policy: CacheSettings, disk: CheckpointStore | None = None,
                 agree: Callable[[int], bool] | None = None, copy_room: Callable[[int], bool] | None = None) -> None:
        """`agree`, for a model split over ranks (each with its own shard of every
        checkpoint): called by every rank at each disk lookup with the tokens it would
        restore (-1: none); True only where every rank would restore the same, so that all
        restore or none does.

        `copy_room`, from the engine's memory budget (engine/admission.py): whether a host
        copy of that many bytes fits now. A checkpoint taken at the end of a turn copies a
        session that stays resident, so where the copy does not fit it waits: the session
        is written when it is evicted (its copy then takes the place of the memory it
        frees) or at shutdown."""
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.disk = disk
        self.agree = agree
        self.copy_room = copy_room
        self.sessions: list[Session] = []
        self.shed_total = 0  # sessions the memory budget evicted (`shed`, `shed_sessions`)

    def new_cache(self) -> list:
        """Empty per-layer caches: the model's own, quantized under --kv-bits where every
        layer is a plain KVCache (sliding-window and recurrent layers stay as they are)."""
        cache = make_prompt_cache(self.model)
        bits = self.policy.kv_bits
        if bits and all(type(c) is KVCache for c in cache):
            return [QuantizedKVCache(group_size=self.policy.kv_group_size, bits=bits) for _ in cache]
        return cache

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- lookup ---------------------------------------------------------------------------

    def start(self, text: str, tokens: list[int], limit: int, label: str | None = None,
              visible: str | None = None, owner: str = LOCAL_OWNER) -> Start:
        """Where the request with rendered `text` and `tokens` starts; `limit` is the most
        tokens the KV may hold before decoding (the context minus one). `label` names a
        live continuation (a tool-output-only request) in the log line when it is found.
        `visible`: the visible-only rendering, where `text` is the true history (hidden
        reasoning revealed); the two differ only inside replayed turns."""
        start = self._own(self._lookup(text, tokens, limit, visible or text, owner))
        start.owner = owner
        start.session.in_use = True
        if start.session not in self.sessions:
            start.made = True
            self.sessions.append(start.session)
        start.session.last_used = time.monotonic()
        source = label if label and start.source in ("visible", "disk") else start.source
        log.info("cache_source=%s cached=%d prompt=%d", source, start.cached, len(start.tokens))
        return start

    def _own(self, start: Start) -> Start:
        """`start`, on a session no running sequence holds: a held one is branched (a copy
        of the reused prefix), or where it cannot be cut, the request starts cold."""
        s = start.session
        if not s.in_use:
            return start
        try:
            branch = self._branch(s, start.cached)
        except ValueError:  # a sliding-window or recurrent cache that moved on while it runs
            branch = None
        if branch is None:
            log.info("kv: the matching session is in use by a running request and cannot be copied: cold start")
            return Start(Session(cache=self.new_cache()), "cold", 0, start.tokens)
        cached = len(branch.tokens)
        return Start(branch, start.source, cached, start.tokens, key_chars=start.key_chars if cached == start.cached else 0,
                     tail=start.tail if cached == start.cached else "")

    def _branch(self, s: Session, n: int) -> Session | None:
        """A copy of `s`'s first `n` tokens (Session.prefix), described for other lookups."""
        branch = s.prefix(n)
        return None if branch is None else self._described(branch)

    def _described(self, s: Session) -> Session:
        """`s` (a branch, a restored checkpoint) with the text its tokens decode to, so other
        lookups match it by what it holds while it runs, before its turn is recorded. A
        branch's text was empty while its tokens were not, and the text-prefix lookup took
        every prompt as continuing it (an empty string prefixes all), with the branch's
        tokens in front of the prompt."""
        s.text = s.prompt_text = self._decode(s.tokens)
        s.prompt_tokens = len(s.tokens)
        return s

    def abandon(self, start: Start) -> None:
        """The request will not run: forget a session made for it (a live one stays)."""
        start.session.in_use = False
        if start.made:
            self._drop(start.session)

    def _lookup(self, text: str, tokens: list[int], limit: int, seen: str, owner: str) -> Start:
        n = len(tokens)
        # By visible transcript only the owner's own sessions: their KV holds what the
        # transcript does not show (hidden reasoning). The other lookups match what the
        # request itself holds, whoever made the session.
        visible = [s for s in self.sessions if s.binding and s.owner == owner and seen.startswith(s.binding.key)
                   and len(seen) > len(s.binding.key)]
        if visible:
            s = max(visible, key=lambda s: len(s.binding.key))
            full = s.tokens + self._encode(s.binding.tail + seen[len(s.binding.key):])
            if len(full) <= limit:
                return Start(s, "visible", len(s.tokens), full, key_chars=len(s.binding.key), tail=s.binding.tail)

        exact = [s for s in self.sessions if 0 < len(s.tokens) < n and tokens[: len(s.tokens)] == s.tokens]
        if exact:
            s = max(exact, key=lambda s: len(s.tokens))
            return Start(s, "token", len(s.tokens), tokens)

        best: Start | None = None
        shared, s = max(((common_prefix(s.tokens, tokens), s) for s in self.sessions), default=(0, None),
                        key=lambda p: p[0])
        if shared > 0:  # a common token prefix, trimmed (or copied) down to it
            best = Start(s, "token", min(shared, n - 1), tokens)
        for s in self.sessions:  # rendered-text prefix: the whole session, or its last prompt
            for part_text, part_tokens in ((s.text, len(s.tokens)), (s.prompt_text, s.prompt_tokens)):
                if part_tokens and part_text and len(text) > len(part_text) and text.startswith(part_text):
                    full = s.tokens[:part_tokens] + self._encode(text[len(part_text):])
                    if len(full) <= limit and (best is None or part_tokens > best.cached):
                        best = Start(s, "text", part_tokens, full)
                    break

        if self.disk is not None or self.agree is not None:
            found = [(m, t) for t in dict.fromkeys((seen, text)) if self.disk is not None
                     and (m := self.disk.find(t, owner, longer_than=best.cached if best else 0)) is not None]
            match, matched = max(found, key=lambda f: f[0].tokens) if found else (None, text)
            start = self._restore(match, matched, limit) if match is not None else None
            if self.agree is not None and not self.agree(start.cached if start is not None else -1):
                if start is not None:
                    log.info("kv disk: not restored: another rank lacks its shard of this checkpoint")
                start = None
            if start is not None:
                return start

        if best is not None:
            return self._take(best)
        return Start(Session(cache=self.new_cache()), "cold", 0, tokens)

    def _restore(self, match, text: str, limit: int) -> Start | None:
        """Start from a checkpoint `match` found for `text`: all of it, or its last prompt,
        cut back a token where the request is that prompt again (one must be fed)."""
        entry = match.entry
        session = self.disk.load(entry, text[: entry.key_chars] if match.whole else "")
        if session is None:
            return None
        if not match.whole:
            full = session.tokens[: match.tokens] + self._encode(text[match.chars:])
            cached = min(match.tokens, len(full) - 1)
            if len(full) > limit or not session.cut(cached):
                return None
            session.binding = None
            log.info("kv disk: restored %s (%d of its %d tokens: its last prompt)", entry.path.name, cached,
                     entry.tokens)
            return Start(self._described(session), "disk", cached, full)
        log.info("kv disk: restored %s (%d tokens, %s)", entry.path.name, entry.tokens, entry.kind)
        tail = session.binding.tail if session.binding is not None else ""
        full = session.tokens + self._encode(tail + text[entry.key_chars:])
        if len(full) > limit:
            return None
        keyed = session.binding is not None  # a visible-kind checkpoint
        return Start(self._described(session), "disk", len(session.tokens), full,
                     key_chars=entry.key_chars if keyed else 0, tail=tail)

    def _take(self, start: Start) -> Start:
        """Cut the chosen session to the reused prefix: in place when the whole session is
        reused, otherwise a copy of the prefix, so the session stays for its own client."""
        s = start.session
        if start.cached == len(s.tokens):
            return start
        branch = self._branch(s, start.cached)
        if branch is None:  # cannot be trimmed and no snapshot early enough
            return Start(Session(cache=self.new_cache()), "cold", 0, start.tokens)
        # A snapshot may sit before the common prefix; start.tokens begins with its tokens.
        return Start(branch, start.source, len(branch.tokens), start.tokens)

    # -- after the turn -------------------------------------------------------------------

    def finish(self, start: Start, generated: list[int], ok: bool, binding: Binding | None, calls=None) -> None:
        """Record what the KV now holds, snapshot, checkpoint and stay within the budget.

        `generated` are the sampled tokens in order (the KV holds those that were fed back);
        `ok` is False when generation failed and the KV cannot be trusted."""
        start.session.in_use = False
        if not ok:
            self._drop(start.session)
            return
        try:
            self._record(start, generated, binding, calls)
        except Exception:  # half-recorded, its tokens and texts would disagree: lookups must not find it
            log.exception("kv: the session's new state could not be recorded; it is dropped")
            self._drop(start.session)

    def _record(self, start: Start, generated: list[int], binding: Binding | None, calls) -> None:
        s = start.session
        full = start.tokens + generated
        held = s.positions()
        held = len(full) if held is None else held
        if held > len(full) and not s.cut(len(full)):  # positions whose tokens are unknown
            self._drop(s)
            return
        s.tokens = full[: min(held, len(full))]
        s.prompt_tokens = min(len(start.tokens), len(s.tokens))
        s.prompt_text = self._decode(s.tokens[: s.prompt_tokens])
        s.text = self._decode(s.tokens)
        if binding is not None and generated and len(s.tokens) == len(full) - 1:
            # The last sampled token was never fed (a one-token reply ends before the
            # look-ahead step feeds its end-of-turn token): it is prefilled with the tail.
            binding = Binding(binding.key, self._decode(full[-1:]) + binding.tail)
        s.binding = binding if len(s.tokens) >= len(full) - 1 else None
        s.owner = start.owner
        s.calls = calls if s.binding else None
        s.last_used = time.monotonic()
        s.snapshot()
        new = len(start.tokens) - start.cached
        grown = len(s.tokens) - s.saved_tokens
        if s.calls is not None:  # an agent's loop resumes here after a restart or another client
            self._checkpoint_resident(s, "tool-call")
        elif new >= self.policy.checkpoint_min_tokens or grown >= self.policy.checkpoint_every:
            self._checkpoint_resident(s, "prefill" if new >= self.policy.checkpoint_min_tokens else "growth")
        self._enforce_budget(spare=s)

    def _checkpoint_resident(self, s: Session, reason: str) -> None:
        """A checkpoint of a session that stays resident: its host copy is memory on top of
        it, so it is taken only where the memory budget holds the copy (`copy_room`)."""
        if self.disk is not None and self.copy_room is not None and not self.copy_room(s.nbytes):
            log.info("kv checkpoint reason=%s deferred: no room in the memory budget for a %.1f MiB host copy now; "
                     "the session of %d tokens is written when it is evicted or at shutdown",
                     reason, s.nbytes / 2**20, len(s.tokens))
            return
        self.checkpoint(s, reason)

    def checkpoint(self, s: Session, reason: str) -> None:
        if self.disk is None or not s.tokens:
            return
        kind, key, tail = self._key(s)
        began = time.perf_counter()
        try:
            path = self.disk.save(s, kind, key, tail)
        except Exception as exc:  # a checkpoint must never fail the request that triggered it
            log.warning("kv disk: checkpoint failed: %s: %s", type(exc).__name__, exc)
            return
        log.info("kv checkpoint reason=%s kind=%s tokens=%d file=%s (copied in %.2fs, written in the background)",
                 reason, kind, len(s.tokens), path.name, time.perf_counter() - began)

    @staticmethod
    def _key(s: Session) -> tuple[str, str, str]:
        """(kind, key, tail) of the session's checkpoint: its file is named by kind and key."""
        return ("visible", s.binding.key, s.binding.tail) if s.binding else ("token", s.text, "")

    def keep_history(self, start: Start, text: str) -> None:
        """Checkpoint the leading part of this request's KV that holds `text` (a compacted
        conversation), keyed by that text, so a request continuing it finds it after the
        session is gone. The KV's own tokens are kept (they may split text differently
        from a fresh tokenization, and hold hidden reasoning where the request came in by
        its visible transcript)."""
        s = start.session
        found = self._text_prefix(s, text)
        kind = "token"
        if found is None and start.key_chars and len(text) >= start.key_chars:
            kind = "visible"  # the cached part holds the visible text's first key_chars characters
            found = start.tokens[: start.cached] + self._encode(start.tail + text[start.key_chars:])
            if s.tokens[: len(found)] != found:
                found = None
        if found is None:
            log.warning("kv checkpoint reason=compaction skipped: no prefix of the KV holds the compacted text")
            return
        if self.disk is None:
            return
        try:
            path = self.disk.save(Session(cache=s.cache, tokens=found, owner=start.owner), kind, text, keep_key=True)
        except Exception as exc:  # a cache that cannot be cut to the prefix (sliding window, recurrent)
            log.warning("kv checkpoint reason=compaction failed: %s: %s", type(exc).__name__, exc)
            return
        log.info("kv checkpoint reason=compaction kind=%s tokens=%d file=%s", kind, len(found), path.name)

    def _text_prefix(self, s: Session, text: str) -> list[int] | None:
        """The shortest prefix of the session's tokens that decodes to `text`, if any."""
        if not s.text.startswith(text):
            return None
        lo, hi = 0, len(s.tokens)
        while lo < hi:  # decoded length grows with the token count
            mid = (lo + hi) // 2
            if len(self._decode(s.tokens[:mid])) < len(text):
                lo = mid + 1
            else:
                hi = mid
        return s.tokens[:lo] if self._decode(s.tokens[:lo]) == text else None

    def _drop(self, s: Session) -> None:
        if s in self.sessions:
            self.sessions.remove(s)

    def _enforce_budget(self, spare: Session) -> None:
        while sum(s.nbytes for s in self.sessions) > self.policy.memory_bytes and len(self.sessions) > 1:
            idle = [s for s in self.sessions if s is not spare and not s.in_use]  # running ones stay
            if not idle:
                return
            self._evict(min(idle, key=lambda s: s.last_used), "kv memory")

    def idle_bytes(self) -> int:
        """What the resident sessions no sequence runs on hold, and the host copies of
        checkpoints still queued for writing."""
        return sum(s.nbytes for s in self.sessions if not s.in_use) + (self.disk.pending if self.disk else 0)

    def shed(self, nbytes: int) -> int:
        """Evict idle sessions, least recently used first, until `nbytes` are freed (the
        memory budget needs room for a sequence: engine/admission.py); returns the bytes freed.
        `shed_total` counts the sessions so evicted (rank 0 tells the other ranks how many)."""
        freed = 0
        while freed < nbytes and (victim := self._oldest_idle()) is not None:
            freed += victim.nbytes
            self.shed_total += 1
            self._evict(victim, "memory budget")
        return freed

    def shed_sessions(self, count: int) -> None:
        """Under lockstep, on the ranks other than 0: evict the `count` least recently used idle
        sessions, as rank 0's `shed` did (the ranks' pools hold the same sessions in the same order)."""
        for _ in range(count):
            if (victim := self._oldest_idle()) is None:
                break
            self.shed_total += 1
            self._evict(victim, "memory budget (rank 0's)")

    def _oldest_idle(self) -> Session | None:
        idle = [s for s in self.sessions if not s.in_use]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def _evict(self, victim: Session, why: str) -> None:
        """Out of memory: to disk where it is worth keeping, else dropped; one log line."""
        if self.disk is None or not self.policy.checkpoint_on_evict:
            fate = "dropped: no checkpoints"
        elif len(victim.tokens) <= victim.saved_tokens:
            fate = "already on disk"
        elif len(victim.tokens) < self.policy.checkpoint_min_tokens and victim.calls is None:  # an agent's loop is kept
            fate = f"dropped: under --kv-checkpoint-min-tokens {self.policy.checkpoint_min_tokens}"
        else:
            fate = "checkpointed"
            self.checkpoint(victim, "evict")
        log.info("%s: evicting a session of %d tokens (%.1f MiB), %s", why, len(victim.tokens),
                 victim.nbytes / 2**20, fate)
        self._drop(victim)

    def close(self) -> None:
        """Shutdown: every resident session not yet on disk is checkpointed, and written."""
        if self.disk is None:
            return
        if self.policy.checkpoint_on_shutdown:
            written = set()  # branches of one conversation can share a key: one file each
            for s in sorted(self.sessions, key=lambda s: -len(s.tokens)):
                if len(s.tokens) > s.saved_tokens and s.tokens and (key := self._key(s)[:2]) not in written:
                    written.add(key)
                    self.checkpoint(s, "shutdown")
        self.disk.flush()
