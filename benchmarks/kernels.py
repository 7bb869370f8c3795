"""The custom kernels against MLX's built-in paths on the same inputs, in one run.

    python -m benchmarks.kernels [--contexts 8192,16384,32768] [--tokens 1,8,32]
                                 [--batches 8x16384,32x16384,1x65536,1x131072] [--repeats 20]
                                 [--chain N] [--out DIR] [--append]

Cases (benchmarks/kernel_chains.py), at decode shapes of a 30B-A3B-class MoE model
(Qwen3-30B-A3B: hidden 2048, 128 experts of hidden 768, top 8; 32 query heads over 4 KV
heads of 128):
- expert: 1, 8 and 32 tokens (a batched decode step) through one MoE layer's experts,
  each token its own top 8, affine 4-bit (and 2-bit at 1 token), group 64. Built-in:
  mlx-lm's SwitchGLU (three mx.gather_qmm and a SwiGLU; from 64 token-expert pairs it
  sorts them by expert). Its bound counts each chosen expert once per call.
- attention: one query step against a QuantizedKVCache of each context length, 4 and 8
  bits, group 64; and batched steps, B sequences x N positions (4-bit), where the bound
  reaches 20 us and more. Built-in: mlx-lm's quantized_scaled_dot_product_attention (two
  mx.quantized_matmul around a softmax over the whole score row).

"ours" is the kernel where MLX has Metal or CUDA; on the CPU build it is the compiled CPU
kernels (experts.c and attention.c, kernels/cpu.py), what `auto` runs there. The
`path` column says which ran, read off the dispatch's counters (a kernel that failed its
first-call check shows as the reference). One timing is a chain of --chain calls in
one evaluation, each call's input the previous call's output (for the experts, through
the MoE block's sum over experts and an RMSNorm; both sides pay for those), as in a
model's decode step: a single call would time the launch and the Python, not the kernel.
The reads are spread as a model spreads them, not served from the GPU's cache: each
expert call picks its own top 8 of all 128 experts (300 MB of 4-bit weights), and each
attention call of a chain reads its own copy of the cache (up to 256 MB in all). Each case
is timed in back-to-back pairs (ours, built-in; best of three chains each) and the
speedup is the median of the pairs' built-in/ours ratios. The bound is the bytes a call
must read (the chosen experts' packed weights, scales and biases; all of K and V) divided
by the device's read bandwidth, measured in the same run (a sum over 1 GiB); "of bound"
is ours' time over that. The "streamed" columns time the same chains with each one's graph
built while the one before runs (mx.async_eval, as mlx-lm decodes): there a call costs
the larger of its CPU share (Python, graph, launch) and its device share, not their sum. Targets on a GPU: expert >= 1.3x, attention >= 1.5x at 16K,
both within 2x of the bound.

Writes benchmarks/results/kernels.csv (with the run's provenance columns; `--append` adds to
its history) and kernels.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.kernel_chains import (  # first: it sets up MLX's CPU BLAS
    EXPERTS, GROUP, KV_HEADS, Q_HEADS, TOP_K, attention_chains, best, expert_chains, read_bandwidth,
)
import mlx.core as mx  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from lmsp_mlx import kernels  # noqa: E402


def streamed(chain, rounds: int = 8) -> float:
    """Seconds per evaluation of chain() when each one's graph is built while the one before
    runs (mx.async_eval, as mlx-lm's generate_step overlaps decode steps): the larger of the
    CPU's share (Python, graph, launch) and the device's, where best() pays their sum."""
    mx.synchronize()
    start = time.perf_counter()
    pending = chain()
    mx.async_eval(pending)
    for _ in range(rounds - 1):
        following = chain()
        mx.async_eval(following)
        mx.eval(pending)
        pending = following
    mx.eval(pending)
    mx.synchronize()
    return (time.perf_counter() - start) / rounds


def median_pairs(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Median of each side, and the median built-in/ours ratio of the pairs."""
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[1] / p[0] for p in pairs))


def paired(ours, builtin, repeats: int, chain: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Seconds per call of each side and the speedup, from back-to-back pairs: evaluated one
    chain at a time, and streamed (a quarter as many pairs)."""
    mx.eval(ours(), builtin())  # compile and warm both
    alone = [(best(ours) / chain, best(builtin) / chain) for _ in range(repeats)]
    overlapped = [(streamed(ours) / chain, streamed(builtin) / chain) for _ in range(max(3, repeats // 4))]
    return median_pairs(alone), median_pairs(overlapped)


def ran(dispatch: kernels.dispatch.Dispatch, before: dict) -> str:
    """Which path the timed calls took: 'kernel', 'reference' or 'both' (a mix)."""
    used = [name for name in ("kernel", "reference") if dispatch.calls[name] > before[name]]
    return used[0] if len(used) == 1 else "both"


def streamed_columns(streaming: tuple[float, float, float]) -> dict:
    ours_t, builtin_t, speedup = streaming
    return {"ours_streamed_ms": ours_t * 1e3, "builtin_streamed_ms": builtin_t * 1e3, "streamed_speedup": speedup}


def expert_case(bits: int, repeats: int, chain: int, bandwidth: float, tokens: int = 1) -> dict:
    ours, builtin, nbytes_read = expert_chains(bits, chain, tokens)
    before = dict(kernels.expert_swiglu.calls)
    (ours_t, builtin_t, speedup), streaming = paired(ours, builtin, repeats, chain)
    bound = nbytes_read / bandwidth
    return {"case": f"expert SwiGLU, {tokens} token{'s' if tokens > 1 else ''}, top {TOP_K} of {EXPERTS}, "
                    f"{bits}-bit g{GROUP}", "kernel": "expert",
            "context": 0, "batch": tokens, "bits": bits, "ours_ms": ours_t * 1e3, "builtin_ms": builtin_t * 1e3,
            "speedup": speedup, "bound_ms": bound * 1e3, "of_bound": ours_t / bound, "target": 1.3 if tokens == 1 else 1.0,
            "path": ran(kernels.expert_swiglu, before), **streamed_columns(streaming)}


def attention_case(context: int, bits: int, repeats: int, chain: int, bandwidth: float, batch: int = 1) -> dict:
    ours, builtin, nbytes_read = attention_chains(context, bits, chain, batch)
    before = dict(kernels.decode_attention.calls)
    (ours_t, builtin_t, speedup), streaming = paired(ours, builtin, repeats, chain)
    bound = nbytes_read / bandwidth
    seqs = f"{batch} sequences x " if batch > 1 else ""
    return {"case": f"decode attention, {seqs}{context // 1024}K positions, {Q_HEADS}/{KV_HEADS} heads, {bits}-bit g{GROUP}",
            "kernel": "attention", "context": context, "batch": batch, "bits": bits, "ours_ms": ours_t * 1e3,
            "builtin_ms": builtin_t * 1e3, "speedup": speedup, "bound_ms": bound * 1e3, "of_bound": ours_t / bound,
            "target": 1.5 if context == 16384 and batch in (1, 8) else None, "path": ran(kernels.decode_attention, before), **streamed_columns(streaming)}


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def plot(rows: list[dict], path: Path, path_name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    names = [r["case"] for r in rows]
    ax.barh(names, [r["speedup"] for r in rows], color=["tab:blue" if r["kernel"] == "expert" else "tab:orange" for r in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"speedup over MLX's built-in (ours: {path_name})")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,16384,32768")
    p.add_argument("--tokens", default="1,8,32", help="tokens of the expert cases (4-bit; 2-bit at 1)")
    p.add_argument("--batches", default="8x16384,32x16384,1x65536,1x131072",
                   help="batched attention cases, SEQUENCESxPOSITIONS (4-bit); empty for none")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chain", type=int, help="calls per timed evaluation (default: 16 on a GPU, 1 on the CPU)")
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()

    backend = kernels.backend()
    chain = args.chain or (16 if backend else 1)
    path_name = (f"kernel on {backend}" if backend
                 else "CPU build: experts.c and attention.c where built")
    print(f"device: {mx.default_device()}, ours: {path_name}, {chain} calls per timing", flush=True)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    cases = [lambda: expert_case(2, args.repeats, chain, bandwidth)]
    cases += [lambda t=t: expert_case(4, args.repeats, chain, bandwidth, t) for t in numbers(args.tokens)]
    cases += [lambda c=c, b=b: attention_case(c, b, args.repeats, chain, bandwidth)
              for c in numbers(args.contexts) for b in (4, 8)]
    cases += [lambda n=n, b=b: attention_case(n, 4, args.repeats, chain, bandwidth, b)
              for b, n in (map(int, spec.split("x")) for spec in args.batches.split(",") if spec)]
    for case in cases:
        rows.append(case())
        print(rows[-1]["case"], f"{rows[-1]['speedup']:.2f}x ({rows[-1]['path']})", flush=True)
        mx.clear_cache()
    for row in rows:
        row["bandwidth_gbs"] = bandwidth / 1e9
        row["chain"] = chain

    write_rows("kernels", rows, provenance, out=args.out, append=args.append)
    plot(rows, args.out / "kernels.png", path_name)
    print(f"\nours: {path_name}; read bandwidth {bandwidth / 1e9:.0f} GB/s\n")
    print("| case | ours (path) | built-in | speedup | target | bound | ours / bound | streamed: ours | built-in | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        target = f"≥ {r['target']}" if r["target"] else ""
        print(f"| {r['case']} | {r['ours_ms']:.3f} ms ({r['path']}) | {r['builtin_ms']:.3f} ms "
              f"| {r['speedup']:.2f}x | {target} "
              f"| {r['bound_ms']:.3f} ms | {r['of_bound']:.1f} | {r['ours_streamed_ms']:.3f} ms "
              f"| {r['builtin_streamed_ms']:.3f} ms | {r['streamed_speedup']:.2f}x |")


if __name__ == "__main__":
    main()
