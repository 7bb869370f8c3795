"""The compiled decode step (cpu_blas/decode.c) gives MLX's logits and KV, step by step,
over a plain cache and over a --kv-bits one (QuantizedKVCache)."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from lmsp_mlx import cpu_blas
from lmsp_mlx.engine import cpu_decode, cpu_math
from lmsp_mlx.engine.runners import CompiledCPURunner, MLXRunner

from tests.tiny_model import _config

pytestmark = pytest.mark.skipif(cpu_blas.decode_kernel() is None, reason="the compiled decode step is not built")


@pytest.fixture(autouse=True)
def kernels_auto(monkeypatch):
    """The default kernel mode, whatever the shell has: under LMSP_KERNELS=reference or off
    the compiled passes leave quantized caches to MLX (tested where that is the point)."""
    monkeypatch.setenv("LMSP_KERNELS", "auto")


def tiny(kind: str, **overrides):
    """A random float32 model of an architecture the step supports, its RoPE fused as the loader does."""
    mx.random.seed(3)
    config = {**_config(300, 4096), "head_dim": 16, **overrides}
    module = {"llama": llama, "qwen2": qwen2}[kind]
    model = module.Model(module.ModelArgs.from_dict({**config, "model_type": kind}))
    mx.eval(model.parameters())
    cpu_math.wrap_ropes(model)
    return model


def compiled(model) -> CompiledCPURunner:
    """The compiled CPU runner over `model`, with the decode steps only (MLX prefills)."""
    found = cpu_decode.decode_steps(model)
    assert found is not None
    return CompiledCPURunner(model, *found, None)


def steps(runner, prompt: list[int], n: int, cache=None):
    """Greedy tokens, per-step logits and the cache after MLX's pass over `prompt` and `n`
    one-token steps through `runner`."""
    model = runner.model
    cache = cache or make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    tokens, seen = [], []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = runner.forward(mx.array([[token]]), cache)[0, -1]
        seen.append(np.array(logits))
    return tokens, seen, cache


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen2", {}),  # q/k/v biases
])
def test_decode_steps_match_mlx_across_a_cache_growth(kind, overrides):
    model = tiny(kind, **overrides)
    reference = steps(MLXRunner(model), list(range(20, 40)), 260)
    got = steps(compiled(model), list(range(20, 40)), 260)  # 280 positions: the cache grows past 256
    assert got[0] == reference[0]
    worst = max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-6)) for a, b in zip(got[1], reference[1]))
    assert worst < 1e-5
    for mine, theirs in zip(got[2], reference[2]):
        assert mine.offset == theirs.offset == 280
        n = mine.offset
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen2", {}),
])
def test_the_batched_step_gives_each_sequence_bitwise_its_own_steps_logits(kind, overrides, monkeypatch):
    """Sequences at different positions (one past a cache growth at 256), each on its own
    cache, stepped together: every row is what the one-sequence step gives it."""
    model = tiny(kind, **overrides)
    runner = compiled(model)
    prompts = [[3], list(range(5, 12)), [4] * 255, [9, 8, 7], [11, 12, 13, 14, 15], [200] * 40]  # 6: one group of 8

    def prefilled(prompt):
        cache = make_prompt_cache(model)
        if len(prompt) > 1:
            model(mx.array([prompt[:-1]]), cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    alone = []
    for prompt in prompts:
        cache, token, rows = prefilled(prompt), prompt[-1], []
        for _ in range(4):
            rows.append(np.array(runner.forward(mx.array([[token]]), cache)[0, -1]))
            token = int(np.argmax(rows[-1]))
        alone.append(rows)
    calls = counted(runner.batch, "lmsp_decode_batch", monkeypatch)
    caches, tokens, rows = [prefilled(p) for p in prompts], [p[-1] for p in prompts], [[] for _ in prompts]
    for _ in range(4):
        logits = np.array(runner.batch([[t] for t in tokens], caches))
        for i, row in enumerate(logits):
            rows[i].append(row)
        tokens = [int(np.argmax(r)) for r in logits]
    assert len(calls) == 4
    for mine, theirs in zip(rows, alone):
        assert all(np.array_equal(a, b) for a, b in zip(mine, theirs))
    assert [c[0].offset for c in caches] == [len(p) + 3 for p in prompts]


def test_a_short_chunk_as_rows_of_the_batched_step_is_its_tokens_stepped_one_by_one():
    """A suffix fed as consecutive rows on one cache (beside another sequence's decode
    row) attends causally: its K/V and its last logits are bitwise those of stepping its
    tokens one at a time."""
    model = tiny("llama")
    runner = compiled(model)
    prompt, chunk = list(range(5, 40)), [7, 8, 9, 10, 11, 12]

    def prefilled(tokens):
        cache = make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    one_by_one = prefilled(prompt)
    for t in chunk:
        last = np.array(runner.forward(mx.array([[t]]), one_by_one)[0, -1])
    other, rows = prefilled([3, 4]), prefilled(prompt)
    logits = np.array(runner.batch([[9], chunk], [other, rows]))
    assert np.array_equal(logits[1], last)
    n = len(prompt) + len(chunk)
    assert rows[0].offset == one_by_one[0].offset == n and other[0].offset == 3
    for mine, theirs in zip(rows, one_by_one):
        assert np.array_equal(np.array(mine.keys[..., :n, :]), np.array(theirs.keys[..., :n, :]))


def test_the_batched_step_takes_one_kind_of_cache_at_a_time():
    model = tiny("llama", head_dim=64)
    runner = compiled(model)
    four = lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]  # noqa: E731
    assert runner.batch.kind(make_prompt_cache(model)) == (0, 0)
    assert runner.batch.kind(four()) == (4, 32)
    # a plain and a quantized cache, or two widths, in one call: nothing written, the caller steps them apart
    assert runner.batch([[1], [2]], [make_prompt_cache(model), four()]) is None
    assert runner.batch([[1], [2]], [four(), [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]]) is None


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_the_batched_step_over_quantized_caches_gives_each_sequence_bitwise_its_own_steps_logits(bits, group,
                                                                                                monkeypatch):
    """--kv-bits sequences of different lengths (several attention splits, one past a cache
    growth), each on its own quantized cache, stepped together: each row is bitwise what
    the one-sequence step gives it (its attention split as that step splits it), and the
    caches hold the same codes."""
    model = tiny("llama", head_dim=64, num_attention_heads=6, num_key_value_heads=2)
    runner = compiled(model)
    prompts = [[3], [t % 300 for t in range(5, 1305)], [4] * 255, [9, 8, 7]]

    def prefilled(prompt):
        cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]
        if len(prompt) > 1:
            model(mx.array([prompt[:-1]]), cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    alone, alone_caches = [], []
    for prompt in prompts:
        cache, token, rows = prefilled(prompt), prompt[-1], []
        for _ in range(3):
            rows.append(np.array(runner.forward(mx.array([[token]]), cache)[0, -1]))
            token = int(np.argmax(rows[-1]))
        alone.append(rows)
        alone_caches.append(cache)
    calls = counted(runner.batch, "lmsp_decode_batch", monkeypatch)
    caches, tokens, rows = [prefilled(p) for p in prompts], [p[-1] for p in prompts], [[] for _ in prompts]
    for _ in range(3):
        logits = np.array(runner.batch([[t] for t in tokens], caches))
        for i, row in enumerate(logits):
            rows[i].append(row)
        tokens = [int(np.argmax(r)) for r in logits]
    assert len(calls) == 3
    for mine, theirs in zip(rows, alone):
        assert all(np.array_equal(a, b) for a, b in zip(mine, theirs))
    for mine, theirs in zip(caches, alone_caches):
        end = theirs[0].offset
        assert mine[0].offset == end
        assert all(np.array_equal(np.array(a[..., :end, :]), np.array(b[..., :end, :]))
                   for m, t in zip(mine, theirs) for a, b in zip((*m.keys, *m.values), (*t.keys, *t.values)))


def counted(holder, function: str, monkeypatch) -> list[int]:
    """Counts the calls `holder.lib` makes of the compiled `function` (so a test sees that
    the compiled pass ran, not MLX in its place)."""
    real, calls = holder.lib, []

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

    def call(*args):
        calls.append(1)
        return getattr(real, function)(*args)

    counting = Counting()
    setattr(counting, function, call)
    monkeypatch.setattr(holder, "lib", counting)
    return calls


def compiled_steps(runner, monkeypatch) -> list[int]:
    return counted(runner.step, "lmsp_decode_step", monkeypatch)


@pytest.mark.parametrize("bits, group, heads, prompt, n", [
    (4, 32, (4, 2, 64), 20, 260),  # 280 positions: the cache grows at 256, as MLX grows it
    (8, 64, (6, 2, 64), 20, 40),
    (4, 64, (9, 3, 64), 1000, 30),  # SmolLM2's 3 query rows a KV head; several splits
    (2, 32, (4, 4, 64), 20, 40),
    (4, 64, (8, 1, 128), 600, 20),  # 8 rows a KV head, heads of 128
    (8, 32, (5, 1, 96), 40, 20),  # 5 rows, heads of 96 (three 32-code chunks)
])
def test_decode_steps_over_a_quantized_cache_match_mlx(bits, group, heads, prompt, n, monkeypatch):
    """The step quantizes K/V as mx.quantize does and attends over the codes as attention.c
    does: MLX's greedy tokens and logits (to 1e-4), and the cache it would have written."""
    model = tiny("llama", head_dim=heads[2], num_attention_heads=heads[0], num_key_value_heads=heads[1])
    quantized = lambda: [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]  # noqa: E731
    tokens = [int(t) % 300 for t in range(7, 7 + 3 * prompt, 3)]
    reference = steps(MLXRunner(model), tokens, n, cache=quantized())
    runner = compiled(model)
    calls = compiled_steps(runner, monkeypatch)
    got = steps(runner, tokens, n, cache=quantized())
    assert len(calls) == n  # a full cache is grown, and the step stays compiled
    assert got[0] == reference[0]
    worst = max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-6)) for a, b in zip(got[1], reference[1]))
    assert worst < 1e-4
    for mine, theirs in zip(got[2], reference[2]):
        end = mine.offset
        assert end == theirs.offset == prompt + n
        for a, b in zip((mine.keys, mine.values), (theirs.keys, theirs.values)):
            # The K/V rows themselves differ in the last float bits (another summation
            # order), so a code on a rounding edge may differ by one: almost all are equal,
            # and the dequantized rows agree to within one quantization step.
            codes = np.array(a[0][..., :end, :]) == np.array(b[0][..., :end, :])
            assert codes.mean() > 0.999
            rows = [np.array(mx.dequantize(*(p[..., :end, :] for p in x), group_size=group, bits=bits)) for x in (a, b)]
            step = float(np.abs(np.array(b[1][..., :end, :])).max())
            assert np.abs(rows[0] - rows[1]).max() <= 1.01 * step + 1e-5


def test_other_caches_and_multi_token_inputs_go_through_mlx(monkeypatch):
    model = tiny("llama")
    runner = compiled(model)
    # A sliding-window cache is not the step's layout: MLX runs it, with the same result.
    rotating = [RotatingKVCache(max_size=32) for _ in model.layers]
    want = steps(MLXRunner(model), [5, 6, 7], 40, cache=[RotatingKVCache(max_size=32) for _ in model.layers])
    got = steps(runner, [5, 6, 7], 40, cache=rotating)
    assert got[0] == want[0]
    # A quantized cache under LMSP_KERNELS=reference or off (attention.c kept out), or of a
    # width the step does not read (3 bits): MLX's path, with MLX's tokens.
    model64 = tiny("llama", head_dim=64)
    runner64 = compiled(model64)
    calls = compiled_steps(runner64, monkeypatch)
    for kernels, bits in (("reference", 4), ("off", 8), ("auto", 3)):
        monkeypatch.setenv("LMSP_KERNELS", kernels)
        quantized = lambda: [QuantizedKVCache(group_size=32, bits=bits) for _ in model64.layers]  # noqa: E731
        assert steps(runner64, [5, 6, 7], 8, cache=quantized())[0] == steps(
            MLXRunner(model64), [5, 6, 7], 8, cache=quantized())[0]
    assert calls == []
    # Several tokens at once (prefill, the first pass): MLX's path.
    cache = make_prompt_cache(model)
    out = runner.forward(mx.array([[1, 2, 3]]), cache)
    assert out.shape[:2] == (1, 3) and type(cache[0]) is KVCache and cache[0].offset == 3


def test_models_it_does_not_know_are_left_alone(monkeypatch):
    quantized = tiny("llama")
    import mlx.nn as nn

    nn.quantize(quantized, group_size=32, bits=8)
    assert cpu_decode.decode_steps(quantized) is None
    monkeypatch.setenv("LMSP_CPU_DECODE", "0")
    assert cpu_decode.decode_steps(tiny("llama")) is None


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_row_quantized_by_the_step_is_the_row_mx_quantize_gives(bits, group):
    """lmsp_quantize_row against mx.quantize, bit for bit, with the rows that test its
    edges: constant, all zero, one sign only, a range below its epsilon, huge values, and
    values on rounding edges (halves)."""
    lib = cpu_blas.decode_kernel()
    d = 256
    rng = np.random.default_rng(bits * group)
    rows = [rng.standard_normal(d), rng.standard_normal(d) * 1e4, np.full(d, 0.75), np.zeros(d),
            np.abs(rng.standard_normal(d)) + 3, -np.abs(rng.standard_normal(d)) - 3, 1 + rng.standard_normal(d) * 1e-9,
            np.round(rng.standard_normal(d) * 4) / 8, rng.integers(-2, 3, d) * 0.5]
    x = np.ascontiguousarray(np.stack(rows).astype(np.float32))
    want = [np.array(a) for a in mx.quantize(mx.array(x), group_size=group, bits=bits)]
    got = [np.empty_like(a) for a in want]
    for i, row in enumerate(x):
        lib.lmsp_quantize_row(row.ctypes.data, d, bits, group, *(a[i].ctypes.data for a in got))
    for mine, theirs in zip(got, want):
        assert mine.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_rows_read_back_by_the_passes_are_what_mx_dequantize_gives(bits, group):
    """lmsp_dequantize_rows (the compiled prefill's reader: AVX2 for 4 and 8 bits, a bit
    reader otherwise) against mx.dequantize, to the last bit or two of a float."""
    lib = cpu_blas.decode_kernel()
    rows, d = 37, 256
    codes, scales, biases = (np.array(a) for a in mx.quantize(mx.random.normal((rows, d)), group_size=group, bits=bits))
    got = np.empty((rows, d), np.float32)
    lib.lmsp_dequantize_rows(codes.ctypes.data, scales.ctypes.data, biases.ctypes.data, rows, d, bits, group,
                             got.ctypes.data)
    want = np.array(mx.dequantize(*(mx.array(a) for a in (codes, scales, biases)), group_size=group, bits=bits))
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6)
