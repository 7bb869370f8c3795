"""The custom kernels (kernels/): their references, dispatch, model swaps and, where MLX
has Metal or CUDA, the kernels themselves against the references."""

from __future__ import annotations

import ctypes
import logging
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from lmsp_mlx import kernels
from lmsp_mlx.engine.batch import generate
from lmsp_mlx.engine.generate import GenerationParams
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.kernels import attention as attention_module
from lmsp_mlx.kernels import cpu as cpu_kernel
from lmsp_mlx.kernels import dispatch, reference
from lmsp_mlx.kernels import cuda_source
from lmsp_mlx.kernels import experts as expert_module
from lmsp_mlx.kernels.quantized import QuantizedExperts
from lmsp_mlx.kernels.sources import sections
from tests.tiny_model import build_tiny_model, build_tiny_moe_model

# The kernels themselves run on Metal or CUDA only (conftest skips `gpu` tests on the CPU
# build); their references are tested on every build.
needs_backend = pytest.mark.gpu


def unpack(packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> np.ndarray:
    """Affine codes decoded as the kernels decode them (kernels/quantized.py), in float64."""
    words = np.array(packed).astype(np.uint64)
    n = words.shape[-1] * 32 // bits
    offsets = np.arange(n) * bits
    lo, shift = words[..., offsets // 32], (offsets % 32).astype(np.uint64)
    hi_index = np.minimum(offsets // 32 + 1, words.shape[-1] - 1)
    codes = (lo >> shift) | (words[..., hi_index] << (np.uint64(32) - shift))
    codes &= np.uint64((1 << bits) - 1)
    groups = np.arange(n) // group_size
    return f64(scales)[..., groups] * codes + f64(biases)[..., groups]


def f64(a) -> np.ndarray:
    """In float64 numpy, via float32 for an mx.array (numpy cannot read bfloat16's buffer)."""
    return np.asarray(a.astype(mx.float32) if isinstance(a, mx.array) else a, np.float64)


def builtin(fn):
    """MLX's built-in result, computed on the CPU device on every build: MLX's CUDA backend
    has no implementation of some of these (seen on an H200: quantized_matmul with float32
    activations at these shapes), and the CPU's result is the one to match either way."""
    with mx.stream(mx.cpu):
        out = fn()
        mx.eval(out)
    return out


def rel_err(got, want) -> float:
    got, want = f64(got), f64(want)
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-12))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_the_kernels_read_mlx_affine_codes_as_one_little_endian_bit_stream(bits, group_size):
    w = mx.random.normal((3, 5, 256))
    packed, scales, biases = mx.quantize(w, group_size, bits)
    # MLX rounds scale * code + bias in float32: equal to the float64 decode within an ulp
    assert np.allclose(unpack(packed, scales, biases, group_size, bits),
                       np.array(mx.dequantize(packed, scales, biases, group_size, bits)), rtol=1e-6, atol=1e-6)


def quantized_experts(experts: int, out: int, inp: int, group_size: int, bits: int) -> QuantizedExperts:
    return QuantizedExperts(*mx.quantize(mx.random.normal((experts, out, inp)) * 0.2, group_size, bits),
                            group_size, bits)


def float_experts(x, indices, gate, up, down) -> np.ndarray:
    """The expert MLP in float64 numpy over the decoded weights."""
    wg, wu, wd = (unpack(*p) for p in (gate, up, down))
    x, indices = f64(x), np.array(indices)
    out = np.zeros((*indices.shape, x.shape[-1]))
    for t in np.ndindex(indices.shape):
        e, xt = indices[t], x[t[:-1]]
        g, u = wg[e] @ xt, wu[e] @ xt
        out[t] = wd[e] @ (g / (1 + np.exp(-g)) * u)
    return out


def stock_switch_glu(d: int, h: int, gate, up, down) -> SwitchGLU:
    """mlx-lm's SwitchGLU over these quantized projections (mx.gather_qmm)."""
    layer = SwitchGLU(d, h, gate.weight.shape[0])
    for name, p in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        q = QuantizedSwitchLinear(p.input_dims, p.output_dims, p.weight.shape[0], bias=False,
                                  group_size=p.group_size, bits=p.bits)
        q.weight, q.scales, q.biases = p.weight, p.scales, p.biases
        setattr(layer, name, q)
    return layer


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("tokens, k", [(1, 8), (3, 2)])
def test_expert_reference_matches_a_float_computation_and_gather_qmm(bits, group_size, tokens, k, monkeypatch):
    monkeypatch.setenv("LMSP_KERNELS", "auto")
    d, h, experts = 128, 192, 10
    gate, up = (quantized_experts(experts, h, d, group_size, bits) for _ in range(2))
    down = quantized_experts(experts, d, h, group_size, bits)
    x = mx.random.normal((tokens, d))
    indices = mx.stack([mx.random.permutation(experts)[:k] for _ in range(tokens)]).astype(mx.uint32)
    got = reference.expert_swiglu(x, indices, gate, up, down)
    assert got.shape == (tokens, k, d) and got.dtype == mx.float32
    assert rel_err(got, float_experts(x, indices, gate, up, down)) < 1e-5
    stock = stock_switch_glu(d, h, gate, up, down)
    assert rel_err(got, stock(x, indices)) < 1e-4
    # The layer the loader puts in its place (the model's view): the same projections, the
    # same result, through the dispatch (the checked kernel: Metal, CUDA or the compiled CPU
    # one; else mlx-lm's own path).
    before = dict(kernels.expert_swiglu.calls)
    layer = kernels.KernelSwitchGLU.of(stock)
    assert layer.gate_proj is stock.gate_proj and layer.down_proj is stock.down_proj
    assert rel_err(layer(x, indices), got) < 1e-4
    ran = "kernel" if kernels.expert_swiglu.available() else "builtin"  # the layer's own gather_qmm path
    assert kernels.expert_swiglu.calls[ran] == before[ran] + 1


def float_attention(q, keys, values, scale, group_size, bits) -> np.ndarray:
    k, v = unpack(*keys, group_size, bits), unpack(*values, group_size, bits)
    q = f64(q)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def quantized_kv(batch: int, heads: int, n: int, d: int, group_size: int, bits: int, spare: int = 0):
    """Keys or values as QuantizedKVCache hands them over: views of a longer buffer."""
    packed, scales, biases = mx.quantize(mx.random.normal((batch, heads, n + spare, d)), group_size, bits)
    return tuple(a[..., :n, :] for a in (packed, scales, biases))


ATTENTION_CASES = [
    # (batch, query heads, KV heads, positions, head dim)
    (1, 4, 4, 1, 64),
    (1, 8, 2, 300, 128),
    (2, 6, 1, 2048 + 300, 64),  # crosses the reference's 2048-position block
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("batch, hq, hkv, n, d, dv", [(*case, case[-1]) for case in ATTENTION_CASES]
                         + [(1, 4, 2, 70, 192, 128)])  # values narrower than keys, as DeepSeek V2's
def test_attention_reference_matches_float_sdpa_and_the_quantized_composite(bits, group_size, batch, hq, hkv, n, d,
                                                                            dv):
    keys = quantized_kv(batch, hkv, n, d, group_size, bits, spare=100)
    values = quantized_kv(batch, hkv, n, dv, group_size, bits, spare=100)
    q, scale = mx.random.normal((batch, hq, 1, d)), d**-0.5
    got = reference.decode_attention(q, keys, values, scale, group_size, bits)
    assert got.shape == (batch, hq, 1, dv)
    assert rel_err(got, float_attention(q, keys, values, scale, group_size, bits)) < 1e-5
    k, v = (mx.dequantize(*kv, group_size, bits) for kv in (keys, values))
    assert rel_err(got, mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)) < 1e-5
    if dv != d:  # mlx-lm's composite reshapes its output to the keys' head size and raises
        return
    composite = builtin(lambda: base.quantized_scaled_dot_product_attention(q, keys, values, scale, None,
                                                                           group_size, bits))
    assert rel_err(got, composite) < 1e-4


def test_the_gpu_attention_kernel_leaves_what_it_cannot_take_to_the_reference():
    """The GPU kernels' limits, which decide on every build what reaches them: one head size
    for K and V (DeepSeek V2's values, 128 of the keys' 192, go to the reference, which
    sizes them apart), whole groups per head, at most 1024 query values per KV head (the
    threadgroup's merge memory), widths and groups it was written for."""
    keys, values = quantized_kv(1, 2, 40, 192, 64, 4), quantized_kv(1, 2, 40, 128, 64, 4)
    q = mx.random.normal((1, 4, 1, 192))
    assert attention_module._fits(q, keys, keys, 64, 4)
    assert not attention_module._fits(q, keys, values, 64, 4)
    odd = quantized_kv(1, 2, 40, 96, 32, 4)
    assert attention_module._fits(mx.random.normal((1, 4, 1, 96)), odd, odd, 32, 4)
    assert not attention_module._fits(mx.random.normal((1, 4, 1, 96)), odd, odd, 64, 4)  # 96 is not whole groups of 64
    wide = quantized_kv(1, 1, 40, 128, 64, 4)
    assert attention_module._fits(mx.random.normal((1, 8, 1, 128)), wide, wide, 64, 4)
    assert not attention_module._fits(mx.random.normal((1, 16, 1, 128)), wide, wide, 64, 4)  # 2048 values
    two = quantized_kv(1, 2, 40, 64, 32, 2)
    assert not attention_module._fits(mx.random.normal((1, 4, 1, 64)), two, two, 32, 2)  # KV_BITS: 4 and 8


needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                      reason="the compiled CPU kernels (lmsp_mlx/cpu_blas/_decode) are not built here")


@pytest.fixture(scope="module")
def portable_decode_build(tmp_path_factory):
    """The _decode module's sources (setup.py) built with -DLMSP_PORTABLE: the scalar paths
    that CPUs without AVX2 and FMA take, which the installed build skips on this machine."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the portable CPU kernels")
    from lmsp_mlx import cpu_blas

    here = Path(cpu_blas.__file__).parent
    out = tmp_path_factory.mktemp("portable") / "decode.so"
    subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", "-DLMSP_PORTABLE", "-o", str(out),
                    *(str(here / f) for f in ("decode.c", "experts.c", "attention.c", "quant.c")), "-lm"], check=True,
                   timeout=120)
    return cpu_blas.declare_decode(ctypes.CDLL(str(out)))


def use_cpu_build(build: str, threads: str, request, monkeypatch) -> None:
    """The installed build (AVX2 for 2, 4 and 8 bits where the CPU has it) or the portable
    one; every call across the cores or every call on one thread (kernels/cpu.py decides by
    size otherwise)."""
    monkeypatch.setattr(cpu_kernel, "PARALLEL_WORK", 0 if threads == "all" else 1 << 62)
    if build == "portable":
        from lmsp_mlx import cpu_blas

        lib = request.getfixturevalue("portable_decode_build")
        monkeypatch.setattr(cpu_blas, "decode_kernel", lambda: lib)


@needs_cpu_kernel
@pytest.mark.parametrize("build, threads", [("installed", "all"), pytest.param("installed", "one", marks=pytest.mark.slow),
                                           pytest.param("portable", "all", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("tokens, k", [(1, 8), (3, 2), (12, 4)])  # 12 x 4 of 10 experts: shared ones
def test_the_cpu_expert_kernel_matches_the_reference(bits, group_size, tokens, k, build, threads, request,
                                                     monkeypatch):
    use_cpu_build(build, threads, request, monkeypatch)
    d, h, experts = 256, 192, 10
    gate, up = (quantized_experts(experts, h, d, group_size, bits) for _ in range(2))
    down = quantized_experts(experts, d, h, group_size, bits)
    x = mx.random.normal((tokens, d))
    indices = mx.stack([mx.random.permutation(experts)[:k] for _ in range(tokens)]).astype(mx.uint32)
    assert cpu_kernel.expert_takes(x, indices, gate, up, down)
    got = cpu_kernel.expert_swiglu(x, indices, gate, up, down)
    assert got.shape == (tokens, k, d) and got.dtype == mx.float32
    assert rel_err(got, reference.expert_swiglu(x, indices, gate, up, down)) < 1e-5


@needs_cpu_kernel
@pytest.mark.parametrize("build, threads", [("installed", "all"), pytest.param("installed", "one", marks=pytest.mark.slow),
                                           pytest.param("portable", "all", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("batch, hq, hkv, n, d", ATTENTION_CASES + [
    (1, 32, 4, 1100, 128), (1, 4, 2, 37, 96),
    (1, 9, 3, 515, 64),  # SmolLM2's 3 rows a KV head; a last split of 3 positions
    (1, 7, 1, 70, 64),  # 7 rows: pairs and a single row scored, 4 and 3 weighed
])
def test_the_cpu_attention_kernel_matches_the_reference(bits, group_size, batch, hq, hkv, n, d, build, threads,
                                                        request, monkeypatch):
    """attention.c against the reference on cache views of a longer buffer (the strides a
    QuantizedKVCache hands over): several splits of 512 positions with a partial one, blocks
    of 32 cut short (also short of the AVX2 path's four positions), grouped heads of 1-8
    query rows (its blocking takes them 2 and 4 at a time), batches; the builds and thread
    counts as for the experts."""
    if d % group_size:
        pytest.skip("a head size the group does not divide")
    use_cpu_build(build, threads, request, monkeypatch)
    keys = quantized_kv(batch, hkv, n, d, group_size, bits, spare=100)
    values = quantized_kv(batch, hkv, n, d, group_size, bits, spare=100)
    q, scale = mx.random.normal((batch, hq, 1, d)), d**-0.5
    assert cpu_kernel.attention_takes(q, keys, values, group_size, bits)
    got = cpu_kernel.decode_attention(q, keys, values, scale, group_size, bits)
    assert got.shape == (batch, hq, 1, d) and got.dtype == mx.float32
    assert rel_err(got, reference.decode_attention(q, keys, values, scale, group_size, bits)) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_a_prompt_chunk_against_a_quantized_cache_is_causal_attention_over_it(bits):
    """A prompt chunk's attention on the CPU build (the cache dequantized, then MLX's fused
    attention): the chunk's last 44 of 300 positions, each seeing the cache up to itself,
    as mlx-lm's quantized attention computes it and as a float64 computation does."""
    keys, values = quantized_kv(1, 2, 300, 64, 32, bits, spare=50), quantized_kv(1, 2, 300, 64, 32, bits, spare=50)
    q, length = mx.random.normal((1, 4, 44, 64)), 44
    got = cpu_kernel.prefill_attention(q, keys, values, 0.125, "causal", 32, bits)
    k = np.repeat(unpack(*keys, 32, bits), 2, axis=1)
    v = np.repeat(unpack(*values, 32, bits), 2, axis=1)
    s = f64(q) @ k.swapaxes(-1, -2) * 0.125
    s[..., np.arange(length)[:, None] + 300 - length < np.arange(300)[None, :]] = -np.inf  # no key after the query
    p = np.exp(s - s.max(-1, keepdims=True))
    assert rel_err(got, (p / p.sum(-1, keepdims=True)) @ v) < 1e-5
    composite = base.quantized_scaled_dot_product_attention(q, keys, values, 0.125, "causal", 32, bits)
    assert rel_err(got, composite) < 1e-4


@needs_cpu_kernel
def test_the_cpu_attention_kernel_leaves_what_it_cannot_read_to_the_fallback():
    keys, q = quantized_kv(1, 2, 40, 64, 32, 4), mx.random.normal((1, 4, 1, 64))
    assert cpu_kernel.attention_takes(q, keys, keys, 32, 4)
    half = tuple(a.astype(mx.float16) if a.dtype == mx.float32 else a for a in keys)
    assert not cpu_kernel.attention_takes(q, half, half, 32, 4)  # a half model's cache
    assert not cpu_kernel.attention_takes(q.astype(mx.float16), keys, keys, 32, 4)
    narrow = quantized_kv(1, 2, 40, 32, 32, 4)
    assert not cpu_kernel.attention_takes(q, keys, narrow, 32, 4)  # values narrower than keys


def test_a_batch_is_its_own_expert_configuration_for_the_first_use_check():
    """Its launches share reads (SHARE > 1), another kernel than one token's: checked apart."""
    gate, up = (quantized_experts(4, 64, 128, 32, 4) for _ in range(2))
    down = quantized_experts(4, 128, 64, 32, 4)
    one = expert_module._config(mx.zeros((1, 128)), mx.array([[0, 1]], mx.uint32), gate, up, down)
    batch = expert_module._config(mx.zeros((3, 128)), mx.array([[0, 1]] * 3, mx.uint32), gate, up, down)
    assert one != batch


@needs_cpu_kernel
def test_tokens_that_share_experts_get_what_each_gets_alone():
    """A batch's tokens share their experts' reads (the work goes expert by expert); each
    token's sums run as they do alone, so its output is bitwise the same."""
    d, h, experts = 256, 128, 6
    gate, up = (quantized_experts(experts, h, d, 32, 4) for _ in range(2))
    down = quantized_experts(experts, d, h, 32, 4)
    x = mx.random.normal((16, d))
    indices = mx.array([[t % 3, 3 + t % 2] for t in range(16)], mx.uint32)  # 5 experts among 16 tokens
    together = np.array(cpu_kernel.expert_swiglu(x, indices, gate, up, down))
    alone = [np.array(cpu_kernel.expert_swiglu(x[t : t + 1], indices[t : t + 1], gate, up, down)) for t in range(16)]
    assert np.array_equal(together, np.concatenate(alone))


@needs_cpu_kernel
def test_the_cpu_expert_kernel_refuses_what_it_cannot_read():
    gate, up = (quantized_experts(4, 64, 128, 32, 4) for _ in range(2))
    down = quantized_experts(4, 128, 64, 32, 4)
    x = mx.random.normal((1, 128))
    with pytest.raises(ValueError, match="did not take this call .status -1"):  # an expert id past the table: no read out of bounds
        cpu_kernel.expert_swiglu(x, mx.array([[1, 4]], mx.uint32), gate, up, down)
    half = [p._replace(scales=p.scales.astype(mx.float16)) for p in (gate, up, down)]
    assert not cpu_kernel.expert_takes(x, mx.array([[1, 2]], mx.uint32), *half)  # half scales: the reference runs
    assert not cpu_kernel.expert_takes(x.astype(mx.float16), mx.array([[1, 2]], mx.uint32), gate, up, down)


def float_switch_glu(d: int, h: int, experts: int, activation=None) -> SwitchGLU:
    """mlx-lm's SwitchGLU over float32 experts with biases (gpt-oss's layout), all random."""
    layer = SwitchGLU(d, h, experts, bias=True, **({"activation": activation} if activation else {}))
    for p in (layer.gate_proj, layer.up_proj, layer.down_proj):
        p.bias = mx.random.normal(p.bias.shape) * 0.1
    mx.eval(layer.parameters())
    return layer


@needs_cpu_kernel
@pytest.mark.parametrize("tokens, k, per", [(2, 2, 2), (8, 2, 1), (5, 4, 4), (80, 2, 2), (80, 2, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_grouped_expert_product_matches_the_reference(tokens, k, per, bias):
    """Every pair's row times its expert's weight, the pairs of one expert taken together:
    a few pairs each (decode.c's grouped product) and, at 80 tokens, more than
    GROUPED_ROWS of one expert (one sgemm per expert); unused experts; a row per token (the
    first projections, per = k) or per pair (the last)."""
    experts, d, m = 6, 96, 80
    weight = mx.random.normal((experts, m, d))
    b = mx.random.normal((experts, m)) if bias else None
    indices = mx.concatenate([mx.random.permutation(experts - 1)[:k] for _ in range(tokens)]).astype(mx.uint32)
    x = mx.random.normal((tokens * k // per, d))
    assert (np.bincount(np.array(indices)).max() > cpu_kernel.GROUPED_ROWS) == (tokens == 80)
    assert cpu_kernel.product_takes(x, indices, weight, b, per)
    got = cpu_kernel.expert_product(x, indices, weight, b, per)
    assert got.shape == (tokens * k, m) and got.dtype == mx.float32
    assert rel_err(got, reference.expert_product(x, indices, weight, b, per)) < 1e-5
    rows = np.repeat(f64(x), per, axis=0) if per > 1 else f64(x)
    want = np.einsum("pmd,pd->pm", f64(weight)[np.array(indices)], rows) + (f64(b)[np.array(indices)] if bias else 0)
    assert rel_err(got, want) < 1e-5


@needs_cpu_kernel
def test_the_grouped_expert_product_refuses_what_it_cannot_read():
    weight, x = mx.random.normal((4, 32, 64)), mx.random.normal((2, 64))
    with pytest.raises(ValueError, match="outside the layer's 4 experts"):  # no read out of bounds
        cpu_kernel.expert_product(x, mx.array([0, 4], mx.uint32), weight, None, 1)
    assert not cpu_kernel.product_takes(x.astype(mx.float16), mx.array([0, 1], mx.uint32), weight, None, 1)
    assert not cpu_kernel.product_takes(x, mx.array([0, 1, 2], mx.uint32), weight, None, 1)  # 3 pairs, 2 rows


@needs_cpu_kernel
@pytest.mark.parametrize("tokens", [1, 3, 8, 70])
def test_a_float_moe_layer_groups_its_experts_and_computes_what_mlx_lm_does(tokens, monkeypatch):
    """gpt-oss's MoE layer (float32 experts with biases, its clamped SwiGLU) as the loader
    swaps it on the CPU build: the same result as mlx-lm's SwitchGLU, one token on mlx-lm's
    own path, more through the grouped product (decode.c's, or at 70 tokens one sgemm per
    expert)."""
    from mlx_lm.models.gpt_oss import SwigluOAI

    monkeypatch.setenv("LMSP_KERNELS", "auto")
    stock = float_switch_glu(64, 96, 4, SwigluOAI())
    layer = kernels.GroupedSwitchGLU.of(stock)
    assert layer.up_proj is stock.up_proj and layer.activation is stock.activation
    x = mx.random.normal((1, tokens, 64))
    indices = mx.stack([mx.random.permutation(4)[:2] for _ in range(tokens)])[None].astype(mx.uint32)
    before = kernels.expert_product.calls["kernel"]
    got = layer(x, indices)
    assert got.shape == (1, tokens, 2, 64)
    assert rel_err(got, stock(x, indices)) < 1e-5
    assert kernels.expert_product.calls["kernel"] == before + (0 if tokens == 1 else 3)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_references_take_a_half_model_and_answer_in_its_dtype(dtype):
    """A float16 / bfloat16 model's inputs (half activations, half scales and biases): the
    references compute in float32 and round once, so they stay within the output's rounding."""
    gate, up = (quantized_experts(6, 64, 128, 32, 4) for _ in range(2))
    down = quantized_experts(6, 128, 64, 32, 4)
    half = [p._replace(scales=p.scales.astype(dtype), biases=p.biases.astype(dtype)) for p in (gate, up, down)]
    x, indices = mx.random.normal((2, 128)).astype(dtype), mx.array([[0, 3], [5, 1]], mx.uint32)
    got = reference.expert_swiglu(x, indices, *half)
    assert got.dtype == dtype
    assert rel_err(got, float_experts(x, indices, *half)) < 1e-2
    keys, values = quantized_kv(1, 2, 300, 64, 32, 4), quantized_kv(1, 2, 300, 64, 32, 4)
    keys, values = ((w, s.astype(dtype), b.astype(dtype)) for w, s, b in (keys, values))
    q = mx.random.normal((1, 8, 1, 64)).astype(dtype)
    got = reference.decode_attention(q, keys, values, 0.125, 32, 4)
    assert got.dtype == dtype
    assert rel_err(got, float_attention(q, keys, values, 0.125, 32, 4)) < 1e-2


@needs_backend
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("tokens, k, dtype", [(1, 8, mx.float32), (1, 8, mx.float16), (4, 2, mx.bfloat16)])
@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "one-launch"])
def test_expert_kernel_matches_its_reference(bits, group_size, tokens, k, dtype, fused, monkeypatch):
    if fused and kernels.backend() != "cuda":
        pytest.skip("the one-launch expert kernel is CUDA's")
    monkeypatch.setattr(expert_module, "FUSED", fused)
    d, h, experts = 512, 256, 16
    gate, up = (quantized_experts(experts, h, d, group_size, bits) for _ in range(2))
    down = quantized_experts(experts, d, h, group_size, bits)
    if dtype != mx.float32:
        gate, up, down = (p._replace(scales=p.scales.astype(dtype), biases=p.biases.astype(dtype)) for p in (gate, up, down))
    x = mx.random.normal((tokens, d)).astype(dtype)
    indices = mx.stack([mx.random.permutation(experts)[:k] for _ in range(tokens)]).astype(mx.uint32)
    got = expert_module.kernel(x, indices, gate, up, down)
    want = reference.expert_swiglu(x, indices, gate, up, down)
    # float32: summation order only; half inputs: the output's own rounding (2^-8 for bfloat16)
    assert rel_err(got, want) < (1e-4 if dtype == mx.float32 else 1e-2)


@needs_backend
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("batch, hq, hkv, n, d", ATTENTION_CASES + [(1, 32, 8, 16384, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "one-launch"])
def test_attention_kernel_matches_its_reference(bits, group_size, batch, hq, hkv, n, d, dtype, fused, monkeypatch):
    if fused and kernels.backend() != "cuda":
        pytest.skip("the one-launch attention kernel is CUDA's")
    monkeypatch.setattr(attention_module, "FUSED", fused)
    keys = quantized_kv(batch, hkv, n, d, group_size, bits, spare=100)
    values = quantized_kv(batch, hkv, n, d, group_size, bits, spare=100)
    if dtype != mx.float32:  # a half model's cache: half scales and biases, half queries
        keys, values = ((w, s.astype(dtype), b.astype(dtype)) for w, s, b in (keys, values))
    q, scale = mx.random.normal((batch, hq, 1, d)).astype(dtype), d**-0.5
    got = attention_module.kernel(q, keys, values, scale, group_size, bits)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: summation order only; half: the output's own rounding (2^-8 for bfloat16)
    want = reference.decode_attention(q, keys, values, scale, group_size, bits)
    assert rel_err(got, want) < (1e-4 if dtype == mx.float32 else 1e-2)


needs_cuda = pytest.mark.skipif(kernels.backend() != "cuda", reason="the one-launch kernels are CUDA's; "
                                "this build has " + (kernels.backend() or "neither Metal nor CUDA"))


@pytest.mark.gpu
@needs_cuda
def test_one_launch_forms_agree_with_two_launches_and_the_reference(monkeypatch):
    """The CUDA one-launch forms hand partial results between blocks through memory and a
    counter, which only a GPU runs concurrently: on a few decode shapes each agrees with its
    two-launch form and with the reference (the per-shape sweeps are
    test_*_kernel_matches_its_reference)."""
    for bits, group_size, tokens, k, dtype in [(4, 64, 1, 8, mx.float16), (3, 32, 4, 8, mx.float32)]:
        d, h, experts = 512, 256, 16
        gate, up = (quantized_experts(experts, h, d, group_size, bits) for _ in range(2))
        down = quantized_experts(experts, d, h, group_size, bits)
        gate, up, down = (p._replace(scales=p.scales.astype(dtype), biases=p.biases.astype(dtype))
                          for p in (gate, up, down))
        x = mx.random.normal((tokens, d)).astype(dtype)
        indices = mx.stack([mx.random.permutation(experts)[:k] for _ in range(tokens)]).astype(mx.uint32)
        got = {}
        for fused in (False, True):
            monkeypatch.setattr(expert_module, "FUSED", fused)
            got[fused] = expert_module.kernel(x, indices, gate, up, down)
        want = reference.expert_swiglu(x, indices, gate, up, down)
        tolerance = 1e-4 if dtype == mx.float32 else 1e-2
        assert rel_err(got[True], got[False]) < tolerance and rel_err(got[True], want) < tolerance
    for bits, group_size, n, dtype in [(4, 64, 16384, mx.float16), (8, 32, 300, mx.float32)]:
        keys, values = (quantized_kv(1, 4, n, 128, group_size, bits, spare=100) for _ in range(2))
        keys, values = ((w, s.astype(dtype), b.astype(dtype)) for w, s, b in (keys, values))
        q = mx.random.normal((1, 32, 1, 128)).astype(dtype)
        got = {}
        for fused in (False, True):
            monkeypatch.setattr(attention_module, "FUSED", fused)
            got[fused] = attention_module.kernel(q, keys, values, 128**-0.5, group_size, bits)
        # the same merge in the same order; two compilations may still contract differently
        assert rel_err(got[True], got[False]) < (1e-6 if dtype == mx.float32 else 2e-3)
        want = reference.decode_attention(q, keys, values, 128**-0.5, group_size, bits)
        assert rel_err(got[True], want) < (1e-4 if dtype == mx.float32 else 1e-2)


def test_dispatch_modes(monkeypatch):
    x = (mx.random.normal((1, 2, 1, 64)), quantized_kv(1, 2, 10, 64, 32, 4), quantized_kv(1, 2, 10, 64, 32, 4),
         0.125, 32, 4)
    monkeypatch.setenv("LMSP_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="LMSP_KERNELS"):
        kernels.decode_attention(*x)
    monkeypatch.setenv("LMSP_KERNELS", "reference")
    assert rel_err(kernels.decode_attention(*x), reference.decode_attention(*x)) == 0
    if kernels.backend() is None and not cpu_kernel.available():  # no kernel of any kind here
        monkeypatch.setenv("LMSP_KERNELS", "kernel")
        with pytest.raises(RuntimeError, match="no Metal or CUDA backend"):
            kernels.decode_attention(*x)
        monkeypatch.setenv("LMSP_KERNELS", "auto")
        before = kernels.decode_attention.calls["reference"]
        kernels.decode_attention(*x)
        assert kernels.decode_attention.calls["reference"] == before + 1
    elif kernels.backend() is None:  # the CPU build's compiled kernel (attention.c)
        for chosen in ("kernel", "auto"):
            monkeypatch.setenv("LMSP_KERNELS", chosen)
            before = kernels.decode_attention.calls["kernel"]
            assert rel_err(kernels.decode_attention(*x), reference.decode_attention(*x)) < 1e-5
            assert kernels.decode_attention.calls["kernel"] == before + 1, chosen


@needs_backend
def test_a_kernel_source_that_does_not_compile_falls_back_to_the_reference_with_one_warning(monkeypatch, caplog):
    """The real build path with a deliberately broken source (a syntax error in the attention
    body): its configuration's first call fails to compile, the reference answers, and the
    log says so once; the next call of that configuration does not try again."""
    from lmsp_mlx.kernels import sources

    real = sources.sections

    def broken(filename):
        parts = dict(real(filename))
        if filename.startswith("decode_attention"):
            parts = {name: ("this is not a kernel;\n" + text if name in ("body", "state") else text)
                     for name, text in parts.items()}
        return parts

    monkeypatch.setattr(sources, "sections", broken)
    sources.kernel.cache_clear()
    monkeypatch.setattr(kernels.decode_attention, "verdicts", {})
    monkeypatch.setenv("LMSP_KERNELS", "auto")
    keys, values = quantized_kv(1, 2, 300, 64, 32, 4), quantized_kv(1, 2, 300, 64, 32, 4)
    q = mx.random.normal((1, 8, 1, 64))
    try:
        with caplog.at_level(logging.WARNING, logger="lmsp_mlx.kernels"):
            before = kernels.decode_attention.calls["reference"]
            for _ in range(2):
                got = kernels.decode_attention(q, keys, values, 0.125, 32, 4)
        assert rel_err(got, reference.decode_attention(q, keys, values, 0.125, 32, 4)) == 0
        assert kernels.decode_attention.calls["reference"] == before + 2
        warnings = [r.getMessage() for r in caplog.records if "kernel unavailable" in r.getMessage()]
        assert len(warnings) == 1, warnings
    finally:
        sources.kernel.cache_clear()  # no broken build outlives the test


def test_auto_mode_checks_each_kernel_configuration_once_and_keeps_only_agreeing_kernels(monkeypatch, caplog):
    """What protects users from a kernel build nobody ran on their GPU: the first call of a
    configuration runs kernel and reference and compares; a disagreeing or failing kernel
    is replaced by the reference, with one warning."""
    monkeypatch.setattr(dispatch, "backend", lambda: "metal")  # the check runs where a backend exists
    monkeypatch.setenv("LMSP_KERNELS", "auto")
    x = mx.arange(6, dtype=mx.float32)

    def broken(a):
        raise RuntimeError("unable to build the kernel\nwith details")

    cases = {"wrong": lambda a: a * 1.5, "broken": broken, "right": lambda a: a + 0.0}
    for name, kernel in cases.items():
        d = dispatch.Dispatch(name, kernel, lambda a: a, lambda a: a.shape, lambda g, w: dispatch.close(g, w, 1e-3))
        with caplog.at_level(logging.INFO, logger="lmsp_mlx.kernels"):
            caplog.clear()
            results = [d(x), d(x), d(mx.arange(3, dtype=mx.float32))]
        assert all(np.array_equal(np.array(r), np.arange(r.size)) for r in results)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        if name == "right":
            assert d.calls == {"kernel": 3, "builtin": 0, "reference": 0} and not warnings
        else:
            assert d.calls == {"kernel": 0, "builtin": 0, "reference": 3}
            assert len(warnings) == 2  # one per configuration (two shapes), not per call
            assert ("disagrees" if name == "wrong" else "unable to build the kernel") in warnings[0].getMessage()


def stock_greedy(path, monkeypatch, prompt: list[int], cache_factory=None) -> list[int]:
    """mlx-lm's own tokens, with no kernel, on the CPU device (builtin)."""
    return builtin(lambda: mx.array(greedy(path, "off", monkeypatch, prompt, cache_factory)[0])).tolist()


def greedy(path, mode: str, monkeypatch, prompt: list[int], cache_factory=None) -> tuple[list[int], str]:
    monkeypatch.setenv("LMSP_KERNELS", mode)
    lm = load_model(path)
    cache = cache_factory(lm) if cache_factory else None
    tokens: list[int] = []
    generate(lm, GenerationParams(prompt=prompt, max_tokens=24, temperature=0.0), emit=lambda e: None,
             cancelled=lambda: False, cache=cache, sampled=tokens)
    return tokens, lm.quantization


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_tiny_moe_model_gives_the_same_greedy_tokens_through_the_engine_with_the_kernel_path(
        tmp_path, monkeypatch, arch):
    """Through the engine, a decode step at a time: the reference path, and what `auto` runs
    (this build's kernel, experts.c on the CPU build), give mlx-lm's own tokens."""
    path = build_tiny_moe_model(tmp_path / arch, arch)
    prompt = list(range(40, 90))
    stock = stock_greedy(path, monkeypatch, prompt)
    auto_runs = "kernel" if kernels.expert_swiglu.available() else "builtin"
    for chosen, ran in (("reference", "reference"), ("auto", auto_runs)):
        before = kernels.expert_swiglu.calls[ran]
        swapped, quantization = greedy(path, chosen, monkeypatch, prompt)
        assert kernels.expert_swiglu.calls[ran] - before >= len(swapped) - 1, chosen  # each decode step
        assert swapped == stock and len(stock) >= 8, chosen
    if kernels.backend() is None:  # the CPU build: float32, except the experts
        assert quantization == "float32, MoE experts affine-4bit-g32"


def test_kv_bits_decode_gives_the_same_greedy_tokens_with_the_attention_kernel_path(tmp_path, monkeypatch):
    """The same for a --kv-bits cache: the reference path, and `auto` (the kernel where this
    build has one: Metal, CUDA, or attention.c on the CPU build; the reference elsewhere)."""
    # Decode steps op by op through MLX, where the dispatch runs (the compiled CPU step reads
    # a quantized cache itself: tests/test_cpu_decode.py).
    monkeypatch.setenv("LMSP_CPU_DECODE", "0")
    path = build_tiny_model(tmp_path / "m", head_dim=64)
    prompt = list(range(30, 130))
    caches = lambda lm: [QuantizedKVCache(group_size=32, bits=4) for _ in lm.model.layers]  # noqa: E731
    stock = stock_greedy(path, monkeypatch, prompt, caches)
    auto_runs = "kernel" if kernels.decode_attention.available() else "reference"
    for chosen, ran in (("reference", "reference"), ("auto", auto_runs)):
        before = kernels.decode_attention.calls[ran]
        swapped, _ = greedy(path, chosen, monkeypatch, prompt, caches)
        assert kernels.decode_attention.calls[ran] - before >= 2 * (len(swapped) - 1), chosen  # 2 layers a step
        assert swapped == stock and len(stock) >= 8, chosen


HALF, BF16, U32 = "__half", "__nv_bfloat16", "uint32_t"
CUDA_BUILDS = {
    "decode_attention, float16 cache, 8 query rows of 128": (
        "decode_attention", "body",
        [("q", BF16), ("kw", U32), ("ks", HALF), ("kb", HALF), ("vw", U32), ("vs", HALF), ("vb", HALF),
         ("first", "int32_t")],
        [("o_acc", "float"), ("o_max", "float"), ("o_sum", "float")],
        [("T", BF16), ("S", HALF), ("D", 128), ("G", 8), ("BITS", 4), ("GS", 64), ("WARPS", 4), ("BATCH", 4),
         ("CHUNK", 256), ("SCALE", 1040187392)]),  # 0.125
    "decode_attention in one launch (state+body+last), float16 cache, 8 query rows of 128": (
        "decode_attention", "state+body+last",
        [("q", BF16), ("kw", U32), ("ks", HALF), ("kb", HALF), ("vw", U32), ("vs", HALF), ("vb", HALF),
         ("first", "int32_t")],
        [("state", "float"), ("result", BF16)],
        [("T", BF16), ("S", HALF), ("D", 128), ("G", 8), ("BITS", 4), ("GS", 64), ("WARPS", 4), ("BATCH", 4),
         ("CHUNK", 256), ("SCALE", 1040187392)]),
    "decode_attention merge, bfloat16 out": (
        "decode_attention", "merge", [("acc", "float"), ("tops", "float"), ("totals", "float")], [("out", BF16)],
        [("T", BF16), ("D", 128), ("G", 8)]),
    "expert gate_up, 3-bit (codes across words)": (
        "expert_swiglu", "gate_up",
        [("x", BF16), ("idx", U32), ("gw", U32), ("gs", HALF), ("gb", HALF), ("uw", U32), ("us", HALF), ("ub", HALF)],
        [("hid", "float")],
        [("S", HALF), ("D", 2048), ("H", 768), ("BITS", 3), ("GS", 64), ("WARPS", 4), ("ROWS", 4), ("X", BF16), ("K", 8),
         ("SHARE", 1)]),
    "expert gate_up of a batch, 4-bit, pairs of an expert taken 3 at a time": (
        "expert_swiglu", "gate_up",
        [("x", HALF), ("idx", U32), ("gw", U32), ("gs", HALF), ("gb", HALF), ("uw", U32), ("us", HALF), ("ub", HALF)],
        [("hid", "float")],
        [("S", HALF), ("D", 2048), ("H", 768), ("BITS", 4), ("GS", 64), ("WARPS", 4), ("ROWS", 4), ("X", HALF), ("K", 8),
         ("SHARE", 3)]),
    "expert fused, 4-bit, the defaults": (
        "expert_swiglu", "fused",
        [("x", HALF), ("idx", U32), ("gw", U32), ("gs", HALF), ("gb", HALF), ("uw", U32), ("us", HALF),
         ("ub", HALF), ("dw", U32), ("ds", HALF), ("db", HALF)], [("y", HALF), ("scratch", "float")],
        [("S", HALF), ("D", 2048), ("H", 768), ("BITS", 4), ("GS", 64), ("WARPS", expert_module.FUSED_WARPS),
         ("ROWS", expert_module.FUSED_ROWS), ("SLICE", expert_module.SLICE), ("X", HALF), ("Y", HALF), ("K", 8)]),
    "expert fused, 3-bit, bfloat16, two chunks a slice": (
        "expert_swiglu", "fused",
        [("x", BF16), ("idx", U32), ("gw", U32), ("gs", BF16), ("gb", BF16), ("uw", U32), ("us", BF16),
         ("ub", BF16), ("dw", U32), ("ds", BF16), ("db", BF16)], [("y", BF16), ("scratch", "float")],
        [("S", BF16), ("D", 2048), ("H", 768), ("BITS", 3), ("GS", 32), ("WARPS", 4), ("ROWS", 4), ("SLICE", 64),
         ("X", BF16), ("Y", BF16), ("K", 8)]),
    "expert down, bfloat16 out": (
        "expert_swiglu", "down",
        [("hid", "float"), ("idx", U32), ("dw", U32), ("ds", HALF), ("db", HALF)], [("y", BF16)],
        [("S", HALF), ("D", 2048), ("H", 768), ("BITS", 4), ("GS", 64), ("WARPS", 4), ("ROWS", 4), ("Y", BF16),
         ("SHARE", 4)]),
}


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory) -> dict[str, list[str]]:
    """Every case of CUDA_BUILDS compiled in one nvcc run, each in a namespace of its own
    (nvcc's start-up is most of a build): ptxas's resource line of each function, by case;
    {"": [nvcc's errors]} where it does not compile."""
    tags = {f"case{i:02d}": case for i, case in enumerate(CUDA_BUILDS)}
    text = cuda_source.STAND_IN + "".join(f"namespace {tag} {{\n{sections(f'{stem}.cu')['header']}\n"
                              f"{cuda_source.kernel(stem, section, inputs, outputs, template)}}}\n"
                              for tag, (stem, section, inputs, outputs, template)
                              in zip(tags, CUDA_BUILDS.values()))
    where = tmp_path_factory.mktemp("nvcc")
    (where / "kernels.cu").write_text(text)
    done = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v", "-c", str(where / "kernels.cu"),
                           "-o", str(where / "kernels.o")], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"": [done.stderr]}
    reports: dict[str, list[str]] = {}
    for name, line in re.findall(r"Function properties for (\S+)\n\s*(.*)", done.stderr):
        tag = next(t for t in tags if f"{len(t)}{t}" in name)
        reports.setdefault(tags[tag], []).append(line.strip())
    return reports


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the CUDA twins' compile check needs the CUDA toolkit")
@pytest.mark.parametrize("case", list(CUDA_BUILDS))
def test_cuda_twins_compile_as_mlx_assembles_them(case, ptxas_reports):
    """Without a GPU the CUDA kernels cannot run here, but they can be compiled the way MLX's
    CUDA backend assembles them (for an H100/H200, sm_90): no syntax, type or template error
    waits for the first user. And ptxas's resource report shows every per-thread array in
    registers: a local-memory frame or a spill (an array indexed by what the compiler
    could not unroll, too many live values) would put the hot loop in memory."""
    assert "" not in ptxas_reports, ptxas_reports.get("", [""])[0]
    assert ptxas_reports[case] and all(line == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
                                       for line in ptxas_reports[case]), ptxas_reports[case]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the CUDA timing programs need the CUDA toolkit")
def test_the_cuda_timing_programs_build(tmp_path):
    """benchmarks/cuda_kernels.py times the CUDA twins outside MLX on a lent GPU, where a
    build error would cost device time: its programs (the defaults' launch code, the host
    check against a float computation) compile here."""
    from benchmarks.cuda_kernels import build

    built = build(tmp_path, "sm_90", ["attention_b4_w4_t4_c256", "attention_b4_w4_t4_c256_f", "expert_b4_w4_r4_s0",
                                      "expert_b4_w8_r4_s32"])
    assert all(path.exists() for path in built.values()) and len(built) == 4


def needs_simt(test):
    """Each SIMT case builds and runs a C++ emulation of a kernel body: slow, and only where g++ is."""
    no_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the SIMT emulation")
    return pytest.mark.slow(no_gxx(test))


# The kernel bodies themselves, run on the CPU by tests/simt.py (one OS thread per GPU
# thread, barriers and simd/warp sums emulated), in float32, against the references: the
# indexing, the synchronisation and the split/merge math of the very text MLX compiles.
DIALECTS = ["metal", "cu"]


@needs_simt
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("bits, group_size, hq, hkv, n, d, batch", [
    # two splits of 256, the second partial and ending mid-batch; 4 query rows per KV head
    (4, 32, 8, 2, 302, 64, attention_module.BATCH),
    (8, 64, 3, 1, 41, 128, attention_module.BATCH),  # fewer positions than a split, ending mid-batch; 3 rows
    (4, 64, 32, 4, 263, 128, 4),  # 8 rows x 4 positions: the 32 scores fill one reduce-scatter round
    (4, 32, 16, 1, 45, 64, 8),  # 16 rows x 8 positions: two rounds, maxima over groups of 8 lanes
    (8, 32, 2, 2, 9, 32, 1),  # one row, one position a batch
    (4, 32, 4, 2, 70, 96, 4),  # 3 values a lane: 12-bit spans straddle words, some lanes cross groups
    (8, 32, 2, 1, 37, 96, 4),  # 24-bit spans
    (8, 64, 2, 1, 33, 256, 4),  # 64-bit spans: value by value
])
def test_attention_kernel_source_computes_its_reference(dialect, bits, group_size, hq, hkv, n, d, batch, monkeypatch):
    from tests import simt

    monkeypatch.setattr(attention_module, "BATCH", batch)

    # A padded cache buffer and the views of its first n positions that the kernel reads.
    buffers = {p: [np.array(a) for a in mx.quantize(mx.random.normal((1, hkv, n + 37, d)), group_size, bits)]
               for p in "kv"}
    keys, values = (tuple(mx.array(a)[:, :, :n] for a in buffers[p]) for p in "kv")
    q, scale = mx.random.normal((1, hq, 1, d)), d**-0.5
    rows, splits = hq // hkv, -(-n // attention_module.CHUNK)
    inputs = {"q": np.array(q.reshape(1, hq, d)), "first": np.zeros(1, np.int32)}
    for p in "kv":
        inputs |= {p + part: a[:, :, :n] for part, a in zip("wsb", buffers[p])}  # strided numpy views
    parts = simt.run("decode_attention", "body", dialect, inputs,
                     {"o_acc": (hkv, splits, rows, d), "o_max": (hkv, splits, rows), "o_sum": (hkv, splits, rows)},
                     {"T": "float", "S": "float", "D": d, "G": rows, "BITS": bits, "GS": group_size,
                      "WARPS": attention_module.WARPS, "BATCH": attention_module.BATCH, "CHUNK": attention_module.CHUNK,
                      "SCALE": attention_module.float_bits(scale)},
                     grid=(1, hkv, splits), threads=32 * attention_module.WARPS)
    out = simt.run("decode_attention", "merge", dialect,
                   {"acc": parts["o_acc"], "tops": parts["o_max"], "totals": parts["o_sum"]},
                   {"out": (hkv * rows, d)}, {"T": "float", "D": d, "G": rows}, grid=(1, hkv * rows, 1), threads=32)
    got = out["out"].reshape(1, hq, 1, d)
    assert rel_err(got, reference.decode_attention(q, keys, values, scale, group_size, bits)) < 1e-5
    if dialect == "cu":  # CUDA's one launch: the same body, the last split merging them all
        assert np.array_equal(run_one_launch(inputs, 1, hkv, rows, d, bits, group_size, scale), out["out"])


def run_one_launch(inputs, batch, hkv, rows, d, bits, group_size, scale):
    """decode_attention.cu's state+body+last under the SIMT emulation: -> (batch * hkv * rows, d)."""
    from tests import simt

    splits = -(-inputs["kw"].shape[2] // attention_module.CHUNK)
    got = simt.run("decode_attention", "state+body+last", "cu", inputs,
                   {"state": (batch * hkv * splits * rows * (d + 2) + batch * hkv,), "result": (batch * hkv * rows, d)},
                   {"T": "float", "S": "float", "D": d, "G": rows, "BITS": bits, "GS": group_size,
                    "WARPS": attention_module.WARPS, "BATCH": attention_module.BATCH, "CHUNK": attention_module.CHUNK,
                    "SCALE": attention_module.float_bits(scale)},
                   grid=(1, batch * hkv, splits), threads=32 * attention_module.WARPS)
    return got["result"]


@needs_simt
def test_the_one_launch_attention_source_merges_many_splits_of_a_batch(monkeypatch):
    """Two sequences, 35 splits a KV head (past one round of 32 in the last split's merge,
    the last round partial), each sequence's last split merging its own splits only: the
    reference's output, and exactly the two-launch merge's, which sums in the same order.
    One KV head a sequence keeps the emulation to 70 threadgroups."""
    from tests import simt

    monkeypatch.setattr(attention_module, "CHUNK", 32)
    batch, hq, hkv, n, d, bits, group_size = 2, 4, 1, 1100, 64, 4, 32
    buffers = {p: [np.array(a) for a in mx.quantize(mx.random.normal((batch, hkv, n + 5, d)), group_size, bits)]
               for p in "kv"}
    keys, values = (tuple(mx.array(a)[:, :, :n] for a in buffers[p]) for p in "kv")
    q, scale = mx.random.normal((batch, hq, 1, d)), d**-0.5
    rows, splits = hq // hkv, -(-n // 32)
    # The second sequence is 803 positions long, left-padded by 297: its first 9 splits are
    # wholly padding (empty states the merge must skip), the 10th starts mid-split.
    first = mx.array([0, 297], mx.int32)
    inputs = {"q": np.array(q.reshape(batch, hq, d)), "first": np.array(first)}
    for p in "kv":
        inputs |= {p + part: a[:, :, :n] for part, a in zip("wsb", buffers[p])}
    got = run_one_launch(inputs, batch, hkv, rows, d, bits, group_size, scale)
    assert splits == 35
    assert rel_err(got.reshape(batch, hq, 1, d), reference.decode_attention(q, keys, values, scale, group_size,
                                                                            bits, first)) < 1e-5
    alone = reference.decode_attention(q[1:], tuple(a[1:, :, 297:] for a in keys), tuple(a[1:, :, 297:] for a in values),
                                       scale, group_size, bits)
    assert rel_err(got.reshape(batch, hq, 1, d)[1:], alone) < 1e-5  # the padding is as if it were not there
    template = {"T": "float", "S": "float", "D": d, "G": rows, "BITS": bits, "GS": group_size,
                "WARPS": attention_module.WARPS, "BATCH": attention_module.BATCH, "CHUNK": 32,
                "SCALE": attention_module.float_bits(scale)}
    parts = simt.run("decode_attention", "body", "cu", inputs,
                     {"o_acc": (batch * hkv, splits, rows, d), "o_max": (batch * hkv, splits, rows),
                      "o_sum": (batch * hkv, splits, rows)}, template,
                     grid=(1, batch * hkv, splits), threads=32 * attention_module.WARPS)
    out = simt.run("decode_attention", "merge", "cu", {"acc": parts["o_acc"], "tops": parts["o_max"],
                                                       "totals": parts["o_sum"]},
                   {"out": (batch * hkv * rows, d)}, {"T": "float", "D": d, "G": rows},
                   grid=(1, batch * hkv * rows, 1), threads=32)
    assert np.array_equal(got, out["out"])


@needs_simt
@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_attention_sources_skip_each_rows_left_padding(dialect):
    """A batch of sequences of different lengths (BatchQuantizedKVCache's layout): row 1
    starts at position 270, so its first split is wholly padding and its second starts
    inside it; each row gets what it gets alone."""
    from tests import simt

    batch, hq, hkv, n, d, bits, group_size = 2, 4, 2, 300, 32, 4, 32
    buffers = {p: [np.array(a) for a in mx.quantize(mx.random.normal((batch, hkv, n, d)), group_size, bits)]
               for p in "kv"}
    keys, values = (tuple(mx.array(a) for a in buffers[p]) for p in "kv")
    q, scale, first = mx.random.normal((batch, hq, 1, d)), d**-0.5, mx.array([0, 270], mx.int32)
    rows, splits = hq // hkv, -(-n // attention_module.CHUNK)
    inputs = {"q": np.array(q.reshape(batch, hq, d)), "first": np.array(first)}
    for p in "kv":
        inputs |= {p + part: a for part, a in zip("wsb", buffers[p])}
    template = {"T": "float", "S": "float", "D": d, "G": rows, "BITS": bits, "GS": group_size,
                "WARPS": attention_module.WARPS, "BATCH": attention_module.BATCH, "CHUNK": attention_module.CHUNK,
                "SCALE": attention_module.float_bits(scale)}
    parts = simt.run("decode_attention", "body", dialect, inputs,
                     {"o_acc": (batch * hkv, splits, rows, d), "o_max": (batch * hkv, splits, rows),
                      "o_sum": (batch * hkv, splits, rows)}, template,
                     grid=(1, batch * hkv, splits), threads=32 * attention_module.WARPS)
    out = simt.run("decode_attention", "merge", dialect,
                   {"acc": parts["o_acc"], "tops": parts["o_max"], "totals": parts["o_sum"]},
                   {"out": (batch * hkv * rows, d)}, {"T": "float", "D": d, "G": rows},
                   grid=(1, batch * hkv * rows, 1), threads=32)
    got = out["out"].reshape(batch, hq, 1, d)
    for b in range(batch):
        start = int(first[b].item())
        alone = reference.decode_attention(q[b : b + 1], tuple(a[b : b + 1, :, start:] for a in keys),
                                           tuple(a[b : b + 1, :, start:] for a in values), scale, group_size, bits)
        assert rel_err(got[b : b + 1], alone) < 1e-5, b


@needs_simt
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("bits, group_size, d, h, tokens, k, rows_per_warp, share, experts", [
    (3, 32, 96, 64, 2, 3, expert_module.ROWS, 1, 6),  # 3-bit codes cross words; 3 chunks a row, most lanes idle
    (4, 64, 1088, 128, 1, 2, expert_module.ROWS, 1, 6),  # 34 chunks a row: lanes 0 and 1 take a second chunk
    (2, 32, 96, 64, 1, 2, 3, 1, 6),  # 12 rows a threadgroup: the last one of each matrix runs past its end
    # a batch whose tokens share experts: 5 tokens x 2 of 3 experts, runs of 3-4 pairs an
    # expert taken 2 (then 3) at a time, the last threadgroup of a run taking fewer
    (4, 32, 96, 64, 5, 2, expert_module.ROWS, 2, 3),
    (3, 32, 64, 96, 5, 2, 3, 3, 3),
])
def test_expert_kernel_sources_compute_their_reference(dialect, bits, group_size, d, h, tokens, k, rows_per_warp,
                                                       share, experts, monkeypatch):
    from tests import simt

    monkeypatch.setattr(expert_module, "ROWS", rows_per_warp)

    gate, up = (quantized_experts(experts, h, d, group_size, bits) for _ in range(2))
    down = quantized_experts(experts, d, h, group_size, bits)
    x = mx.random.normal((tokens, d))
    indices = mx.stack([mx.random.permutation(experts)[:k] for _ in range(tokens)]).astype(mx.uint32)
    pairs, rows = tokens * k, expert_module.WARPS * expert_module.ROWS
    common = {"S": "float", "D": d, "H": h, "BITS": bits, "GS": group_size,
              "WARPS": expert_module.WARPS, "ROWS": expert_module.ROWS}
    idx = np.array(indices.reshape(-1))
    hidden = simt.run("expert_swiglu", "gate_up", dialect,
                      {"x": np.array(x), "idx": idx, **{n: np.array(a) for n, a in zip(
                          ("gw", "gs", "gb", "uw", "us", "ub"), (*gate[:3], *up[:3]))}},
                      {"hid": (pairs, h)}, {**common, "X": "float", "K": k, "SHARE": share},
                      grid=(-(-h // rows), pairs, 1), threads=32 * expert_module.WARPS)["hid"]
    y = simt.run("expert_swiglu", "down", dialect,
                 {"hid": hidden, "idx": idx, **{n: np.array(a) for n, a in zip(("dw", "ds", "db"), down[:3])}},
                 {"y": (pairs, d)}, {**common, "Y": "float", "SHARE": share},
                 grid=(-(-d // rows), pairs, 1), threads=32 * expert_module.WARPS)["y"]
    want = reference.expert_swiglu(x, indices, gate, up, down)
    assert rel_err(y.reshape(tokens, k, d), want) < 1e-5


def run_fused(x, indices, gate, up, down, template, trace=False):
    """expert_swiglu.cu's one-launch kernel under the SIMT emulation: -> y (pairs, D)[, trace]."""
    from tests import simt

    pairs, d, h = indices.size, x.shape[-1], gate.output_dims
    slices = h // template["SLICE"]
    inputs = {"x": np.array(x), "idx": np.array(indices.reshape(-1)), **{n: np.array(a) for n, a in zip(
        ("gw", "gs", "gb", "uw", "us", "ub", "dw", "ds", "db"), (*gate[:3], *up[:3], *down[:3]))}}
    common = {"S": "float", "D": d, "H": h, "BITS": gate.bits, "GS": gate.group_size, "X": "float", "Y": "float",
              "K": indices.shape[-1], **template}
    got = simt.run("expert_swiglu", "fused", "cu", inputs, {"y": (pairs, d), "scratch": (pairs * slices * d + pairs,)},
                   common, grid=(slices, pairs, 1), threads=32 * template["WARPS"], trace=trace)
    return (got[0]["y"], got[1]) if trace else got["y"]


@needs_simt
@pytest.mark.parametrize("bits, group_size, d, h, tokens, k, slice_, warps, rows", [
    (4, 64, 1088, 128, 1, 2, 32, 8, 4),  # the defaults' shape of launch; lanes 0 and 1 take a second x chunk
    (3, 32, 96, 64, 2, 3, 32, 4, 4),  # 3-bit codes cross words; two rounds of rows a warp
    (2, 32, 96, 128, 1, 2, 64, 4, 2),  # two chunks of each down row a block, groups of 32 inside a slice
    (8, 64, 64, 192, 2, 1, 64, 8, 8),  # 8-bit, one slice holding a whole group
])
def test_the_fused_expert_kernel_source_computes_its_reference(bits, group_size, d, h, tokens, k, slice_, warps, rows):
    """The CUDA one-launch kernel: every block's slice of the hidden vector, its partial down
    product, and the last block's sum over the slices give the reference's output."""
    experts = 5
    gate, up = (quantized_experts(experts, h, d, group_size, bits) for _ in range(2))
    down = quantized_experts(experts, d, h, group_size, bits)
    x = mx.random.normal((tokens, d))
    indices = mx.stack([mx.random.permutation(experts)[:k] for _ in range(tokens)]).astype(mx.uint32)
    y = run_fused(x, indices, gate, up, down, {"SLICE": slice_, "WARPS": warps, "ROWS": rows})
    want = reference.expert_swiglu(x, indices, gate, up, down)
    assert rel_err(y.reshape(tokens, k, d), want) < 1e-5


@needs_simt
def test_the_fused_expert_kernel_source_reads_shared_memory_without_bank_conflicts():
    """Its staged x as gate_up's (one pass for 16-byte reads), and its hidden slice as a
    broadcast: every thread of a warp reads the same value."""
    gate, up = (quantized_experts(2, 64, 1024, 64, 4) for _ in range(2))
    down = quantized_experts(2, 1024, 64, 64, 4)
    x, indices = mx.random.normal((1, 1024)), mx.array([[1]], mx.uint32)
    _, trace = run_fused(x, indices, gate, up, down, {"SLICE": 32, "WARPS": expert_module.FUSED_WARPS,
                                                      "ROWS": expert_module.FUSED_ROWS}, trace=True)
    assert trace.worst(16)["xs"] == 1 and trace.worst(4)["xs"] <= 4
    assert trace.worst(4)["hsl"] == 1


@needs_simt
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("section", ["gate_up", "down"])
def test_expert_kernel_sources_read_their_staged_vector_without_bank_conflicts(dialect, section):
    """Every lane of a simdgroup reads its own 32-value chunk of the staged x (gate_up) or
    hidden vector (down), so a plain layout put the 32 lanes' reads of one value in one bank
    of threadgroup memory: 32 passes a read (8 for nvcc's 16-byte reads). The H200 sweep
    fits that: the same weight reads took 61 us at 4 rows a simdgroup and 92 us at 1 row,
    which reads the staged vector 4 times as often. Traced as NVIDIA GPUs serve the reads,
    the swizzled layout takes one pass for 16-byte reads and at most 4 for 4-byte ones."""
    from tests import simt

    width, other, bits, group_size = 1024, 64, 4, 64  # 32 chunks a row: every lane busy
    d, h = (width, other) if section == "gate_up" else (other, width)
    common = {"S": "float", "D": d, "H": h, "BITS": bits, "GS": group_size,
              "WARPS": expert_module.WARPS, "ROWS": expert_module.ROWS}
    idx = np.array([1], np.uint32)
    if section == "gate_up":
        gate, up = (quantized_experts(2, h, d, group_size, bits) for _ in range(2))
        inputs = {"x": np.array(mx.random.normal((1, d))), "idx": idx,
                  **{n: np.array(a) for n, a in zip(("gw", "gs", "gb", "uw", "us", "ub"), (*gate[:3], *up[:3]))}}
        outputs, template, staged = {"hid": (1, h)}, {**common, "X": "float", "K": 1, "SHARE": 1}, "xs"
    else:
        down = quantized_experts(2, d, h, group_size, bits)
        inputs = {"hid": np.array(mx.random.normal((1, h))), "idx": idx,
                  **{n: np.array(a) for n, a in zip(("dw", "ds", "db"), down[:3])}}
        outputs, template, staged = {"y": (1, d)}, {**common, "Y": "float", "SHARE": 1}, "xs"
    _, trace = simt.run("expert_swiglu", section, dialect, inputs, outputs, template,
                        grid=(1, 1, 1), threads=32 * expert_module.WARPS, trace=True)
    assert trace.worst(16)[staged] == 1
    assert trace.worst(4)[staged] <= 4
