"""A CUDA kernel body as MLX's CUDA backend assembles it, for building it outside MLX.

mx.fast.cuda_kernel wraps a body in a generated function (mlx/backend/cuda/custom_kernel.cpp,
build_kernel): `const <type>* input` with `input_shape` / `input_strides` after it where the
body names them (by value, __grid_constant__), then `<type>* output`, then the template
args as constants at the top of the body, inside namespace mlx::core::cu after the header.
`assemble` writes the same text, with STAND_IN for the part of MLX's utils.cuh our bodies
use, so nvcc can compile it (tests/test_kernels.py: registers and spills) and a plain CUDA
program can launch and time it (benchmarks/cuda_kernels.py: the kernels' GPU time without
MLX's per-operation cost).
"""

from __future__ import annotations

from .sources import body as section_body, sections

STAND_IN = """
#include <cstdint>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#define MAX_NDIM 8
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
"""


def extras(body: str, name: str) -> list[str]:
    """The shape/strides parameters MLX adds after input `name`: those the body names."""
    return [kind for kind in ("shape", "strides") if f"{name}_{kind}" in body]


def kernel(stem: str, section: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
           template: list[tuple[str, int | str]], name: str | None = None) -> str:
    """One __global__ function (default name lmsp_<stem>_<section>), without the header."""
    body = section_body(f"{stem}.cu", section)
    params = []
    for arg, ctype in inputs:
        params.append(f"const {ctype}* {arg}")
        params += [f"const __grid_constant__ {'Shape' if kind == 'shape' else 'Strides'} {arg}_{kind}"
                   for kind in extras(body, arg)]
    params += [f"{ctype}* {arg}" for arg, ctype in outputs]
    consts = "".join(f"constexpr int {k} = {v};\n" if isinstance(v, int) else f"using {k} = {v};\n" for k, v in template)
    name = name or f"lmsp_{stem}_{section.replace('+', '_')}"
    return (f"namespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {name}({', '.join(params)}) {{\n{consts}{body}}}\n}}\n")


def assemble(stem: str, section: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
             template: list[tuple[str, int | str]]) -> str:
    """A compilable file: the stand-in, `stem`.cu's header, and the kernel."""
    return f"{STAND_IN}\n{sections(f'{stem}.cu')['header']}\n{kernel(stem, section, inputs, outputs, template)}"
