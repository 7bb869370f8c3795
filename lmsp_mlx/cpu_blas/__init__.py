"""Route MLX's float32 matmuls to an optimised BLAS on Linux.

MLX's Linux wheel links a reference BLAS (about 3 GFLOP/s on our machines against about
70 in numpy's OpenBLAS). `accelerate()` loads the compiled shim (`shim.c`) into the global
symbol scope before `mlx.core` is imported, so MLX's `cblas_sgemm` resolves to the shim,
which forwards to the OpenBLAS inside numpy's wheel (one BLAS thread pool per process)
and sends one-row/one-column products to sgemv. macOS is left alone (Accelerate, Metal).
Set LMSP_STOCK_BLAS=1 to measure the stock path.

Importing lmsp_mlx changes nothing: a process calls `accelerate()` itself, first, before
anything imports mlx.core (serve.py, tests/conftest.py and the benchmarks do). The loader
warns where a CPU model loads without it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("lmsp_mlx.cpu_blas")

_status = "stock"
_shim: ctypes.CDLL | None = None
_openblas: ctypes.CDLL | None = None
_parked_at = -1  # forwarded BLAS calls when the OpenBLAS workers were last parked


def _numpy_openblas() -> Path | None:
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(list(spec.submodule_search_locations)[0]).parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas64_*.so"))
    return found[0] if found else None


def _openblas_config(path: Path) -> str:
    lib = ctypes.CDLL(str(path))
    lib.scipy_openblas_get_config64_.restype = ctypes.c_char_p
    return lib.scipy_openblas_get_config64_().decode().strip()


def accelerate() -> str:
    """Install the shim if this is Linux and nothing has imported mlx.core yet; returns the status."""
    global _status, _shim
    if _shim is not None or not sys.platform.startswith("linux") or os.environ.get("LMSP_STOCK_BLAS"):
        return _status
    if "mlx.core" in sys.modules:
        log.warning("mlx.core was imported before accelerate(): MLX matmuls stay on the stock reference BLAS (slow)")
        return _status
    shim = importlib.util.find_spec("lmsp_mlx.cpu_blas._shim")
    openblas = _numpy_openblas()
    if shim is None or shim.origin is None or openblas is None:
        missing = "the compiled BLAS shim" if shim is None else "numpy's OpenBLAS"
        log.warning("%s is missing: MLX matmuls use the stock reference BLAS (slow); reinstall with a C compiler", missing)
        return _status
    lib = ctypes.CDLL(shim.origin, mode=ctypes.RTLD_LOCAL)
    if lib.lmsp_blas_init(str(openblas).encode()) != 0:
        log.warning("%s lacks the expected OpenBLAS symbols: MLX matmuls use the stock reference BLAS (slow)", openblas)
        return _status
    # Promote to the global scope now that it works: mlx.core binds cblas_sgemm to it at import.
    _shim = ctypes.CDLL(shim.origin, mode=ctypes.RTLD_GLOBAL)
    _shim.lmsp_blas_calls.restype = ctypes.c_longlong
    _shim.lmsp_swiglu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    _shim.lmsp_causal_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_float]
    _shim.lmsp_rope.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 8 + [ctypes.c_void_p] * 2
    _shim.lmsp_prefill_scratch.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    _shim.lmsp_prefill_scratch.restype = ctypes.c_int64
    _shim.lmsp_prefill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4
    _status = f"{_openblas_config(openblas)} (numpy's), sgemv for one-row products"
    decode = decode_kernel()
    if decode is not None and os.environ.get("LMSP_SMALL_GEMM", "1") != "0":
        # 2-24 activation rows times a weight (MLX's batched decode steps): decode.c's product
        # reads each weight row once, where OpenBLAS's sgemm packs the whole weight per call.
        _shim.lmsp_blas_set_small_gemm(ctypes.cast(decode.lmsp_small_gemm, ctypes.c_void_p))
        _status += ", decode.c's batched product for 2-24 rows"
    global _openblas
    _openblas = ctypes.CDLL(str(openblas))
    if not hasattr(_openblas, "blas_thread_shutdown_"):
        _openblas = None
    return _status


def status() -> str:
    """'stock', or which BLAS MLX's float32 matmuls run on."""
    return _status


def fused_kernels() -> ctypes.CDLL | None:
    """The shim's fused prefill kernels (`prefill.c`: causal attention, SwiGLU, RoPE; `forward.c`:
    a prompt chunk through all layers), or None
    where the shim is not installed. ctypes releases the GIL while they run."""
    return _shim


def forwarded_calls() -> tuple[int, int, int]:
    """(sgemm, sgemv, small-row product) calls the shim has forwarded: proof that MLX goes through it."""
    if _shim is None:
        return (0, 0, 0)
    return (_shim.lmsp_blas_calls(0), _shim.lmsp_blas_calls(1), _shim.lmsp_blas_calls(2))


_decode: ctypes.CDLL | None = None


def decode_kernel() -> ctypes.CDLL | None:
    """The compiled decode step (`decode.c`, one sequence or a batch), quantized MoE experts (`experts.c`) and
    attention over a quantized KV cache (`attention.c`), all OpenMP, or None where they were not built (Linux only; a compiler without OpenMP skips
    them). ctypes releases the GIL while they run."""
    global _decode
    if _decode is None and sys.platform.startswith("linux"):
        spec = importlib.util.find_spec("lmsp_mlx.cpu_blas._decode")
        if spec is None or spec.origin is None:
            return None
        # libgomp, loaded with this module, reads it once: its workers spin 300,000 times
        # after each parallel region (milliseconds here) before they sleep. Between the
        # small-row products of an MLX step that spin took a core from MLX's own thread
        # and OpenBLAS's (Qwen3-Next at 4 sequences: 49 against 174 tok/s); 3,000 still
        # covers the compiled step's barriers (its decode and batched figures held).
        os.environ.setdefault("GOMP_SPINCOUNT", "3000")
        _decode = declare_decode(ctypes.CDLL(spec.origin))
    return _decode


def declare_decode(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of decode.c, experts.c and attention.c) with its functions' C signatures set."""
    lib.lmsp_decode_step.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32] + [ctypes.c_void_p] * 4
    lib.lmsp_decode_step.restype = ctypes.c_int
    lib.lmsp_decode_batch.argtypes = ([ctypes.c_void_p, ctypes.c_int32] + [ctypes.c_void_p] * 6 + [ctypes.c_int32]
                                      + [ctypes.c_void_p] * 3)
    lib.lmsp_decode_batch.restype = ctypes.c_int
    lib.lmsp_decode_batch_scratch.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
    lib.lmsp_decode_batch_scratch.restype = ctypes.c_int64
    lib.lmsp_expert_swiglu.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 9
                                       + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3)
    lib.lmsp_expert_swiglu.restype = ctypes.c_int
    lib.lmsp_grouped_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    lib.lmsp_grouped_gemm.restype = ctypes.c_int
    lib.lmsp_decode_attention.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 8
                                          + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])
    lib.lmsp_decode_attention.restype = ctypes.c_int
    lib.lmsp_quantize_row.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.lmsp_quantize_row.restype = None
    lib.lmsp_dequantize_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p]
    lib.lmsp_dequantize_rows.restype = None
    return lib


def blas_ran() -> None:
    """Calls of OpenBLAS that bypass the forwarded cblas_sgemm (the compiled prefill's
    sgemms, numpy's matmuls) say so here, so the next `park_blas_threads` parks them."""
    global _parked_at
    _parked_at = -1
    if _shim is not None:
        _shim.lmsp_blas_note(1)  # the shim's small-row products keep to one thread meanwhile


def park_blas_threads() -> None:
    """Stop OpenBLAS's worker threads if BLAS ran since they were last stopped.

    After each call OpenBLAS's workers spin for about 2^28 cycles (some 100 ms) before they
    sleep. On a 2-core machine a spinning worker halves the compiled decode step that
    follows a prefill (measured: 65-100 ms against 35-40 at 2,600 positions), since its
    OpenMP threads wait on each other at every layer. Shut down, the workers are started
    again by OpenBLAS's next call, in about 0.1 ms."""
    global _parked_at
    if _shim is None or _openblas is None:
        return
    calls = sum(forwarded_calls())
    if calls != _parked_at:
        import mlx.core as mx

        mx.synchronize()  # no MLX op may be inside OpenBLAS while its threads stop
        _openblas.blas_thread_shutdown_()
        _parked_at = calls
        _shim.lmsp_blas_note(0)
