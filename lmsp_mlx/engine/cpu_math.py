"""Fused prefill ops for MLX's CPU backend: SwiGLU and causal attention.

Measured on our Linux machines (mlx-cpu 0.32): `mx.exp` on 750k float32 values takes
16-20 ms, numpy's 0.5 ms, while multiply/add take 0.3 ms; and each MLX or numpy op is a
separate pass over memory. With the matmuls on OpenBLAS (lmsp_mlx/cpu_blas), the SiLU and
attention's softmax cost more than all of a layer's matmuls. The compiled shim's fused
kernels (`cpu_blas/prefill.c`, AVX2 exp) do each in one or two passes: for 512 tokens of
SmolLM2 (9 heads, 3 KV heads) a SwiGLU drops from 21 ms to 1.1 ms, a layer's attention from
72 ms (mx.fast) to about 6.

Prefill attention with an explicit mask array (sliding windows, padding) runs in numpy:
the same OpenBLAS for the two matmuls and a vectorised exp. Decode steps (one query) keep
mx.fast, where the copies would cost more than the tiny softmax.

On the CPU backend only, the loader binds `OPS` in its own copy of the module that
defines the model (engine/model_ops.py; mlx-lm itself is left unchanged) and wraps the
model's RoPE layers (`wrap_ropes`); Metal and CUDA keep MLX's own kernels. Without the compiled shim, SwiGLU
and causal attention stay MLX's own.

For llama and qwen2 float32 models, batch-1 prompt chunks skip MLX altogether
(cpu_prefill.py chains the same kernels in C); these swaps serve every other model and
cache, and the MLX path those fall back to.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations, base

from .. import cpu_blas

# Below this many elements (a decode step) the copies to numpy and back cost more than
# MLX's slow exp: mlx-lm's single compiled swiglu is faster there.
_FAST_FROM = 16384


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    kernels = cpu_blas.fused_kernels()
    if kernels is None or gate.size < _FAST_FROM or gate.shape != x.shape or {gate.dtype, x.dtype} != {mx.float32}:
        return activations.swiglu(gate, x)
    g, u = np.ascontiguousarray(gate), np.ascontiguousarray(x)
    out = np.empty(g.shape, np.float32)
    kernels.lmsp_swiglu(g.ctypes.data, u.ctypes.data, out.ctypes.data, g.size)
    return mx.array(out)


def _rows(a: mx.array) -> np.ndarray:
    """A (B, H, S, D) array whose every head is S contiguous rows, without a copy when it
    already is one: the KV cache hands attention a slice of its padded buffer, and copying
    that (all layers, long contexts) cost more than the attention of a short suffix."""
    view = np.asarray(a)
    if view.dtype == np.float32 and view.strides[-1] == 4 and view.strides[-2] == 4 * view.shape[-1]:
        return view
    return np.ascontiguousarray(view, dtype=np.float32)


def causal_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal grouped-query attention in the fused kernel; shapes as mx.fast's.

    Each KV head's group of query heads is laid out position-major, (length, group, dim),
    so one sgemm covers the whole group."""
    b, heads, length, dim = queries.shape
    kv_heads, source = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = np.ascontiguousarray(np.asarray(queries).reshape(b, kv_heads, group, length, dim).transpose(0, 1, 3, 2, 4))
    k, v = _rows(keys), _rows(values)
    out = np.empty(q.shape, np.float32)
    kernels = cpu_blas.fused_kernels()
    cpu_blas.blas_ran()
    for i in range(b):
        for h in range(kv_heads):
            if kernels.lmsp_causal_attention(
                q[i, h].ctypes.data, k[i, h].ctypes.data, v[i, h].ctypes.data, out[i, h].ctypes.data,
                length, group, source, dim, scale,
            ):
                raise MemoryError("no memory for the attention scores")
    return mx.array(out).transpose(0, 1, 3, 2, 4).reshape(b, heads, length, dim)


@lru_cache(maxsize=8)  # every layer's queries and keys share one prompt chunk's tables
def _rope_tables(offset: int, length: int, dims: int, base: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotation angles, (length, dims / 2), computed in float64."""
    angles = (offset + np.arange(length))[:, None] * scale * np.power(base, -np.arange(0, dims, 2) / dims)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class FusedRoPE(nn.Module):
    """nn.RoPE (rotate-halves form) with prefill on the fused kernel; everything else,
    decode steps included, goes to the wrapped module."""

    def __init__(self, rope: nn.RoPE) -> None:
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        kernels = cpu_blas.fused_kernels()
        if kernels is None or x.ndim != 4 or x.shape[2] < 2 or x.dtype != mx.float32 or not isinstance(offset, int):
            return self.rope(x, offset=offset)
        b, heads, length, dim = x.shape
        dims = self.rope.dims
        cos, sin = _rope_tables(offset, length, dims, float(self.rope.base), float(self.rope.scale))
        src = np.asarray(x)  # a strided view of MLX's buffer: no copy
        if src.strides[-1] != 4:
            src = np.ascontiguousarray(src)
        out = np.empty(x.shape, np.float32)
        kernels.lmsp_rope(
            src.ctypes.data, out.ctypes.data, b, heads, length, dim, *(st // 4 for st in src.strides[:3]),
            dims, cos.ctypes.data, sin.ctypes.data,
        )
        return mx.array(out)


@lru_cache(maxsize=16)
def _future(length: int, source: int) -> np.ndarray:
    """True where a query (the last `length` of `source` positions) would see the future."""
    return np.triu(np.ones((length, source), dtype=bool), k=source - length + 1)


def _grouped_mask(mask: mx.array, heads: int, kv_heads: int) -> np.ndarray:
    """An MLX mask (.., H or 1, L, S) laid out for scores of shape (B, kv_heads, group, L, S)."""
    m = np.array(mask)
    if m.ndim == 4 and m.shape[1] == heads and heads > 1:
        return m.reshape(m.shape[0], kv_heads, heads // kv_heads, *m.shape[2:])
    return m[:, :, None] if m.ndim == 4 else m


def prefill_attention(queries, keys, values, scale: float, mask) -> mx.array:
    """Grouped-query softmax attention with any mask; shapes as mx.fast.scaled_dot_product_attention.

    All of it runs in numpy: q, k and v (small) are copied in and the output copied back,
    instead of the large score matrix going both ways; numpy's matmul is the same OpenBLAS."""
    b, heads, length, dim = queries.shape
    kv_heads, source = keys.shape[1], keys.shape[2]
    cpu_blas.blas_ran()  # numpy's matmuls run on the same OpenBLAS
    q = np.array((queries * scale).reshape(b, kv_heads, heads // kv_heads, length, dim))
    scores = q @ np.array(keys)[:, :, None].swapaxes(-1, -2)  # (B, kv_heads, group, L, S)
    hidden = None  # positions a query must not see
    if isinstance(mask, str):  # "causal"
        hidden = _future(length, source)
    elif mask is not None:
        m = _grouped_mask(mask, heads, kv_heads)
        if m.dtype == np.bool_:
            hidden = ~m
        else:
            scores += m
    if hidden is not None:
        np.copyto(scores, -np.inf, where=hidden)
    scores -= scores.max(-1, keepdims=True)
    # Far-below-max scores would make exp return denormals, which are 2x slower in exp
    # and far slower in the BLAS matmul that follows; e^-80 is already nothing beside 1.
    np.maximum(scores, -80.0, out=scores)
    np.exp(scores, out=scores)
    if hidden is not None:
        np.copyto(scores, 0.0, where=hidden)
    scores /= scores.sum(-1, keepdims=True)
    out = scores @ np.array(values)[:, :, None]
    return mx.array(out).reshape(b, heads, length, -1).astype(queries.dtype)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's `models.base.scaled_dot_product_attention`, with numpy's softmax for prefill."""
    plain = not hasattr(cache, "bits") and sinks is None and queries.dtype == mx.float32
    if plain and queries.shape[2] > 1:
        if mask == "causal" and cpu_blas.fused_kernels() is not None:
            return causal_attention(queries, keys, values, scale)
        return prefill_attention(queries, keys, values, scale, mask)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)


# What the CPU backend binds in its copy of a model's module (engine/model_ops.py), by the
# name the module calls: mlx-lm's function there, and ours.
OPS = {
    "swiglu": (activations.swiglu, swiglu),
    "scaled_dot_product_attention": (base.scaled_dot_product_attention, scaled_dot_product_attention),
}


def wrap_ropes(model: nn.Module) -> int:
    """Wrap the model's plain (rotate-halves) RoPE layers in FusedRoPE; returns how many."""
    ropes = [m for _, m in model.named_modules() if type(m.get("rope")) is nn.RoPE and not m["rope"].traditional]
    for m in ropes:
        m.rope = FusedRoPE(m.rope)
    return len(ropes)
