"""The CPU backend's fast exp/SiLU agree with MLX's own to float32 rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from lmsp_mlx.engine import cpu_math


def test_exp_matches_float64_over_the_float32_range():
    x = np.concatenate([np.linspace(-87, 88, 200001), [0.0, -1e-8, 1e-8]]).astype(np.float32)
    got = np.array(cpu_math.exp(mx.array(x)), dtype=np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 5e-7


def test_exp_of_masked_scores_is_exactly_zero():
    # -inf (a masked score) and anything below the smallest normal float32 flush to 0.0.
    got = np.array(cpu_math.exp(mx.array([-np.inf, -1000.0, -100.0], dtype=mx.float32)))
    assert (got == 0.0).all()


def test_silu_matches_mlx():
    x = mx.random.normal((64, 1536)) * 8
    want = x * mx.sigmoid(x)
    assert mx.abs(cpu_math.silu(x) - want).max().item() < 1e-5
    big = mx.array([-1e4, -90.0, 0.0, 90.0, 1e4])
    assert np.allclose(np.array(cpu_math.silu(big)), np.array(big * mx.sigmoid(big)), atol=1e-30)


def test_other_dtypes_use_mlx_itself():
    x = mx.random.normal((8,)).astype(mx.float16)
    assert cpu_math.silu(x).dtype == mx.float16
    assert mx.array_equal(cpu_math.exp(x), mx.exp(x))


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


def test_installed_model_gives_the_same_logits(tiny_model_dir, monkeypatch):
    from mlx_lm.models import activations, base, llama
    from mlx_lm.utils import load_model

    # MLX's own ops for the reference run; monkeypatch restores whatever was there.
    monkeypatch.setattr(llama, "swiglu", activations.swiglu)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    model, _ = load_model(tiny_model_dir)
    tokens = mx.array([[5, 9, 40, 41, 77, 3] * 30])
    before = model(tokens)
    assert cpu_math.install(model) == ["swiglu", "scaled_dot_product_attention"]
    assert llama.swiglu is cpu_math.swiglu
    after = model(tokens)
    assert mx.abs(after - before).max().item() < 1e-3
    assert mx.array_equal(mx.argmax(after, axis=-1), mx.argmax(before, axis=-1))
