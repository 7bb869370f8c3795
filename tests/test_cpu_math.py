"""The CPU backend's fused prefill ops agree with MLX's own to float32 rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import mlx.nn as nn
import pytest
from lmsp_mlx import cpu_blas
from lmsp_mlx.engine import cpu_math
from mlx_lm.models import activations

needs_kernels = pytest.mark.skipif(cpu_blas.fused_kernels() is None, reason="compiled shim not installed")


@needs_kernels
def test_swiglu_matches_mlx():
    gate = mx.random.normal((2, 64, 1536)) * 8
    up = mx.random.normal((2, 64, 1536))
    want = gate * mx.sigmoid(gate) * up
    assert mx.abs(cpu_math.swiglu(gate, up) - want).max().item() < 1e-5
    # Saturated ends: e^(-x) clamps instead of overflowing into inf/nan.
    big = mx.concatenate([mx.array([-1e4, -90.0, -1e-8, 0.0, 90.0, 1e4]), mx.zeros(20000)])
    got = np.array(cpu_math.swiglu(big, mx.ones_like(big)))
    assert np.isfinite(got).all()
    assert np.allclose(got[:6], [0.0, 0.0, -5e-9, 0.0, 90.0, 1e4], atol=1e-30, rtol=1e-6)


def test_swiglu_leaves_decode_steps_and_other_dtypes_to_mlx():
    small = mx.random.normal((1, 1, 1536))
    assert mx.array_equal(cpu_math.swiglu(small, small), activations.swiglu(small, small))
    half = mx.random.normal((64, 1536)).astype(mx.float16)
    assert cpu_math.swiglu(half, half).dtype == mx.float16


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("length, source", [(2, 2), (5, 12), (200, 200), (130, 700)])
def test_causal_attention_matches_mlx(heads, kv_heads, length, source):
    # 200 positions x 3 heads spans several 256-row blocks; 130 of 700 continues a cache.
    q = mx.random.normal((1, heads, length, 32)) * 3  # large scores: the exp clamp matters
    k = mx.random.normal((1, kv_heads, source, 32)) * 3
    v = mx.random.normal((1, kv_heads, source, 32))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    got = cpu_math.causal_attention(q, k, v, 0.2)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-4


@needs_kernels
@pytest.mark.parametrize("dims, offset", [(64, 0), (32, 1000), (64, 4000)])
def test_fused_rope_matches_mlx_and_float64(dims, offset):
    rope = nn.RoPE(dims, base=100000)
    x = mx.random.normal((2, 20, 5, 64)).transpose(0, 2, 1, 3)  # the layout attention passes
    got = cpu_math.FusedRoPE(rope)(x, offset=offset)
    # MLX computes the angles in float32, the fused path in float64: at position 4000
    # they differ by about 1e-3 radian.
    assert mx.abs(got - rope(x, offset=offset)).max().item() < 3e-3
    half = dims // 2
    xs = np.array(x, dtype=np.float64)
    angles = (offset + np.arange(20))[:, None] * 100000.0 ** (-np.arange(0, dims, 2) / dims)
    lo, hi = xs[..., :half], xs[..., half:dims]
    want = np.concatenate([lo * np.cos(angles) - hi * np.sin(angles), hi * np.cos(angles) + lo * np.sin(angles), xs[..., dims:]], -1)
    assert np.abs(np.array(got) - want).max() < 1e-4


def test_fused_rope_leaves_decode_steps_to_mlx():
    rope = nn.RoPE(64)
    x = mx.random.normal((1, 4, 1, 64))
    assert mx.array_equal(cpu_math.FusedRoPE(rope)(x, offset=7), rope(x, offset=7))


@pytest.mark.parametrize("length, source", [(7, 7), (5, 12), (64, 64)])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", None])
def test_prefill_attention_matches_mlx(length, source, mask_kind):
    q = mx.random.normal((1, 6, length, 32)) * 3  # large scores: the exp clamp matters
    k = mx.random.normal((1, 2, source, 32)) * 3
    v = mx.random.normal((1, 2, source, 32))
    if mask_kind == "causal":
        mask = "causal"
    elif mask_kind == "bool":
        mask = mx.random.uniform(shape=(1, 1, length, source)) > 0.4
        mask[..., 0] = True  # every query sees something
    elif mask_kind == "additive":
        mask = mx.random.normal((1, 6, length, source))
    else:
        mask = None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    got = cpu_math.prefill_attention(q, k, v, 0.2, mask)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-4


def test_a_loaded_model_gives_mlx_logits_and_leaves_mlx_lm_unchanged(tiny_model_dir):
    """The loader binds the fast ops in its own copy of the model's module: the model gives
    the stock model's logits, and mlx-lm's module still holds mlx-lm's functions."""
    from mlx_lm.models import activations, base, llama
    from mlx_lm.utils import load_model as stock_load

    from lmsp_mlx.engine.loader import load_model

    stock, _ = stock_load(tiny_model_dir)
    lm = load_model(tiny_model_dir)
    assert isinstance(lm.model.model.layers[0].self_attn.rope, cpu_math.FusedRoPE)
    module = type(lm.model).__call__.__globals__  # the namespace the model's code runs in: the loader's copy
    assert module is not vars(llama) and module["swiglu"] is cpu_math.swiglu
    assert llama.swiglu is activations.swiglu and llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert type(stock) is llama.Model and type(stock).__call__ is llama.Model.__call__
    tokens = mx.array([[5, 9, 40, 41, 77, 3] * 30])
    before, after = stock(tokens), lm.model(tokens)
    assert mx.abs(after - before).max().item() < 1e-3
    assert mx.array_equal(mx.argmax(after, axis=-1), mx.argmax(before, axis=-1))
