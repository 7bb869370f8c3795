"""The kernels' launch shapes, swept on a GPU: which WARPS / BATCH / CHUNK, WARPS / ROWS and SLICE to keep.

    python -m benchmarks.kernel_sweep [--chain 16] [--out benchmarks/results] [--append]

The kernels' constants (kernels/attention.py, kernels/experts.py) were chosen by reasoning,
with no GPU to time them on. One run of this on a GPU times each candidate on the
benchmark's decode shapes (16K positions of 4-bit KV, 32/4 heads of 128; one token's top 8
of 128 4-bit experts of 2048/768), each as a chain of calls in one evaluation on inputs
spread past the GPU's cache (benchmarks/kernel_chains.py's, as benchmarks/kernels.py times
them), and checks each candidate's output against the reference, so a candidate that is
fast but wrong shows as wrong.
Under CUDA both kernels are also timed in their other launch form: the experts' two
launches against the fused one, and attention's body then merge against its one launch.
Writes kernel_sweep.csv (with the run's provenance columns; `--append` adds to its history).
The CPU build has no kernels: there it says so and stops.
"""

from __future__ import annotations

import argparse

from benchmarks.kernel_chains import (  # first: it sets up MLX's CPU BLAS
    EXPERT_HIDDEN, EXPERTS, GROUP, HEAD_DIM, HIDDEN, KV_HEADS, Q_HEADS, SPREAD, TOP_K, best, nbytes, read_bandwidth,
)
import mlx.core as mx  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from lmsp_mlx import kernels  # noqa: E402
from lmsp_mlx.kernels import attention, experts, reference  # noqa: E402
from lmsp_mlx.kernels.dispatch import close  # noqa: E402
from lmsp_mlx.kernels.quantized import QuantizedExperts  # noqa: E402

ATTENTION = [(w, b, c) for w, b in ((4, 1), (4, 2), (4, 4), (4, 8), (2, 4), (8, 2), (8, 4)) for c in (128, 256, 512)]
EXPERT = [(4, 4), (4, 2), (4, 1), (8, 2), (8, 1), (2, 4), (2, 8)]  # two launches: WARPS, ROWS
FUSED = [(32, 8, 4), (32, 4, 4), (32, 4, 8), (64, 8, 4), (64, 8, 8), (64, 4, 4)]  # one launch: SLICE, WARPS, ROWS
CONTEXT, BITS = 16384, 4


def timed(step, chain: int) -> float:
    """Seconds per call of a chain of `chain` calls, step(i, previous output)."""
    def go():
        out = None
        for i in range(chain):
            out = step(i, out)
        return out
    mx.eval(go())
    return min(best(go) for _ in range(5)) / chain


def sweep_attention(chain: int, bandwidth: float) -> list[dict]:
    def cache():
        packed, scales, biases = mx.quantize(mx.random.normal((1, KV_HEADS, CONTEXT, HEAD_DIM)), GROUP, BITS)
        return packed, scales.astype(mx.float16), biases.astype(mx.float16)

    one = nbytes(*cache()) * 2
    copies = max(1, min(chain, -(-SPREAD // one)))
    caches = [(cache(), cache()) for _ in range(copies)]
    q0 = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(mx.float16)
    mx.eval(caches, q0)
    scale = HEAD_DIM**-0.5
    want = reference.decode_attention(q0, *caches[0], scale, GROUP, BITS)
    defaults = attention.WARPS, attention.BATCH, attention.CHUNK, attention.FUSED
    candidates = [(w, b, c, attention.FUSED) for w, b, c in ATTENTION]
    if kernels.backend() == "cuda":  # the default shape in two launches too, body then merge
        candidates.append((*defaults[:3], False))
    rows = []
    for warps, batch, chunk, fused in candidates:
        attention.WARPS, attention.BATCH, attention.CHUNK, attention.FUSED = warps, batch, chunk, fused
        form = " one launch" if fused and kernels.backend() == "cuda" else ""
        row = {"kernel": "attention", "config": f"WARPS={warps} BATCH={batch} CHUNK={chunk}{form}"}
        try:
            right = close(attention.kernel(q0, *caches[0], scale, GROUP, BITS), want, 2e-2)
            t = timed(lambda i, q: attention.kernel(q0 if q is None else q, *caches[i % copies], scale, GROUP, BITS),
                      chain)
            row |= {"us": t * 1e6, "of_bound": t / (one / bandwidth), "agrees": right}
        except Exception as exc:  # a shape this GPU cannot build (threadgroup memory, registers)
            row |= {"us": None, "of_bound": None, "agrees": f"failed: {str(exc).splitlines()[0][:120]}"}
        rows.append(row)
        print(row, flush=True)
    attention.WARPS, attention.BATCH, attention.CHUNK, attention.FUSED = defaults
    return rows


def sweep_experts(chain: int, bandwidth: float) -> list[dict]:
    def projection(out: int, inp: int) -> QuantizedExperts:
        w, s, b = mx.quantize(mx.random.normal((EXPERTS, out, inp)) * inp**-0.5, GROUP, BITS)
        return QuantizedExperts(w, s.astype(mx.float16), b.astype(mx.float16), GROUP, BITS)

    parts = [projection(EXPERT_HIDDEN, HIDDEN), projection(EXPERT_HIDDEN, HIDDEN), projection(HIDDEN, EXPERT_HIDDEN)]
    x0 = mx.random.normal((1, HIDDEN)).astype(mx.float16)
    picks = [mx.random.permutation(EXPERTS)[:TOP_K].reshape(1, TOP_K).astype(mx.uint32) for _ in range(chain)]
    mx.eval(parts, x0, picks)
    want = reference.expert_swiglu(x0, picks[0], *parts)
    bound = TOP_K * sum(nbytes(p.weight[0], p.scales[0], p.biases[0]) for p in parts) / bandwidth
    defaults = experts.FUSED, experts.WARPS, experts.ROWS, experts.SLICE, experts.FUSED_WARPS, experts.FUSED_ROWS
    candidates = [(False, None, warps, per) for warps, per in EXPERT]
    if kernels.backend() == "cuda":
        candidates += [(True, slice_, warps, per) for slice_, warps, per in FUSED]
    rows = []
    for fused, slice_, warps, per in candidates:
        experts.FUSED = fused
        if fused:
            experts.SLICE, experts.FUSED_WARPS, experts.FUSED_ROWS = slice_, warps, per
            config = f"fused SLICE={slice_} WARPS={warps} ROWS={per}"
        else:
            experts.WARPS, experts.ROWS = warps, per
            config = f"WARPS={warps} ROWS={per}"
        row = {"kernel": "expert", "config": config}
        try:
            right = close(experts.kernel(x0, picks[0], *parts), want, 2e-2)
            t = timed(lambda i, x: mx.fast.rms_norm(
                experts.kernel(x0 if x is None else x, picks[i], *parts).sum(axis=-2), None, 1e-5), chain)
            row |= {"us": t * 1e6, "of_bound": t / bound, "agrees": right}
        except Exception as exc:
            row |= {"us": None, "of_bound": None, "agrees": f"failed: {str(exc).splitlines()[0][:120]}"}
        rows.append(row)
        print(row, flush=True)
    experts.FUSED, experts.WARPS, experts.ROWS, experts.SLICE, experts.FUSED_WARPS, experts.FUSED_ROWS = defaults
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=16)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    if kernels.backend() is None:
        print("this MLX build has neither Metal nor CUDA: no GPU kernels to sweep")
        return
    bandwidth = read_bandwidth()
    print(f"{kernels.backend()}: read bandwidth {bandwidth / 1e9:.0f} GB/s, {args.chain} calls per timing", flush=True)
    rows = sweep_attention(args.chain, bandwidth) + sweep_experts(args.chain, bandwidth)
    write_rows("kernel_sweep", rows, provenance, out=args.out, append=args.append,
               fields=["kernel", "config", "us", "of_bound", "agrees"])


if __name__ == "__main__":
    main()
