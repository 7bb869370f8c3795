/*
 * The MoE expert MLP over affine-quantized weights, for MLX's Linux CPU build: the CPU
 * counterpart of kernels/expert_swiglu.metal (same chunk arithmetic, same layout).
 *
 * Why: through MLX a decode step's 8 chosen experts cost about 30 ms per layer at 30B-A3B
 * shapes in float32 on 2 cores (gather_qmm; dequantizing them first, 0.4 s), where their
 * 19 MB of 4-bit codes take about a millisecond to read. Here each weight row is
 * read once, 32 codes at a time (BITS whole words under one scale and bias), and never
 * dequantized to memory: a chunk's dot product with x is scale * sum(code * x) + bias *
 * sum(x), with the sums of x per chunk computed once. Rows are split across the cores
 * (OpenMP), first gate and up (writing silu(gate) * up), then down.
 *
 * Layout (mlx-lm's QuantizedSwitchLinear): weights (E, out, in * bits / 32) uint32, one
 * little-endian bit stream per row; scales and biases (E, out, in / group) float32 (the
 * CPU loader makes every floating parameter float32). in and out are multiples of 32 and
 * group a multiple of 32, so a chunk never crosses a group.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* Two speeds of AVX2. For 2, 4 and 8 bits, hand-written (row_dot_avx2, picked at run time
 * by has_avx2(), simd.h): 30B-A3B layer, 2 cores, median of 7 back-to-back pairs against
 * the build before it, 4-bit 11.8 -> 2.9 ms, 2-bit 4.8x, 8-bit 3.9x faster. For the other
 * widths, an AVX2+FMA clone of the portable code beside the default one, picked at load
 * time (ifunc), where the compiler vectorizes the chunk loops itself (4-bit was 25 -> 11 ms). */
#if defined(__x86_64__) && defined(__GNUC__)
#define LMSP_CLONES __attribute__((target_clones("avx2,fma", "default")))
#else
#define LMSP_CLONES
#endif

/* sum(code_i * x_i) over one chunk of 32 codes: BITS words. */
static inline float chunk_dot(const uint32_t *w, const float *x, int bits) {
    float s = 0.0f;
    if (bits == 4) {
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 8; i++) s += (float)((w[j] >> (4 * i)) & 15u) * x[8 * j + i];
    } else if (bits == 8) {
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) s += (float)((w[j] >> (8 * i)) & 255u) * x[4 * j + i];
    } else if (bits == 2) {
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < 16; i++) s += (float)((w[j] >> (2 * i)) & 3u) * x[16 * j + i];
    } else {
        const uint32_t mask = (1u << bits) - 1u;
        for (int i = 0; i < 32; i++) {
            const int off = i * bits, word = off >> 5, shift = off & 31;
            uint32_t v = w[word] >> shift;
            if (shift + bits > 32) v |= w[word + 1] << (32 - shift);
            s += (float)(v & mask) * x[i];
        }
    }
    return s;
}

/* One quantized row against x (n values, n / 32 chunk sums in xsum). */
static inline float row_dot(const uint32_t *w, const float *scales, const float *biases, const float *x,
                            const float *xsum, int64_t n, int bits, int group) {
    float s = 0.0f;
    for (int64_t c = 0; c < n / 32; c++) {
        const int64_t g = c * 32 / group;
        s += scales[g] * chunk_dot(w + c * bits, x + c * 32, bits) + biases[g] * xsum[c];
    }
    return s;
}

#if defined(__x86_64__)
/* row_dot for 2, 4 and 8 bits, what quantized models use: a chunk's bytes widen to 8 codes
 * at a time and meet x in the order the unpack leaves them in, so x is kept per chunk in
 * that order (to_chunk_order in simd.h, once per token) and no shuffle runs per row. */
__attribute__((target("avx2,fma"))) static float row_dot_avx2(const uint32_t *w, const float *scales,
                                                              const float *biases, const float *xp,
                                                              const float *xsum, int64_t n, int bits, int group) {
    __m256 acc = _mm256_setzero_ps();
    float bias_part = 0.0f;
    for (int64_t c = 0; c < n / 32; c++) {
        const int64_t g = c * 32 / group;
        const uint8_t *p = (const uint8_t *)(w + c * bits);
        const float *xc = xp + c * 32;
        __m256 s;
        if (bits == 4) {
            const __m128i v = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            s = _mm256_mul_ps(widen8(lo), _mm256_loadu_ps(xc));
            s = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xc + 8), s);
            s = _mm256_fmadd_ps(widen8(hi), _mm256_loadu_ps(xc + 16), s);
            s = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xc + 24), s);
        } else if (bits == 2) {
            const __m128i v = _mm_loadl_epi64((const __m128i *)p), mask = _mm_set1_epi8(3);
            s = _mm256_mul_ps(widen8(_mm_and_si128(v, mask)), _mm256_loadu_ps(xc));
            s = _mm256_fmadd_ps(widen8(_mm_and_si128(_mm_srli_epi16(v, 2), mask)), _mm256_loadu_ps(xc + 8), s);
            s = _mm256_fmadd_ps(widen8(_mm_and_si128(_mm_srli_epi16(v, 4), mask)), _mm256_loadu_ps(xc + 16), s);
            s = _mm256_fmadd_ps(widen8(_mm_and_si128(_mm_srli_epi16(v, 6), mask)), _mm256_loadu_ps(xc + 24), s);
        } else {  /* 8 */
            s = _mm256_mul_ps(widen8(_mm_loadl_epi64((const __m128i *)p)), _mm256_loadu_ps(xc));
            for (int j = 1; j < 4; j++)
                s = _mm256_fmadd_ps(widen8(_mm_loadl_epi64((const __m128i *)(p + 8 * j))), _mm256_loadu_ps(xc + 8 * j), s);
        }
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(scales[g]), acc);
        bias_part += biases[g] * xsum[c];
    }
    return hsum8(acc) + bias_part;
}
#endif

static void chunk_sums(const float *x, float *sums, int64_t n) {
    for (int64_t c = 0; c < n / 32; c++) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += x[c * 32 + i];
        sums[c] = s;
    }
}

/* One row through the AVX2 path where `fast` (x in chunk order), else the portable one. */
static inline float row(int fast, const uint32_t *w, const float *scales, const float *biases, const float *x,
                        const float *xsum, int64_t n, int bits, int group) {
#if defined(__x86_64__)
    if (fast) return row_dot_avx2(w, scales, biases, x, xsum, n, bits, group);
#endif
    (void)fast;
    return row_dot(w, scales, biases, x, xsum, n, bits, group);
}

/* The pairs grouped by expert (a stable counting sort): order[] lists them expert by
 * expert, and expert run r is pairs order[at[r] .. at[r + 1] - 1] of expert run_expert[r].
 * Returns the number of runs, or -1 out of memory (the arrays are then freed). */
static int64_t group_by_expert(const uint32_t *idx, int64_t pairs, int64_t experts, int64_t **order, int64_t **at,
                               int64_t **run_expert) {
    int64_t *count = calloc((size_t)experts + 1, sizeof(int64_t));
    *order = malloc(sizeof(int64_t) * pairs), *at = malloc(sizeof(int64_t) * (pairs + 1));
    *run_expert = malloc(sizeof(int64_t) * pairs);
    if (!count || !*order || !*at || !*run_expert) {
        free(count), free(*order), free(*at), free(*run_expert);
        return -1;
    }
    for (int64_t p = 0; p < pairs; p++) count[idx[p] + 1]++;
    for (int64_t e = 0; e < experts; e++) count[e + 1] += count[e];
    int64_t runs = 0;
    for (int64_t e = 0; e < experts; e++)
        if (count[e + 1] > count[e]) (*at)[runs] = count[e], (*run_expert)[runs++] = e;
    (*at)[runs] = pairs;
    for (int64_t p = 0; p < pairs; p++) (*order)[count[idx[p]]++] = p;
    free(count);
    return runs;
}

/* For each of the tokens * k (token, expert) pairs: y[pair] = down(silu(gate x) * up x).
 * x (tokens, d); idx (tokens * k) expert ids; hidden (pairs, h) and sums (tokens * d / 32 +
 * pairs * h / 32 floats) are scratch. Pairs that share an expert share its weight reads:
 * the work goes row by row of each chosen expert (sorted by expert, as gather_qmm's
 * sorted_indices path), every pair of that expert meeting the row while it is in cache,
 * so a batch reads each chosen expert once however many of its tokens chose it. Each
 * pair's sums run in the order they do alone. `parallel`: across the cores (OpenMP), else
 * on the calling thread (kernels/cpu.py decides). Returns 0, -1 for a shape it does not
 * take, -2 out of memory. */
LMSP_CLONES int lmsp_expert_swiglu(const float *x, const uint32_t *idx, int64_t tokens, int64_t k, int64_t experts,
                       const uint32_t *gw, const float *gs, const float *gb, const uint32_t *uw, const float *us,
                       const float *ub, const uint32_t *dw, const float *ds, const float *db, int64_t d, int64_t h,
                       int bits, int group, int parallel, float *hidden, float *sums, float *y) {
    if (d % 32 || h % 32 || group % 32 || d % group || h % group || bits < 1 || bits > 8) return -1;
    const int64_t pairs = tokens * k;
    for (int64_t p = 0; p < pairs; p++)
        if (idx[p] >= (uint64_t)experts) return -1;
    if (pairs == 0) return 0;
    int64_t *order, *at, *run_expert;
    const int64_t runs = group_by_expert(idx, pairs, experts, &order, &at, &run_expert);
    if (runs < 0) return -2;
    const int64_t d_words = d * bits / 32, h_words = h * bits / 32, d_groups = d / group, h_groups = h / group;
    float *xsums = sums, *hsums = sums + tokens * (d / 32);
    for (int64_t t = 0; t < tokens; t++) chunk_sums(x + t * d, xsums + t * (d / 32), d);

    /* The AVX2 path reads x and the hidden vectors in chunk order (simd.h). */
    float *xp = NULL, *hp = NULL;
#if defined(__x86_64__)
    if (has_avx2() && (bits == 2 || bits == 4 || bits == 8)) {
        xp = malloc(sizeof(float) * tokens * d);
        hp = malloc(sizeof(float) * pairs * h);
        if (xp == NULL || hp == NULL) {
            free(xp), free(hp);
            xp = hp = NULL;
        }
    }
    if (xp != NULL)
        for (int64_t t = 0; t < tokens; t++) to_chunk_order(x + t * d, xp + t * d, d, bits);
#endif
    const int fast = xp != NULL;
    const float *xin = fast ? xp : x, *hin = fast ? hp : hidden;

#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t u = 0; u < runs * h; u++) {
        const int64_t r = u / h, row_ = run_expert[r] * h + u % h;
        for (int64_t i = at[r]; i < at[r + 1]; i++) {
            const int64_t p = order[i], t = p / k;
            const float *xt = xin + t * d, *st = xsums + t * (d / 32);
            const float g = row(fast, gw + row_ * d_words, gs + row_ * d_groups, gb + row_ * d_groups, xt, st, d,
                                bits, group);
            const float v = row(fast, uw + row_ * d_words, us + row_ * d_groups, ub + row_ * d_groups, xt, st, d,
                                bits, group);
            hidden[p * h + u % h] = g / (1.0f + expf(-g)) * v;
        }
    }
    for (int64_t p = 0; p < pairs; p++) chunk_sums(hidden + p * h, hsums + p * (h / 32), h);
#if defined(__x86_64__)
    if (fast)
        for (int64_t p = 0; p < pairs; p++) to_chunk_order(hidden + p * h, hp + p * h, h, bits);
#endif

#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t u = 0; u < runs * d; u++) {
        const int64_t r = u / d, row_ = run_expert[r] * d + u % d;
        for (int64_t i = at[r]; i < at[r + 1]; i++) {
            const int64_t p = order[i];
            y[p * d + u % d] = row(fast, dw + row_ * h_words, ds + row_ * h_groups, db + row_ * h_groups,
                                   hin + p * h, hsums + p * (h / 32), h, bits, group);
        }
    }
    free(xp), free(hp), free(order), free(at), free(run_expert);
    return 0;
}
