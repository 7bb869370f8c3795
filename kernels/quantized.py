"""The quantized arrays the kernels read, as mlx-lm lays them out.

MLX's affine quantization packs each row's `bits`-wide codes as one little-endian bit
stream in uint32 words (code i occupies bits i*bits .. i*bits+bits-1 of the row, crossing a
word boundary for 3, 5 and 6 bits), with one float scale and bias per `group_size` codes:
value = scale * code + bias. tests/test_kernels.py checks this against mx.dequantize for
every width the kernels take, so the kernels' unpacking and MLX's stay the same thing.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

EXPERT_BITS = (2, 3, 4, 8)
KV_BITS = (4, 8)
GROUP_SIZES = (32, 64)


class QuantizedExperts(NamedTuple):
    """One projection of every expert: weight (E, out, in * bits / 32) uint32, scales and
    biases (E, out, in / group_size); mlx-lm's QuantizedSwitchLinear."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @classmethod
    def of(cls, layer) -> "QuantizedExperts":
        return cls(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)

    @property
    def input_dims(self) -> int:
        return self.scales.shape[-1] * self.group_size

    @property
    def output_dims(self) -> int:
        return self.weight.shape[-2]


class QuantizedTensor(NamedTuple):
    """(packed, scales, biases): mlx-lm's QuantizedKVCache keys or values, (B, H, N, ...)."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
