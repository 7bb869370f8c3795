"""The compiled prefill (cpu_blas/forward.c) gives MLX's hidden states, KV and tokens, over
a plain cache and over a --kv-bits one (QuantizedKVCache)."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from lmsp_mlx import cpu_blas
from lmsp_mlx.engine import cpu_decode, cpu_prefill
from lmsp_mlx.engine.runners import CompiledCPURunner, MLXRunner
from tests.test_cpu_decode import compiled_steps, counted, tiny

pytestmark = pytest.mark.skipif(cpu_blas.fused_kernels() is None, reason="the compiled BLAS shim is not built")


@pytest.fixture(autouse=True)
def kernels_auto(monkeypatch):
    """The default kernel mode, whatever the shell has: under LMSP_KERNELS=reference or off
    the compiled passes leave quantized caches to MLX (tested where that is the point)."""
    monkeypatch.setenv("LMSP_KERNELS", "auto")


def compiled(model, decode: bool = False) -> CompiledCPURunner:
    """The compiled CPU runner over `model` with the compiled prefill (and the decode steps)."""
    chunk = cpu_prefill.prefill_pass(model)
    steps = cpu_decode.decode_steps(model) if decode else (None, None)
    assert chunk is not None and steps is not None
    return CompiledCPURunner(model, *steps, chunk)


def chunks(runner, prompt: list[int], sizes: list[int], cache=None):
    """Hidden states of each chunk and the cache after running `prompt` through the
    runner's way through the model's body in chunks of `sizes`."""
    cache = cache or make_prompt_cache(runner.model)
    outs, start = [], 0
    for size in sizes:
        outs.append(np.array(runner.hidden(mx.array([prompt[start : start + size]]), cache=cache)))
        start += size
    return outs, cache


def compiled_chunks(runner, monkeypatch) -> list[int]:
    return counted(runner.chunk, "lmsp_prefill", monkeypatch)


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
    want, want_cache = chunks(MLXRunner(model), prompt, sizes)
    got, got_cache = chunks(compiled(model), prompt, sizes)
    for a, b in zip(got, want):
        assert a.shape == b.shape and close(a, b)
    for mine, theirs in zip(got_cache, want_cache):
        assert type(mine) is KVCache and mine.offset == theirs.offset == 600
        assert mine.keys.shape == theirs.keys.shape  # grown in the same steps
        for x, y in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert close(np.array(x[..., :600, :]), np.array(y[..., :600, :]))


@pytest.mark.parametrize("bits, group, heads", [(4, 32, (4, 2)), (8, 64, (9, 3)), (4, 64, (4, 4))])
def test_prefill_chunks_over_a_quantized_cache_match_mlx(bits, group, heads, monkeypatch):
    """The chunk's rows quantized into the cache (grown as mlx-lm grows it) and attention
    over the dequantized cache: mlx-lm's hidden states and cache."""
    model = tiny("llama", head_dim=64, num_attention_heads=heads[0], num_key_value_heads=heads[1])
    quantized = lambda: [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]  # noqa: E731
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 300, 600)]
    sizes = [200, 100, 7, 293]
    want, want_cache = chunks(MLXRunner(model), prompt, sizes, quantized())
    runner = compiled(model)
    calls = compiled_chunks(runner, monkeypatch)
    got, got_cache = chunks(runner, prompt, sizes, quantized())
    assert len(calls) == len(sizes)
    for a, b in zip(got, want):
        # K/V differ from MLX's in the last float bits, so a code on a rounding edge may
        # round the other way: one quantization step in a few values.
        assert a.shape == b.shape and close(a, b, 1e-3)
    for mine, theirs in zip(got_cache, want_cache):
        assert type(mine) is QuantizedKVCache and mine.offset == theirs.offset == 600
        assert [a.shape for a in mine.keys] == [a.shape for a in theirs.keys]  # grown in the same steps
        for x, y in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert (np.array(x[0][..., :600, :]) == np.array(y[0][..., :600, :])).mean() > 0.999
            rows = [np.array(mx.dequantize(*(p[..., :600, :] for p in c), group_size=group, bits=bits)) for c in (x, y)]
            assert np.abs(rows[0] - rows[1]).max() <= 1.01 * float(np.abs(np.array(y[1])).max()) + 1e-5


@pytest.mark.parametrize("bits", [None, 4])
def test_greedy_tokens_match_with_both_compiled_passes(bits, monkeypatch):
    """A prompt prefilled by forward.c then decoded by decode.c samples what MLX samples,
    over a plain cache and over a 4-bit one."""
    reference = tiny("llama", head_dim=64)
    fast = compiled(tiny("llama", head_dim=64), decode=True)
    calls, steps = compiled_chunks(fast, monkeypatch), compiled_steps(fast, monkeypatch)
    prompt = list(range(30, 130))

    def greedy(runner, n=40):
        cache = make_prompt_cache(runner.model) if bits is None else [
            QuantizedKVCache(group_size=32, bits=bits) for _ in runner.model.layers]
        runner.prefill(mx.array([prompt[:-1]]), cache)
        token, out = prompt[-1], []
        for _ in range(n):
            token = int(mx.argmax(runner.forward(mx.array([[token]]), cache)[0, -1]).item())
            out.append(token)
        return out

    assert greedy(fast) == greedy(MLXRunner(reference)) and calls == [1] and len(steps) == 40


def test_other_caches_and_inputs_go_through_mlx():
    model = tiny("llama")
    runner = compiled(model)
    rotating = [RotatingKVCache(max_size=32) for _ in model.layers]
    out = runner.hidden(mx.array([list(range(50))]), cache=rotating)
    assert out.shape == (1, 50, 64) and type(rotating[0]) is RotatingKVCache and rotating[0].offset == 50
    two = runner.hidden(mx.array([[1, 2, 3], [4, 5, 6]]), cache=make_prompt_cache(model))  # batch 2: MLX
    assert two.shape == (2, 3, 64)


def test_a_quantized_cache_restored_from_a_checkpoint_takes_the_compiled_pass(monkeypatch):
    """A checkpoint read back from disk holds a QuantizedKVCache's parts in lists, not
    tuples: the next chunk still runs compiled, growing the cache, with MLX's result."""
    model = tiny("llama", head_dim=64)
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 300, 300)]

    def restored():
        cache = [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
        model.model(mx.array([prompt[:250]]), cache=cache)
        for c in cache:
            c.keys, c.values = list(c.keys), list(c.values)
        return cache

    theirs = restored()
    want = np.array(model.model(mx.array([prompt[250:]]), cache=theirs))
    runner = compiled(model)
    mine = restored()
    calls = compiled_chunks(runner, monkeypatch)
    got = np.array(runner.hidden(mx.array([prompt[250:]]), cache=mine))
    assert calls == [1] and mine[0].offset == theirs[0].offset == 300 and close(got, want, 1e-3)
    assert mine[0].keys[0].shape == theirs[0].keys[0].shape  # grown as mlx-lm grows it
