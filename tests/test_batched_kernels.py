"""Batched decode with the kernels: B sequences of different lengths in one step.

- A `--kv-bits` batch is one BatchQuantizedKVCache per layer (cache/batch.py), left-padded,
  whose attention is `decode_attention` with each row's first position; on the CPU build a
  llama-family model's batch stays in the compiled step instead (tests/test_cpu_decode.py).
- MoE experts of a batch go through `expert_swiglu`, tokens that share an expert sharing
  its reads (tests/test_kernels.py checks experts.c bitwise against each token alone).
- Tiny random MoE models of mlx-lm architectures (qwen3_moe, deepseek_v2, deepseek_v3),
  served batched, give the greedy tokens of mlx-lm's own layers run one sequence at a time.

Tolerance of the token comparisons: none. A padded batch sums in another order than one
sequence alone, so logits differ in the last bits; these tiny models' greedy choices
(a lm_head scaled up, tiny_model.py) have no near-tie.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from tests.test_batching import together
from tests.test_engine import wait_for_metric
from tests.tiny_model import build_tiny_moe_model

from lmsp_mlx import kernels
from lmsp_mlx.cache.batch import BatchQuantizedKVCache
from lmsp_mlx.engine.batch import generate
from lmsp_mlx.engine.generate import GenerationParams
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.sequence import Sequence
from lmsp_mlx.kernels import cpu as cpu_kernel
from lmsp_mlx.kernels import reference
from tests.helpers import HTTP


def filled(length: int, heads: int = 2, d: int = 64, bits: int = 4, group: int = 32, seed: int = 0) -> QuantizedKVCache:
    cache = QuantizedKVCache(group_size=group, bits=bits)
    if length:
        mx.random.seed(seed)
        cache.update_and_fetch(mx.random.normal((1, heads, length, d)), mx.random.normal((1, heads, length, d)))
    return cache


def parts(cache) -> list[np.ndarray]:
    return [np.array(a[..., : cache.offset, :]) for a in (*cache.keys, *cache.values)]


def test_a_batch_of_quantized_caches_extracts_each_as_it_was_and_grows_each_as_alone():
    lengths = [300, 7, 0, 256]
    caches = [filled(n, seed=i) for i, n in enumerate(lengths)]
    batch = BatchQuantizedKVCache.merge(caches)
    assert batch.size() == 300 and batch.left_padding.tolist() == [0, 293, 300, 44]
    assert batch.offset.tolist() == lengths  # each row's own length: what RoPE reads
    for i, c in enumerate(caches):
        back = batch.extract(i)
        assert back.offset == c.offset and (not c.offset or all(np.array_equal(a, b) for a, b in zip(parts(back), parts(c))))
    # Three steps of new K/V for all rows: each row's codes are the ones its own cache quantizes.
    for step in range(3):
        k, v = mx.random.normal((4, 2, 1, 64)), mx.random.normal((4, 2, 1, 64))
        batch.update_and_fetch(k, v)
        for i, c in enumerate(caches):
            c.update_and_fetch(k[i : i + 1], v[i : i + 1])
    for i, c in enumerate(caches):
        assert all(np.array_equal(a, b) for a, b in zip(parts(batch.extract(i)), parts(c)))
    assert batch.offset.tolist() == [n + 3 for n in lengths]
    with pytest.raises(ValueError, match="different widths"):
        BatchQuantizedKVCache.merge([filled(3), filled(3, bits=8)])


@pytest.mark.parametrize("bits, group, d", [(4, 32, 64), (8, 64, 64), (4, 128, 128), (8, 128, 128)])
def test_attention_over_a_padded_batch_is_each_row_alone(bits, group, d):
    """The reference and, on the CPU build, attention.c: row b attends from first[b]."""
    lengths = [1100, 9, 600]
    batch = BatchQuantizedKVCache.merge([filled(n, heads=2, d=d, bits=bits, group=group, seed=i)
                                         for i, n in enumerate(lengths)])
    keys, values = batch.keys_and_values()
    q, scale = mx.random.normal((3, 8, 1, d)), d**-0.5
    paths = [reference.decode_attention]
    if cpu_kernel.available():
        paths.append(cpu_kernel.decode_attention)
    for path in paths:
        got = path(q, keys, values, scale, group, bits, batch.left_padding)
        for b, start in enumerate(batch.left_padding.tolist()):
            alone = reference.decode_attention(q[b : b + 1], tuple(a[b : b + 1, :, start:] for a in keys),
                                               tuple(a[b : b + 1, :, start:] for a in values), scale, group, bits)
            err = float(mx.abs(got[b : b + 1] - alone).max() / mx.abs(alone).max())
            assert err < 1e-5, (path.__module__, b)


MOE_CASES = [("qwen3_moe", None), ("qwen3_moe", 4), ("deepseek_v2", None), ("deepseek_v2", 4), ("deepseek_v3", None)]
PROMPTS = [list(range(40, 90)), list(range(60, 67)), list(range(30, 160)), list(range(100, 123))]


def stock_alone(path, prompt: list[int], bits, monkeypatch) -> list[int]:
    """mlx-lm's own layers (LMSP_KERNELS=off), one sequence."""
    monkeypatch.setenv("LMSP_KERNELS", "off")
    lm = load_model(path)
    cache = [QuantizedKVCache(group_size=32, bits=bits) for _ in lm.model.layers] if bits else None
    sampled: list[int] = []
    generate(lm, GenerationParams(prompt=prompt, max_tokens=12, temperature=0.0), emit=lambda e: None, cache=cache,
             sampled=sampled)
    return sampled


@pytest.mark.parametrize("arch, bits", MOE_CASES)
def test_a_tiny_moe_model_batched_with_the_kernels_gives_mlx_lms_tokens_alone(arch, bits, tmp_path, monkeypatch):
    path = build_tiny_moe_model(tmp_path / arch, arch)
    expected = [stock_alone(path, p, bits, monkeypatch) for p in PROMPTS]
    monkeypatch.setenv("LMSP_KERNELS", "auto")
    lm = load_model(path)
    caches = [[QuantizedKVCache(group_size=32, bits=bits) for _ in lm.model.layers] if bits else None
              for _ in PROMPTS]
    seqs = [Sequence(lm, GenerationParams(prompt=p, max_tokens=12, temperature=0.0),
                     c if c is not None else make_prompt_cache(lm.model),
                     emit=lambda e: None) for p, c in zip(PROMPTS, caches)]
    experts, attention = dict(kernels.expert_swiglu.calls), dict(kernels.decode_attention.calls)
    assert together(lm, seqs) == {}
    assert [s.sampled for s in seqs] == expected and sum(map(len, expected)) >= 24  # some end early, on EOS
    # The batched steps went through the kernels: this build's (experts.c and attention.c here).
    ran = "kernel" if kernels.expert_swiglu.available() else "builtin"
    assert kernels.expert_swiglu.calls[ran] > experts[ran]
    if bits:
        ran = "kernel" if kernels.decode_attention.available() else "reference"
        assert kernels.decode_attention.calls[ran] > attention[ran]
    assert all(type(c).__name__ == ("QuantizedKVCache" if bits else "KVCache") for s in seqs for c in s.cache)


@pytest.mark.slow  # 1,800 decode steps of a quantized MoE model: about 6 s here
def test_a_kv_bits_moe_model_serves_concurrent_requests_in_one_batch(start_server, tmp_path):
    path = build_tiny_moe_model(tmp_path / "moe", "qwen3_moe")
    server = start_server("--model", str(path), "--model-id", "moe", "--kv-bits", "4", "--kv-group-size", "32",
                          "--no-kv-disk", "--max-batch", "4")
    # Prompts of different lengths (a padded batch); ignore_eos: 300 steps each, so they overlap.
    bodies = [{"model": "moe", "prompt": list(range(40, 50 + 37 * i)), "max_tokens": 300, "temperature": 0,
               "ignore_eos": True} for i in range(3)]

    def complete(body) -> str:
        r = HTTP.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone = [complete(b) for b in bodies]
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, complete(bodies[i]))) for i in range(3)]
    for t in threads:
        t.start()
    wait_for_metric(server, "lmsp_batch_sequences 3")
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(3)] == alone and all(alone)
    assert "steps outside the batch" not in server.log()


def test_sequences_of_two_cache_kinds_in_one_batch_each_get_their_tokens_alone(tiny_model_dir):
    """Plain and --kv-bits caches side by side (the compiled step takes one kind a step, the
    other steps apart), with members ending at different steps, so the batch's make-up
    changes: each sequence's tokens are the ones it gets alone, its cache never stale."""
    from tests.tiny_model import build_tiny_model

    lm = load_model(build_tiny_model(tiny_model_dir.parent / "kinds", head_dim=64))
    four = lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in lm.model.layers]  # noqa: E731
    # The quantized one first: once a plain one ends, the two kinds tie, and the first seen
    # (the quantized one, a moment ago a merged batch of its own) takes the compiled step.
    plans = [(list(range(60, 95)), 10, four), (list(range(40, 70)), 4, None), (list(range(50, 58)), 14, None)]

    def params(prompt, n):
        return GenerationParams(prompt=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)

    expected, lengths = [], []
    for prompt, n, cache in plans:
        sampled: list[int] = []
        kv = cache() if cache else make_prompt_cache(lm.model)
        generate(lm, params(prompt, n), emit=lambda e: None, cache=kv, sampled=sampled)
        expected.append(sampled)
        lengths.append(kv[0].offset)
    seqs = [Sequence(lm, params(prompt, n), cache() if cache else make_prompt_cache(lm.model), emit=lambda e: None)
            for prompt, n, cache in plans]
    assert together(lm, seqs) == {}
    assert [s.sampled for s in seqs] == expected and [len(t) for t in expected] == [10, 4, 14]
    assert [s.cache[0].offset for s in seqs] == lengths  # no fed token lost from a cache
