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

#include "simd.h"

#define SPLIT 512 /* positions a task takes: 32 tasks per KV head at 16K, plenty for the cores */
#define BLOCK 32  /* positions scored together: the running state is rescaled once per block */

typedef struct {
    const uint32_t *w;
    const float *s, *b;
    int64_t ws[3], ss[3], bs[3]; /* (batch, head, row) strides in elements */
} Rows;

/* Row p of head (batch, head) decoded to floats, in code order. */
static void decode_row(const Rows *r, int64_t batch, int64_t head, int64_t p, int64_t d, int bits, int group,
                       float *out) {
    const uint32_t *w = r->w + batch * r->ws[0] + head * r->ws[1] + p * r->ws[2];
    const float *s = r->s + batch * r->ss[0] + head * r->ss[1] + p * r->ss[2];
    const float *b = r->b + batch * r->bs[0] + head * r->bs[1] + p * r->bs[2];
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t i = 0; i < d; i++) {
        const int64_t off = i * bits, word = off >> 5;
        const int shift = off & 31;
        uint32_t v = w[word] >> shift;
        if (shift + bits > 32) v |= w[word + 1] << (32 - shift);
        out[i] = s[i / group] * (float)(v & mask) + b[i / group];
    }
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

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return hsum8(_mm256_add_ps(s0, s1));
}

__attribute__((target("avx2,fma"))) static void axpy_avx2(float *y, float a, const float *x, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

/* e^x over a block's weights (x <= 0 here). */
__attribute__((target("avx2,fma"))) static void exp_block_avx2(float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) x[i] = expf(x[i]);
}
#endif

/* One task: positions [p0, p1) of KV head (batch, head) against its `rows` query rows
 * (scaled, in the vectors' order), leaving the running maxima, sums and weighted value
 * sums in top, total and acc. */
static void attend(int fast, const float *q, const Rows *keys, const Rows *values, int64_t batch, int64_t head,
                   int64_t p0, int64_t p1, int64_t rows, int64_t d, int bits, int group, float *top, float *total,
                   float *acc, float *scratch) {
    float *k = scratch, *v = scratch + BLOCK * d, *w = v + d; /* w: rows x BLOCK weights */
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
    memset(acc, 0, sizeof(float) * rows * d);
    for (int64_t start = p0; start < p1; start += BLOCK) {
        const int n = (int)(p1 - start < BLOCK ? p1 - start : BLOCK);
        for (int j = 0; j < n; j++) {
#if defined(__x86_64__)
            if (fast) {
                decode_row_avx2(keys, batch, head, start + j, d, bits, group, k + j * d);
                continue;
            }
#endif
            decode_row(keys, batch, head, start + j, d, bits, group, k + j * d);
        }
        for (int64_t r = 0; r < rows; r++) {
            float *wr = w + r * BLOCK, best = top[r];
            for (int j = 0; j < n; j++) {
#if defined(__x86_64__)
                wr[j] = fast ? dot_avx2(q + r * d, k + j * d, d) : dot(q + r * d, k + j * d, d);
#else
                wr[j] = dot(q + r * d, k + j * d, d);
#endif
                best = wr[j] > best ? wr[j] : best;
            }
            const float fade = expf(top[r] - best); /* 0 on the first block (top = -inf) */
            for (int j = 0; j < n; j++) wr[j] -= best;
#if defined(__x86_64__)
            if (fast)
                exp_block_avx2(wr, n);
            else
#endif
                for (int j = 0; j < n; j++) wr[j] = expf(wr[j]);
            float sum = 0.0f;
            for (int j = 0; j < n; j++) sum += wr[j];
            total[r] = total[r] * fade + sum;
            if (fade != 1.0f)
                for (int64_t i = 0; i < d; i++) acc[r * d + i] *= fade;
            top[r] = best;
        }
        for (int j = 0; j < n; j++) {
#if defined(__x86_64__)
            if (fast) {
                decode_row_avx2(values, batch, head, start + j, d, bits, group, v);
                for (int64_t r = 0; r < rows; r++) axpy_avx2(acc + r * d, w[r * BLOCK + j], v, d);
                continue;
            }
#endif
            decode_row(values, batch, head, start + j, d, bits, group, v);
            for (int64_t r = 0; r < rows; r++) axpy(acc + r * d, w[r * BLOCK + j], v, d);
        }
    }
}

/* out (batch, heads, rows, d) = softmax(q k^T * scale) v for each KV head's `rows` query
 * rows q (batch, heads, rows, d), contiguous. `strides` holds 18 element strides: (batch,
 * head, row) for kw, ks, kb, vw, vs, vb. `parallel`: across the cores (OpenMP), else on the
 * calling thread (kernels/cpu.py decides). Returns 0, or -1 for a shape it does not take. */
int lmsp_decode_attention(const float *q, int64_t batch, int64_t heads, int64_t rows, int64_t d, int64_t n,
                          const uint32_t *kw, const float *ks, const float *kb, const uint32_t *vw, const float *vs,
                          const float *vb, const int64_t *strides, int bits, int group, float scale, int parallel,
                          float *out) {
    if (d % 32 || group % 32 || d % group || bits < 1 || bits > 8 || n < 1 || rows < 1) return -1;
    Rows keys = {kw, ks, kb, {0}, {0}, {0}}, values = {vw, vs, vb, {0}, {0}, {0}};
    for (int i = 0; i < 3; i++) {
        keys.ws[i] = strides[i], keys.ss[i] = strides[3 + i], keys.bs[i] = strides[6 + i];
        values.ws[i] = strides[9 + i], values.ss[i] = strides[12 + i], values.bs[i] = strides[15 + i];
    }
    int fast = 0;
#if defined(__x86_64__)
    fast = has_avx2() && (bits == 2 || bits == 4 || bits == 8);
#endif
    const int64_t splits = (n + SPLIT - 1) / SPLIT, tasks = batch * heads * splits;
    float *qs = malloc(sizeof(float) * batch * heads * rows * d);
    float *tops = malloc(sizeof(float) * tasks * rows), *totals = malloc(sizeof(float) * tasks * rows);
    float *accs = malloc(sizeof(float) * tasks * rows * d);
    int failed = qs == NULL || tops == NULL || totals == NULL || accs == NULL;
    if (!failed) {
        /* The query rows, scaled, in the order the decoded rows come in. */
        for (int64_t i = 0; i < batch * heads * rows; i++) {
            float *row = qs + i * d;
            if (fast)
                to_chunk_order(q + i * d, row, d, bits);
            else
                memcpy(row, q + i * d, sizeof(float) * d);
            for (int64_t e = 0; e < d; e++) row[e] *= scale;
        }
#pragma omp parallel reduction(| : failed) if (parallel)
        {
            float *scratch = malloc(sizeof(float) * (BLOCK * d + d + rows * BLOCK));
            if (scratch == NULL) failed = 1;
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < tasks; t++) {
                if (scratch == NULL) continue;
                const int64_t bh = t / splits, split = t % splits, p0 = split * SPLIT;
                attend(fast, qs + bh * rows * d, &keys, &values, bh / heads, bh % heads, p0,
                       p0 + SPLIT < n ? p0 + SPLIT : n, rows, d, bits, group, tops + t * rows, totals + t * rows,
                       accs + t * rows * d, scratch);
            }
            free(scratch);
        }
    }
    if (!failed) {
        /* The splits' states merged per query row, rescaled to the row's overall maximum. */
        float *row = malloc(sizeof(float) * d);
        failed = row == NULL;
        for (int64_t bh = 0; !failed && bh < batch * heads; bh++)
            for (int64_t r = 0; r < rows; r++) {
                float best = -INFINITY, total = 0.0f;
                for (int64_t s = 0; s < splits; s++) best = fmaxf(best, tops[(bh * splits + s) * rows + r]);
                memset(row, 0, sizeof(float) * d);
                for (int64_t s = 0; s < splits; s++) {
                    const int64_t at = (bh * splits + s) * rows + r;
                    const float f = expf(tops[at] - best);
                    total += f * totals[at];
                    for (int64_t e = 0; e < d; e++) row[e] += f * accs[at * d + e];
                }
                for (int64_t e = 0; e < d; e++) row[e] /= total;
                float *o = out + (bh * rows + r) * d;
                if (fast)
                    from_chunk_order(row, o, d, bits);
                else
                    memcpy(o, row, sizeof(float) * d);
            }
        free(row);
    }
    free(qs), free(tops), free(totals), free(accs);
    return failed ? -2 : 0;
}
