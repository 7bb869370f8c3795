/*
 * A llama-family float32 model as the compiled passes see it (decode.c, forward.c):
 * pointers into MLX's own weight arrays and into the layers' KV cache buffers.
 * engine/cpu_decode.py fills it (ctypes mirror: _Layer, _Model).
 *
 * A layer's cache is (n_kv_heads, capacity, head_dim), contiguous: mlx-lm's KVCache
 * buffer for batch 1. Or, where kv_bits is set, mlx-lm's QuantizedKVCache
 * buffers: codes (n_kv_heads, capacity, head_dim * kv_bits / 32) uint32, scales and biases
 * (n_kv_heads, capacity, head_dim / kv_group) float32. RoPE is the non-traditional
 * (half-split) form over rope_dims.
 */
#ifndef LMSP_MODEL_H
#define LMSP_MODEL_H

#include <math.h>
#include <stdint.h>

typedef struct {
    const float *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *wgate, *wup, *wdown;
    const float *bq, *bk, *bv; /* NULL where the model has no bias (llama); Qwen2 has these */
    float *keys, *values;
    uint32_t *key_codes, *value_codes; /* a quantized cache (kv_bits > 0) */
    float *key_scales, *key_biases, *value_scales, *value_biases;
} lmsp_layer;

/* One sequence's cache of one layer in the batched step (lmsp_decode_batch): a plain one's
 * K and V buffers, or a quantized one's parts (the model's kv_bits > 0), each with room
 * for the sequence's capacity positions. */
typedef struct {
    float *keys, *values;
    uint32_t *key_codes, *value_codes;
    float *key_scales, *key_biases, *value_scales, *value_biases;
} lmsp_cache;

typedef struct {
    int32_t n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab, capacity, rope_dims;
    float eps, scale;
    const float *embed, *final_norm, *head;
    lmsp_layer *layers;
    int32_t kv_bits, kv_group; /* 0, 0: a plain float cache */
} lmsp_model;

static inline void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* Rotates one head's vector in place; cos, sin hold rope_dims / 2 values for its position. */
static inline void rope_head(float *x, int64_t dims, const float *cos, const float *sin) {
    int64_t half = dims / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

static inline void add_bias(float *y, const float *b, int64_t n) {
    if (b)
        for (int64_t i = 0; i < n; i++) y[i] += b[i];
}

#endif
