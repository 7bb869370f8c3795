"""The CPU build's kernels: lmsp_mlx/cpu_blas/experts.c and attention.c through ctypes.

MLX's CPU build has no Metal or CUDA. There, mlx-lm's gather_qmm path took 28-48 ms for
one token through a 30B-A3B layer's 8 experts, and the reference, which dequantizes them
to memory, 427 ms. experts.c reads each chosen row once, 32 codes at a time, across the
cores (2.6-2.8 ms with its AVX2 path, 11-13 ms portable). attention.c does the same for a
decode step's attention over a quantized KV cache, where the reference dequantizes blocks
of positions to memory. Both take what a float32 model produces: float32 activations,
scales and biases, codes of 1-8 bits, groups that are multiples of 32. Anything else (or a
build without the compiled module) is not taken: the `*_takes` functions say so, and the
dispatch's fallback runs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import cpu_blas
from . import reference
from .quantized import QuantizedExperts


# Multiply-adds from which a call runs across the cores. Below it (a small model's decode
# step: SmolLM2's attention at 512 positions is 0.3 M) one thread does it: in a decode step
# through MLX these calls sit between MLX's own ops and OpenBLAS's, and on 2 cores the
# OpenMP team and OpenBLAS's threads then slowed each other (a 4-bit KV cache at 512
# positions: 5.1 tok/s across the cores against 9.6 on one, and 6.6 without attention.c).
# 30B-A3B-sized calls (38 M for the experts, 67 M for attention at 16K) stay parallel.
PARALLEL_WORK = 4 << 20


def _parallel(work: int) -> bool:
    """Whether a call of `work` multiply-adds goes across the cores; if so, OpenBLAS's
    spinning workers are stopped first (they would halve the OpenMP loop)."""
    if work < PARALLEL_WORK:
        return False
    cpu_blas.park_blas_threads()
    return True


def available() -> bool:
    return cpu_blas.decode_kernel() is not None


def expert_takes(x: mx.array, indices: mx.array, gate: QuantizedExperts, up: QuantizedExperts,
                 down: QuantizedExperts) -> bool:
    parts = (gate, up, down)
    d, h = x.shape[-1], gate.output_dims
    return (available() and x.dtype == mx.float32 and len({(p.bits, p.group_size) for p in parts}) == 1
            and all(p.scales.dtype == mx.float32 and p.biases.dtype == mx.float32 for p in parts)
            and gate.group_size % 32 == 0 and d % gate.group_size == 0 and h % gate.group_size == 0
            and gate.input_dims == up.input_dims == d and up.output_dims == h and down.input_dims == h
            and down.output_dims == d)


def _contiguous(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated MLX array (a copy only if it is strided)."""
    return np.ascontiguousarray(np.asarray(a))


def expert_swiglu(x: mx.array, indices: mx.array, gate: QuantizedExperts, up: QuantizedExperts,
                  down: QuantizedExperts) -> mx.array:
    """reference.expert_swiglu's result, computed by experts.c (call `expert_takes` first)."""
    *lead, d = x.shape
    k, h = indices.shape[-1], gate.output_dims
    tokens = math.prod(lead)
    pairs = tokens * k
    xs = _contiguous(x.reshape(tokens, d))
    idx = _contiguous(indices.reshape(pairs).astype(mx.uint32))
    arrays = [_contiguous(a) for p in (gate, up, down) for a in (p.weight, p.scales, p.biases)]
    hidden = np.empty((pairs, h), np.float32)
    sums = np.empty(tokens * (d // 32) + pairs * (h // 32), np.float32)
    y = np.empty((pairs, d), np.float32)
    done = cpu_blas.decode_kernel().lmsp_expert_swiglu(
        xs.ctypes.data, idx.ctypes.data, tokens, k, gate.weight.shape[0], *(a.ctypes.data for a in arrays),
        d, h, gate.bits, gate.group_size, _parallel(3 * pairs * d * h), hidden.ctypes.data, sums.ctypes.data,
        y.ctypes.data)
    if done == -2:  # no memory for its grouping or scratch: what it computes, the plain way
        return reference.expert_swiglu(x, indices, gate, up, down)
    if done != 0:
        raise ValueError(f"experts.c did not take this call (status {done}): x {x.shape}, bits {gate.bits}, "
                         f"group {gate.group_size}")
    return mx.array(y).reshape(*lead, k, d)


# The most pairs one expert takes in lmsp_grouped_gemm, whose product reads a weight row
# once for all of them but runs at some 17 GFLOP/s here; past it (a prompt chunk) each
# expert's pairs are one OpenBLAS sgemm instead (the shim's small-row cut, for the same reason).
GROUPED_ROWS = 24


def _expert_gemms(x: np.ndarray, idx: np.ndarray, w: np.ndarray, b: np.ndarray | None, per: int) -> np.ndarray:
    """expert_product for a prompt chunk: each expert's pairs gathered, one sgemm each."""
    order = np.argsort(idx, kind="stable")
    bounds = np.searchsorted(idx[order], np.arange(w.shape[0] + 1))
    y = np.empty((idx.size, w.shape[1]), np.float32)
    for e in np.flatnonzero(np.diff(bounds)):
        pairs = order[bounds[e]:bounds[e + 1]]
        y[pairs] = x[pairs // per] @ w[e].T
        if b is not None:
            y[pairs] += b[e]
    cpu_blas.blas_ran()  # numpy's matmuls run on the shim's OpenBLAS: its workers now spin
    return y


def product_takes(x: mx.array, indices: mx.array, weight: mx.array, bias: mx.array | None, per: int) -> bool:
    return (available() and x.ndim == 2 and weight.ndim == 3 and x.shape[-1] == weight.shape[-1]
            and x.dtype == weight.dtype == mx.float32 and (bias is None or bias.dtype == mx.float32)
            and indices.ndim == 1 and indices.size == x.shape[0] * per)


def expert_product(x: mx.array, indices: mx.array, weight: mx.array, bias: mx.array | None, per: int) -> mx.array:
    """reference.expert_product's result, computed by decode.c's lmsp_grouped_gemm, which
    reads each chosen expert's weight once for all the pairs that chose it (call
    `product_takes` first)."""
    experts, m, d = weight.shape
    pairs = indices.size
    xs = _contiguous(x)
    idx = _contiguous(indices.astype(mx.uint32))
    w = _contiguous(weight)
    b = None if bias is None else _contiguous(bias)
    if pairs > GROUPED_ROWS and int(np.bincount(idx, minlength=experts).max()) > GROUPED_ROWS:
        return mx.array(_expert_gemms(xs, idx, w, b, per))
    y = np.empty((pairs, m), np.float32)
    gathered, results = np.empty((pairs, d), np.float32), np.empty((pairs, m), np.float32)
    order = np.empty(pairs + 2 * (experts + 1), np.int64)
    done = cpu_blas.decode_kernel().lmsp_grouped_gemm(
        w.ctypes.data, None if b is None else b.ctypes.data, xs.ctypes.data, idx.ctypes.data, y.ctypes.data, pairs,
        per, experts, m, d, gathered.ctypes.data, results.ctypes.data, order.ctypes.data,
        not _parallel(pairs * m * d))
    if done != 0:
        raise ValueError(f"an expert index of {indices.shape} lies outside the layer's {experts} experts")
    return mx.array(y)


def attention_takes(queries: mx.array, keys, values, group_size: int, bits: int) -> bool:
    b, hq, length, d = queries.shape
    hkv, n = keys[0].shape[1], keys[0].shape[2]
    return (available() and queries.dtype == mx.float32 and hq % hkv == 0 and n > 0
            and all(a.dtype == mx.float32 for a in (*keys[1:], *values[1:]))
            and values[0].shape[-1] == keys[0].shape[-1] and d == keys[0].shape[-1] * 32 // bits
            and d % 32 == 0 and group_size % 32 == 0 and d % group_size == 0 and 1 <= bits <= 8)


def _strided(a: mx.array) -> tuple[np.ndarray, list[int]]:
    """A zero-copy numpy view of a cache view, and its (batch, head, row) strides in elements
    (a copy only if its last axis is strided)."""
    view = np.asarray(a)
    if view.strides[-1] != view.itemsize:
        view = np.ascontiguousarray(view)
    return view, [s // view.itemsize for s in view.strides[:3]]


def decode_attention(queries: mx.array, keys, values, scale: float, group_size: int, bits: int,
                     first: mx.array | None = None) -> mx.array:
    """reference.decode_attention's result, computed by attention.c (call `attention_takes` first)."""
    b, hq, length, d = queries.shape
    hkv, n = keys[0].shape[1], keys[0].shape[2]
    rows = hq // hkv * length
    q = _contiguous(queries.reshape(b, hkv, rows, d))
    views = [_strided(a) for a in (*keys, *values)]
    strides = np.array([s for _, part in views for s in part], np.int64)
    starts = None if first is None else np.ascontiguousarray(np.asarray(first), np.int32)
    attended = n * b if starts is None else int(n * b - starts.sum())
    out = np.empty((b, hkv, rows, d), np.float32)
    done = cpu_blas.decode_kernel().lmsp_decode_attention(
        q.ctypes.data, b, hkv, rows, d, n, *(v.ctypes.data for v, _ in views), strides.ctypes.data,
        None if starts is None else starts.ctypes.data, bits, group_size, scale,
        _parallel(2 * hkv * rows * attended * d), out.ctypes.data)
    if done == -2:  # no memory for its split states: what it computes, the plain way
        return reference.decode_attention(queries, keys, values, scale, group_size, bits, first)
    if done != 0:
        raise ValueError(f"attention.c did not take this call (status {done}): queries {queries.shape}, "
                         f"bits {bits}, group {group_size}")
    return mx.array(out).reshape(b, hq, length, d)


def prefill_attention(queries: mx.array, keys, values, scale: float, mask, group_size: int, bits: int,
                      sinks: mx.array | None = None) -> mx.array:
    """A prompt chunk's attention over a quantized cache on the CPU build: the cache
    dequantized and MLX's scaled_dot_product_attention with the chunk's mask. mlx-lm's
    quantized attention runs MLX's CPU quantized_matmul, which made a 4-bit cache's prefill
    10-18x slower than a plain cache's (SmolLM2-135M: 26 against 467 tok/s at 2,048
    tokens). The dequantized K and V live for one layer's call."""
    k = mx.dequantize(*keys, group_size, bits).astype(queries.dtype)
    v = mx.dequantize(*values, group_size, bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)
