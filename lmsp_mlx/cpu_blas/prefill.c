/*
 * Fused prefill pieces for MLX's Linux CPU build: causal attention and SwiGLU.
 *
 * MLX's CPU elementwise ops run one pass per op on one core, and its exp costs about
 * 27 ns per value; numpy's about 0.7 but still one pass per op. With the matmuls on
 * OpenBLAS, a 512-token prefill of SmolLM2 spent more time in attention's softmax and
 * the MLP's SiLU than in all the layer's matmuls. Here:
 *
 * - attention runs per head in blocks of query rows: one sgemm for the scores (only the
 *   keys a block can see, so the causal half is never computed), one pass that takes the
 *   row maximum and one that exponentiates and sums (an AVX2 exp, 8 lanes), one sgemm
 *   for the weighted values, then the rows are divided by their sums. A block's scores
 *   stay in cache between the passes.
 * - SwiGLU is one pass: silu(gate) * up.
 *
 * The AVX2 exp is simd.h's. Without AVX2+FMA (checked at run time) a scalar expf loop is used.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blas.h"
#include "simd.h"


/* out[i] = exp(x[i] - shift) over n values; returns their sum. */
static float exp_sum_scalar(const float *x, float *out, int64_t n, float shift) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float e = expf(fminf(fmaxf(x[i] - shift, EXP_LO), EXP_HI));
        out[i] = e;
        sum += e;
    }
    return sum;
}

static void swiglu_scalar(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(fminf(fmaxf(-g, EXP_LO), EXP_HI))) * up[i];
    }
}

#if defined(__x86_64__)

__attribute__((target("avx2,fma"))) static float exp_sum_avx2(const float *x, float *out, int64_t n,
                                                              float shift) {
    __m256 s = _mm256_set1_ps(shift), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(out + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int k = 0; k < 8; k++) sum += lanes[k];
    return sum + exp_sum_scalar(x + i, out + i, n - i, shift);
}

__attribute__((target("avx2,fma"))) static float max_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int k = 0; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

__attribute__((target("avx2,fma"))) static void swiglu_avx2(const float *gate, const float *up, float *out,
                                                            int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    swiglu_scalar(gate + i, up + i, out + i, n - i);
}

#else
#define exp_sum_avx2 exp_sum_scalar
#define max_avx2 max_scalar
#define swiglu_avx2 swiglu_scalar
#endif

static float max_scalar(const float *x, int64_t n) {
    float top = -INFINITY;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

static float row_max(const float *x, int64_t n) { return has_avx2() ? max_avx2(x, n) : max_scalar(x, n); }

static float exp_sum(const float *x, float *out, int64_t n, float shift) {
    return has_avx2() ? exp_sum_avx2(x, out, n, shift) : exp_sum_scalar(x, out, n, shift);
}

void lmsp_swiglu(const float *gate, const float *up, float *out, int64_t n) {
    if (has_avx2())
        swiglu_avx2(gate, up, out, n);
    else
        swiglu_scalar(gate, up, out, n);
}

enum { BLOCK_ROWS = 256 }; /* score rows per sgemm: 256 x 1024 keys is 1 MiB, cache-sized */

/*
 * Causal attention for the `group` query heads that share one key/value head.
 * q: (length, group, dim), scores are scaled by `scale`; k, v: (source, dim);
 * out: (length, group, dim); all row-major and contiguous. Stacking the group's heads
 * makes each sgemm `group` times taller (more efficient). Query position i is at
 * source - length + i and sees keys 0..source - length + i. Returns 0, or 1 when out
 * of memory.
 */
int lmsp_causal_attention(const float *q, const float *k, const float *v, float *out, int64_t length,
                          int64_t group, int64_t source, int64_t dim, float scale) {
    int64_t offset = source - length;
    int64_t step = BLOCK_ROWS / group > 0 ? BLOCK_ROWS / group : 1; /* positions per block */
    float *scores = malloc(sizeof(float) * (step * group) * source);
    float *sums = malloc(sizeof(float) * step * group);
    if (!scores || !sums) {
        free(scores);
        free(sums);
        return 1;
    }
    for (int64_t start = 0; start < length; start += step) {
        int64_t positions = length - start < step ? length - start : step;
        int64_t rows = positions * group;
        int64_t seen = offset + start + positions; /* keys the block's last position sees */
        lmsp_blas_sgemm(RowMajor, NoTrans, Trans, rows, seen, dim, scale, q + start * group * dim, dim, k, dim,
                        0.0f, scores, seen);
        for (int64_t r = 0; r < rows; r++) {
            float *row = scores + r * seen;
            int64_t visible = offset + start + r / group + 1;
            sums[r] = exp_sum(row, row, visible, row_max(row, visible));
            memset(row + visible, 0, sizeof(float) * (seen - visible));
        }
        float *dst = out + start * group * dim;
        lmsp_blas_sgemm(RowMajor, NoTrans, NoTrans, rows, dim, seen, 1.0f, scores, seen, v, dim, 0.0f, dst, dim);
        for (int64_t r = 0; r < rows; r++) {
            float inv = 1.0f / sums[r];
            for (int64_t d = 0; d < dim; d++) dst[r * dim + d] *= inv;
        }
    }
    free(sums);
    free(scores);
    return 0;
}

/*
 * Rotary position embedding, rotate-halves form (mx.fast.rope with traditional=False).
 * x: (batch, heads, length, dim) with element strides sb, sh, sl and a contiguous last
 * axis, so the transposed projections need no copy; out: contiguous, same shape.
 * cos, sin: (length, dims / 2) for the positions of x. Features past `dims` are copied.
 * MLX's CPU rope computes sin and cos per element, about 5 ns each.
 */
void lmsp_rope(const float *x, float *out, int64_t batch, int64_t heads, int64_t length, int64_t dim, int64_t sb,
               int64_t sh, int64_t sl, int64_t dims, const float *cos, const float *sin) {
    int64_t half = dims / 2;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t l = 0; l < length; l++) {
                const float *row = x + b * sb + h * sh + l * sl;
                const float *c = cos + l * half, *s = sin + l * half;
                float *o = out + ((b * heads + h) * length + l) * dim;
                for (int64_t i = 0; i < half; i++) {
                    float lo = row[i], hi = row[i + half];
                    o[i] = lo * c[i] - hi * s[i];
                    o[i + half] = hi * c[i] + lo * s[i];
                }
                for (int64_t i = dims; i < dim; i++) o[i] = row[i];
            }
}
