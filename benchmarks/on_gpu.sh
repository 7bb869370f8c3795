#!/usr/bin/env bash
# The custom kernels on an NVIDIA GPU under MLX's CUDA backend, in one run: the device
# tool's machine (an H200) runs this from the repository root, with $OUT for results.
#
#   bash benchmarks/on_gpu.sh        # on the GPU machine; results in $OUT (default ./gpu-out)
#
# 1. a venv with MLX's CUDA build instead of the CPU one (pyproject.toml asks for mlx[cpu]
#    on Linux, so the project is installed without dependencies and they are added here);
# 2. tests/test_kernels.py with LMSP_KERNELS=kernel: every kernel against its reference;
# 3. benchmarks/kernels.py: kernels against MLX's built-ins, CSV + PNG.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m venv /tmp/gpu-venv
PIP=/tmp/gpu-venv/bin/pip
PY=/tmp/gpu-venv/bin/python
{
  $PIP install -q 'mlx[cuda12]>=0.32' || $PIP install -q 'mlx[cuda]>=0.32'
  $PIP install -q --no-deps -e .
  $PIP install -q 'mlx-lm>=0.32.2' quart hypercorn pydantic numpy safetensors tokenizers tqdm platformdirs \
    cryptography llguidance pytest httpx matplotlib
} >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
$PY -c "import mlx.core as mx; from lmsp_mlx import kernels; print(mx.__version__, mx.default_device(), kernels.backend())" \
  | tee "$OUT/backend.txt"
LMSP_KERNELS=kernel timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -40 | tee "$OUT/tests.txt"
timeout 240 $PY benchmarks/kernels.py --repeats 20 --out "$OUT" 2>&1 | tail -20 | tee "$OUT/bench.txt"
