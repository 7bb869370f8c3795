/*
 * A prompt chunk through every layer of a llama-family float32 model, for MLX's Linux CPU build.
 *
 * Why: through MLX, a 512-token prefill of SmolLM2 spent about 30% of its time outside the
 * matmuls and the attention kernel: each RMSNorm, residual add, transpose and RoPE is a
 * separate single-core pass with its own dispatch, and q/k/v cross between MLX and numpy
 * for the fused kernels. Here a chunk is one call. The matmuls are OpenBLAS sgemms on
 * MLX's weight buffers, with the residual adds riding on them (beta = 1). RoPE writes the
 * queries straight into the layout the attention kernel takes and the keys straight into
 * the cache. Attention and SwiGLU are prefill.c's. What is left is a few cache-sized passes
 * on the calling thread, while OpenBLAS's worker waits on the other core.
 *
 * A quantized cache (--kv-bits): the chunk's K/V rows are quantized into it as mlx-lm's
 * update would, and the chunk attends over the whole cache dequantized, new rows included,
 * which is what mlx-lm's quantized attention reads. One KV head is dequantized at a time,
 * so the buffer is one head's K and V (34 MB at 32K positions of 128), not the layer's
 * (268 MB with 8 KV heads): a quantized cache is there to save memory.
 */
#include <stdlib.h>
#include <string.h>

#include "blas.h"
#include "model.h"
#include "quant.h"

/* y (n x out) = x (n x in) W^T, plus y when `add`: W is (out, in) row-major, as nn.Linear's. */
static void linear(const float *x, const float *w, float *y, int64_t n, int64_t in, int64_t out, int add) {
    lmsp_blas_sgemm(RowMajor, NoTrans, Trans, n, out, in, 1.0f, x, in, w, in, add ? 1.0f : 0.0f, y, out);
}

/* Floats of scratch lmsp_prefill needs for a chunk of n tokens. */
int64_t lmsp_prefill_scratch(const lmsp_model *m, int64_t n) {
    int64_t qdim = (int64_t)m->n_heads * m->head_dim, kvdim = (int64_t)m->n_kv_heads * m->head_dim;
    return n * (2 * (int64_t)m->dim + 3 * qdim + 2 * kvdim + 2 * (int64_t)m->hidden);
}

/* KV head j's rows 0..total-1 of a quantized cache as floats, (total, head_dim). */
static void dequantize_head(const lmsp_model *m, const uint32_t *w, const float *s, const float *b, int64_t j,
                            int64_t total, float *out) {
    const int64_t hd = m->head_dim, words = hd * m->kv_bits / 32, groups = hd / m->kv_group, cap = m->capacity;
    lmsp_dequantize_rows(w + j * cap * words, s + j * cap * groups, b + j * cap * groups, total, hd, m->kv_bits,
                         m->kv_group, out);
}

/*
 * Runs tokens[0..n) at positions pos..pos+n-1. Their K/V are written into each layer's
 * cache at those positions (the caller has made room; rows 0..pos-1 hold the context),
 * and `out` (n x dim) receives the final normalized hidden states, what the model body
 * returns. cos, sin: (n, rope_dims / 2). Returns 0, or 1 when out of memory.
 */
int lmsp_prefill(const lmsp_model *m, const int32_t *tokens, int64_t n, int64_t pos, const float *cos,
                 const float *sin, float *out, float *scratch) {
    const int64_t dim = m->dim, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv_heads, hidden = m->hidden;
    const int64_t group = nh / nkv, cap = m->capacity, half = m->rope_dims / 2;
    const int64_t qdim = nh * hd, kvdim = nkv * hd;
    float *x = scratch, *h = x + n * dim, *q = h + n * dim, *k = q + n * qdim, *v = k + n * kvdim;
    float *qg = v + n * kvdim, *att = qg + n * qdim, *gate = att + n * qdim, *up = gate + n * hidden;
    /* a quantized cache's rows 0..pos+n-1 of one KV head, dequantized (kf, vf) */
    float *kf = NULL, *vf = NULL;
    if (m->kv_bits) {
        kf = malloc(sizeof(float) * 2 * (pos + n) * hd);
        if (kf == NULL) return 1;
        vf = kf + (pos + n) * hd;
    }
    int failed = 0;
    for (int64_t t = 0; t < n; t++) memcpy(x + t * dim, m->embed + (int64_t)tokens[t] * dim, dim * sizeof(float));
    for (int32_t l = 0; !failed && l < m->n_layers; l++) {
        const lmsp_layer *ly = &m->layers[l];
        for (int64_t t = 0; t < n; t++) rms_norm(x + t * dim, ly->attn_norm, h + t * dim, dim, m->eps);
        linear(h, ly->wq, q, n, dim, qdim, 0);
        linear(h, ly->wk, k, n, dim, kvdim, 0);
        linear(h, ly->wv, v, n, dim, kvdim, 0);
        /* Query head j reads KV head j / group (MLX's grouping). qg is (nkv, n, group, hd):
           each KV head's group position-major, so one sgemm in the kernel covers the group. */
        for (int64_t t = 0; t < n; t++) {
            const float *c = cos + t * half, *s = sin + t * half;
            float *qt = q + t * qdim, *kt = k + t * kvdim, *vt = v + t * kvdim;
            add_bias(qt, ly->bq, qdim);
            add_bias(kt, ly->bk, kvdim);
            add_bias(vt, ly->bv, kvdim);
            for (int64_t j = 0; j < nh; j++) {
                rope_head(qt + j * hd, m->rope_dims, c, s);
                memcpy(qg + (((j / group) * n + t) * group + j % group) * hd, qt + j * hd, hd * sizeof(float));
            }
            for (int64_t j = 0; j < nkv; j++) rope_head(kt + j * hd, m->rope_dims, c, s);
            lmsp_store_kv(m, ly, kt, vt, pos + t);
        }
        for (int64_t j = 0; !failed && j < nkv; j++) {
            const float *keys = kf, *values = vf;
            if (m->kv_bits) {
                dequantize_head(m, ly->key_codes, ly->key_scales, ly->key_biases, j, pos + n, kf);
                dequantize_head(m, ly->value_codes, ly->value_scales, ly->value_biases, j, pos + n, vf);
            } else
                keys = ly->keys + j * cap * hd, values = ly->values + j * cap * hd;
            failed = lmsp_causal_attention(qg + j * n * group * hd, keys, values, att + j * n * group * hd, n, group,
                                           pos + n, hd, m->scale) != 0;
        }
        if (failed) break;
        /* Back to (n, nh * hd) for the output projection, reusing q. */
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = 0; j < nkv; j++)
                memcpy(q + t * qdim + j * group * hd, att + (j * n + t) * group * hd, group * hd * sizeof(float));
        linear(q, ly->wo, x, n, qdim, dim, 1);
        for (int64_t t = 0; t < n; t++) rms_norm(x + t * dim, ly->mlp_norm, h + t * dim, dim, m->eps);
        linear(h, ly->wgate, gate, n, dim, hidden, 0);
        linear(h, ly->wup, up, n, dim, hidden, 0);
        lmsp_swiglu(gate, up, gate, n * hidden);
        linear(gate, ly->wdown, x, n, hidden, dim, 1);
    }
    free(kf);
    if (failed) return 1;
    for (int64_t t = 0; t < n; t++) rms_norm(x + t * dim, m->final_norm, out + t * dim, dim, m->eps);
    return 0;
}
