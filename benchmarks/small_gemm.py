"""A few activation rows times a weight, the product of a batched decode step through MLX:
OpenBLAS's sgemm against decode.c's batched product, in one run.

    python -m benchmarks.small_gemm [--rows 1,2,4,8,16,24,32] [--repeats 50] [--out DIR] [--append]

Each case times `mx.eval(x @ w.T)` (x: rows x K, w: N x K, float32) best of `--repeats`,
with the shim's small-row product (the default) and with it turned off
(`LMSP_SMALL_GEMM=0`), in two child processes of each, alternating (the shim reads the
setting when MLX loads); each case keeps its best. One row goes to sgemv either way, and
more than 24 rows to OpenBLAS's sgemm. Writes benchmarks/results/small_gemm.csv (with the
run's provenance) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import Provenance, output_arguments, write_rows

SHAPES = ((1024, 4096), (4096, 1024), (1024, 1024))  # (K, N): up, down and square projections

CHILD = """
import json, sys, time
from lmsp_mlx.cpu_blas import accelerate, status
accelerate()
import mlx.core as mx
rows, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
for m in rows:  # every path once before any timing: a process's first products run slow
    for k, n in json.loads(sys.argv[3]):
        mx.eval(mx.ones((m, k)) @ mx.ones((n, k)).T)
out = []
for m in rows:
    for k, n in json.loads(sys.argv[3]):
        x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
        mx.eval(x, w)
        for _ in range(3):
            mx.eval(x @ w.T)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(x @ w.T)
            best = min(best, time.perf_counter() - start)
        out.append({"rows": m, "k": k, "n": n, "ms": best * 1e3})
print(json.dumps({"status": status(), "rows": out}))
"""


def measure(rows: list[int], repeats: int, small: bool) -> dict:
    env = {**os.environ, "LMSP_SMALL_GEMM": "1" if small else "0"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(rows), str(repeats), json.dumps(SHAPES)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,24,32")
    p.add_argument("--repeats", type=int, default=50)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    rows = [int(r) for r in args.rows.split(",")]
    # Two children of each, alternating, each case's best: one child's timings drift with the
    # machine's state (a first child ran one-row products 1.3x slower than the next).
    runs = [measure(rows, args.repeats, small) for small in (True, False, True, False)]
    on, off = ({"status": a["status"], "rows": [min(x, y, key=lambda r: r["ms"]) for x, y in zip(a["rows"], b["rows"])]}
               for a, b in (runs[0::2], runs[1::2]))
    print(f"with the small-row product: {on['status']}\nwithout: {off['status']}")
    table = []
    for a, b in zip(on["rows"], off["rows"]):
        flops = 2 * a["rows"] * a["k"] * a["n"]
        table.append({"rows": a["rows"], "weight": f"{a['n']}x{a['k']}", "sgemm_ms": round(b["ms"], 3),
                      "small_product_ms": round(a["ms"], 3), "speedup": round(b["ms"] / a["ms"], 2),
                      "small_product_gflops": round(flops / a["ms"] / 1e6, 1)})
    write_rows("small_gemm", table, provenance, out=args.out, append=args.append)
    print("\n| rows | weight | OpenBLAS sgemm | small-row product | speedup |\n|---:|---|---:|---:|---:|")
    for r in table:
        print(f"| {r['rows']} | {r['weight']} | {r['sgemm_ms']} ms | {r['small_product_ms']} ms | {r['speedup']}x |")


if __name__ == "__main__":
    main()
