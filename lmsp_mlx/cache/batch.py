"""Several sequences' quantized KV caches as one batch: what mlx-lm's `BatchKVCache` is for
plain caches, for `QuantizedKVCache` (`--kv-bits`), which mlx-lm has no batch form of.

The layout is BatchKVCache's: the sequences are right-aligned in one buffer per part
(codes, scales, biases; (B, Hkv, capacity, ...)), each row left-padded to the longest,
`left_padding` (B,) saying by how much and `offset` (B,) each row's own length, which the
model's RoPE reads. Row b's valid positions are left_padding[b].._idx-1. New positions are
quantized with `mx.quantize` as QuantizedKVCache quantizes them (per row and group, so a
sequence's codes are the same merged or alone), written at `_idx` for every row.

A decode step's attention reads the buffers where they are, skipping each row's padding:
the wrapped attention (kernels/install.py) passes `left_padding` to `decode_attention` as
`first`. Every other consumer gets `make_mask`'s left-padded causal mask, as with
BatchKVCache. `merge` builds one from sequences' own caches, `extract` gives one back,
and `filter` / `extend` drop rows and add rows, as BatchKVCache's do.

`write_row` puts one sequence into a free row of a batch, for this class and mlx-lm's
plain and recurrent batch forms: a join that copies only the joiner.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache, QuantizedKVCache, _BaseCache

Parts = tuple[mx.array, mx.array, mx.array]  # codes, scales, biases


class BatchQuantizedKVCache(_BaseCache):
    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Parts | None = None
        self.values: Parts | None = None
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self.offset = mx.array([-p for p in left_padding], dtype=mx.int32)
        self._idx = 0
        self.group_size, self.bits = group_size, bits

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch of `caches` (one layer's, one per sequence), each copied right-aligned.
        They must share a bit width and group; a ValueError says otherwise."""
        kinds = {(c.group_size, c.bits) for c in caches}
        if len(kinds) != 1:
            raise ValueError(f"quantized caches of different widths or groups cannot share a batch: {sorted(kinds)}")
        group_size, bits = kinds.pop()
        lengths = [0 if c.keys is None else c.offset for c in caches]
        n = max(lengths)
        batch = cls([n - length for length in lengths], group_size, bits)
        if n == 0:
            return batch
        capacity = (n // cls.step + 1) * cls.step  # room for the next steps: no regrowth at once
        template = next(c for c in caches if c.keys is not None and c.offset)

        def merged(which: str) -> Parts:
            parts = []
            for j, like in enumerate(getattr(template, which)):
                buffer = mx.zeros((len(caches), like.shape[1], capacity, like.shape[-1]), like.dtype)
                for i, (c, length) in enumerate(zip(caches, lengths)):
                    if length:
                        buffer[i : i + 1, :, n - length : n] = getattr(c, which)[j][..., :length, :]
                parts.append(buffer)
            return tuple(parts)

        batch.keys, batch.values = merged("keys"), merged("values")
        batch.offset = batch.offset + n
        batch._idx = n
        return batch

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as a sequence's own cache: its positions without the padding."""
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = int(self.left_padding[idx].item())
        if self.keys is not None and self._idx > padding:
            cache.keys, cache.values = (tuple(mx.contiguous(a[idx : idx + 1, :, padding : self._idx]) for a in parts)
                                        for parts in (self.keys, self.values))
            cache.offset = self._idx - padding
        return cache

    def filter(self, rows: mx.array) -> None:
        """Keep only `rows` (indices into the batch), in place; what every kept row now
        pads on the left alike is cut, as BatchKVCache.filter does."""
        self.left_padding, self.offset = self.left_padding[rows], self.offset[rows]
        if self.keys is not None:
            self.keys, self.values = (tuple(a[rows] for a in parts) for parts in (self.keys, self.values))
        if (cut := min(self.left_padding.tolist(), default=0)) > 0:
            if self.keys is not None:
                self.keys, self.values = (tuple(a[..., cut:, :] for a in parts) for parts in (self.keys, self.values))
            self._idx -= cut
            self.left_padding = self.left_padding - cut

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows, in place: both right-aligned at the longer one's index, so
        a row's own positions keep their codes (only padding is added on the left)."""
        if (other.group_size, other.bits) != (self.group_size, self.bits):
            raise ValueError("quantized caches of different widths or groups cannot share a batch")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        end = max(self._idx, other._idx)
        capacity = max(c.keys[0].shape[2] - c._idx for c in (self, other) if c.keys is not None) + end
        template = self if self.keys is not None else other

        def aligned(c: BatchQuantizedKVCache, which: str) -> list[mx.array]:
            rows = c.left_padding.shape[0]
            left = end - c._idx
            out = []
            for j, like in enumerate(getattr(template, which)):
                a = getattr(c, which)[j][..., : c._idx, :] if c.keys is not None else \
                    mx.zeros((rows, like.shape[1], 0, like.shape[-1]), like.dtype)
                out.append(mx.pad(a, [(0, 0), (0, 0), (left, capacity - end), (0, 0)]))
            return out

        self.keys, self.values = (tuple(mx.concatenate(pair) for pair in zip(aligned(self, w), aligned(other, w)))
                                  for w in ("keys", "values"))
        self.left_padding = mx.concatenate([self.left_padding + (end - self._idx),
                                            other.left_padding + (end - other._idx)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = end

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        b, heads, steps, _ = keys.shape
        prev = self._idx
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            self._grow(b, heads, steps, keys.shape[-1], values.shape[-1], keys.dtype)
        for parts, new in ((self.keys, keys), (self.values, values)):
            for buffer, q in zip(parts, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                buffer[..., prev : prev + steps, :] = q
        self._idx += steps
        self.offset = self.offset + steps
        return self.keys_and_values()

    def _grow(self, b: int, heads: int, steps: int, dk: int, dv: int, dtype: mx.Dtype) -> None:
        more = (self.step + steps - 1) // self.step * self.step
        per_word = 32 // self.bits

        def fresh(d: int) -> Parts:
            shape = (b, heads, more)
            return (mx.zeros((*shape, d // per_word), mx.uint32), mx.zeros((*shape, d // self.group_size), dtype),
                    mx.zeros((*shape, d // self.group_size), dtype))

        if self.keys is None:
            self.keys, self.values = fresh(dk), fresh(dv)
            return
        self.keys, self.values = (tuple(mx.concatenate([a[..., : self._idx, :], z], axis=2) for a, z in zip(old, fresh(d)))
                                  for old, d in ((self.keys, dk), (self.values, dv)))

    def keys_and_values(self) -> tuple[Parts, Parts]:
        return tuple(tuple(a[..., : self._idx, :] for a in parts) for parts in (self.keys, self.values))

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for parts in (self.keys, self.values) for a in parts)


# -- writing one sequence into a free row --------------------------------------------------------


def write_row(batch, row: int, cache) -> bool:
    """Put `cache` (one sequence's own cache of one layer) into row `row` of `batch` (that
    layer's batch form), in place, copying only that sequence's state; False where this
    batch form cannot take it there (a sliding-window batch, whose rows share one ring
    position, or a sequence longer than the batch's positions), and then nothing changed.

    The row's earlier content needs no clearing: a KV row's positions before the new
    `left_padding` are masked, and a recurrent row's state is replaced whole."""
    if type(batch) is CacheList:
        if not all(fits(b, c) for b, c in zip(batch.caches, cache.caches)):
            return False
        return all([write_row(b, row, c) for b, c in zip(batch.caches, cache.caches)])
    if not fits(batch, cache):
        return False
    if type(batch) is ArraysCache:
        for e, state in enumerate(cache.cache):
            batch.cache[e][row : row + 1] = state if state is not None else mx.zeros_like(batch.cache[e][:1])
        return True
    length = 0 if cache.keys is None else cache.offset
    end = batch._idx
    if length:
        if type(batch) is BatchKVCache:
            batch.keys[row : row + 1, :, end - length : end] = cache.keys[..., :length, :]
            batch.values[row : row + 1, :, end - length : end] = cache.values[..., :length, :]
        else:
            for mine, theirs in ((batch.keys, cache.keys), (batch.values, cache.values)):
                for a, b in zip(mine, theirs):
                    a[row : row + 1, :, end - length : end] = b[..., :length, :]
    batch.left_padding[row] = end - length
    batch.offset[row] = length
    return True


def fits(batch, cache) -> bool:
    """Whether `write_row` can put `cache` into a row of `batch`."""
    if type(batch) is ArraysCache:
        return type(cache) is ArraysCache and all(c is not None for c in batch.cache)
    if type(batch) is CacheList:
        return type(cache) is CacheList and all(fits(b, c) for b, c in zip(batch.caches, cache.caches))
    if (type(batch), type(cache)) not in ((BatchKVCache, KVCache), (BatchQuantizedKVCache, QuantizedKVCache)):
        return False
    if batch.keys is None:
        return False
    length = 0 if cache.keys is None else cache.offset
    return length <= batch._idx
