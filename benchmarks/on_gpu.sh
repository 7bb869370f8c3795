#!/usr/bin/env bash
# The custom kernels on the lent NVIDIA GPU (an H200) under MLX's CUDA backend.
#
# Here first: `bash benchmarks/gpu_wheels.sh` (MLX's CUDA build, split for the 64 MiB carry
# limit). Then two device calls, back to back (the machine stays warm 30 s):
#   run(command="bash benchmarks/on_gpu.sh stage", carry=[".whl/a"], timeout_s=120)
#   run(command="bash benchmarks/on_gpu.sh run", carry=[".whl/b"], timeout_s=540)
# `run` installs MLX into /tmp/site, runs tests/test_kernels.py with LMSP_KERNELS=kernel
# (every kernel against its reference) and benchmarks/kernels.py; results land in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
case "${1:-}" in
stage)
    mkdir -p /tmp/stage && cp .whl/a/* /tmp/stage/ && ls -la /tmp/stage
    ;;
run)
    name=$(cat /tmp/stage/cuda-wheel-name) || { echo "run the stage call first"; exit 1; }
    cat /tmp/stage/part.aa .whl/b/part.ab > "/tmp/stage/$name"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        /tmp/stage/mlx-*.whl /tmp/stage/mlx_lm-*.whl "/tmp/stage/$name" >"$OUT/install.log" 2>&1 \
        || { tail -20 "$OUT/install.log"; exit 1; }
    # lmsp_mlx.kernels is the top-level kernels/ folder (a package-dir mapping when installed)
    [ -e lmsp_mlx/kernels ] || ln -s ../kernels lmsp_mlx/kernels
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import mlx.core as mx; from lmsp_mlx import kernels; print(mx.__version__, mx.default_device(), kernels.backend())" \
        2>&1 | tee "$OUT/backend.txt"
    LMSP_KERNELS=kernel timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 \
        | tee "$OUT/tests.txt" | tail -40
    timeout 200 python3 benchmarks/kernels.py --repeats 20 --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | tail -16
    ;;
*)
    echo "usage: on_gpu.sh stage|run (see the comment at the top)"; exit 2
    ;;
esac
