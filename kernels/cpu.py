"""The CPU build's expert kernel: lmsp_mlx/cpu_blas/experts.c through ctypes.

MLX's CPU build has no Metal or CUDA. There, mlx-lm's gather_qmm path took 28-48 ms for
one token through a 30B-A3B layer's 8 experts, and the reference, which dequantizes them
to memory, 427 ms. experts.c reads each chosen row once, 32 codes at a time, across the
cores (2.6-2.8 ms with its AVX2 path, 11-13 ms portable). It takes what the CPU loader produces: float32 x, scales and biases,
codes of 1-8 bits, groups that are multiples of 32. Anything else (or a build without the
compiled module) is not taken: `takes` says so and mlx-lm's own path runs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import cpu_blas
from .quantized import QuantizedExperts


def available() -> bool:
    return cpu_blas.decode_kernel() is not None


def takes(x: mx.array, indices: mx.array, gate: QuantizedExperts, up: QuantizedExperts,
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
    """reference.expert_swiglu's result, computed by experts.c (call `takes` first)."""
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
    cpu_blas.park_blas_threads()  # OpenBLAS's spinning workers would halve the OpenMP loop
    done = cpu_blas.decode_kernel().lmsp_expert_swiglu(
        xs.ctypes.data, idx.ctypes.data, tokens, k, gate.weight.shape[0], *(a.ctypes.data for a in arrays),
        d, h, gate.bits, gate.group_size, hidden.ctypes.data, sums.ctypes.data, y.ctypes.data)
    if done != 0:
        raise ValueError(f"experts.c does not take this shape: x {x.shape}, bits {gate.bits}, group {gate.group_size}")
    return mx.array(y).reshape(*lead, k, d)
