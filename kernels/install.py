"""How the kernels enter a loaded mlx-lm model (every backend; off with LMSP_KERNELS=off).

Nothing here changes mlx-lm: the loader owns both seams.
- MoE layers: each SwitchGLU whose three projections are affine-quantized
  QuantizedSwitchLinear (qwen3_moe, deepseek_v2/v3, mixtral, ...) is replaced in the
  model's tree by a KernelSwitchGLU holding the same projections (`expert_layers`, the way
  `nn.quantize` replaces a Linear). Its decode and small-batch calls go through
  expert_swiglu (up to 32 tokens on a GPU, 64 on the CPU build; a batch's tokens that
  chose one expert share its reads). Larger calls keep mlx-lm's sorted gather_qmm path,
  which is what it is built for, and so does any call the dispatch gives no kernel (its
  `builtin`).
- Attention: `attention_op(inner)` is the attention function the loader binds in its own
  copy of the model's module (engine/model_ops.py). A one-position query against a
  QuantizedKVCache (`--kv-bits`), or against a batch of them (a BatchQuantizedKVCache:
  each row from its own first position), goes through decode_attention (the reference
  where its kernel does not run). On the CPU build a prompt chunk against such a cache
  runs on the cache dequantized (cpu.prefill_attention) rather than MLX's slow CPU
  quantized_matmul. Everything else goes to `inner` unchanged.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU, SwitchLinear

from . import cpu, reference
from .attention import decode_attention
from .dispatch import backend, mode
from .experts import expert_product, expert_swiglu
from .quantized import QuantizedExperts

# Tokens a call may hold to go through the expert kernel (a batched decode step); larger
# calls (prompt chunks) keep mlx-lm's sorted gather_qmm path, which is built for them. On
# a GPU up to 32, the batches benchmarks/kernels.py sets against gather_qmm (a batch's
# pairs of one expert share its reads; not yet timed on a GPU). On the CPU build up to 64,
# where experts.c does the same, and gather_qmm, in float32 there, took 28 ms for one
# token's 8 experts of a 30B-A3B layer.
MAX_TOKENS = {"gpu": 32, "cpu": 64}


def _holding(cls: type[SwitchGLU], layer: SwitchGLU) -> SwitchGLU:
    """A `cls` holding `layer`'s projections and activation (no copy of a weight)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.gate_proj, new.up_proj, new.down_proj = layer.gate_proj, layer.up_proj, layer.down_proj
    new.activation = layer.activation
    return new


class KernelSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU, with decode and small batches on the expert kernel."""

    of = classmethod(_holding)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if indices.size // indices.shape[-1] > MAX_TOKENS["gpu" if backend() else "cpu"]:
            return super().__call__(x, indices)
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        return expert_swiglu(x, mx.stop_gradient(indices), *(QuantizedExperts.of(p) for p in projections),
                             builtin=lambda: super(KernelSwitchGLU, self).__call__(x, indices))


class GroupedSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU over float experts, with decode and small batches grouped by
    expert on the CPU build (expert_product): each projection reads a chosen expert's
    weight once for all the tokens that chose it, a prompt chunk's as one sgemm per expert.
    The activation is the layer's own (SwiGLU, gpt-oss's clamped one, ...)."""

    of = classmethod(_holding)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        *lead, d = x.shape
        k = indices.shape[-1]
        tokens = indices.size // k
        if tokens == 1:  # one token's K experts are K different ones: nothing to group
            return super().__call__(x, indices)
        flat, rows = mx.stop_gradient(indices).reshape(-1), x.reshape(tokens, d)

        def project(p: SwitchLinear, h: mx.array, per: int) -> mx.array:
            bias = p["bias"] if "bias" in p else None
            return expert_product(h, flat, p["weight"], bias, per,
                                  builtin=lambda: reference.expert_product(h, flat, p["weight"], bias, per))

        up, gate = project(self.up_proj, rows, k), project(self.gate_proj, rows, k)
        return project(self.down_proj, self.activation(up, gate), 1).reshape(*lead, k, d)


def _eligible(layer: object) -> bool:
    if type(layer) is not SwitchGLU or type(layer.activation) is not SwiGLU:
        return False
    projections = (layer.gate_proj, layer.up_proj, layer.down_proj)
    return all(
        type(p) is QuantizedSwitchLinear and p.mode == "affine" and p.global_scale is None
        and p.get("biases") is not None and "bias" not in p
        for p in projections
    )


def expert_layers(model: nn.Module) -> int:
    """Replace each eligible SwitchGLU in `model`'s tree by a KernelSwitchGLU over the same
    projections; returns how many. Under LMSP_KERNELS=off, none."""
    if mode() == "off":
        return 0
    found = [(parent, key) for parent in model.modules() for key, child in parent.items() if _eligible(child)]
    for parent, key in found:
        parent[key] = KernelSwitchGLU.of(parent[key])
    return len(found)


def _float_experts(layer: object) -> bool:
    if type(layer) is not SwitchGLU:
        return False
    return all(type(p) is SwitchLinear and p.weight.dtype == mx.float32
               for p in (layer.gate_proj, layer.up_proj, layer.down_proj))


def float_expert_layers(model: nn.Module) -> int:
    """On the CPU build, replace each SwitchGLU over float32 experts in `model`'s tree by a
    GroupedSwitchGLU over the same projections; returns how many. Under LMSP_KERNELS=off,
    or where expert_product has no kernel (Metal, CUDA), none."""
    if mode() == "off" or not expert_product.available():
        return 0
    found = [(parent, key) for parent in model.modules() for key, child in parent.items() if _float_experts(child)]
    for parent, key in found:
        parent[key] = GroupedSwitchGLU.of(parent[key])
    return len(found)


def attention_op(inner: Callable, quantized: tuple[type, ...]) -> Callable | None:
    """The model module's attention function with caches of the `quantized` kinds (each with
    `bits` and `group_size`: `--kv-bits` caches and their batch form) on decode_attention,
    `inner` taking everything else; None under LMSP_KERNELS=off."""
    if mode() == "off":
        return None

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # No `builtin` fallback for decode: where no kernel runs, the reference does, which
        # on the CPU build beat mlx-lm's two-quantized_matmul attention (1.1-1.9x at 8K-32K
        # positions in float32, 16x with float16 caches) and never holds an N-long score row.
        if isinstance(cache, quantized):
            # A batch of sequences (cache/batch.py's BatchQuantizedKVCache) has a left-padded
            # mask; its padding is all the mask says for one position, and goes as `first`.
            first = getattr(cache, "left_padding", None)
            if sinks is None and queries.shape[2] == 1 and (mask is None or isinstance(mask, str) or first is not None):
                return decode_attention(queries, keys, values, scale, cache.group_size, cache.bits, first)
            if backend() is None and keys[0].shape[-1] == values[0].shape[-1]:  # a prompt chunk, CPU build
                return cpu.prefill_attention(queries, keys, values, scale, mask, cache.group_size, cache.bits,
                                             sinks)
        return inner(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention
