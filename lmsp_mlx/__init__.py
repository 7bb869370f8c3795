"""lmsp-mlx: a local model server for MLX speaking LMSP 1.0 and OpenAI-style /v1/responses."""

__version__ = "0.1.0"
LMSP_VERSION = "1.0"
