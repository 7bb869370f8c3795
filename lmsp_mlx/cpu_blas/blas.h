/*
 * What the shim's pieces share: CBLAS constants, the forwarded OpenBLAS sgemm (shim.c)
 * and the fused prefill kernels (prefill.c) that forward.c chains.
 */
#ifndef LMSP_BLAS_H
#define LMSP_BLAS_H

#include <stdint.h>

enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112 };

typedef void (*sgemm_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                         const float *, int64_t, float, float *, int64_t);

extern sgemm_fn lmsp_real_sgemm; /* shim.c: numpy's OpenBLAS */
/* lmsp_real_sgemm, noting that OpenBLAS's workers may now spin (shim.c) */
void lmsp_blas_sgemm(int order, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                     int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

int lmsp_causal_attention(const float *q, const float *k, const float *v, float *out, int64_t length,
                          int64_t group, int64_t source, int64_t dim, float scale);
void lmsp_swiglu(const float *gate, const float *up, float *out, int64_t n);

#endif
