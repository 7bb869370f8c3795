"""The quantized expert MLP for decode and small batches: the kernel, its dispatch and its limits.

`expert_swiglu(x, indices, gate, up, down)` is what mlx-lm's SwitchGLU computes over
QuantizedSwitchLinear projections: x (..., D), indices (..., K) -> (..., K, D).

The kernel is two launches (expert_swiglu.metal / .cu): gate_up reads each selected
expert's gate and up rows once against x and writes silu(gate) * up, and down reads the
down rows against that. In a batch (more than one token), the pairs that chose one expert
are taken up to SHARE at a time by one threadgroup, so the expert's rows are read from
memory once for them (as gather_qmm's sorted path shares them). Under CUDA, decode-sized calls (up to FUSED_PAIRS token-expert
pairs) take one launch instead, `fused`, whose blocks each own a slice of the hidden
rows and the pair's last block sums their partial outputs. Only the chosen experts' rows
are read. Shapes it does not take
(mixed bit widths, a width or group size MLX's affine mode has that these do not, dims
above MAX_DIM) go to MLX's built-in path (the dispatch's `builtin`).
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import cpu, reference
from .dispatch import Dispatch, backend, close
from .quantized import EXPERT_BITS, GROUP_SIZES, QuantizedExperts
from .sources import kernel as build

WARPS = 4  # simdgroups per threadgroup
# Pairs of a batch that chose one expert are taken SHARE at a time by one threadgroup, which
# reads the expert's rows once for all of them; their staged vectors (SHARE of x or of the
# hidden vector) take at most STAGED floats of threadgroup memory (24 KB of Metal's 32).
MAX_SHARE, STAGED = 4, 6144
ROWS = 4  # output rows per simdgroup
MAX_DIM = 7168  # x or the hidden vector staged in threadgroup memory (28 KB of Metal's 32)
# The fused launch (CUDA): hidden rows a block owns, its warps, and the most pairs it takes
# (its scratch holds a float partial output per pair and slice: 32 pairs of a 30B-A3B
# layer are 6 MB). Metal keeps two launches: its custom kernels make every output atomic
# or none, and the output here is half or bfloat16.
FUSED = True
SLICE, FUSED_WARPS, FUSED_ROWS, FUSED_PAIRS = 32, 8, 4, 32


def _fits(x: mx.array, indices: mx.array, gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts) -> bool:
    same = {(p.bits, p.group_size) for p in (gate, up, down)}
    if len(same) != 1:
        return False
    bits, group = same.pop()
    d, h = x.shape[-1], gate.output_dims
    return (indices.size < 65536  # token-expert pairs are the grid's second axis (CUDA caps it at 65535)
            and bits in EXPERT_BITS and group in GROUP_SIZES and d <= MAX_DIM and h <= MAX_DIM
            and gate.input_dims == up.input_dims == d and up.output_dims == h and down.input_dims == h
            and down.output_dims == d)


def kernel(x: mx.array, indices: mx.array, gate: QuantizedExperts, up: QuantizedExperts,
           down: QuantizedExperts) -> mx.array:
    *lead, d = x.shape
    k, h = indices.shape[-1], gate.output_dims
    tokens = math.prod(lead)
    pairs = tokens * k
    flat = indices.reshape(pairs).astype(mx.uint32)
    if _fused(pairs, h):
        return fused(x.reshape(tokens, d), flat, k, gate, up, down).reshape(*lead, k, d)
    per_group = WARPS * ROWS  # rows a threadgroup computes
    # S, X and Y name the input and output dtypes even where the body does not use them:
    # MLX's CUDA backend tells compiled kernels apart by name and template args only.
    common = [("S", gate.scales.dtype), ("D", d), ("H", h), ("BITS", gate.bits), ("GS", gate.group_size),
              ("WARPS", WARPS), ("ROWS", ROWS)]
    shared = tokens > 1  # one token's k experts are k different ones: nothing to share
    gate_up = build(backend(), "expert_swiglu", "gate_up", ("x", "idx", "gw", "gs", "gb", "uw", "us", "ub"), ("hid",))
    (hidden,) = gate_up(
        inputs=[x.reshape(tokens, d), flat, *gate[:3], *up[:3]],
        template=[*common, ("X", x.dtype), ("K", k), ("SHARE", share(d) if shared else 1)],
        grid=(32 * WARPS * -(-h // per_group), pairs, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(pairs, h)],
        output_dtypes=[mx.float32],
    )
    down_run = build(backend(), "expert_swiglu", "down", ("hid", "idx", "dw", "ds", "db"), ("y",))
    (y,) = down_run(
        inputs=[hidden, flat, *down[:3]],
        template=[*common, ("Y", x.dtype), ("SHARE", share(h) if shared else 1)],
        grid=(32 * WARPS * -(-d // per_group), pairs, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(pairs, d)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*lead, k, d)


def share(n: int) -> int:
    """Pairs a threadgroup takes at once, for a staged vector of n floats."""
    return max(1, min(MAX_SHARE, STAGED // n))


def _fused(pairs: int, h: int) -> bool:
    return FUSED and backend() == "cuda" and pairs <= FUSED_PAIRS and h % SLICE == 0


def fused(x: mx.array, flat: mx.array, k: int, gate: QuantizedExperts, up: QuantizedExperts,
          down: QuantizedExperts) -> mx.array:
    """The one-launch kernel (CUDA): x (tokens, D), flat (tokens * k) -> (tokens * k, D)."""
    d, h, pairs, slices = x.shape[-1], gate.output_dims, flat.size, gate.output_dims // SLICE
    run = build("cuda", "expert_swiglu", "fused",
                ("x", "idx", "gw", "gs", "gb", "uw", "us", "ub", "dw", "ds", "db"), ("y", "scratch"))
    y, _ = run(
        inputs=[x, flat, *gate[:3], *up[:3], *down[:3]],
        template=[("S", gate.scales.dtype), ("D", d), ("H", h), ("BITS", gate.bits), ("GS", gate.group_size),
                  ("WARPS", FUSED_WARPS), ("ROWS", FUSED_ROWS), ("SLICE", SLICE), ("X", x.dtype), ("Y", x.dtype),
                  ("K", k)],
        grid=(32 * FUSED_WARPS * slices, pairs, 1),
        threadgroup=(32 * FUSED_WARPS, 1, 1),
        output_shapes=[(pairs, d), (pairs * slices * d + pairs,)],
        output_dtypes=[x.dtype, mx.float32],
        init_value=0.0,  # the counters (and partials) start at zero
    )
    return y


def _config(x, indices, gate, up, down) -> tuple:
    # the launch taken is part of it: each is checked against the reference on first use
    # a batch (more than one token) shares reads: its SHARE variants are checked apart too
    return (backend(), x.shape[-1], gate.output_dims, indices.shape[-1], gate.bits, gate.group_size,
            str(gate.scales.dtype), str(x.dtype), _fused(indices.size, gate.output_dims),
            indices.size > indices.shape[-1])


def _kernel(x, indices, gate, up, down):
    """This build's kernel: the GPU one, or on the CPU build experts.c (kernels/cpu.py)."""
    return (kernel if backend() else cpu.expert_swiglu)(x, indices, gate, up, down)


def _takes(x, indices, gate, up, down) -> bool:
    return (_fits if backend() else cpu.expert_takes)(x, indices, gate, up, down)


# float32's tolerance allows for the reference's matmuls running as TF32 (MLX_ENABLE_TF32,
# on by default on CUDA GPUs and Apple's M5): about 1e-3 of the output's scale.
expert_swiglu = Dispatch("expert_swiglu", _kernel, reference.expert_swiglu, _config,
                         lambda got, want: close(got, want, 2e-2 if got.dtype != mx.float32 else 5e-3),
                         available=lambda: backend() is not None or cpu.available(), fits=_takes)


def _product_config(x, indices, weight, bias, per) -> tuple:
    # one pair, a few, or more than four: the C product's three inner loops (decode.c)
    pairs = indices.size
    return (x.shape[-1], weight.shape[0], weight.shape[1], per, bias is not None, 1 if pairs == 1 else min(pairs, 5))


# The float experts' grouped product exists on the CPU build only (kernels/cpu.py): under
# Metal and CUDA MLX's gather_mm has sorted, grouped kernels of its own.
expert_product = Dispatch("expert_product", cpu.expert_product, reference.expert_product, _product_config,
                          lambda got, want: close(got, want, 1e-4),
                          available=lambda: backend() is None and cpu.available(), fits=cpu.product_takes)
