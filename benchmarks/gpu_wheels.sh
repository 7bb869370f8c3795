#!/usr/bin/env bash
# Here, before a device run: the wheels the lent GPU machine lacks, in two carries.
#
# That machine reaches nothing outside it and has no MLX; its Python is 3.12 and its CUDA
# 13 libraries (cuBLAS, cuDNN, NVRTC, ...) are the ones mlx-cuda-13 needs. One call may
# carry 64 MiB, and mlx-cuda-13 alone is about 90 MB, so it travels split in two:
#   .whl/a: mlx, mlx-lm and the first half of mlx-cuda-13   (carry in the `stage` call)
#   .whl/b: the second half                                 (carry in the `run` call)
#   .whl/c: the server's other dependencies (quart, hypercorn, pydantic, transformers, ...,
#           the test extra), for the `server` and `suite` steps  (carry in the `deps` call)
# See benchmarks/on_gpu.sh for the two calls.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl/a .whl/b .whl/tmp
PIP="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64"
$PIP -d .whl/a mlx==0.32.4 mlx-lm==0.32.2
$PIP -d .whl/tmp mlx-cuda-13==0.32.4
wheel=$(ls .whl/tmp/*.whl)
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
split -b "$half" "$wheel" .whl/tmp/part.
mv .whl/tmp/part.aa .whl/a/ && mv .whl/tmp/part.ab .whl/b/
basename "$wheel" > .whl/a/cuda-wheel-name
rm -rf .whl/tmp
# Everything the project needs besides MLX, resolved for the device's Python (pip resolves
# the project's own dependency list; mlx, mlx-lm and the CUDA wheel come from a and b).
mkdir -p .whl/c
python3 - >.whl/c/requirements.txt <<'PY'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in p["dependencies"] + p["optional-dependencies"]["test"]:
    if not re.match(r"mlx", dep):
        print(dep.split(";")[0].replace(" ", ""))
PY
${PIP/--no-deps /} -d .whl/c -r .whl/c/requirements.txt  # with their own dependencies
rm -f .whl/c/mlx-*.whl .whl/c/mlx_lm-*.whl .whl/c/mlx_cuda*.whl
du -sh .whl/a .whl/b .whl/c
