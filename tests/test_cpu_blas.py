"""MLX's float32 matmuls through the OpenBLAS shim give float32-accurate results."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from lmsp_mlx import cpu_blas

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim is for MLX's Linux CPU build")


@pytest.fixture(scope="module", autouse=True)
def on_cpu():
    with mx.stream(mx.cpu):
        yield


def close(got: mx.array, a: np.ndarray, b: np.ndarray, expected: np.ndarray) -> None:
    # float32 accumulation over K terms: error grows like sqrt(K) * eps * |a||b|.
    scale = np.abs(a).max() * np.abs(b).max() * a.shape[-1] ** 0.5
    assert np.abs(np.array(got, dtype=np.float64) - expected).max() <= 2e-6 * scale + 1e-6


@linux
def test_the_shim_is_active():
    assert cpu_blas.status().startswith("OpenBLAS")
    before = cpu_blas.forwarded_calls()
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)), mx.ones((1, 64)) @ mx.ones((64, 64)))
    after = cpu_blas.forwarded_calls()
    assert after[0] > before[0] and after[1] > before[1]  # one sgemm, one sgemv


@linux
@pytest.mark.skipif(cpu_blas.decode_kernel() is None, reason="the compiled decode module is not built")
@pytest.mark.parametrize("rows", [2, 5, 8, 13, 24])
def test_a_few_rows_times_a_weight_take_the_small_row_product(rows):
    """A batched decode step's shape (x @ W.T, a few rows): decode.c's product, not OpenBLAS's sgemm."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 300)).astype(np.float32)
    w = rng.standard_normal((257, 300)).astype(np.float32)
    before = cpu_blas.forwarded_calls()
    got = mx.array(x) @ mx.array(w).T
    mx.eval(got)
    after = cpu_blas.forwarded_calls()
    assert after[2] == before[2] + 1 and after[0] == before[0]
    close(got, x, w.T, x.astype(np.float64) @ w.T.astype(np.float64))


SHAPES = [(64, 48, 80), (1, 300, 257), (257, 300, 1), (1, 1, 64), (3, 1, 5), (1, 7, 1), (130, 1, 70),
          (2, 300, 257), (8, 64, 96), (5, 13, 70), (9, 64, 96), (24, 40, 33), (25, 40, 33)]  # 2-24 rows: decode.c's product where it takes them


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_all_transposes(m, k, n, ta, tb):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    # Transposed operands are built as transposed views, the layout MLX hands to BLAS as Trans.
    xa = mx.array(np.ascontiguousarray(a.T)).T if ta else mx.array(a)
    xb = mx.array(np.ascontiguousarray(b.T)).T if tb else mx.array(b)
    close(xa @ xb, a, b, a.astype(np.float64) @ b.astype(np.float64))


@pytest.mark.parametrize("m, k, n", [(1, 64, 96), (96, 64, 1), (33, 64, 17)])
def test_batched_and_broadcast(m, k, n):
    rng = np.random.default_rng(k + n)
    a = rng.standard_normal((4, 3, m, k)).astype(np.float32)
    b = rng.standard_normal((3, k, n)).astype(np.float32)
    close(mx.array(a) @ mx.array(b), a, b, a.astype(np.float64) @ b.astype(np.float64))


@pytest.mark.parametrize("m, k, n", [(1, 128, 64), (64, 128, 1), (40, 128, 50)])
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, 2.0), (1.0, 0.0)])
def test_addmm(m, k, n, alpha, beta):
    rng = np.random.default_rng(m + n)
    c = rng.standard_normal((m, n)).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = mx.addmm(mx.array(c), mx.array(a), mx.array(b), alpha=alpha, beta=beta)
    expected = alpha * (a.astype(np.float64) @ b.astype(np.float64)) + beta * c
    close(got, a, b, expected)


def test_a_linear_layer_in_decode_shape():
    """The decode step's product: one token (1x576) through a 576x1536 projection."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 576)).astype(np.float32)
    w = rng.standard_normal((1536, 576)).astype(np.float32)
    got = mx.array(x) @ mx.array(w).T
    close(got, x, w.T, x.astype(np.float64) @ w.T.astype(np.float64))
