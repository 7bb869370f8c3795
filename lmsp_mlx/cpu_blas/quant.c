/*
 * The QuantizedKVCache row format's writer and reader for the compiled passes (quant.h).
 * Built into both extensions: decode.c (its decode step) and forward.c (prefill) use it.
 */
#include <math.h>
#include <string.h>

#include "quant.h"

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

void lmsp_dequantize_rows(const uint32_t *w, const float *s, const float *b, int64_t rows, int64_t d, int bits,
                          int group, float *out) {
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

void lmsp_store_kv(const lmsp_model *m, const lmsp_layer *ly, const float *k, const float *v, int64_t pos) {
    const int64_t hd = m->head_dim;
    for (int64_t j = 0; j < m->n_kv_heads; j++) {
        const int64_t row = j * m->capacity + pos;
        if (!m->kv_bits) {
            memcpy(ly->keys + row * hd, k + j * hd, (size_t)hd * sizeof(float));
            memcpy(ly->values + row * hd, v + j * hd, (size_t)hd * sizeof(float));
            continue;
        }
        const int64_t words = hd * m->kv_bits / 32, groups = hd / m->kv_group;
        lmsp_quantize_row(k + j * hd, hd, m->kv_bits, m->kv_group, ly->key_codes + row * words,
                          ly->key_scales + row * groups, ly->key_biases + row * groups);
        lmsp_quantize_row(v + j * hd, hd, m->kv_bits, m->kv_group, ly->value_codes + row * words,
                          ly->value_scales + row * groups, ly->value_biases + row * groups);
    }
}
