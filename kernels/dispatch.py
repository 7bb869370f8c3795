"""Kernel or reference: which one runs, decided once per kernel and shape.

`LMSP_KERNELS` chooses:
- `auto` (default): the kernel where its backend exists (Metal on Apple silicon, CUDA
  under MLX's CUDA backend), the reference elsewhere. The first call of each kernel
  configuration (shapes, bit width, dtypes) also runs the reference and compares: a
  kernel that fails to compile or disagrees is logged once and replaced by the reference
  for that configuration, so a driver or toolchain we never ran cannot give wrong tokens.
- `reference`: always the reference (what the CPU build runs).
- `kernel`: always the kernel, no check and no fallback (tests and benchmarks); an error
  where no backend exists.
- `off`: no swaps at all: mlx-lm's own layers (install.py), for comparison.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import mlx.core as mx

log = logging.getLogger("lmsp_mlx.kernels")

MODES = ("auto", "reference", "kernel", "off")


@lru_cache(maxsize=1)  # asked on every MoE layer and attention call; fixed for the process
def backend() -> str | None:
    """'metal', 'cuda', or None (the CPU build: no kernel backend)."""
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def mode() -> str:
    value = os.environ.get("LMSP_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"LMSP_KERNELS={value!r}: expected one of {', '.join(MODES)}")
    return value


class Dispatch:
    """Runs `kernel(*args)` or `reference(*args)` as the mode and the checks decide.

    `config(*args)` names a kernel configuration (what would make it compile to other
    code); `agree(got, want)` says whether a kernel's output matches the reference's."""

    def __init__(self, name: str, kernel: Callable[..., Any], reference: Callable[..., Any],
                 config: Callable[..., tuple], agree: Callable[[mx.array, mx.array], bool]) -> None:
        self.name, self.kernel, self.reference, self.config, self.agree = name, kernel, reference, config, agree
        self.verdicts: dict[tuple, bool] = {}  # configuration -> the kernel may run
        self.calls = {"kernel": 0, "reference": 0}  # what ran, for tests and benchmarks

    def __call__(self, *args):
        chosen = mode()
        if chosen == "kernel" and backend() is None:
            raise RuntimeError(f"{self.name}: LMSP_KERNELS=kernel, but MLX has no Metal or CUDA backend here")
        use = chosen == "kernel"
        if chosen == "auto" and backend() is not None:
            key = self.config(*args)
            if key not in self.verdicts:
                self.verdicts[key] = self._check(key, args)
            use = self.verdicts[key]
        self.calls["kernel" if use else "reference"] += 1
        return self.kernel(*args) if use else self.reference(*args)

    def _check(self, key: tuple, args: tuple) -> bool:
        try:
            got = self.kernel(*args)
            mx.eval(got)
        except Exception as exc:  # a compile error names the toolchain's complaint
            log.warning("%s kernel unavailable for %s (%s: %s); using the reference", self.name, key,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        want = self.reference(*args)
        if not self.agree(got, want):
            log.warning("%s kernel disagrees with its reference for %s; using the reference", self.name, key)
            return False
        log.info("%s kernel checked against its reference for %s", self.name, key)
        return True


def close(got: mx.array, want: mx.array, rtol: float) -> bool:
    """Agreement relative to the reference's scale: max |got - want| <= rtol * max |want|."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err = mx.max(mx.abs(got - want)).item()
    return bool(err <= rtol * max(mx.max(mx.abs(want)).item(), 1e-6))
