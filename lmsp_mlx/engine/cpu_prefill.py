"""Prompt chunks of llama-family float32 models in one compiled call, on MLX's CPU backend.

Through MLX, a 512-token prefill of SmolLM2 spent about 30% of its time outside the
matmuls and the attention kernel: RMSNorms, residual adds, transposes, RoPE and the
copies between MLX and numpy for the fused kernels, each a separate single-core pass.
`lmsp_prefill` (cpu_blas/forward.c, in the BLAS shim) runs a chunk through every layer:
OpenBLAS sgemms on MLX's weight buffers, prefill.c's attention and SwiGLU, and K/V
written straight into the layers' mlx-lm `KVCache` buffers. The cache grows as
`update_and_fetch` would grow it, and its offset advances as it would. A `--kv-bits`
cache (`QuantizedKVCache`) takes the same call: the rows are quantized into it as
`mx.quantize` does, and the chunk attends over the cache dequantized for the layer, as
mlx-lm's quantized attention reads it. Through MLX such a chunk ran op by op.

`prefill_pass(model)` binds it to a model; the compiled CPU runner (engine/runners.py)
calls it for a multi-token batch-1 chunk against the caches the compiled decode step
reads (`CompiledModel.layout`) in place of the model's body (the `model` attribute of an
mlx-lm model, which returns the final normalized hidden states), and the body otherwise.
It applies to the models the compiled decode step takes (cpu_decode._supported).
`LMSP_CPU_PREFILL=0` turns it off.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import cpu_blas
from .cpu_decode import CompiledModel, compile_model, make_room
from .cpu_math import _rope_tables


class PrefillPass:
    """The compiled prefill bound to one model's weights."""

    def __init__(self, lib, compiled: CompiledModel) -> None:
        self.lib = lib
        self.compiled = compiled
        self.scratch = np.empty(0, np.float32)

    def __call__(self, tokens: mx.array, cache: list) -> mx.array | None:
        """Final hidden states (1, n, dim) for `tokens` (1, n), their K/V written into
        `cache`; None where this chunk must go through MLX."""
        n = tokens.shape[1]
        ids = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32)[0])
        if self.compiled.layout(cache) is None or ids.min() < 0 or ids.max() >= self.compiled.spec.vocab:
            return None  # out-of-range ids: what MLX makes of them, never a read outside the table
        make_room(cache, n, self.compiled.spec.n_kv_heads, self.compiled.spec.head_dim)
        pos = self.compiled.bind(cache, n)
        if pos is None:
            return None
        spec = self.compiled.spec
        need = self.lib.lmsp_prefill_scratch(ctypes.byref(spec), n)
        if self.scratch.size < need:
            self.scratch = np.empty(need, np.float32)
        cos, sin = _rope_tables(pos, n, spec.rope_dims, *self.compiled.rope)
        out = np.empty((n, spec.dim), np.float32)
        cpu_blas.blas_ran()  # its sgemms wake OpenBLAS's workers, which then spin (park_blas_threads)
        if self.lib.lmsp_prefill(ctypes.byref(spec), ids.ctypes.data, n, pos, cos.ctypes.data, sin.ctypes.data,
                                 out.ctypes.data, self.scratch.ctypes.data):
            raise MemoryError("no memory for the attention scores")
        for c in cache:
            c.offset += n
        return mx.array(out)[None]


def prefill_pass(model: nn.Module) -> PrefillPass | None:
    """The compiled prefill bound to `model`'s weights, where it applies (the models the
    compiled decode step takes; not under LMSP_CPU_PREFILL=0)."""
    lib = cpu_blas.fused_kernels()
    compiled = compile_model(model, lib, "LMSP_CPU_PREFILL", "compiled prefill")
    return None if compiled is None else PrefillPass(lib, compiled)
