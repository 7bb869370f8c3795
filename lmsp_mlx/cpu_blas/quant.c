/*
 * The QuantizedKVCache row format's writer and reader for the compiled passes (quant.h).
 * Built into both extensions: decode.c (its decode step) and forward.c (prefill) use it.
 */
#include <math.h>
#include <string.h>

#include "quant.h"
#include "simd.h"

void lmsp_quantize_row(const float *x, int64_t d, int bits, int group, uint32_t *w, float *s, float *b) {
    /* MLX's CPU quantize, step for step (divisions, not reciprocals; rintf under the default
     * rounding mode), so a row written here reads back as the same bits a QuantizedKVCache
     * update would have stored: checkpoints and greedy tokens do not depend on which path
     * wrote the cache. */
    const float bins = (float)((1 << bits) - 1);
    uint64_t acc = 0;
    int have = 0;
    for (int64_t g = 0; g < d / group; g++) {
        const float *xs = x + g * group;
        float lo = INFINITY, hi = -INFINITY;
        for (int j = 0; j < group; j++) hi = fmaxf(hi, xs[j]), lo = fminf(lo, xs[j]);
        const int low_edge = fabsf(lo) > fabsf(hi);
        float scale = fmaxf((hi - lo) / bins, 1e-7f);
        scale = low_edge ? scale : -scale;
        const float edge = low_edge ? lo : hi, q0 = rintf(edge / scale);
        float bias = 0.0f;
        if (q0 != 0.0f) scale = edge / q0, bias = edge;
        s[g] = scale, b[g] = bias;
        for (int j = 0; j < group; j++) {
            const float v = fminf(fmaxf(rintf((xs[j] - bias) / scale), 0.0f), bins);
            acc |= (uint64_t)v << have; /* one little-endian bit stream, as the kernels read it */
            if ((have += bits) >= 32) *w++ = (uint32_t)acc, acc >>= 32, have -= 32;
        }
    }
}

#if defined(__x86_64__)
/* lmsp_dequantize_rows for 4 and 8 bits, 32 codes at a time in their own order: the
 * compiled prefill dequantizes a layer's whole cache per chunk, and the scalar bit reader
 * made a 4-bit prefill 12-17% slower than a float cache's at 2K-8K tokens. */
__attribute__((target("avx2,fma"))) static void dequantize_avx2(const uint8_t *w, const float *s, const float *b,
                                                                int64_t rows, int64_t d, int bits, int group,
                                                                float *out) {
    const int64_t bytes = d * bits / 8, groups = d / group;
    for (int64_t r = 0; r < rows; r++, w += bytes, s += groups, b += groups, out += d)
        for (int64_t c = 0; c < d / 32; c++) {
            const __m256 scale = _mm256_set1_ps(s[c * 32 / group]), bias = _mm256_set1_ps(b[c * 32 / group]);
            __m128i part[4];
            if (bits == 4) { /* byte i holds codes 2i (low nibble) and 2i + 1: interleave back */
                const __m128i v = _mm_loadu_si128((const __m128i *)(w + c * 16)), m = _mm_set1_epi8(15);
                const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
                const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
                part[0] = first, part[1] = _mm_srli_si128(first, 8), part[2] = second, part[3] = _mm_srli_si128(second, 8);
            } else
                for (int k = 0; k < 4; k++) part[k] = _mm_loadl_epi64((const __m128i *)(w + c * 32 + 8 * k));
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(out + c * 32 + 8 * k, _mm256_fmadd_ps(widen8(part[k]), scale, bias));
        }
}
#endif

void lmsp_dequantize_rows(const uint32_t *w, const float *s, const float *b, int64_t rows, int64_t d, int bits,
                          int group, float *out) {
#if defined(__x86_64__)
    if (has_avx2() && (bits == 4 || bits == 8) && d % 32 == 0 && group % 32 == 0) {
        dequantize_avx2((const uint8_t *)w, s, b, rows, d, bits, group, out);
        return;
    }
#endif
    const int64_t words = d * bits / 32, groups = d / group;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t r = 0; r < rows; r++, w += words, s += groups, b += groups, out += d) {
        uint64_t acc = 0;
        int have = 0;
        const uint32_t *word = w;
        for (int64_t i = 0; i < d; i++) {
            if (have < bits) acc |= (uint64_t)*word++ << have, have += 32;
            out[i] = s[i / group] * (float)(uint32_t)(acc & mask) + b[i / group];
            acc >>= bits, have -= bits;
        }
    }
}

void lmsp_store_cache(const lmsp_model *m, const lmsp_cache *c, int64_t cap, const float *k, const float *v,
                      int64_t pos) {
    const int64_t hd = m->head_dim;
    for (int64_t j = 0; j < m->n_kv_heads; j++) {
        const int64_t row = j * cap + pos;
        if (!m->kv_bits) {
            memcpy(c->keys + row * hd, k + j * hd, (size_t)hd * sizeof(float));
            memcpy(c->values + row * hd, v + j * hd, (size_t)hd * sizeof(float));
            continue;
        }
        const int64_t words = hd * m->kv_bits / 32, groups = hd / m->kv_group;
        lmsp_quantize_row(k + j * hd, hd, m->kv_bits, m->kv_group, c->key_codes + row * words,
                          c->key_scales + row * groups, c->key_biases + row * groups);
        lmsp_quantize_row(v + j * hd, hd, m->kv_bits, m->kv_group, c->value_codes + row * words,
                          c->value_scales + row * groups, c->value_biases + row * groups);
    }
}

void lmsp_store_kv(const lmsp_model *m, const lmsp_layer *ly, const float *k, const float *v, int64_t pos) {
    const lmsp_cache c = {ly->keys, ly->values, ly->key_codes, ly->value_codes,
                          ly->key_scales, ly->key_biases, ly->value_scales, ly->value_biases};
    lmsp_store_cache(m, &c, m->capacity, k, v, pos);
}
