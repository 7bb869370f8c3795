"""Custom kernels for the quantized MoE-expert and attention paths.

Each kernel has its sources here (`<name>.metal` for mx.fast.metal_kernel and a CUDA twin
`<name>.cu` for mx.fast.cuda_kernel), a pure-MLX reference with the same signature
(reference.py), and a dispatch (dispatch.py, `LMSP_KERNELS`) that runs the kernel only
where its backend exists and MLX's built-in path or the reference (whichever measured
faster) elsewhere, so everything runs on the CPU build.

- expert_swiglu: each token's top-k experts' SwiGLU MLP over affine-quantized weights
  (2/3/4/8 bits, groups of 32/64), for decode and small batches; KernelSwitchGLU puts it
  in mlx-lm's MoE models. On the CPU build its kernel is experts.c (cpu.py).
- expert_product (CPU build only): one projection of a float-expert MoE layer with the
  pairs of each expert grouped, so a batch reads an expert's weight once, not once per
  token that chose it (MLX's CPU gather_mm); GroupedSwitchGLU puts it in mlx-lm's MoE
  models with float32 experts (decode.c's lmsp_grouped_gemm, cpu.py).
- decode_attention: one query step against mlx-lm's QuantizedKVCache (4/8 bits), grouped
  query heads, K/V dequantized on the fly with an online softmax; used for `--kv-bits`.

The loader puts them into a loaded model (install.py's `expert_layers`,
`float_expert_layers` and `attention_op`), without changing mlx-lm.
"""

from .attention import decode_attention
from .dispatch import backend, mode
from .experts import expert_product, expert_swiglu
from .install import GroupedSwitchGLU, KernelSwitchGLU, attention_op, expert_layers, float_expert_layers
from .quantized import QuantizedExperts

__all__ = ["GroupedSwitchGLU", "KernelSwitchGLU", "QuantizedExperts", "backend", "decode_attention", "attention_op", "expert_layers", "expert_product", "expert_swiglu", "float_expert_layers", "mode"]
