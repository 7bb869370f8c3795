"""Swapping the kernels into a loaded mlx-lm model (every backend; off with LMSP_KERNELS=off).

- MoE layers: each SwitchGLU whose three projections are affine-quantized
  QuantizedSwitchLinear (qwen3_moe, deepseek_v2/v3, mixtral, ...) becomes a
  KernelSwitchGLU: the same module and parameters, whose decode and small-batch calls go
  through expert_swiglu (up to 32 tokens on a GPU, 64 on the CPU build; a batch's tokens
  that chose one expert share its reads). Larger calls keep mlx-lm's sorted gather_qmm
  path, which is what it is built for, and so does any call the dispatch gives no kernel
  (its `builtin`).
- Attention: the model module's `scaled_dot_product_attention` is wrapped so that a
  one-position query against a QuantizedKVCache (`--kv-bits`), or against a batch of them
  (a BatchQuantizedKVCache: each row from its own first position), goes through
  decode_attention (the reference where its kernel does not run). On the CPU build a
  prompt chunk against such a cache runs on the cache dequantized (cpu.prefill_attention)
  rather than MLX's slow CPU quantized_matmul. Everything else is passed on unchanged.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU

from . import cpu
from .attention import decode_attention
from .dispatch import backend, mode
from .experts import expert_swiglu
from .quantized import QuantizedExperts

# Tokens a call may hold to go through the expert kernel (a batched decode step); larger
# calls (prompt chunks) keep mlx-lm's sorted gather_qmm path, which is built for them. On
# a GPU up to 32, the batches benchmarks/kernels.py sets against gather_qmm (a batch's
# pairs of one expert share its reads; not yet timed on a GPU). On the CPU build up to 64,
# where experts.c does the same, and gather_qmm, in float32 there, took 28 ms for one
# token's 8 experts of a 30B-A3B layer.
MAX_TOKENS = {"gpu": 32, "cpu": 64}


class KernelSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU, with decode and small batches on the expert kernel."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if indices.size // indices.shape[-1] > MAX_TOKENS["gpu" if backend() else "cpu"]:
            return super().__call__(x, indices)
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        return expert_swiglu(x, mx.stop_gradient(indices), *(QuantizedExperts.of(p) for p in projections),
                             builtin=lambda: super(KernelSwitchGLU, self).__call__(x, indices))


def _eligible(layer: nn.Module) -> bool:
    if type(layer) is not SwitchGLU or type(layer.activation) is not SwiGLU:
        return False
    projections = (layer.gate_proj, layer.up_proj, layer.down_proj)
    return all(
        type(p) is QuantizedSwitchLinear and p.mode == "affine" and p.global_scale is None
        and p.get("biases") is not None and "bias" not in p
        for p in projections
    )


def _model_module(model: nn.Module):
    """The mlx-lm module that defines the model (its class may be an engine subclass)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("mlx_lm.models."):
            return sys.modules[cls.__module__]
    return None


def _wrap_attention(module) -> bool:
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None or getattr(current, "lmsp_decode_attention", False):
        return current is not None

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # No `builtin` fallback for decode: where no kernel runs, the reference does, which
        # on the CPU build beat mlx-lm's two-quantized_matmul attention (1.1-1.9x at 8K-32K
        # positions in float32, 16x with float16 caches) and never holds an N-long score row.
        if hasattr(cache, "bits") and mode() != "off":
            # A batch of sequences (cache/batch.py's BatchQuantizedKVCache) has a left-padded
            # mask; its padding is all the mask says for one position, and goes as `first`.
            first = getattr(cache, "left_padding", None)
            if sinks is None and queries.shape[2] == 1 and (mask is None or isinstance(mask, str) or first is not None):
                return decode_attention(queries, keys, values, scale, cache.group_size, cache.bits, first)
            if backend() is None and keys[0].shape[-1] == values[0].shape[-1]:  # a prompt chunk, CPU build
                return cpu.prefill_attention(queries, keys, values, scale, mask, cache.group_size, cache.bits,
                                             sinks)
        return current(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.lmsp_decode_attention = True
    module.scaled_dot_product_attention = scaled_dot_product_attention
    return True


def install(model: nn.Module) -> list[str]:
    """Swap the kernels in where they apply; returns what was swapped, for the load log."""
    if mode() == "off":
        return []
    done = []
    moe = [m for _, m in model.named_modules() if _eligible(m)]
    for layer in moe:
        layer.__class__ = KernelSwitchGLU
    if moe:
        done.append(f"expert_swiglu ({len(moe)} MoE layers)")
    module = _model_module(model)
    if module is not None and _wrap_attention(module):
        done.append("decode_attention (--kv-bits caches)")
    return done
