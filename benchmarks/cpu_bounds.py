"""The CPU backend against the machine's limits, measured in one run.

    python -m benchmarks.cpu_bounds [--model PATH] [--prompt 512] [--decode 64] [--repeats 5] [--out DIR] [--append]

1. float32 GEMM GFLOP/s: MLX (through lmsp-mlx's BLAS routing) against numpy's sgemm,
   in back-to-back pairs (median ratio).
2. The model's prefill tok/s, through the server's generation loop, against the FLOP
   bound: numpy's sgemm rate divided by the FLOPs a prompt token needs (the layers'
   matmuls and the attention over the prompt; no output head, whose logits only the last
   prompt token needs). The sgemm rate of these shared machines swings by 30% within
   minutes, so each prefill run is paired with an sgemm measurement taken just before
   it, and the ratio is the median of the pairs.
3. Decode tok/s against the memory-bandwidth bound: the streaming read rate of this
   machine (the faster of a threaded sum and numpy's sgemv over 1 GiB), measured just
   before each run, divided by the bytes a decode step must read
   (all weights used as matmuls, output head included, plus the KV cache); the ratio is
   the median of the pairs.

Writes benchmarks/results/cpu_bounds.csv (with the run's provenance columns; `--append`
adds to its history) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from lmsp_mlx import cpu_blas

cpu_blas.accelerate()  # first: MLX binds its BLAS as mlx.core loads
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from lmsp_mlx.engine.loader import load_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402


FIELDS = ("what", "case", "unit", "measured", "reference", "ratio", "target")  # of a row, in this order


def best_time(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_gflops(n: int, repeats: int = 7) -> tuple[float, float, float]:
    """MLX and numpy GFLOP/s (medians) and the median ratio of back-to-back pairs: the
    machine's rate drifts by tens of percent within seconds, a pair sees the same state."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    xa, xb = mx.array(a), mx.array(b)
    mx.eval(xa, xb)
    flops = 2 * n**3
    pairs = []
    for _ in range(repeats):
        mlx_t = best_time(lambda: mx.eval(xa @ xb), 2)
        np_t = best_time(lambda: a @ b, 2)
        pairs.append((flops / mlx_t / 1e9, flops / np_t / 1e9))
    mlx_gf, np_gf = (float(np.median([p[i] for p in pairs])) for i in (0, 1))
    return mlx_gf, np_gf, float(np.median([m / n_ for m, n_ in pairs]))


def numpy_sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / best_time(lambda: a @ b, repeats) / 1e9


def read_bandwidth(gib: float = 1.0, threads: int = 2) -> float:
    """Bytes/s of the fastest streaming read measured: a numpy sum (one slice per thread;
    numpy releases the GIL) or numpy's sgemv over a 1 GiB matrix (OpenBLAS on every core).

    The sum alone is not enough: its pairwise summation is compute-bound at about 7 GB/s
    a core here, while sgemv reads the same GiB at 23 GB/s. A bound taken from the sum
    made decode look twice as close to the machine's limit as it is."""
    data = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(data, threads)

    def summed():
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    matrix, vector = data.reshape(-1, 4096), np.ones(4096, dtype=np.float32)
    return data.nbytes / min(best_time(summed, repeats=3), best_time(lambda: matrix @ vector, repeats=3))


def body_params(config: dict) -> int:
    """Weights used as matmuls in the transformer layers (not the output head)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * inter
    return layers * per_layer


def attention_flops(config: dict, context: int) -> int:
    """Scores and weighted values for one token over `context` positions, all layers."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 4 * config["num_hidden_layers"] * heads * head_dim * context


def time_generation(lm, prompt: list[int], decode: int) -> tuple[float, float]:
    """Prefill and decode tok/s of the server's own generation loop (greedy)."""
    from lmsp_mlx.engine.batch import generate
    from lmsp_mlx.engine.generate import GenerationParams

    params = GenerationParams(prompt=prompt, max_tokens=decode, temperature=0.0, prefill_step=2048)
    done = generate(lm, params, emit=lambda event: None, cancelled=lambda: False)
    return done.prefill_tps, done.decode_tps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for the prefill measurement")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()

    print(f"BLAS: {cpu_blas.status()}", flush=True)
    rows = []
    for n in (512, 1024, 2048):
        mlx_gf, np_gf, ratio = gemm_gflops(n)
        rows.append(("gemm", f"{n}x{n}x{n} float32", "GFLOP/s", mlx_gf, np_gf, ratio, 0.8))
        print(f"gemm {n}: mlx {mlx_gf:.1f} numpy {np_gf:.1f} GFLOP/s", flush=True)

    path = args.model or ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    lm = load_model(path)
    config = __import__("json").loads((path / "config.json").read_text())
    filler = "The clerks copied the ledgers again because the damp reached the lower shelves. "
    ids = lm.tokenizer.encode(filler * (args.prompt // 10 + 1), add_special_tokens=False)[: args.prompt]
    body = body_params(config)
    head = config["vocab_size"] * config["hidden_size"]
    params = body + head
    # A prompt token needs the layers and attention, not the output head: only the last
    # prompt token's logits are used, and the server computes no others.
    prefill_flops = 2 * body + attention_flops(config, args.prompt // 2)
    kv_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * (
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    ) * 4 * (args.prompt + args.decode // 2)
    decode_bytes = 4 * params + kv_bytes
    runs = []  # (sgemm FLOP/s and read bytes/s just before, prefill tok/s, decode tok/s)
    for _ in range(args.repeats):
        rate, bandwidth = numpy_sgemm_gflops() * 1e9, read_bandwidth()
        runs.append((rate, bandwidth, *time_generation(lm, ids, args.decode)))
        print(f"sgemm {rate / 1e9:.1f} GFLOP/s, read {bandwidth / 1e9:.1f} GB/s, "
              f"prefill {runs[-1][2]:.1f} tok/s, decode {runs[-1][3]:.1f} tok/s", flush=True)
    sgemm_rate, bandwidth, prefill, decode = (float(np.median([r[i] for r in runs])) for i in range(4))
    prefill_bound, decode_bound = sgemm_rate / prefill_flops, bandwidth / decode_bytes
    prefill_ratio = float(np.median([r[2] * prefill_flops / r[0] for r in runs]))
    decode_ratio = float(np.median([r[3] * decode_bytes / r[1] for r in runs]))
    rows.append(("prefill", f"{lm.id} {args.prompt} tokens", "tok/s", prefill, prefill_bound, prefill_ratio, 0.5))
    rows.append(("decode", f"{lm.id} after {args.prompt} tokens", "tok/s", decode, decode_bound, decode_ratio, 0.6))

    write_rows("cpu_bounds", [dict(zip(FIELDS, row)) for row in rows], provenance, out=args.out, append=args.append)
    print(f"\nsgemm {sgemm_rate / 1e9:.1f} GFLOP/s (median), read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"{params / 1e6:.1f}M matmul parameters\n")
    print("| what | case | measured | reference | ratio | target |")
    print("|---|---|---:|---:|---:|---:|")
    for what, case, unit, measured, ref, ratio, target in rows:
        ref_name = {"gemm": "numpy sgemm", "prefill": "FLOP bound", "decode": "bandwidth bound"}[what]
        print(f"| {what} | {case} | {measured:.1f} {unit} | {ref:.1f} {unit} ({ref_name}) | {ratio:.2f} | ≥ {target} |")


if __name__ == "__main__":
    main()
