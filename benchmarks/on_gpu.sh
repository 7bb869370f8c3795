#!/usr/bin/env bash
# The custom kernels on the lent NVIDIA GPU (an H200) under MLX's CUDA backend.
#
# Here first: `bash benchmarks/gpu_wheels.sh` (MLX's CUDA build, split for the 64 MiB carry
# limit, and the server's other dependencies). Then device calls, back to back (the
# machine stays warm 30 s):
#   run(command="bash benchmarks/on_gpu.sh stage", carry=[".whl/a"], timeout_s=120)
#   run(command="bash benchmarks/on_gpu.sh deps", carry=[".whl/c"], timeout_s=120)   (server, suite)
#   run(command="bash benchmarks/on_gpu.sh run", carry=[".whl/b"], timeout_s=540)
# then give_back(). Issue 27's figures and whole-server check, in about 9 minutes:
#   run(command="bash benchmarks/on_gpu.sh run bench server suite", carry=[".whl/b"], timeout_s=560)
# `run` installs MLX into /tmp/site, then runs the steps named after it, in that order
# (default: tests bench sweep); results land in $OUT:
#   cuda     python -m benchmarks.cuda_kernels: the CUDA twins' own GPU time, outside MLX
#   profile  python -m benchmarks.gpu_profile: ours and MLX's kernels inside MLX, under ncu
#   tests    tests/test_kernels.py with LMSP_KERNELS=kernel, less the per-configuration
#            kernel-against-reference cases (NVRTC compiles each); `alltests` includes them
#   bench    python -m benchmarks.kernels (1/8/32-token experts, batched attention at 8 and 32
#            sequences x 16K, 64K and 128K positions);  sweep  python -m benchmarks.kernel_sweep
#   server   python -m lmsp_mlx.serve on a quantized model (the default one where carried in
#            models/, else a tiny qwen3_moe built there), --kv-bits 4, kernels in auto mode:
#            LMSP, /v1/responses and Chat answer, 4 concurrent completions decode in one
#            batch; its log and the listing's quantization go to $OUT/server.txt
#   suite    the whole test suite, GPU-only tests included (needs the deps call)
# e.g. run(command="bash benchmarks/on_gpu.sh run cuda profile tests bench", carry=[".whl/b"], timeout_s=540)
# Rehearsed on this machine with Python 3.12, the device's package versions and MLX's CPU
# wheel in place of the CUDA one (everything but the GPU itself).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
case "${1:-}" in
stage)
    mkdir -p /tmp/stage && cp .whl/a/* /tmp/stage/ && ls -la /tmp/stage
    ;;
deps)
    mkdir -p /tmp/stage/deps && cp .whl/c/* /tmp/stage/deps/ && ls /tmp/stage/deps | wc -l
    ;;
run)
    name=$(cat /tmp/stage/cuda-wheel-name) || { echo "run the stage call first"; exit 1; }
    cat /tmp/stage/part.aa .whl/b/part.ab > "/tmp/stage/$name"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        /tmp/stage/mlx-*.whl /tmp/stage/mlx_lm-*.whl "/tmp/stage/$name" >/tmp/install.log 2>&1 \
        || { tail -20 /tmp/install.log; exit 1; }
    if [ -d /tmp/stage/deps ]; then  # the server's dependencies, without replacing the machine's own
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
            /tmp/stage/deps/*.whl >>/tmp/install.log 2>&1 || tail -5 /tmp/install.log
    fi
    # libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/...: next to
    # where pip put it. They are the machine's own (PyTorch's nvidia-* wheels), elsewhere.
    nv=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null)
    if [ -n "$nv" ]; then
        ln -sfn "$nv" /tmp/site/nvidia
        export LD_LIBRARY_PATH="$(ls -d "$nv"/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}"
    fi
    # NVRTC, which builds the kernels, needs the CUDA headers: CUDA_HOME, else /usr/local/cuda
    if [ -z "${CUDA_HOME:-}" ] && [ ! -d /usr/local/cuda/include ] && command -v nvcc >/dev/null; then
        export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
    fi
    # At most 8 files come back from $OUT: the machine's facts go into one, env.txt.
    { echo "nvidia=$nv CUDA_HOME=${CUDA_HOME:-} nvcc=$(command -v nvcc) ncu=$(command -v ncu)"
      ldd /tmp/site/mlx/lib/libmlx.so; } >"$OUT/env.txt" 2>&1
    grep "not found" "$OUT/env.txt"
    # lmsp_mlx.kernels is the top-level kernels/ folder (a package-dir mapping when installed)
    [ -e lmsp_mlx/kernels ] || ln -s ../kernels lmsp_mlx/kernels
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/env.txt"
    python3 -c "from lmsp_mlx import kernels; import mlx.core as mx; print(mx.__version__, mx.default_device(), kernels.backend())" \
        2>&1 | tee -a "$OUT/env.txt"
    shift
    [ $# -gt 0 ] || set -- tests bench sweep
    # full float32 in the tests (MLX runs float32 matmuls as TF32 by default on these GPUs,
    # references included); the benchmarks keep the default a user gets
    # (the SIMT-emulated and nvcc-compiled sources run on every CPU machine: not here)
    for step in "$@"; do
        echo "== $step $(date +%T)"
        case $step in
        cuda) timeout 150 python3 -m benchmarks.cuda_kernels --out "$OUT" 2>&1 | tee "$OUT/cuda.txt" | tail -20 ;;
        profile) timeout 180 python3 -m benchmarks.gpu_profile --out "$OUT" 2>&1 | tee "$OUT/profile.txt" | tail -12 ;;
        tests|alltests)
            only=$([ "$step" = tests ] && echo "and not kernel_matches_its_reference")
            MLX_ENABLE_TF32=0 LMSP_KERNELS=kernel timeout 240 python3 -m pytest -q -p no:cacheprovider \
                tests/test_kernels.py -k "not source and not cuda_twins and not timing_programs $only" 2>&1 | tee "$OUT/tests.txt" | tail -40 ;;
        bench) timeout 150 python3 -m benchmarks.kernels --repeats 20 --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | tail -22 ;;
        # the launch shapes the constants in kernels/ should take on this GPU
        sweep) timeout 100 python3 -m benchmarks.kernel_sweep --out "$OUT" 2>&1 | tee "$OUT/sweep.txt" | tail -30 ;;
        server) timeout 90 bash benchmarks/gpu_server.sh "$OUT" 2>&1 | tee "$OUT/server.txt" | tail -20 ;;
        # the whole suite, GPU-only tests included, less the per-configuration NVRTC sweeps
        # (`alltests` runs those) and the npm CLIs (nothing can be installed there)
        suite) MLX_ENABLE_TF32=0 timeout 270 python3 -m pytest -q -p no:cacheprovider \
                   -k "not codex and not claude_code and not kernel_matches_its_reference" 2>&1 | tee "$OUT/suite.txt" | tail -30 ;;
        *) echo "unknown step $step" ;;
        esac
    done
    rm -f "$OUT"/*.png  # drawn here from the CSVs: the 8 files that come back are for data
    ;;
*)
    echo "usage: on_gpu.sh stage|run (see the comment at the top)"; exit 2
    ;;
esac
