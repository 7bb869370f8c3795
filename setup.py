"""Build step for the one compiled piece: the CPU BLAS shim (Linux only, optional).

Everything else is in pyproject.toml. `optional=True`: without a C compiler the install
still succeeds and the server falls back to MLX's stock BLAS with one warning line.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "lmsp_mlx.cpu_blas._shim",
            sources=["lmsp_mlx/cpu_blas/shim.c", "lmsp_mlx/cpu_blas/prefill.c", "lmsp_mlx/cpu_blas/forward.c",
                     "lmsp_mlx/cpu_blas/quant.c"],
            depends=["lmsp_mlx/cpu_blas/simd.h", "lmsp_mlx/cpu_blas/blas.h", "lmsp_mlx/cpu_blas/model.h",
                     "lmsp_mlx/cpu_blas/quant.h"],
            extra_compile_args=["-O3"],
            libraries=["dl", "m"],
            optional=True,
        )
    )
    # The fused decode step, the quantized MoE experts and attention over a quantized KV
    # cache (OpenMP across the cores); their
    # own module, so a compiler without OpenMP loses only these, not the BLAS shim.
    ext_modules.append(
        Extension(
            "lmsp_mlx.cpu_blas._decode",
            sources=["lmsp_mlx/cpu_blas/decode.c", "lmsp_mlx/cpu_blas/experts.c", "lmsp_mlx/cpu_blas/attention.c",
                     "lmsp_mlx/cpu_blas/quant.c"],
            depends=["lmsp_mlx/cpu_blas/simd.h", "lmsp_mlx/cpu_blas/model.h", "lmsp_mlx/cpu_blas/attention.h",
                     "lmsp_mlx/cpu_blas/quant.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            # quant.c is in both modules and _shim is loaded RTLD_GLOBAL: -Bsymbolic keeps
            # this module's calls on its own copies, the ones its tests look up.
            extra_link_args=["-fopenmp", "-Wl,-Bsymbolic"],
            libraries=["m"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
