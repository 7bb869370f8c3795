"""lmsp-mlx: a local model server for MLX speaking LMSP 1.0 and OpenAI-style /v1/responses."""

__version__ = "0.1.0"
LMSP_VERSION = "1.0"

# Before anything imports mlx.core: on Linux, route its float32 matmuls to OpenBLAS.
from .cpu_blas import accelerate as _accelerate  # noqa: E402

_accelerate()
