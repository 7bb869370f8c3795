"""Decode attention over a quantized KV cache: the kernel, its dispatch and its limits.

`decode_attention(queries, keys, values, scale, group_size, bits, first=None)` takes what
mlx-lm's quantized attention takes (queries (B, Hq, L, D); keys and values as
QuantizedKVCache returns them, (packed, scales, biases) views of its buffers) and returns
(B, Hq, L, D). Every query position of batch row b sees cached positions first[b]..N-1, as
in a decode step: `first` (B,) int32 is the left padding of a batch of sequences of
different lengths (cache/batch.py's BatchQuantizedKVCache), None for none.

The kernel (decode_attention.metal / .cu) reads K and V where the cache keeps them (the
views' strides, no copy), in splits of CHUNK positions across the GPU; a second, small
kernel merges the splits' partial softmax states (under CUDA, the last split of each head
merges them in the same launch). Shapes it does not take (head sizes
that are not a multiple of 32, values narrower than keys, more than 1024 query values
per KV head, grids past CUDA's limits) go to the reference. On MLX's CPU build the kernel
is attention.c (kernels/cpu.py) for a float32 model's cache, the reference otherwise.
"""

from __future__ import annotations

import struct
from functools import lru_cache

import mlx.core as mx

from . import cpu, reference
from .dispatch import Dispatch, backend, close
from .quantized import GROUP_SIZES, KV_BITS
from .sources import kernel as build

CHUNK = 256  # positions per threadgroup: 64 splits per KV head at 16K
WARPS = 4  # simdgroups per threadgroup (their merge takes WARPS * G * D floats of its memory)
BATCH = 4  # positions a simdgroup loads together
FUSED = True  # under CUDA, merge the splits in the same launch ("state+body+last"); Metal keeps two


def _fits(queries: mx.array, keys, values, group_size: int, bits: int) -> bool:
    b, hq, length, d = queries.shape
    hkv = keys[0].shape[1]
    return (d % 32 == 0 and d % group_size == 0 and hq % hkv == 0 and (hq // hkv) * length * d <= 1024
            and values[0].shape[-1] == keys[0].shape[-1]  # one head size for K and V
            and bits in KV_BITS and group_size in GROUP_SIZES and keys[0].shape[2] > 0
            and b * hq * length < 65536 and -(-keys[0].shape[2] // CHUNK) < 65536)  # CUDA's grid y and z limits


def kernel(queries, keys, values, scale: float, group_size: int, bits: int, first: mx.array | None = None) -> mx.array:
    b, hq, length, d = queries.shape
    hkv, n = keys[0].shape[1], keys[0].shape[2]
    rows = hq // hkv * length  # query rows per KV head: the group's heads, each position
    q = mx.contiguous(queries.reshape(b, hq * length, d))
    splits = -(-n // CHUNK)
    fused = _fused()
    body = build(backend(), "decode_attention", "state+body+last" if fused else "body",
                 ("q", "kw", "ks", "kb", "vw", "vs", "vb", "first"),
                 ("state", "result") if fused else ("o_acc", "o_max", "o_sum"), contiguous=False)
    states = [(b * hkv, splits, rows, d), (b * hkv, splits, rows), (b * hkv, splits, rows)]
    # fused: the three states and a counter per (batch, KV head) in one float output
    state_size = b * hkv * splits * rows * (d + 2) + b * hkv
    outputs = body(
        inputs=[q, *keys, *values, _no_padding(b) if first is None else first.astype(mx.int32)],
        # T and S name the input dtypes though the body does not use them: MLX's CUDA
        # backend tells compiled kernels apart by name and template args only. The scale
        # travels as its float bits (fixed per model: one build, no per-call array).
        template=[("T", queries.dtype), ("S", keys[1].dtype), ("D", d), ("G", rows), ("BITS", bits),
                  ("GS", group_size), ("WARPS", WARPS), ("BATCH", BATCH), ("CHUNK", CHUNK),
                  ("SCALE", float_bits(scale))],
        grid=(32 * WARPS, b * hkv, splits),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(state_size,), (b * hkv * rows, d)] if fused else states,
        output_dtypes=[mx.float32, queries.dtype] if fused else [mx.float32] * 3,
        init_value=0.0 if fused else None,  # the counters start at zero (MLX fills every output)
    )
    if fused:
        return outputs[1].reshape(b, hq, length, d)
    acc, top, total = outputs
    merge = build(backend(), "decode_attention", "merge", ("acc", "tops", "totals"), ("out",))
    (out,) = merge(
        inputs=[acc, top, total],
        template=[("T", queries.dtype), ("D", d), ("G", rows)],
        grid=(32, b * hkv * rows, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(b * hkv * rows, d)],
        output_dtypes=[queries.dtype],
    )
    return out.reshape(b, hq, length, d)


@lru_cache(maxsize=64)
def _no_padding(batch: int) -> mx.array:
    """`first` for a batch without left padding: kept, so a decode step makes no array for it."""
    return mx.zeros((batch,), mx.int32)


def _fused() -> bool:
    return FUSED and backend() == "cuda"


def float_bits(x: float) -> int:
    """A float32's bits as a signed int32, the form a template constant takes."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _config(queries, keys, values, scale, group_size, bits, first=None) -> tuple:
    # A padded batch is its own configuration: its first call is checked against the reference too.
    return (backend(), queries.shape[1] // keys[0].shape[1] * queries.shape[2], queries.shape[3], bits,
            group_size, str(keys[1].dtype), str(queries.dtype), float_bits(scale), _fused(), first is not None)


def _kernel(queries, keys, values, scale, group_size, bits, first=None):
    """This build's kernel: the GPU one, or on the CPU build attention.c (kernels/cpu.py)."""
    return (kernel if backend() else cpu.decode_attention)(queries, keys, values, scale, group_size, bits, first)


def _takes(queries, keys, values, scale, group_size, bits, first=None) -> bool:
    if backend():
        return _fits(queries, keys, values, group_size, bits)
    return cpu.attention_takes(queries, keys, values, group_size, bits)


# Half outputs round to 2^-8 (bfloat16); float32 allows for the reference's matmuls
# running as TF32 (see experts.py).
decode_attention = Dispatch("decode_attention", _kernel, reference.decode_attention, _config,
                            lambda got, want: close(got, want, 2e-2 if got.dtype != mx.float32 else 5e-3),
                            available=lambda: backend() is not None or cpu.available(), fits=_takes)
