"""Pure-MLX references of the custom kernels, with the kernels' signatures.

They state what each kernel computes, in the plainest MLX: dequantize what is read, then
float32 arithmetic. They run on every backend (the CPU build included), are tested against
a float computation and against MLX's built-ins, and are the dispatch's answer wherever a
kernel's backend is absent.
"""

from __future__ import annotations

import mlx.core as mx

from .quantized import QuantizedExperts

ATTENTION_BLOCK = 2048  # positions dequantized at a time: the score row never spans N


def _gathered(p: QuantizedExperts, indices: mx.array) -> mx.array:
    """The selected experts' weights, dequantized: (..., K, out, in) float32."""
    return mx.dequantize(p.weight[indices], p.scales[indices], p.biases[indices], p.group_size, p.bits).astype(
        mx.float32
    )


def expert_swiglu(x: mx.array, indices: mx.array, gate: QuantizedExperts, up: QuantizedExperts,
                  down: QuantizedExperts) -> mx.array:
    """For each token, its K experts' SwiGLU MLP: down(silu(gate x) * up x).

    x: (..., D); indices: (..., K) expert ids. Returns (..., K, D) in x's dtype, as
    mlx-lm's SwitchGLU does (the caller weighs and sums the K outputs)."""
    xf = x.astype(mx.float32)[..., None, :, None]  # (..., 1, D, 1)
    g = (_gathered(gate, indices) @ xf)[..., 0]  # (..., K, H)
    u = (_gathered(up, indices) @ xf)[..., 0]
    h = g * mx.sigmoid(g) * u
    y = (_gathered(down, indices) @ h[..., None])[..., 0]  # (..., K, D)
    return y.astype(x.dtype)


def expert_product(x: mx.array, indices: mx.array, weight: mx.array, bias: mx.array | None, per: int) -> mx.array:
    """One projection of a float MoE layer, as mlx-lm's SwitchLinear computes it: each
    token-expert pair's row of x times its expert's weight, plus its bias.

    x: (P / per, D), a row for every `per` pairs (per = K for an expert MLP's first
    projections, 1 for its last); indices: (P,) expert ids; weight: (E, M, D); bias:
    (E, M) or None. Returns (P, M)."""
    rows = x[mx.arange(indices.size) // per][:, None, :]  # (P, 1, D)
    y = mx.gather_mm(rows, weight.swapaxes(-1, -2), rhs_indices=indices)[:, 0]
    return y if bias is None else y + bias[indices]


def decode_attention(queries: mx.array, keys: tuple[mx.array, mx.array, mx.array],
                     values: tuple[mx.array, mx.array, mx.array], scale: float, group_size: int,
                     bits: int, first: mx.array | None = None) -> mx.array:
    """Attention of a few query positions (decode: one) against a quantized KV cache.

    queries: (B, Hq, L, D); keys, values: (packed, scales, biases) as mlx-lm's
    QuantizedKVCache returns them, (B, Hkv, N, ...); every query of batch row b sees
    positions first[b]..N-1 (no causal mask: the decode step's last position; `first`,
    (B,) int32, is a batch's left padding, None for none). Grouped-query heads: query head h reads
    KV head h // (Hq / Hkv). The softmax is online over blocks of positions, so no
    N-long score row is ever held. Returns (B, Hq, L, Dv) in the queries' dtype, Dv the
    values' head size (the keys' for most models)."""
    b, hq, length, d = queries.shape
    hkv, n = keys[0].shape[1], keys[0].shape[2]
    dv = values[0].shape[-1] * 32 // bits  # values may be narrower than keys (DeepSeek V2: 128 of 192)
    rows = hq // hkv * length
    q = (queries.astype(mx.float32) * scale).reshape(b, hkv, rows, d)
    top = mx.full((b, hkv, rows, 1), -mx.inf, mx.float32)
    total = mx.zeros((b, hkv, rows, 1), mx.float32)
    acc = mx.zeros((b, hkv, rows, dv), mx.float32)
    for start in range(0, n, ATTENTION_BLOCK):
        part = slice(start, min(start + ATTENTION_BLOCK, n))
        k = mx.dequantize(*(a[:, :, part] for a in keys), group_size, bits).astype(mx.float32)
        v = mx.dequantize(*(a[:, :, part] for a in values), group_size, bits).astype(mx.float32)
        scores = q @ k.swapaxes(-1, -2)  # (B, Hkv, rows, block)
        if first is not None:  # a row's left padding scores -inf, and a block wholly inside it adds nothing
            padding = mx.arange(part.start, part.stop) < first.reshape(b, 1, 1, 1)
            scores = mx.where(padding, -mx.inf, scores)
        new_top = mx.maximum(top, scores.max(-1, keepdims=True))
        shift = mx.where(new_top == -mx.inf, 0.0, new_top)  # no -inf - -inf
        p = mx.exp(scores - shift)
        fade = mx.exp(top - shift)
        total = total * fade + p.sum(-1, keepdims=True)
        acc = acc * fade + p @ v
        top = new_top
    return (acc / total).reshape(b, hq, length, dv).astype(queries.dtype)
