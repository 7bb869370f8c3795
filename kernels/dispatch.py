"""Kernel, MLX's built-in path or reference: which one runs, decided once per kernel and shape.

`LMSP_KERNELS` chooses:
- `auto` (default): the kernel where one exists for this build and takes the shape
  (Metal on Apple silicon, CUDA under MLX's CUDA backend, and on the Linux CPU build the
  compiled experts.c and attention.c for a float32 model, kernels/cpu.py). Elsewhere,
  the faster of the other two as measured on the CPU build: the caller's `builtin`
  (MLX's own path, as mlx-lm runs it) where it passes one, else the reference. The
  experts pass mlx-lm's gather_qmm path (9x faster than their reference in float32);
  attention passes none (its reference beat mlx-lm's quantized attention). The first
  call of each kernel configuration (shapes, bit width, dtypes) also runs the reference
  and compares: a kernel that fails to compile or disagrees is logged once and not used
  for that configuration, so a driver or toolchain we never ran cannot give wrong tokens.
- `reference`: always the pure-MLX reference (tests: what each kernel must compute).
- `kernel`: always the kernel where it takes the shape, no check (tests and benchmarks);
  an error where this build has none.
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
    """Runs `kernel(*args)`, the caller's `builtin()` or `reference(*args)` as the mode and
    the checks decide.

    `config(*args)` names a kernel configuration (what would make it compile to other
    code); `agree(got, want)` says whether a kernel's output matches the reference's;
    `available()` whether this build has the kernel (default: MLX has Metal or CUDA);
    `fits(*args)` whether the kernel takes these inputs."""

    def __init__(self, name: str, kernel: Callable[..., Any], reference: Callable[..., Any],
                 config: Callable[..., tuple], agree: Callable[[mx.array, mx.array], bool],
                 available: Callable[[], bool] | None = None, fits: Callable[..., bool] | None = None) -> None:
        self.name, self.kernel, self.reference, self.config, self.agree = name, kernel, reference, config, agree
        self.available = available or (lambda: backend() is not None)
        self.fits = fits or (lambda *args: True)
        self.verdicts: dict[tuple, bool] = {}  # configuration -> the kernel may run
        self.calls = {"kernel": 0, "builtin": 0, "reference": 0}  # what ran, for tests and benchmarks

    def __call__(self, *args, builtin: Callable[[], Any] | None = None):
        chosen = mode()
        here = self.available()
        if chosen == "kernel" and not here:
            raise RuntimeError(f"{self.name}: LMSP_KERNELS=kernel, but MLX has no Metal or CUDA backend here "
                               "(and no compiled CPU kernel for it)")
        use = chosen in ("auto", "kernel") and here and self.fits(*args)
        if use and chosen == "auto":
            key = self.config(*args)
            if key not in self.verdicts:
                self.verdicts[key] = self._check(key, args)
            use = self.verdicts[key]
        if use:
            path, run = "kernel", lambda: self.kernel(*args)
        elif builtin is not None and chosen != "reference":
            path, run = "builtin", builtin
        else:
            path, run = "reference", lambda: self.reference(*args)
        self.calls[path] += 1
        return run()

    def _check(self, key: tuple, args: tuple) -> bool:
        try:
            got = self.kernel(*args)
            mx.eval(got)
        except Exception as exc:  # a compile error names the toolchain's complaint
            log.warning("%s kernel unavailable for %s (%s: %s); not using it", self.name, key,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        want = self.reference(*args)
        if not self.agree(got, want):
            log.warning("%s kernel disagrees with its reference for %s; not using it", self.name, key)
            return False
        log.info("%s kernel checked against its reference for %s", self.name, key)
        return True


def close(got: mx.array, want: mx.array, rtol: float) -> bool:
    """Agreement relative to the reference's scale: max |got - want| <= rtol * max |want|."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err = mx.max(mx.abs(got - want)).item()
    return bool(err <= rtol * max(mx.max(mx.abs(want)).item(), 1e-6))
