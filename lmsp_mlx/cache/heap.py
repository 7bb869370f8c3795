"""Hand freed heap memory back to the OS, where glibc keeps it.

A server process has many threads that allocate (the worker's MLX arrays, the checkpoint
writer's host copies, the event loop's to_thread pool), and glibc gives each its own
arena, up to 8 per core. Memory freed inside an arena stays resident until the arena's
top is free: in a 10-minute soak the resident size grew from 1.1 to 2.9 GiB while MLX's
own active memory stayed at 0.7-0.95 GiB, held in about twenty 64 MiB arenas.
`malloc_trim(0)` returns the free pages of every arena (madvise), whatever thread calls
it; it walks the arenas, so the worker's `HeapTrimmer` runs it at most once per `every`
seconds after steps (a long prefill frees its KV cache's old buffer at each 256-position
growth), and whenever the worker goes idle; the checkpoint writer runs it after each write
(the host copy it frees was made in the worker's arena). One 3,200-token prompt of the
default model, with its checkpoint, left 46 MiB outside MLX's memory when the trim ran only
after sequences ended; now 13 MiB.

The trim after steps ran at most every 5 s until the memory budget's benchmark (8 prompts
of 3,200 tokens at 1,400 MiB) peaked 3 MiB over the budget plus the runtime's own: each
256-token growth of 5 sequences' caches frees buffers MLX's cache does not keep, and 5 s of
them outlasted the room the budget had counted. Every second: 161 and 20 MiB within, in
two runs.
A trim with nothing to return takes about a millisecond.

(A fixed mmap threshold, `mallopt(M_MMAP_THRESHOLD, 256 KiB)`, returned those buffers at
once, but every step's large scratch buffers were then mapped and zeroed afresh: decode
and prefill were about 10% slower on the default model in one A/B run. Not taken.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        _libc = None


def trim_heap() -> None:
    """Return every arena's free pages now (after a checkpoint's host copy is freed: made by
    the worker, freed by the writer, its pages would stay in the worker's arena)."""
    if _libc is not None:
        _libc.malloc_trim(0)


class HeapTrimmer:
    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._last = 0.0

    def __call__(self, idle: bool = False) -> None:
        """Trim, unless it was done less than `every` seconds ago; `idle`: the worker is about
        to wait for work, so a trim delays nothing (and the last sequence's pages go now)."""
        now = time.monotonic()
        if idle or now - self._last >= self.every:
            self._last = now
            trim_heap()
