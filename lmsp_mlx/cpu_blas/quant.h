/*
 * mlx-lm's QuantizedKVCache rows, written and read by the compiled passes (decode.c,
 * forward.c): a row of d values is d * bits / 32 uint32 words, one little-endian bit
 * stream of its codes, and d / group float32 scales and biases; value = scale * code + bias.
 */
#ifndef LMSP_QUANT_H
#define LMSP_QUANT_H

#include <stdint.h>

#include "model.h"

/* x (d floats) quantized as mx.quantize does it (affine, groups of `group`, round half to
 * even, the group's edge value kept exact): the row a QuantizedKVCache update would store. */
void lmsp_quantize_row(const float *x, int64_t d, int bits, int group, uint32_t *w, float *s, float *b);

/* `rows` consecutive rows (codes, scales and biases contiguous, as a cache head's) back to
 * floats, out (rows x d): what mx.dequantize gives. */
void lmsp_dequantize_rows(const uint32_t *w, const float *s, const float *b, int64_t rows, int64_t d, int bits,
                          int group, float *out);

/* One position's K and V (n_kv_heads x head_dim each) into a cache of `cap` positions at
 * `pos`: copied into a plain cache, quantized into a quantized one (m->kv_bits). */
void lmsp_store_cache(const lmsp_model *m, const lmsp_cache *c, int64_t cap, const float *k, const float *v,
                      int64_t pos);

/* The same into the layer's own cache (m->capacity positions). */
void lmsp_store_kv(const lmsp_model *m, const lmsp_layer *ly, const float *k, const float *v, int64_t pos);

#endif
