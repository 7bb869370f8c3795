/*
 * The MoE expert MLP over affine-quantized weights, for MLX's Linux CPU build: the CPU
 * counterpart of kernels/expert_swiglu.metal (same chunk arithmetic, same layout).
 *
 * Why: through MLX a decode step's 8 chosen experts cost about 0.85 s per layer at
 * 30B-A3B shapes (MLX's CPU dequantize runs at 7-15 ns a value; gather_qmm is slower still),
 * where their 19 MB of 4-bit codes take a few milliseconds to read. Here each weight row is
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

/* An AVX2+FMA build of the whole pass beside the default one, picked at load time (ifunc):
 * the compiler vectorizes the chunk loops itself there (4-bit: 25 ms -> 11 ms a 30B-A3B
 * layer here). The decode step's other kernels check for AVX2 by hand (simd.h). */
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

static void chunk_sums(const float *x, float *sums, int64_t n) {
    for (int64_t c = 0; c < n / 32; c++) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += x[c * 32 + i];
        sums[c] = s;
    }
}

/* For each of the tokens * k (token, expert) pairs: y[pair] = down(silu(gate x) * up x).
 * x (tokens, d); idx (tokens * k) expert ids; hidden (pairs, h) and sums (tokens * d / 32 +
 * pairs * h / 32 floats) are scratch. Returns 0, or -1 for a shape it does not take. */
LMSP_CLONES int lmsp_expert_swiglu(const float *x, const uint32_t *idx, int64_t tokens, int64_t k, int64_t experts,
                       const uint32_t *gw, const float *gs, const float *gb, const uint32_t *uw, const float *us,
                       const float *ub, const uint32_t *dw, const float *ds, const float *db, int64_t d, int64_t h,
                       int bits, int group, float *hidden, float *sums, float *y) {
    if (d % 32 || h % 32 || group % 32 || d % group || h % group || bits < 1 || bits > 8) return -1;
    const int64_t pairs = tokens * k;
    for (int64_t p = 0; p < pairs; p++)
        if (idx[p] >= (uint64_t)experts) return -1;
    const int64_t d_words = d * bits / 32, h_words = h * bits / 32, d_groups = d / group, h_groups = h / group;
    float *xsums = sums, *hsums = sums + tokens * (d / 32);
    for (int64_t t = 0; t < tokens; t++) chunk_sums(x + t * d, xsums + t * (d / 32), d);

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < pairs * h; r++) {
        const int64_t p = r / h, row = (int64_t)idx[p] * h + r % h, t = p / k;
        const float *xt = x + t * d, *st = xsums + t * (d / 32);
        const float g = row_dot(gw + row * d_words, gs + row * d_groups, gb + row * d_groups, xt, st, d, bits, group);
        const float u = row_dot(uw + row * d_words, us + row * d_groups, ub + row * d_groups, xt, st, d, bits, group);
        hidden[r] = g / (1.0f + expf(-g)) * u;
    }
    for (int64_t p = 0; p < pairs; p++) chunk_sums(hidden + p * h, hsums + p * (h / 32), h);

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < pairs * d; r++) {
        const int64_t p = r / d, row = (int64_t)idx[p] * d + r % d;
        y[r] = row_dot(dw + row * h_words, ds + row * h_groups, db + row * h_groups, hidden + p * h,
                       hsums + p * (h / 32), h, bits, group);
    }
    return 0;
}
