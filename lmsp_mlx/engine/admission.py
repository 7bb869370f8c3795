"""Admission by memory: one budget (`--memory-budget-mb`) for everything the loaded models
hold, their weights, the KV of their running sequences and their resident KV sessions.

A sequence joins the batch only when its KV, grown to its output limit or to the context
(`need`), fits beside what the running ones may grow to and the weights. Until then it
waits, in arrival order, and the queue's limits still apply. The resident sessions give
way first: idle ones go to disk (their pool's own eviction) to make room. A request whose
KV could never fit, even alone beside its model's weights, is refused before it queues
(`too_big`: 507 with both figures).

The worker thread alone calls `fits`; the figures it keeps are read by /metrics.

A checkpoint that keeps its session resident (the end of a turn) copies the KV to host
memory for the writer: that copy is made only where `room` holds it, else the checkpoint
waits for the session's eviction (whose copy replaces the memory it frees) or shutdown
(cache/pool.py, `copy_room`).

The process's memory outside MLX's (its Python objects, the requests' buffers, the store)
is the runtime's own, measured once the first models are loaded (`HostGrowth`); where it
grows past that by more than a noise floor, the growth takes room from the budget too, so
the whole process stays within the budget plus the runtime's own.

Invariant: the KV reserved for running sequences plus the idle resident sessions plus the
loaded weights plus the host growth stay within the budget, except where a sequence runs
alone (nothing else to wait for: it is admitted whatever, logged).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import mlx.core as mx

from .footprint import gb

log = logging.getLogger("lmsp_mlx.engine")


def out_of_memory(exc: BaseException) -> bool:
    """An allocation failure, as MLX's allocators word it ([metal::malloc], [malloc],
    CUDA's out of memory) or as Python raises it."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "malloc" in text or "allocate" in text or "out of memory" in text.lower()


def cache_limit(budget: int) -> int:
    """MLX's cache of freed buffers (kept for reuse, resident all the while), held to a
    twentieth of the budget: a step's buffers still come from it, and the large ones a long
    prompt's prefill or a cache's growth frees go back rather than stay outside the budget."""
    return budget // 20


@dataclass
class MemoryFigures:
    """For /metrics, as the worker last counted them."""

    budget: int | None = None
    weights: int = 0
    kv_reserved: int = 0  # the running sequences', each grown to its limit
    kv_resident: int = 0  # idle resident sessions
    host: int = 0  # the process's memory outside MLX's, grown past the runtime's own
    waits: int = 0  # sequences that waited for memory before joining


HOST_NOISE = 16 * 2**20  # host growth below this is not counted: see HostGrowth


class HostGrowth:
    """How far the process's memory outside MLX's (its resident size less MLX's active and
    cached buffers, read together) has grown past where it stood once the first models were
    loaded (`start`): the runtime's own, which the budget does not cover.

    Read where MLX's arrays are in the process's heap (Linux, the CPU device), from
    /proc/self/statm; elsewhere (Metal, CUDA: MLX's buffers are the device's) it reads 0, as
    `start` logs. Growth under `noise` is not counted: a Python process's first requests
    import modules and open thread arenas (a few MiB), and a budget of a few MiB must keep
    its figures; what a soak's 16 clients hold (buffers, the store, objects) is 50-100 MiB."""

    def __init__(self, noise: int = HOST_NOISE) -> None:
        self.noise = noise
        self._base: int | None = None
        self._page = 0  # bytes a page, read at `start` where statm is

    def start(self) -> None:
        readable = sys.platform.startswith("linux") and mx.default_device().type == mx.DeviceType.cpu
        if readable:
            self._page = os.sysconf("SC_PAGE_SIZE")
        self._base = self._outside() if readable else None
        if self._base is None:
            log.info("memory: the process's memory outside MLX's is not read on this platform; "
                     "the budget counts MLX's memory only")
        else:
            log.info("memory: the runtime's own memory outside MLX's is %s; growth past it by more "
                     "than %s takes room from the budget", gb(self._base), gb(self.noise))

    def _outside(self) -> int | None:
        try:
            with open("/proc/self/statm", "rb") as f:
                rss = int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None
        return rss - mx.get_active_memory() - mx.get_cache_memory()

    def __call__(self) -> int:
        """The growth counted now, bytes (0 before `start`, or where it is not read)."""
        if self._base is None or (now := self._outside()) is None:
            return 0
        grown = now - self._base
        return grown if grown > self.noise else 0


class MemoryGate:
    def __init__(self, budget: int | None, source: str, weights: Callable[[], int],
                 host: Callable[[], int] = lambda: 0) -> None:
        self.budget, self.source = budget, source
        self._weights = weights  # the loaded models' weights, bytes
        self._host = host  # the process's memory outside MLX's, grown past the runtime's own (HostGrowth)
        self.figures = MemoryFigures(budget=budget)

    @staticmethod
    def need(slot, prompt_tokens: int, max_tokens: int) -> int:
        """A sequence's KV grown to its output limit or to the context."""
        if slot.kv is None:
            return 0
        return slot.kv.bytes_for(min(prompt_tokens + max_tokens, slot.lm.context_length))

    def output_room(self, slot, prompt_tokens: int) -> int | None:
        """The most output tokens a sequence's KV may grow to alone beside its model's
        weights (a request that sets no output limit gets no more); None: no bound."""
        kv = slot.kv
        if self.budget is None or kv is None or kv.per_token == 0:
            return None
        left = self.budget - slot.size_bytes - kv.fixed
        if left < 0:
            return 0
        return max(0, (left // (kv.per_token * kv.step) + 1) * kv.step - prompt_tokens)

    def too_big(self, slot, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run here (its KV alone beside its model's weights exceeds
        the budget), or None."""
        if self.budget is None:
            return None
        need = self.need(slot, prompt_tokens, max_tokens)
        if slot.size_bytes + need <= self.budget:
            return None
        return (f"this request's KV cache grows to about {gb(need)} ({prompt_tokens} prompt tokens and up to "
                f"{max_tokens} more), but {gb(max(0, self.budget - slot.size_bytes))} of the {gb(self.budget)} "
                f"memory budget ({self.source}) is left beside {slot.id}'s weights; ask for fewer output tokens "
                f"or send a shorter prompt")

    def room(self, reserved: int, pools: list, host: int | None = None) -> int | None:
        """The budget's bytes free beside the weights, the running sequences' reservations
        (`reserved`), the idle resident sessions, the checkpoint copies queued for writing,
        MLX's buffer cache and the host growth (`host`, as read already, else read now);
        None: no budget."""
        if self.budget is None:
            return None
        host = self._host() if host is None else host
        held = self._weights() + reserved + sum(p.idle_bytes() for p in pools) + host
        return self.budget - held - cache_limit(self.budget)

    def fits(self, need: int, running: Iterable[int], pools: list, alone: bool) -> bool:
        """Whether a sequence needing `need` bytes may join beside the running ones (their
        reservations) and all `room` counts: idle resident sessions are evicted to make room
        first. `alone`: nothing runs, so nothing could free memory by waiting: it joins whatever."""
        if self.budget is None:
            return True
        reserved, host = sum(running), self._host()  # host: read once (/proc), before any eviction's copy
        for pool in pools:
            if (short := need - self.room(reserved, pools, host)) <= 0:
                break
            pool.shed(short)  # an evicted session's checkpoint copy counts until it is written
        free = self.room(reserved, pools, host)
        self.count(reserved, pools, host)
        if free >= need:
            return True
        if alone:
            log.warning("memory: a sequence needing %s joins alone although only %s of the budget is free",
                        gb(need), gb(max(0, free)))
            return True
        return False

    def count(self, reserved: int, pools: list, host: int | None = None) -> None:
        """Refresh the figures /metrics shows."""
        f = self.figures
        f.weights, f.kv_reserved, f.kv_resident = self._weights(), reserved, sum(p.idle_bytes() for p in pools)
        f.host = self._host() if host is None else host
