/*
 * cblas_sgemm for MLX's Linux CPU build, forwarded to an optimised OpenBLAS.
 *
 * The mlx-cpu wheel resolves cblas_sgemm from a bundled reference (netlib) BLAS, about
 * 25x slower than OpenBLAS on our machines. Loaded with RTLD_GLOBAL before mlx.core,
 * this library's cblas_sgemm wins symbol resolution. It forwards to the OpenBLAS that
 * numpy's wheel already ships (64-bit integers, `scipy_` prefix, `64_` suffix), so the
 * process keeps one BLAS thread pool, and sends one-row and one-column products (every
 * decode step) to sgemv: OpenBLAS's sgemm is no faster than the reference there, its
 * sgemv runs at memory bandwidth.
 *
 * Python loads it with ctypes; the module init below only makes it an importable
 * extension so that the installed file can be found with importlib.
 */
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <time.h>

#include "blas.h"

typedef void (*sgemv_fn)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *,
                         int64_t, float, float *, int64_t);

/* Y = X W^T for a few rows of X (decode.c's lmsp_small_gemm, in the OpenMP module). */
typedef void (*small_gemm_fn)(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t nb,
                              int serial);

sgemm_fn lmsp_real_sgemm; /* also used by prefill.c and forward.c */
static sgemv_fn real_sgemv;
static small_gemm_fn small_gemm; /* NULL until lmsp_blas_set_small_gemm: then 2..SMALL_ROWS rows go there */
static long long forwarded_gemm, forwarded_gemv, forwarded_small;

#define SMALL_ROWS 24 /* past it OpenBLAS is as fast (benchmarks/small_gemm.py: 1.2x at 24 rows, 1.02x at 32) */

/* The batched product for a few rows (NULL turns it off); Python sets it once the
 * compiled decode module is loaded, which this library cannot link against. */
void lmsp_blas_set_small_gemm(small_gemm_fn f) { small_gemm = f; }

/* OpenBLAS's workers spin for some 100 ms after a call they took part in. A thread team
 * started meanwhile fights them for the cores (a model whose steps interleave OpenBLAS
 * calls with small-row products, Qwen3-Next's, ran 0.8x OpenBLAS alone), so the small-row
 * product runs on the calling thread until that window has passed since OpenBLAS's last
 * call of a size it threads; alone it still beats OpenBLAS's sgemm, which packs the whole
 * weight. */
#define SPIN_WINDOW_NS 150000000LL
#define THREADED_FLOPS 65536 /* below this OpenBLAS runs a call on the caller's thread */
static long long openblas_last_ns = -SPIN_WINDOW_NS;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void openblas_called(int64_t flops) {
    if (flops >= THREADED_FLOPS) openblas_last_ns = now_ns();
}

static int openblas_spinning(void) { return now_ns() - openblas_last_ns < SPIN_WINDOW_NS; }

/* Python says so: 1 after numpy's matmuls (OpenBLAS's workers may spin), 0 once it parked
 * them (cpu_blas.park_blas_threads). */
void lmsp_blas_note(int spinning) { openblas_last_ns = spinning ? now_ns() : -SPIN_WINDOW_NS; }

void lmsp_blas_sgemm(int order, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                     int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    lmsp_real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    openblas_called(M * N * K);
}

/* Returns 0 when `path` is an OpenBLAS with the expected symbols. */
int lmsp_blas_init(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 1;
    lmsp_real_sgemm = (sgemm_fn)dlsym(lib, "scipy_cblas_sgemm64_");
    real_sgemv = (sgemv_fn)dlsym(lib, "scipy_cblas_sgemv64_");
    return lmsp_real_sgemm && real_sgemv ? 0 : 2;
}

/* Calls forwarded so far: 0 sgemm, 1 sgemv, 2 the small-row product. */
long long lmsp_blas_calls(int which) { return which == 2 ? forwarded_small : which ? forwarded_gemv : forwarded_gemm; }

/* Row-major C = alpha * op(A) op(B) + beta * C. */
static void row_major(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                      int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (small_gemm && M >= 2 && M <= SMALL_ROWS && ta == NoTrans && tb == Trans && alpha == 1.0f && beta == 0.0f &&
        lda == K && ldb == K && ldc == N && K > 0) {
        /* C (M x N) = A B^T, A a few activation rows, B a weight (N x K): each weight row read
         * once. On the calling thread alone while OpenBLAS's workers may still spin. */
        small_gemm(B, A, C, N, K, M, openblas_spinning());
        forwarded_small++;
        return;
    }
    if (M == 1 && N > 1 && K > 0) {
        /* c (1xN) = a (1xK) op(B): y = op(B)^T a. a's elements are lda apart when A is transposed. */
        int64_t inca = ta == NoTrans ? 1 : lda;
        if (tb == NoTrans)
            real_sgemv(RowMajor, Trans, K, N, alpha, B, ldb, A, inca, beta, C, 1);
        else
            real_sgemv(RowMajor, NoTrans, N, K, alpha, B, ldb, A, inca, beta, C, 1);
        forwarded_gemv++;
        openblas_called(N * K);
        return;
    }
    if (N == 1 && M > 1 && K > 0) {
        /* c (Mx1, ldc apart) = op(A) b. b's elements are ldb apart unless B is transposed. */
        int64_t incb = tb == NoTrans ? ldb : 1;
        if (ta == NoTrans)
            real_sgemv(RowMajor, NoTrans, M, K, alpha, A, lda, B, incb, beta, C, ldc);
        else
            real_sgemv(RowMajor, Trans, K, M, alpha, A, lda, B, incb, beta, C, ldc);
        forwarded_gemv++;
        openblas_called(M * K);
        return;
    }
    lmsp_real_sgemm(RowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    forwarded_gemm++;
    openblas_called(M * N * K);
}

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (order == ColMajor) /* C^T = op(B)^T op(A)^T in row-major terms */
        row_major(tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
    else
        row_major(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shim", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__shim(void) { return PyModule_Create(&module); }
