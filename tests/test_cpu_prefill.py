"""The compiled prefill (cpu_blas/forward.c) gives MLX's hidden states, KV and tokens."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from lmsp_mlx import cpu_blas
from lmsp_mlx.engine import cpu_decode, cpu_prefill
from test_cpu_decode import tiny

pytestmark = pytest.mark.skipif(cpu_blas.fused_kernels() is None, reason="the compiled BLAS shim is not built")


def chunks(model, prompt: list[int], sizes: list[int]):
    """Hidden states of each chunk and the cache after running `prompt` through the model's
    body in chunks of `sizes`."""
    cache = make_prompt_cache(model)
    outs, start = [], 0
    for size in sizes:
        outs.append(np.array(model.model(mx.array([prompt[start : start + size]]), cache=cache)))
        start += size
    return outs, cache


def close(a, b, tol=2e-5) -> bool:
    return float(np.abs(a - b).max()) <= tol * (float(np.abs(b).max()) + 1e-6)


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen2", {}),  # q/k/v biases
])
def test_prefill_chunks_match_mlx_across_cache_growth(kind, overrides):
    model = tiny(kind, **overrides)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 300, 600)]
    sizes = [200, 100, 7, 293]  # grows past 256 and 512 mid-chunk; later chunks attend to earlier ones
    want, want_cache = chunks(model, prompt, sizes)
    assert cpu_prefill.install(model)
    got, got_cache = chunks(model, prompt, sizes)
    for a, b in zip(got, want):
        assert a.shape == b.shape and close(a, b)
    for mine, theirs in zip(got_cache, want_cache):
        assert type(mine) is KVCache and mine.offset == theirs.offset == 600
        assert mine.keys.shape == theirs.keys.shape  # grown in the same steps
        for x, y in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert close(np.array(x[..., :600, :]), np.array(y[..., :600, :]))


def test_greedy_tokens_match_with_both_compiled_passes():
    """A prompt prefilled by forward.c then decoded by decode.c samples what MLX samples."""
    reference = tiny("llama")
    fast = tiny("llama")
    assert cpu_prefill.install(fast) and cpu_decode.install(fast)
    prompt = list(range(30, 130))

    def greedy(model, n=40):
        cache = make_prompt_cache(model)
        model.model(mx.array([prompt[:-1]]), cache=cache)
        token, out = prompt[-1], []
        for _ in range(n):
            token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
            out.append(token)
        return out

    assert greedy(fast) == greedy(reference)


def test_other_caches_and_inputs_go_through_mlx():
    model = tiny("llama")
    assert cpu_prefill.install(model)
    rotating = [RotatingKVCache(max_size=32) for _ in model.layers]
    out = model.model(mx.array([list(range(50))]), cache=rotating)
    assert out.shape == (1, 50, 64) and type(rotating[0]) is RotatingKVCache and rotating[0].offset == 50
    two = model.model(mx.array([[1, 2, 3], [4, 5, 6]]), cache=make_prompt_cache(model))  # batch 2: MLX
    assert two.shape == (2, 3, 64)
