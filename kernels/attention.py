"""Decode attention over a quantized KV cache: the kernel, its dispatch and its limits.

`decode_attention(queries, keys, values, scale, group_size, bits)` takes what mlx-lm's
quantized attention takes (queries (B, Hq, L, D); keys and values as QuantizedKVCache
returns them, (packed, scales, biases) views of its buffers) and returns (B, Hq, L, D).
Every query position sees all N cached positions, as in a decode step.

The kernel (decode_attention.metal / .cu) reads K and V where the cache keeps them (the
views' strides, no copy), in splits of CHUNK positions across the GPU, and the splits'
partial softmax states are merged here. Shapes it does not take (head sizes that are not
a multiple of 32, more than 1024 query values per KV head) go to the reference.
"""

from __future__ import annotations

import mlx.core as mx

from . import reference
from .dispatch import Dispatch, backend, close
from .quantized import GROUP_SIZES, KV_BITS
from .sources import kernel as build

CHUNK = 256  # positions per threadgroup: 64 splits per KV head at 16K
WARPS = 4


def _fits(queries: mx.array, keys, group_size: int, bits: int) -> bool:
    _, hq, length, d = queries.shape
    hkv = keys[0].shape[1]
    return (d % 32 == 0 and d % group_size == 0 and hq % hkv == 0 and (hq // hkv) * length * d <= 1024
            and bits in KV_BITS and group_size in GROUP_SIZES and keys[0].shape[2] > 0)


def kernel(queries, keys, values, scale: float, group_size: int, bits: int) -> mx.array:
    b, hq, length, d = queries.shape
    hkv, n = keys[0].shape[1], keys[0].shape[2]
    rows = hq // hkv * length  # query rows per KV head: the group's heads, each position
    q = mx.contiguous(queries.reshape(b, hq * length, d))
    splits = -(-n // CHUNK)
    run = build(backend(), "decode_attention", "body",
                ("q", "kw", "ks", "kb", "vw", "vs", "vb", "n", "scale"), ("o_acc", "o_max", "o_sum"),
                contiguous=False)
    acc, top, total = run(
        inputs=[q, *keys, *values, mx.array([n], mx.int32), mx.array([scale], mx.float32)],
        # T and S name the input dtypes though the body does not use them: MLX's CUDA
        # backend tells compiled kernels apart by name and template args only.
        template=[("T", queries.dtype), ("S", keys[1].dtype), ("D", d), ("G", rows), ("BITS", bits), ("GS", group_size),
                  ("WARPS", WARPS), ("CHUNK", CHUNK)],
        grid=(32 * WARPS, b * hkv, splits),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(b * hkv, splits, rows, d), (b * hkv, splits, rows), (b * hkv, splits, rows)],
        output_dtypes=[mx.float32] * 3,
    )
    return merge(acc, top, total).reshape(b, hq, length, d).astype(queries.dtype)


def merge(acc: mx.array, top: mx.array, total: mx.array) -> mx.array:
    """The splits' partial softmax states -> attention output, (B*Hkv, rows, D).

    acc (B*Hkv, splits, rows, D) holds each split's exp-weighted V sums relative to its
    own running maximum `top`; `total` the matching sums of weights."""
    weight = mx.exp(top - top.max(axis=1, keepdims=True))  # (B*Hkv, splits, rows)
    return (acc * weight[..., None]).sum(axis=1) / (total * weight).sum(axis=1)[..., None]


def _config(queries, keys, values, scale, group_size, bits) -> tuple:
    return (backend(), queries.shape[1] // keys[0].shape[1] * queries.shape[2], queries.shape[3], bits,
            group_size, str(keys[1].dtype), str(queries.dtype))


def _kernel_or_reference(queries, keys, values, scale, group_size, bits):
    if not _fits(queries, keys, group_size, bits):
        return reference.decode_attention(queries, keys, values, scale, group_size, bits)
    return kernel(queries, keys, values, scale, group_size, bits)


decode_attention = Dispatch("decode_attention", _kernel_or_reference, reference.decode_attention, _config,
                            lambda got, want: close(got, want, 2e-3))
