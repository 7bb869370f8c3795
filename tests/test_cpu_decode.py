"""The compiled decode step (cpu_blas/decode.c) gives MLX's logits and KV, step by step."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from lmsp_mlx import cpu_blas
from lmsp_mlx.engine import cpu_decode, cpu_math

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import _config  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_blas.decode_kernel() is None, reason="the compiled decode step is not built")


def tiny(kind: str, **overrides):
    """A random float32 model of an architecture the step supports, with cpu_math's swaps."""
    mx.random.seed(3)
    config = {**_config(300, 4096), "head_dim": 16, **overrides}
    module = {"llama": llama, "qwen2": qwen2}[kind]
    model = module.Model(module.ModelArgs.from_dict({**config, "model_type": kind}))
    mx.eval(model.parameters())
    cpu_math.install(model)
    return model


def steps(model, prompt: list[int], n: int, fast: bool, cache=None):
    """Greedy tokens, per-step logits and the cache after `n` one-token steps."""
    plain = type(model).__mro__[1] if hasattr(model, "decode_step") else type(model)
    cache = cache or make_prompt_cache(model)
    logits = plain.__call__(model, mx.array([prompt]), cache=cache)[0, -1]
    tokens, seen = [], []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        call = model if fast else (lambda x, cache: plain.__call__(model, x, cache=cache))
        logits = call(mx.array([[token]]), cache=cache)[0, -1]
        seen.append(np.array(logits))
    return tokens, seen, cache


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen2", {}),  # q/k/v biases
])
def test_decode_steps_match_mlx_across_a_cache_growth(kind, overrides):
    model = tiny(kind, **overrides)
    reference = steps(model, list(range(20, 40)), 260, fast=False)
    assert cpu_decode.install(model)
    got = steps(model, list(range(20, 40)), 260, fast=True)  # 280 positions: the cache grows past 256
    assert got[0] == reference[0]
    worst = max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-6)) for a, b in zip(got[1], reference[1]))
    assert worst < 1e-5
    for mine, theirs in zip(got[2], reference[2]):
        assert mine.offset == theirs.offset == 280
        n = mine.offset
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-5, rtol=1e-5)


def test_other_caches_and_multi_token_inputs_go_through_mlx():
    model = tiny("llama")
    assert cpu_decode.install(model)
    # A sliding-window cache is not the step's layout: MLX runs it, with the same result.
    rotating = [RotatingKVCache(max_size=32) for _ in model.layers]
    want = steps(model, [5, 6, 7], 40, fast=False, cache=[RotatingKVCache(max_size=32) for _ in model.layers])
    got = steps(model, [5, 6, 7], 40, fast=True, cache=rotating)
    assert got[0] == want[0]
    # Several tokens at once (prefill, the first pass): MLX's path.
    cache = make_prompt_cache(model)
    out = model(mx.array([[1, 2, 3]]), cache=cache)
    assert out.shape[:2] == (1, 3) and type(cache[0]) is KVCache and cache[0].offset == 3


def test_models_it_does_not_know_are_left_alone(monkeypatch):
    quantized = tiny("llama")
    import mlx.nn as nn

    nn.quantize(quantized, group_size=32, bits=8)
    assert not cpu_decode.install(quantized)
    monkeypatch.setenv("LMSP_CPU_DECODE", "0")
    assert not cpu_decode.install(tiny("llama"))
