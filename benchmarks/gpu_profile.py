"""Each path's GPU kernels inside MLX, timed by Nsight Compute (ncu): where a call's time goes.

    python -m benchmarks.gpu_profile [--chain 8] [--out benchmarks/results] [--append]

benchmarks/kernels.py's wall-clock time per call includes MLX's cost per operation (the
Python that builds the graph, the graph node, its update and launch); on the H200 every
launch shape of ours came out near the same 60-75 µs. This runs the same chains
(benchmarks/kernel_chains.py: ours and mlx-lm's built-in path, same inputs) once under ncu
and reads each kernel's GPU duration and the bytes it read from device memory, with caches
flushed before each kernel (ncu's default) as they would be in a model that reads its other
layers in between. So per call: which kernels ran, their GPU time, and the DRAM bytes they
read; kernels.py's wall time minus this GPU time is MLX's overhead.

The parent runs itself under `ncu --profile-from-start off --clock-control none` (the card's
clocks as found); the child warms every chain (compiles kernels), then profiles them in one
range, a tiny marker kernel before each chain so the kernels can be told apart. Needs
MLX's CUDA backend and ncu with access to the GPU's counters. Writes gpu_profile.csv (with
the run's provenance columns; `--append` adds to its history).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import io
import re
import shutil
import subprocess
import sys
from collections import defaultdict

from benchmarks.common import ROOT, Provenance, output_arguments, write_rows

CASES = [("expert", 0, 4), ("expert", 0, 2), ("attention", 16384, 4), ("attention", 16384, 8)]
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum")
MARK = "lmsp_marker_"


def label(kind: str, context: int, bits: int, path: str) -> str:
    return f"{kind}_{context // 1024}k_{bits}bit_{path}" if context else f"{kind}_{bits}bit_{path}"


def child(chain: int) -> None:
    from benchmarks.kernel_chains import attention_chains, expert_chains
    import mlx.core as mx

    runs = []
    for kind, context, bits in CASES:
        ours, builtin, _ = expert_chains(bits, chain) if kind == "expert" else attention_chains(context, bits, chain)
        runs += [(label(kind, context, bits, "ours"), ours), (label(kind, context, bits, "builtin"), builtin)]
    for _, go in runs:  # compile and warm everything outside the profiled range
        mx.eval(go())
    mx.synchronize()
    one = mx.zeros((1,), mx.float32)
    markers = {name: mx.fast.cuda_kernel(name=MARK + name, input_names=["a"], output_names=["b"], source="b[0] = a[0];")
               for name, _ in runs}

    def mark(name: str) -> None:
        mx.eval(markers[name](inputs=[one], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                              output_dtypes=[mx.float32])[0])

    for name, _ in runs:  # compile the markers too
        mark(name)
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for name, go in runs:
        mark(name)
        mx.eval(go())
        mx.synchronize()
    cuda.cuProfilerStop()


UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse(text: str) -> list[dict]:
    """ncu's --csv rows, one per (kernel launch, metric), in launch order: merged per launch."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        launch = launches.setdefault(row["ID"], {"name": row["Kernel Name"]})
        value = float(row["Metric Value"].replace(",", "")) * UNITS.get(row["Metric Unit"], 1.0)
        launch["us" if row["Metric Name"].startswith("gpu__time") else "bytes"] = value
    return list(launches.values())


def short(name: str) -> str:
    """A kernel's name without namespaces, template and parameter lists."""
    base = name.split("(")[0].split("<")[0]
    return base.rsplit("::", 1)[-1][:60]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=8)
    output_arguments(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.chain)
        return
    provenance = Provenance.gather()
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("no ncu on PATH (Nsight Compute): nothing to profile with")
    done = subprocess.run([ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv",
                           "--metrics", ",".join(METRICS), sys.executable, "-m", "benchmarks.gpu_profile", "--child",
                           "--chain", str(args.chain)], cwd=ROOT, capture_output=True, text=True)
    launches = parse(done.stdout)
    if done.returncode != 0 or not launches:
        print(done.stdout[-3000:], done.stderr[-3000:])
        sys.exit(f"ncu gave no kernel rows (exit {done.returncode})")

    groups: dict[str, list[dict]] = defaultdict(list)
    current = None
    for launch in launches:
        if MARK in launch["name"]:  # MLX names it custom_kernel_<name>; ncu may add the signature
            current = re.match(r"\w+", launch["name"].split(MARK, 1)[1]).group(0)
        elif current is not None:
            groups[current].append(launch)

    rows = []
    for name, kernels in groups.items():
        per_kernel: dict[str, list[float]] = defaultdict(list)
        for k in kernels:
            per_kernel[short(k["name"])].append(k.get("us", 0.0))
        us = sum(k.get("us", 0.0) for k in kernels) / args.chain
        nbytes = sum(k.get("bytes", 0.0) for k in kernels) / args.chain
        rows.append({"case": name, "kernels_per_call": len(kernels) / args.chain, "gpu_us_per_call": us,
                     "dram_mb_per_call": nbytes / 1e6, "gbs": nbytes / us * 1e-3 if us else 0.0,
                     "kernels": "; ".join(f"{k} x{len(v) / args.chain:g} {sum(v) / len(v):.1f}us"
                                          for k, v in per_kernel.items())})
    write_rows("gpu_profile", rows, provenance, out=args.out, append=args.append)
    print("| case | kernels a call | GPU µs a call | DRAM MB a call | GB/s | kernels (count a call, mean µs) |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kernels_per_call']:g} | {r['gpu_us_per_call']:.1f} | {r['dram_mb_per_call']:.2f} "
              f"| {r['gbs']:.0f} | {r['kernels']} |")


if __name__ == "__main__":
    main()
