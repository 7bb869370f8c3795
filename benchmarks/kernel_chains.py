"""The kernels' decode-shape cases as MLX chains: what benchmarks/kernels.py times against
MLX's built-ins, kernel_sweep.py sweeps launch shapes on, and gpu_profile.py runs under ncu.

Shapes of a 30B-A3B-class MoE model (Qwen3-30B-A3B: hidden 2048, 128 experts of hidden 768,
top 8; 32 query heads over 4 KV heads of 128). A chain is a function that builds `chain`
calls in one graph, each call's input the previous call's output, with the reads spread as
a model spreads them (SPREAD), not served from the GPU's cache.
"""

from __future__ import annotations

import time

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.base import quantized_scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU  # noqa: E402

from lmsp_mlx import kernels  # noqa: E402
from lmsp_mlx.kernels.quantized import QuantizedExperts  # noqa: E402

HIDDEN, EXPERT_HIDDEN, EXPERTS, TOP_K = 2048, 768, 128, 8
# What the loader gives each build: a half model on a GPU; float32 on the CPU build, where
# every floating parameter is made float32 (the compiled CPU expert kernel reads that).
DTYPE = mx.float16 if kernels.backend() else mx.float32
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
GROUP = 64


def best(chain, calls: int = 3) -> float:
    """Seconds of the fastest of `calls` evaluations of chain()."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(chain())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth() -> float:
    data = mx.ones((1 << 28,), mx.float32)  # 1 GiB
    mx.eval(data)
    return data.nbytes / best(lambda: data.sum(), 5)


def nbytes(*arrays: mx.array) -> int:
    return sum(a.nbytes for a in arrays)


SPREAD = 256 << 20  # bytes the timed reads are spread over: several times any GPU's L2


def expert_chains(bits: int, chain: int, tokens: int = 1):
    """(ours, built-in, bytes one call must read): each a function that builds a chain of
    `chain` calls of one MoE layer's experts for `tokens` tokens, as a model's decode runs them."""
    def projection(out: int, inp: int) -> QuantizedSwitchLinear:
        layer = QuantizedSwitchLinear(inp, out, EXPERTS, bias=False, group_size=GROUP, bits=bits)
        layer.scales, layer.biases = layer.scales.astype(DTYPE), layer.biases.astype(DTYPE)
        return layer

    layer = SwitchGLU(HIDDEN, EXPERT_HIDDEN, EXPERTS)
    layer.gate_proj, layer.up_proj = projection(EXPERT_HIDDEN, HIDDEN), projection(EXPERT_HIDDEN, HIDDEN)
    layer.down_proj = projection(HIDDEN, EXPERT_HIDDEN)
    mx.eval(layer.parameters())
    x0 = mx.random.normal((tokens, HIDDEN)).astype(DTYPE)
    picks = [mx.stack([mx.random.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).astype(mx.uint32)
             for _ in range(chain)]
    mx.eval(x0, picks)
    parts = [QuantizedExperts.of(p) for p in (layer.gate_proj, layer.up_proj, layer.down_proj)]

    def run(step):
        def go():
            x = x0
            for indices in picks:
                x = mx.fast.rms_norm(step(x, indices).sum(axis=-2), None, 1e-5)
            return x
        return go

    per_expert = sum(nbytes(p.weight[0], p.scales[0], p.biases[0]) for p in parts)
    chosen = sum(len(set(i.reshape(-1).tolist())) for i in picks) / len(picks)  # experts a call reads
    return run(lambda x, i: kernels.expert_swiglu(x, i, *parts)), run(layer), chosen * per_expert


def attention_chains(context: int, bits: int, chain: int, batch: int = 1):
    """(ours, built-in, bytes one call must read): each a function that builds a chain of
    `chain` one-step attention calls of `batch` sequences, each against its own quantized
    cache of `context` positions."""
    def cache() -> tuple[mx.array, mx.array, mx.array]:
        packed, scales, biases = mx.quantize(mx.random.normal((batch, KV_HEADS, context, HEAD_DIM)), GROUP, bits)
        return packed, scales.astype(DTYPE), biases.astype(DTYPE)

    one = nbytes(*cache()) * 2
    copies = max(1, min(chain, -(-SPREAD // one)))
    caches = [(cache(), cache()) for _ in range(copies)]
    q0 = mx.random.normal((batch, Q_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    mx.eval(caches, q0)
    scale = HEAD_DIM**-0.5

    def run(step):
        def go():
            q = q0
            for i in range(chain):
                q = step(q, *caches[i % copies])
            return q
        return go

    return (run(lambda q, k, v: kernels.decode_attention(q, k, v, scale, GROUP, bits)),
            run(lambda q, k, v: quantized_scaled_dot_product_attention(q, k, v, scale, None, GROUP, bits)), one)
