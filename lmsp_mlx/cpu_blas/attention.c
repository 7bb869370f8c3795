/*
 * Decode attention over mlx-lm's QuantizedKVCache, for MLX's Linux CPU build: the CPU
 * counterpart of kernels/decode_attention.metal (same online softmax over splits of the
 * positions, merged at the end; same layout).
 *
 * Why: the pure-MLX reference dequantizes blocks of 2,048 positions to memory and
 * multiplies them with OpenBLAS: 87 ms at 16K positions of 4-bit KV (32 query heads over 4
 * KV heads of 128), for a cache of 9 MB. Here each cached row is read once and decoded
 * into a small buffer that stays in L1, scored against the KV head's query rows, and
 * its value row added into their running sums, with OpenMP over (KV head, split).
 *
 * Layout (mlx-lm's QuantizedKVCache, as its update_and_fetch hands it over): packed codes
 * (B, H, N, D * bits / 32) uint32, one little-endian bit stream per row; scales and biases
 * (B, H, N, D / group) float32 (a float32 model's cache). Views of a longer buffer: the
 * batch, head and row strides are passed, the last axis is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "quant.h"
#include "simd.h"

#define SPLIT LMSP_SPLIT
#define BLOCK 32 /* positions scored together: the running state is rescaled once per block */

typedef lmsp_rows Rows;

/* Row p of head (batch, head) decoded to floats, in code order. */
static void decode_row(const Rows *r, int64_t batch, int64_t head, int64_t p, int64_t d, int bits, int group,
                       float *out) {
    lmsp_dequantize_rows(r->w + batch * r->ws[0] + head * r->ws[1] + p * r->ws[2],
                         r->s + batch * r->ss[0] + head * r->ss[1] + p * r->ss[2],
                         r->b + batch * r->bs[0] + head * r->bs[1] + p * r->bs[2], 1, d, bits, group, out);
}

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

#if defined(__x86_64__)
/* decode_row for 2, 4 and 8 bits, in chunk order (simd.h). */
__attribute__((target("avx2,fma"))) static void decode_row_avx2(const Rows *r, int64_t batch, int64_t head,
                                                                int64_t p, int64_t d, int bits, int group,
                                                                float *out) {
    const uint8_t *w = (const uint8_t *)(r->w + batch * r->ws[0] + head * r->ws[1] + p * r->ws[2]);
    const float *s = r->s + batch * r->ss[0] + head * r->ss[1] + p * r->ss[2];
    const float *b = r->b + batch * r->bs[0] + head * r->bs[1] + p * r->bs[2];
    for (int64_t c = 0; c < d / 32; c++) {
        const __m256 scale = _mm256_set1_ps(s[c * 32 / group]), bias = _mm256_set1_ps(b[c * 32 / group]);
        const uint8_t *q = w + c * 4 * bits;
        float *o = out + c * 32;
        __m128i parts[4];
        if (bits == 4) {
            const __m128i v = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
            parts[0] = lo, parts[1] = _mm_srli_si128(lo, 8), parts[2] = hi, parts[3] = _mm_srli_si128(hi, 8);
        } else if (bits == 2) {
            const __m128i v = _mm_loadl_epi64((const __m128i *)q), m = _mm_set1_epi8(3);
            for (int k = 0; k < 4; k++) parts[k] = _mm_and_si128(_mm_srli_epi16(v, 2 * k), m);
        } else {
            for (int k = 0; k < 4; k++) parts[k] = _mm_loadl_epi64((const __m128i *)(q + 8 * k));
        }
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(widen8(parts[k]), scale, bias));
    }
}

/* The four sums of a, b, c, d's lanes, in that order. */
__attribute__((target("avx2,fma"))) static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* Scores of query rows q (R of them, 1 or 2) against the block's decoded keys k, four
 * positions at a time: 4R independent sums, so each load serves several multiply-adds and
 * the FMA latency is hidden (one dot product at a time was latency-bound, about half the
 * FMA rate, plus a horizontal sum per score). w gets the scores at w[r * BLOCK + j]; k
 * holds n4 rows (a multiple of 4, zero past the block's end). */
__attribute__((target("avx2,fma"), always_inline)) static inline void scores_avx2(const float *q, const float *k,
                                                                                 float *w, int R, int n4,
                                                                                 int64_t d) {
    for (int j = 0; j < n4; j += 4) {
        const float *k0 = k + j * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
        __m256 s[2][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) s[r][c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 a = _mm256_loadu_ps(k0 + i), b = _mm256_loadu_ps(k1 + i), c = _mm256_loadu_ps(k2 + i),
                         e = _mm256_loadu_ps(k3 + i);
            for (int r = 0; r < R; r++) {
                const __m256 x = _mm256_loadu_ps(q + r * d + i);
                s[r][0] = _mm256_fmadd_ps(x, a, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(x, b, s[r][1]);
                s[r][2] = _mm256_fmadd_ps(x, c, s[r][2]);
                s[r][3] = _mm256_fmadd_ps(x, e, s[r][3]);
            }
        }
        for (int r = 0; r < R; r++) _mm_storeu_ps(w + r * BLOCK + j, hsum4(s[r][0], s[r][1], s[r][2], s[r][3]));
    }
}

/* acc[r] = acc[r] * fade[r] + sum_j w[r * BLOCK + j] v[j] for R (1-4) query rows, 16
 * columns at a time held in registers across the block's n positions: acc is read and
 * written once a block, not once a position (one axpy per position and row was bound by
 * its stores), and the rescale rides along. */
__attribute__((target("avx2,fma"), always_inline)) static inline void weigh_avx2(const float *w, const float *v,
                                                                                const float *fade, float *acc,
                                                                                int R, int n, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) {
        __m256 s[4][2];
        for (int r = 0; r < R; r++) {
            const __m256 f = _mm256_set1_ps(fade[r]);
            s[r][0] = _mm256_mul_ps(f, _mm256_loadu_ps(acc + r * d + i));
            s[r][1] = _mm256_mul_ps(f, _mm256_loadu_ps(acc + r * d + i + 8));
        }
        for (int j = 0; j < n; j++) {
            const __m256 a = _mm256_loadu_ps(v + j * d + i), b = _mm256_loadu_ps(v + j * d + i + 8);
            for (int r = 0; r < R; r++) {
                const __m256 x = _mm256_broadcast_ss(w + r * BLOCK + j);
                s[r][0] = _mm256_fmadd_ps(x, a, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(x, b, s[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(acc + r * d + i, s[r][0]);
            _mm256_storeu_ps(acc + r * d + i + 8, s[r][1]);
        }
    }
}

/* e^x over a block's weights (x <= 0 here). */
__attribute__((target("avx2,fma"))) static void exp_block_avx2(float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) x[i] = expf(x[i]);
}
#endif

/* Folds a block's scores wr[0..n) of one query row into its running maximum and total:
 * wr becomes the block's weights e^(score - max), and the factor the row's earlier sums
 * must be rescaled by is returned (0 on the first block, where top = -inf). */
static float fold(float *wr, int n, int fast, float *top, float *total) {
    float best = *top;
    for (int j = 0; j < n; j++) best = wr[j] > best ? wr[j] : best;
    for (int j = 0; j < n; j++) wr[j] -= best;
#if defined(__x86_64__)
    if (fast)
        exp_block_avx2(wr, n);
    else
#endif
        for (int j = 0; j < n; j++) wr[j] = expf(wr[j]);
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += wr[j];
    const float fade = expf(*top - best);
    *total = *total * fade + sum, *top = best;
    return fade;
}

/* One task: positions [p0, p1) of KV head (batch, head) against its `rows` query rows
 * (scaled, in the vectors' order), leaving the running maxima, sums and weighted value
 * sums in top, total and acc. Portable C: what CPUs without AVX2 (and the tests'
 * LMSP_PORTABLE build) run. */
static void attend(const float *q, const Rows *keys, const Rows *values, int64_t batch, int64_t head, int64_t p0,
                   int64_t p1, int64_t rows, int64_t d, int bits, int group, float *top, float *total, float *acc,
                   float *scratch) {
    float *k = scratch, *v = scratch + BLOCK * d, *w = v + d; /* w: rows x BLOCK weights */
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
    memset(acc, 0, sizeof(float) * rows * d);
    for (int64_t start = p0; start < p1; start += BLOCK) {
        const int n = (int)(p1 - start < BLOCK ? p1 - start : BLOCK);
        for (int j = 0; j < n; j++) decode_row(keys, batch, head, start + j, d, bits, group, k + j * d);
        for (int64_t r = 0; r < rows; r++) {
            float *wr = w + r * BLOCK;
            for (int j = 0; j < n; j++) wr[j] = dot(q + r * d, k + j * d, d);
            const float fade = fold(wr, n, 0, top + r, total + r);
            if (fade != 1.0f)
                for (int64_t i = 0; i < d; i++) acc[r * d + i] *= fade;
        }
        for (int j = 0; j < n; j++) {
            decode_row(values, batch, head, start + j, d, bits, group, v);
            for (int64_t r = 0; r < rows; r++) axpy(acc + r * d, w[r * BLOCK + j], v, d);
        }
    }
}

#if defined(__x86_64__)
/* attend() with AVX2 (2, 4 and 8 bits, rows in chunk order): a block's keys are decoded
 * into the scratch, scored against the query rows two at a time, then its values decoded
 * into the same space and weighed into the sums four rows at a time. The scratch (BLOCK
 * rows of d floats, 16 KB at d = 128) stays in L1. */
__attribute__((target("avx2,fma"))) static void attend_avx2(const float *q, const Rows *keys, const Rows *values,
                                                            int64_t batch, int64_t head, int64_t p0, int64_t p1,
                                                            int64_t rows, int64_t d, int bits, int group,
                                                            float *top, float *total, float *acc, float *scratch) {
    float *kv = scratch, *w = scratch + BLOCK * d, *fade = w + rows * BLOCK;
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
    memset(acc, 0, sizeof(float) * rows * d);
    for (int64_t start = p0; start < p1; start += BLOCK) {
        const int n = (int)(p1 - start < BLOCK ? p1 - start : BLOCK), n4 = (n + 3) & ~3;
        for (int j = 0; j < n; j++) decode_row_avx2(keys, batch, head, start + j, d, bits, group, kv + j * d);
        memset(kv + n * d, 0, sizeof(float) * (n4 - n) * d);
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) scores_avx2(q + r * d, kv, w + r * BLOCK, 2, n4, d);
        if (r < rows) scores_avx2(q + r * d, kv, w + r * BLOCK, 1, n4, d);
        for (r = 0; r < rows; r++) fade[r] = fold(w + r * BLOCK, n, 1, top + r, total + r);
        for (int j = 0; j < n; j++) decode_row_avx2(values, batch, head, start + j, d, bits, group, kv + j * d);
        for (r = 0; r + 4 <= rows; r += 4) weigh_avx2(w + r * BLOCK, kv, fade + r, acc + r * d, 4, n, d);
        switch (rows - r) { /* constant R, so each case compiles to its own unrolled loop */
        case 3: weigh_avx2(w + r * BLOCK, kv, fade + r, acc + r * d, 3, n, d); break;
        case 2: weigh_avx2(w + r * BLOCK, kv, fade + r, acc + r * d, 2, n, d); break;
        case 1: weigh_avx2(w + r * BLOCK, kv, fade + r, acc + r * d, 1, n, d); break;
        }
    }
}
#endif

int lmsp_attention_fast(int bits) {
#if defined(__x86_64__)
    return has_avx2() && (bits == 2 || bits == 4 || bits == 8);
#else
    (void)bits;
    return 0;
#endif
}

void lmsp_attention_queries(int fast, const float *q, float *qs, int64_t count, int64_t d, int bits, float scale) {
    for (int64_t i = 0; i < count; i++) {
        float *row = qs + i * d;
        if (fast)
            to_chunk_order(q + i * d, row, d, bits);
        else
            memcpy(row, q + i * d, sizeof(float) * d);
        for (int64_t e = 0; e < d; e++) row[e] *= scale;
    }
}

/* the decoded rows (BLOCK of them, or BLOCK keys and one value row), the weights (rows x
 * BLOCK) and, for attend_avx2, the rows' fades */
int64_t lmsp_attention_scratch(int64_t rows, int64_t d) { return BLOCK * d + d + rows * BLOCK + rows; }

void lmsp_attention_split(int fast, const float *qs, const lmsp_rows *keys, const lmsp_rows *values, int64_t batch,
                          int64_t head, int64_t p0, int64_t p1, int64_t rows, int64_t d, int bits, int group,
                          float *top, float *total, float *acc, float *scratch) {
#if defined(__x86_64__)
    if (fast) {
        attend_avx2(qs, keys, values, batch, head, p0, p1, rows, d, bits, group, top, total, acc, scratch);
        return;
    }
#endif
    attend(qs, keys, values, batch, head, p0, p1, rows, d, bits, group, top, total, acc, scratch);
}

void lmsp_attention_merge(int fast, const float *tops, const float *totals, const float *accs, int64_t splits,
                          int64_t rows, int64_t d, int bits, float *out, float *row) {
    /* each row's splits rescaled to its overall maximum */
    for (int64_t r = 0; r < rows; r++) {
        float best = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < splits; s++) best = fmaxf(best, tops[s * rows + r]);
        memset(row, 0, sizeof(float) * d);
        for (int64_t s = 0; s < splits; s++) {
            const int64_t at = s * rows + r;
            const float f = expf(tops[at] - best);
            total += f * totals[at];
            for (int64_t e = 0; e < d; e++) row[e] += f * accs[at * d + e];
        }
        for (int64_t e = 0; e < d; e++) row[e] /= total;
        if (fast)
            from_chunk_order(row, out + r * d, d, bits);
        else
            memcpy(out + r * d, row, sizeof(float) * d);
    }
}

/* out (batch, heads, rows, d) = softmax(q k^T * scale) v for each KV head's `rows` query
 * rows q (batch, heads, rows, d), contiguous. `strides` holds 18 element strides: (batch,
 * head, row) for kw, ks, kb, vw, vs, vb. Batch row b attends positions first[b]..n-1 (its
 * left padding is skipped: a batch of sequences of different lengths); first NULL: all n.
 * `parallel`: across the cores (OpenMP), else on the calling thread (kernels/cpu.py
 * decides). Returns 0, -1 for a shape it does not take, -2 when out of memory. */
int lmsp_decode_attention(const float *q, int64_t batch, int64_t heads, int64_t rows, int64_t d, int64_t n,
                          const uint32_t *kw, const float *ks, const float *kb, const uint32_t *vw, const float *vs,
                          const float *vb, const int64_t *strides, const int32_t *first, int bits, int group,
                          float scale, int parallel, float *out) {
    if (d % 32 || group % 32 || d % group || bits < 1 || bits > 8 || n < 1 || rows < 1) return -1;
    for (int64_t b = 0; first && b < batch; b++)
        if (first[b] < 0 || first[b] >= n) return -1; /* a row with nothing to attend */
    Rows keys = {kw, ks, kb, {0}, {0}, {0}}, values = {vw, vs, vb, {0}, {0}, {0}};
    for (int i = 0; i < 3; i++) {
        keys.ws[i] = strides[i], keys.ss[i] = strides[3 + i], keys.bs[i] = strides[6 + i];
        values.ws[i] = strides[9 + i], values.ss[i] = strides[12 + i], values.bs[i] = strides[15 + i];
    }
    const int fast = lmsp_attention_fast(bits);
    const int64_t splits = (n + SPLIT - 1) / SPLIT, tasks = batch * heads * splits;
    float *qs = malloc(sizeof(float) * batch * heads * rows * d);
    float *tops = malloc(sizeof(float) * tasks * rows), *totals = malloc(sizeof(float) * tasks * rows);
    float *accs = malloc(sizeof(float) * tasks * rows * d), *row = malloc(sizeof(float) * d);
    int failed = qs == NULL || tops == NULL || totals == NULL || accs == NULL || row == NULL;
    if (!failed) {
        lmsp_attention_queries(fast, q, qs, batch * heads * rows, d, bits, scale);
#pragma omp parallel reduction(| : failed) if (parallel)
        {
            float *scratch = malloc(sizeof(float) * lmsp_attention_scratch(rows, d));
            if (scratch == NULL) failed = 1;
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < tasks; t++) {
                if (scratch == NULL) continue;
                const int64_t bh = t / splits, s0 = t % splits * SPLIT, p1 = s0 + SPLIT < n ? s0 + SPLIT : n;
                const int64_t from = first ? first[bh / heads] : 0, p0 = s0 > from ? s0 : from;
                if (p0 >= p1) { /* a split wholly inside the row's padding: an empty state */
                    for (int64_t r = 0; r < rows; r++) tops[t * rows + r] = -INFINITY, totals[t * rows + r] = 0.0f;
                    memset(accs + t * rows * d, 0, sizeof(float) * rows * d);
                    continue;
                }
                lmsp_attention_split(fast, qs + bh * rows * d, &keys, &values, bh / heads, bh % heads, p0, p1, rows,
                                     d, bits, group, tops + t * rows, totals + t * rows, accs + t * rows * d, scratch);
            }
            free(scratch);
        }
    }
    for (int64_t bh = 0; !failed && bh < batch * heads; bh++)
        lmsp_attention_merge(fast, tops + bh * splits * rows, totals + bh * splits * rows,
                             accs + bh * splits * rows * d, splits, rows, d, bits, out + bh * rows * d, row);
    free(qs), free(tops), free(totals), free(accs), free(row);
    return failed ? -2 : 0;
}
