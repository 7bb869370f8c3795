/*
 * One decode step of a llama-family model in float32, for MLX's Linux CPU build.
 *
 * Why: a decode step is a chain of one-row products over the whole model (540 MB of
 * weights for SmolLM2-135M in float32) plus a few hundred tiny ops. Through MLX each op is a
 * separate dispatch (about 18 ms of a 75 ms step) and OpenBLAS threads 576-wide
 * matrix-vector products poorly (about 30 ms where the memory bound is about 22). Here the
 * whole step is one call: every layer's matrix-vector products read each weight row once
 * with AVX2 FMA, split across the cores (OpenMP), attention reads the layer's cached K and
 * V once (scores, then one AVX2 exp pass (simd.h), then the weighted sum), and the elementwise work
 * (RMSNorm, RoPE, SiLU) happens in registers between them.
 *
 * The model's weights and the KV cache are MLX's own arrays (pointers to their buffers):
 * K and V for the new position are written into the cache buffer at `pos`, as mlx-lm's
 * KVCache would; the caller then advances the cache's offset. Layout of a layer's cache:
 * (n_kv_heads, capacity, head_dim), contiguous. A --kv-bits cache (QuantizedKVCache,
 * model.h) gets the row quantized as mx.quantize would (quant.c), and its attention is
 * attention.c's, split across the team. RoPE is the non-traditional (half-split) form;
 * `cos`/`sin` hold the rotation for this position (rope_dims / 2 values).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "model.h"
#include "quant.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif


static void attend(const float *q, const float *keys, const float *values, float *scores, float *out, int64_t n,
                   int64_t d, float scale);

/* ---- dot products: 4 rows of W against x at once, so each x load serves four rows ---- */

static void rows_scalar(const float *w, const float *x, float *y, int64_t r0, int64_t r1, int64_t n, int add) {
    for (int64_t r = r0; r < r1; r++) {
        const float *row = w + r * n;
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += row[i] * x[i];
        y[r] = add ? y[r] + s : s;
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void rows_avx2(const float *w, const float *x, float *y, int64_t r0,
                                                          int64_t r1, int64_t n, int add) {
    int64_t r = r0, n8 = n & ~(int64_t)7;
    for (; r + 4 <= r1; r += 4) {
        const float *a = w + r * n, *b = a + n, *c = b + n, *d = c + n;
        __m256 sa = _mm256_setzero_ps(), sb = sa, sc = sa, sd = sa;
        for (int64_t i = 0; i < n8; i += 8) {
            /* the next four rows: the hardware prefetcher alone left 10% of the bandwidth */
            _mm_prefetch((const char *)(a + 4 * n + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + 4 * n + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(c + 4 * n + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(d + 4 * n + i), _MM_HINT_T0);
            __m256 xv = _mm256_loadu_ps(x + i);
            sa = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), xv, sa);
            sb = _mm256_fmadd_ps(_mm256_loadu_ps(b + i), xv, sb);
            sc = _mm256_fmadd_ps(_mm256_loadu_ps(c + i), xv, sc);
            sd = _mm256_fmadd_ps(_mm256_loadu_ps(d + i), xv, sd);
        }
        float out[4] = {hsum8(sa), hsum8(sb), hsum8(sc), hsum8(sd)};
        for (int64_t i = n8; i < n; i++) {
            out[0] += a[i] * x[i];
            out[1] += b[i] * x[i];
            out[2] += c[i] * x[i];
            out[3] += d[i] * x[i];
        }
        for (int k = 0; k < 4; k++) y[r + k] = add ? y[r + k] + out[k] : out[k];
    }
    rows_scalar(w, x, y, r, r1, n, add);
}

/* attend() for head_dim a multiple of 8: scores four positions at a time (independent
 * sums, so the FMA latency is hidden), and the weighted sum one pass over V in row order
 * with up to 16 column accumulators (a column-at-a-time pass re-read V eight times). */
__attribute__((target("avx2,fma"))) static void attend_avx2(const float *q, const float *keys, const float *values,
                                                            float *scores, float *out, int64_t n, int64_t d,
                                                            float scale) {
    float top = -INFINITY;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = keys + t * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < d; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            s0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), s0);
            s1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), s1);
            s2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), s2);
            s3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), s3);
        }
        float v[4] = {hsum8(s0) * scale, hsum8(s1) * scale, hsum8(s2) * scale, hsum8(s3) * scale};
        for (int j = 0; j < 4; j++) {
            scores[t + j] = v[j];
            top = v[j] > top ? v[j] : top;
        }
    }
    for (; t < n; t++) {
        const float *k = keys + t * d;
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), s);
        scores[t] = hsum8(s) * scale;
        top = scores[t] > top ? scores[t] : top;
    }
    __m256 shift = _mm256_set1_ps(top), acc8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
        _mm256_storeu_ps(scores + t, e);
        acc8 = _mm256_add_ps(acc8, e);
    }
    float sum = hsum8(acc8);
    for (; t < n; t++) {
        scores[t] = expf(scores[t] - top);
        sum += scores[t];
    }
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int64_t c0 = 0; c0 < d; c0 += 128) {
        int64_t w = (d - c0 < 128 ? d - c0 : 128) / 8;
        __m256 acc[16];
        for (int64_t j = 0; j < w; j++) acc[j] = _mm256_setzero_ps();
        for (t = 0; t < n; t++) {
            __m256 p = _mm256_set1_ps(scores[t]);
            const float *v = values + t * d + c0;
            for (int64_t j = 0; j < w; j++) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[j]);
        }
        for (int64_t j = 0; j < w; j++) _mm256_storeu_ps(out + c0 + 8 * j, _mm256_mul_ps(acc[j], inv));
    }
}

#else
#define rows_avx2 rows_scalar
#define attend_avx2 attend
#endif

/* This thread's share [*r0, *r1) of m rows, in blocks of four; 0 when it has none. */
static int thread_rows(int64_t m, int64_t *r0, int64_t *r1) {
#ifdef _OPENMP
    int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    int64_t t = 0, nt = 1;
#endif
    int64_t blocks = (m + 3) / 4, per = (blocks + nt - 1) / nt;
    *r0 = t * per * 4, *r1 = (t + 1) * per * 4;
    if (*r1 > m) *r1 = m;
    return *r0 < *r1;
}

/* y = W x (+ y when `add`), W (m, n) row-major: this thread's share of the rows. */
static void gemv_part(const float *w, const float *x, float *y, int64_t m, int64_t n, int add) {
    int64_t r0, r1;
    if (!thread_rows(m, &r0, &r1)) return;
    if (has_avx2())
        rows_avx2(w, x, y, r0, r1, n, add);
    else
        rows_scalar(w, x, y, r0, r1, n, add);
}



/* One query head against positions 0..n-1 of its KV head: scores, softmax, weighted sum. */
static void attend(const float *q, const float *keys, const float *values, float *scores, float *out, int64_t n,
                   int64_t d, float scale) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const float *k = keys + t * d;
        float s = 0.0f;
        for (int64_t i = 0; i < d; i++) s += q[i] * k[i];
        s *= scale;
        scores[t] = s;
        top = s > top ? s : top;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - top);
        sum += scores[t];
    }
    memset(out, 0, (size_t)d * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        const float *v = values + t * d;
        float p = scores[t] / sum;
        for (int64_t i = 0; i < d; i++) out[i] += p * v[i];
    }
}


/* The layer's attention over its plain cache, positions 0..n-1: this thread's share of the
 * query heads (a work-sharing loop; every thread of the team calls it). */
static void attend_plain(const lmsp_model *m, const lmsp_layer *ly, const float *q, float *scores, float *att,
                         int64_t n) {
    const int64_t hd = m->head_dim, cap = m->capacity, group = m->n_heads / m->n_kv_heads;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < m->n_heads; j++) {
        const int64_t kv = j / group;
        if (has_avx2() && hd % 8 == 0)
            attend_avx2(q + j * hd, ly->keys + kv * cap * hd, ly->values + kv * cap * hd, scores + j * n,
                        att + j * hd, n, hd, m->scale);
        else
            attend(q + j * hd, ly->keys + kv * cap * hd, ly->values + kv * cap * hd, scores + j * n, att + j * hd,
                   n, hd, m->scale);
    }
}

/* A quantized cache's attention for one layer: its rows, and the per-step state of
 * attention.c's split tasks (allocated once a step, shared by the layers). */
typedef struct {
    int fast;
    int64_t rows, split, splits, words, groups; /* split: positions a task takes */
    float *qs, *tops, *totals, *accs, *scratch; /* scratch: one lmsp_attention_scratch + d per thread */
    int64_t per_thread;
} QuantizedStep;

/* A cache part's rows for attention.c: (head, row) strides of a cache of `cap` positions. */
static lmsp_rows part_rows(const uint32_t *w, const float *sc, const float *b, int64_t cap, int64_t words,
                           int64_t groups) {
    lmsp_rows r = {w, sc, b, {0}, {0}, {0}};
    r.ws[1] = cap * words, r.ws[2] = words;
    r.ss[1] = r.bs[1] = cap * groups, r.ss[2] = r.bs[2] = groups;
    return r;
}

/* The team's size outside a parallel region, and this thread's share of per-thread scratch inside one. */
static int64_t team_size(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static float *thread_scratch(float *scratch, int64_t per_thread) {
#ifdef _OPENMP
    return scratch + omp_get_thread_num() * per_thread;
#else
    (void)per_thread;
    return scratch;
#endif
}

/* The layer's attention over its quantized cache, positions 0..n-1, by this thread's share
 * of the team: (KV head, qa->split positions) tasks, then the KV heads' merges. Called by every
 * thread of the team (work-sharing loops inside); q is scaled and reordered in qa->qs. */
static void attend_quantized(const lmsp_model *m, const lmsp_layer *ly, const QuantizedStep *qa, int64_t n,
                             float *att) {
    const int64_t hd = m->head_dim, rows = qa->rows, splits = qa->splits, tasks = m->n_kv_heads * splits;
    const lmsp_rows keys = part_rows(ly->key_codes, ly->key_scales, ly->key_biases, m->capacity, qa->words, qa->groups);
    const lmsp_rows values = part_rows(ly->value_codes, ly->value_scales, ly->value_biases, m->capacity, qa->words,
                                       qa->groups);
    float *scratch = thread_scratch(qa->scratch, qa->per_thread);
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t head = t / splits, p0 = t % splits * qa->split;
        lmsp_attention_split(qa->fast, qa->qs + head * rows * hd, &keys, &values, 0, head, p0,
                             p0 + qa->split < n ? p0 + qa->split : n, rows, hd, m->kv_bits, m->kv_group,
                             qa->tops + t * rows, qa->totals + t * rows, qa->accs + t * rows * hd, scratch);
    }
#pragma omp for schedule(static)
    for (int64_t head = 0; head < m->n_kv_heads; head++)
        lmsp_attention_merge(qa->fast, qa->tops + head * splits * rows, qa->totals + head * splits * rows,
                             qa->accs + head * splits * rows * hd, splits, rows, hd, m->kv_bits,
                             att + head * rows * hd, scratch + qa->per_thread - hd);
}

static void free_quantized(QuantizedStep *qa) {
    free(qa->qs), free(qa->tops), free(qa->totals), free(qa->accs), free(qa->scratch);
}

/* Positions an attention task takes over a quantized cache of n positions. About four
 * tasks a thread: with whole 512-position splits a short context had only n_kv_heads tasks
 * (3 for SmolLM2 on 2 threads, one thread idle part of the time; the balance gained 0-5%
 * of the step at 256-4K positions, within this machine's noise). The batched step splits
 * each sequence as this step would alone, so its attention sums in the same order. */
static int64_t quantized_split(const lmsp_model *m, int64_t n, int64_t threads) {
    int64_t split = (n * m->n_kv_heads + 4 * threads - 1) / (4 * threads);
    split = (split + 31) / 32 * 32;
    return split < 64 ? 64 : split > LMSP_SPLIT ? LMSP_SPLIT : split;
}

/* The step's state for a quantized cache of n positions; 0, or -1 out of memory. */
static int prepare_quantized(const lmsp_model *m, int64_t n, QuantizedStep *qa) {
    const int64_t hd = m->head_dim, nkv = m->n_kv_heads;
    const int64_t threads = team_size();
    qa->fast = lmsp_attention_fast(m->kv_bits);
    qa->split = quantized_split(m, n, threads);
    qa->rows = m->n_heads / nkv, qa->splits = (n + qa->split - 1) / qa->split;
    qa->words = hd * m->kv_bits / 32, qa->groups = hd / m->kv_group;
    qa->per_thread = lmsp_attention_scratch(qa->rows, hd) + hd;
    const int64_t states = nkv * qa->splits * qa->rows;
    qa->qs = malloc(sizeof(float) * m->n_heads * hd);
    qa->tops = malloc(sizeof(float) * states), qa->totals = malloc(sizeof(float) * states);
    qa->accs = malloc(sizeof(float) * states * hd), qa->scratch = malloc(sizeof(float) * threads * qa->per_thread);
    if (qa->qs && qa->tops && qa->totals && qa->accs && qa->scratch) return 0;
    free_quantized(qa);
    return -1;
}

/*
 * Logits for `token` at position `pos` (the cache holds positions 0..pos-1; K/V of `pos`
 * are written). `scratch` holds dim*2 + (n_heads + 2*n_kv_heads + n_heads)*head_dim +
 * hidden*2 + n_heads*(pos+1) floats. With a quantized cache (kv_bits), its attention is
 * attention.c's, run by this step's team. Returns 0, or -1 out of memory (nothing written).
 */
int lmsp_decode_step(const lmsp_model *m, int32_t token, int32_t pos, const float *cos, const float *sin,
                     float *logits, float *scratch) {
    const int64_t dim = m->dim, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv_heads, hidden = m->hidden;
    const int64_t n = (int64_t)pos + 1;
    float *x = scratch, *h = x + dim, *q = h + dim, *k = q + nh * hd, *v = k + nkv * hd, *att = v + nkv * hd;
    float *gate = att + nh * hd, *up = gate + hidden, *scores = up + hidden;
    QuantizedStep qa = {0};
    if (m->kv_bits && prepare_quantized(m, n, &qa) != 0) return -1;
    memcpy(x, m->embed + (int64_t)token * dim, (size_t)dim * sizeof(float));
#pragma omp parallel
    {
        for (int32_t l = 0; l < m->n_layers; l++) {
            const lmsp_layer *ly = &m->layers[l];
#pragma omp single
            rms_norm(x, ly->attn_norm, h, dim, m->eps);
            gemv_part(ly->wq, h, q, nh * hd, dim, 0);
            gemv_part(ly->wk, h, k, nkv * hd, dim, 0);
            gemv_part(ly->wv, h, v, nkv * hd, dim, 0);
#pragma omp barrier
#pragma omp single
            {
                add_bias(q, ly->bq, nh * hd);
                add_bias(k, ly->bk, nkv * hd);
                add_bias(v, ly->bv, nkv * hd);
                for (int64_t j = 0; j < nh; j++) rope_head(q + j * hd, m->rope_dims, cos, sin);
                for (int64_t j = 0; j < nkv; j++) rope_head(k + j * hd, m->rope_dims, cos, sin);
                lmsp_store_kv(m, ly, k, v, pos);
                if (m->kv_bits) lmsp_attention_queries(qa.fast, q, qa.qs, nh, hd, m->kv_bits, m->scale);
            }
            if (m->kv_bits)
                attend_quantized(m, ly, &qa, n, att);
            else
                attend_plain(m, ly, q, scores, att, n);
            gemv_part(ly->wo, att, x, dim, nh * hd, 1);
#pragma omp barrier
#pragma omp single
            rms_norm(x, ly->mlp_norm, h, dim, m->eps);
            gemv_part(ly->wgate, h, gate, hidden, dim, 0);
            gemv_part(ly->wup, h, up, hidden, dim, 0);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t i = 0; i < hidden; i++) {
                float g = gate[i];
                gate[i] = g / (1.0f + expf(-g)) * up[i];
            }
            gemv_part(ly->wdown, gate, x, dim, hidden, 1);
#pragma omp barrier
        }
#pragma omp single
        rms_norm(x, m->final_norm, h, dim, m->eps);
        gemv_part(m->head, h, logits, m->vocab, dim, 0);
    }
    if (m->kv_bits) free_quantized(&qa);
    return 0;
}


/* ---- the batched step: B sequences in one pass over the weights ----
 *
 * Why: a decode step of one sequence is bound by reading the weights (540 MB for
 * SmolLM2-135M in float32); B sequences stepped one by one read them B times. Here every
 * weight row is read once for the whole batch: each 8-float slice of a row meets every
 * sequence's input while it sits in a register (row_batch4/8).
 *
 * Each sequence keeps its own float32 cache, plain or quantized (the KV session it started
 * from): no merged batch cache, no padding, its own position. A row's sum runs in the same order as
 * the one-sequence step's (8-lane FMA over the row, hsum8, then the tail), so a sequence
 * gets bitwise the logits it gets alone, whatever else is in the batch. */

#if defined(__x86_64__)
/* One weight row against up to 8 sequences' inputs (K accumulators, K = 4 or 8): the row
 * streams in once, each 8-float slice of it meets every sequence while it sits in a
 * register, so the weight reads overlap the FMAs (a block of rows re-read from L1 per pair
 * of sequences left the memory idle between blocks: 20% of the FMA peak at 8 sequences). */
#define LMSP_ROW_BATCH(K)                                                                                     \
    __attribute__((target("avx2,fma"))) static void row_batch##K(const float *row, const float *x, float *y,  \
                                                                 int64_t n, int64_t m, int64_t nb, int add) { \
        const int64_t n8 = n & ~(int64_t)7;                                                                    \
        const float *xs[K];                                                                                    \
        for (int k = 0; k < K; k++) xs[k] = x + (k < nb ? k : 0) * n;                                          \
        __m256 acc[K];                                                                                         \
        for (int k = 0; k < K; k++) acc[k] = _mm256_setzero_ps();                                              \
        for (int64_t i = 0; i < n8; i += 8) {                                                                  \
            _mm_prefetch((const char *)(row + 4 * n + i), _MM_HINT_T0);                                        \
            __m256 w = _mm256_loadu_ps(row + i);                                                               \
            for (int k = 0; k < K; k++) acc[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[k] + i), acc[k]);      \
        }                                                                                                      \
        for (int k = 0; k < K && k < nb; k++) {                                                                \
            float s = hsum8(acc[k]);                                                                           \
            for (int64_t i = n8; i < n; i++) s += row[i] * xs[k][i];                                           \
            y[k * m] = add ? y[k * m] + s : s;                                                                 \
        }                                                                                                      \
    }
LMSP_ROW_BATCH(4)
LMSP_ROW_BATCH(8)

/* Two weight rows against up to 4 sequences' inputs: 8 accumulators, 6 loads per 8 FMAs
 * where row_batch8 needs 9 per 8. For more than 4 sequences the pair is read once per 4
 * (from L1 after the first: `fetch` prefetches the next pair on that pass only). Each sum
 * runs in row_batch's order, so the logits stay bitwise the one-sequence step's. */
__attribute__((target("avx2,fma"))) static void pair_batch4(const float *row, const float *x, float *y, int64_t n,
                                                            int64_t m, int64_t nb, int add, int fetch) {
    const int64_t n8 = n & ~(int64_t)7;
    const float *row2 = row + n;
    const float *xs[4];
    for (int k = 0; k < 4; k++) xs[k] = x + (k < nb ? k : 0) * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t i = 0; i < n8; i += 8) {
        if (fetch) {
            _mm_prefetch((const char *)(row + 2 * n + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(row2 + 2 * n + i), _MM_HINT_T0);
        }
        __m256 w1 = _mm256_loadu_ps(row + i), w2 = _mm256_loadu_ps(row2 + i), v;
        v = _mm256_loadu_ps(xs[0] + i), a0 = _mm256_fmadd_ps(w1, v, a0), b0 = _mm256_fmadd_ps(w2, v, b0);
        v = _mm256_loadu_ps(xs[1] + i), a1 = _mm256_fmadd_ps(w1, v, a1), b1 = _mm256_fmadd_ps(w2, v, b1);
        v = _mm256_loadu_ps(xs[2] + i), a2 = _mm256_fmadd_ps(w1, v, a2), b2 = _mm256_fmadd_ps(w2, v, b2);
        v = _mm256_loadu_ps(xs[3] + i), a3 = _mm256_fmadd_ps(w1, v, a3), b3 = _mm256_fmadd_ps(w2, v, b3);
    }
    __m256 acc[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
    for (int p = 0; p < 2; p++) {
        const float *w = p ? row2 : row;
        for (int k = 0; k < 4 && k < nb; k++) {
            float s = hsum8(acc[p][k]);
            for (int64_t i = n8; i < n; i++) s += w[i] * xs[k][i];
            y[k * m + p] = add ? y[k * m + p] + s : s;
        }
    }
}

/* `pairs`: more than 4 sequences go through pair_batch4, 4 at a time. In the small-row
 * product (its own thread team per call) that ran 1.2-1.5x row_batch8 at 8 rows; inside
 * the compiled batched step (one team for the whole step) it ran 0.95x, so the step keeps
 * row_batch8. Four or fewer rows are memory-bound either way. */
__attribute__((target("avx2,fma"))) static void rows_batch_avx2(const float *w, const float *x, float *y, int64_t r0,
                                                                int64_t r1, int64_t n, int64_t m, int64_t nb,
                                                                int add, int pairs) {
    int64_t r = r0;
    if (pairs && nb > 4) {
        for (; r + 2 <= r1; r += 2)
            for (int64_t j = 0; j < nb; j += 4)
                pair_batch4(w + r * n, x + j * n, y + j * m + r, n, m, nb - j < 4 ? nb - j : 4, add, j == 0);
    }
    for (; r < r1; r++) {
        for (int64_t j = 0; j < nb; j += 8) {
            const int64_t left = nb - j < 8 ? nb - j : 8;
            if (left <= 4)
                row_batch4(w + r * n, x + j * n, y + j * m + r, n, m, left, add);
            else
                row_batch8(w + r * n, x + j * n, y + j * m + r, n, m, left, add);
        }
    }
}
#else
static void rows_batch_avx2(const float *w, const float *x, float *y, int64_t r0, int64_t r1, int64_t n, int64_t m,
                            int64_t nb, int add, int pairs) {
    for (int64_t j = 0; j < nb; j++) rows_scalar(w, x + j * n, y + j * m, r0, r1, n, add);
}
#endif

/* Y = X W^T (+ Y when `add`): X (nb, n), Y (nb, m), W (m, n) row-major; this thread's
 * share of W's rows (thread_rows, as gemv_part). */
static void gemm_part(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t nb, int add) {
    int64_t r0, r1;
    if (!thread_rows(m, &r0, &r1)) return;
    if (has_avx2()) {
        rows_batch_avx2(w, x, y, r0, r1, n, m, nb, add, 0);
    } else {
        for (int64_t j = 0; j < nb; j++) rows_scalar(w, x + j * n, y + j * m, r0, r1, n, add);
    }
}

/* Below this many multiply-adds a product runs on the calling thread: waking the team
 * would cost more than the product. */
#define SERIAL_FLOATS 65536

/* Rows [r0, r1) of Y = X W^T: X (nb, n), Y (nb, m), W (m, n) row-major. */
static void product_rows(const float *w, const float *x, float *y, int64_t r0, int64_t r1, int64_t m, int64_t n,
                         int64_t nb) {
    if (nb == 1) {
        if (has_avx2())
            rows_avx2(w, x, y, r0, r1, n, 0);
        else
            rows_scalar(w, x, y, r0, r1, n, 0);
    } else if (has_avx2()) {
        rows_batch_avx2(w, x, y, r0, r1, n, m, nb, 0, 1);
    } else {
        for (int64_t j = 0; j < nb; j++) rows_scalar(w, x + j * n, y + j * m, r0, r1, n, 0);
    }
}

/* Y = X W^T for 2-24 rows of X: X (nb, n), Y (nb, m), W (m, n) row-major. The BLAS shim
 * sends MLX's batched decode products here (one row per sequence times every weight):
 * OpenBLAS's sgemm packs all of W on every call, 1.5 ms for 2 or 8 rows of a 4096x1024
 * weight against 0.13 ms for one row, where this reads each weight row once for all the
 * rows. `serial`: on the calling thread only (the shim's call while OpenBLAS's workers may
 * still spin); a small product also runs there, a team would cost more than it. */
void lmsp_small_gemm(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t nb, int serial) {
    if (serial || m * n * nb < SERIAL_FLOATS) {
        product_rows(w, x, y, 0, m, m, n, nb);
        return;
    }
#pragma omp parallel
    {
        int64_t r0, r1;
        if (thread_rows(m, &r0, &r1)) product_rows(w, x, y, r0, r1, m, n, nb);
    }
}

/* One projection of a float MoE layer, its token-expert pairs grouped by expert:
 * Y[p] = X[p / per] W[idx[p]]^T (+ bias[idx[p]]) for p < pairs, row-major W (experts, m, n),
 * bias (experts, m) or NULL, X (pairs / per, n), Y (pairs, m). per is k for an expert MLP's
 * first projections (a token's row serves its k pairs) and 1 for its last (a row per pair).
 *
 * Why: MLX's CPU gather_mm multiplies pair by pair, so an expert's weight is read once per
 * pair that chose it; a batch of 8 tokens' 16 pairs over 4 experts read them 16 times.
 * Here the pairs of one expert are gathered into consecutive rows of `xs` and go through
 * product_rows together, which reads each weight row once for all of them; their results
 * land in `ys` and are scattered to Y. Scratch: xs (pairs, n), ys (pairs, m), `order`
 * pairs + 2 * (experts + 1) int64. Returns 0, or -1 for an index out of range (nothing
 * written). `serial`: on the calling thread only. */
int lmsp_grouped_gemm(const float *w, const float *bias, const float *x, const uint32_t *idx, float *y, int64_t pairs,
                      int64_t per, int64_t experts, int64_t m, int64_t n, float *xs, float *ys, int64_t *order,
                      int serial) {
    int64_t *start = order + pairs, *next = start + experts + 1; /* start[e]: expert e's first sorted row */
    for (int64_t e = 0; e <= experts; e++) start[e] = 0;
    for (int64_t p = 0; p < pairs; p++) {
        if (idx[p] >= (uint32_t)experts) return -1;
        start[idx[p] + 1]++;
    }
    for (int64_t e = 0; e < experts; e++) start[e + 1] += start[e];
    for (int64_t e = 0; e < experts; e++) next[e] = start[e];
    for (int64_t p = 0; p < pairs; p++) order[next[idx[p]]++] = p; /* stable: a token's pairs keep their order */
    for (int64_t s = 0; s < pairs; s++) memcpy(xs + s * n, x + order[s] / per * n, (size_t)n * sizeof(float));
    if (serial || pairs * m * n < SERIAL_FLOATS) {
        for (int64_t e = 0; e < experts; e++)
            if (start[e + 1] > start[e])
                product_rows(w + e * m * n, xs + start[e] * n, ys + start[e] * m, 0, m, m, n, start[e + 1] - start[e]);
    } else {
#pragma omp parallel
        {
            int64_t r0, r1;
            if (thread_rows(m, &r0, &r1)) /* this thread's rows of every expert: one team for the call */
                for (int64_t e = 0; e < experts; e++)
                    if (start[e + 1] > start[e])
                        product_rows(w + e * m * n, xs + start[e] * n, ys + start[e] * m, r0, r1, m, n,
                                     start[e + 1] - start[e]);
        }
    }
    for (int64_t s = 0; s < pairs; s++) {
        const int64_t p = order[s];
        const float *b = bias ? bias + (int64_t)idx[p] * m : NULL;
        for (int64_t j = 0; j < m; j++) y[p * m + j] = ys[s * m + j] + (b ? b[j] : 0.0f);
    }
    return 0;
}

/* Floats of scratch lmsp_decode_batch needs for `nb` sequences at positions `pos`. */
int64_t lmsp_decode_batch_scratch(const lmsp_model *m, int32_t nb, const int32_t *pos) {
    int64_t positions = 0;
    for (int32_t s = 0; s < nb; s++) positions += (int64_t)pos[s] + 1;
    /* a plain cache's score rows; a quantized cache's attention keeps its own state */
    return nb * (3 * (int64_t)m->dim + (2 * (int64_t)m->n_heads + 2 * m->n_kv_heads) * m->head_dim +
                 2 * (int64_t)m->hidden) + (m->kv_bits ? 0 : (int64_t)m->n_heads * positions);
}

/* A quantized batch's attention state: each row's (KV head, split) tasks, numbered across
 * the batch (row s's start at task_at[s], split[s] positions each), their softmax states,
 * and the rows' scaled queries. Allocated once a step, shared by the layers. */
typedef struct {
    int fast;
    int64_t tasks, per_thread;
    int64_t *task_at, *split;
    int32_t *task_row;
    float *qs, *tops, *totals, *accs, *scratch;
} BatchQuantized;

static void free_batch_quantized(BatchQuantized *bq) {
    free(bq->task_at), free(bq->split), free(bq->task_row);
    free(bq->qs), free(bq->tops), free(bq->totals), free(bq->accs), free(bq->scratch);
}

static int prepare_batch_quantized(const lmsp_model *m, int64_t nb, const int32_t *pos, BatchQuantized *bq) {
    const int64_t hd = m->head_dim, nkv = m->n_kv_heads, rows = m->n_heads / nkv;
    const int64_t threads = team_size();
    bq->fast = lmsp_attention_fast(m->kv_bits);
    bq->task_at = malloc(sizeof(int64_t) * (nb + 1)), bq->split = malloc(sizeof(int64_t) * nb);
    if (!bq->task_at || !bq->split) return free_batch_quantized(bq), -1;
    bq->task_at[0] = 0;
    for (int64_t s = 0; s < nb; s++) {
        const int64_t n = (int64_t)pos[s] + 1;
        bq->split[s] = quantized_split(m, n, threads);
        bq->task_at[s + 1] = bq->task_at[s] + nkv * ((n + bq->split[s] - 1) / bq->split[s]);
    }
    bq->tasks = bq->task_at[nb];
    bq->per_thread = lmsp_attention_scratch(rows, hd) + hd;
    bq->task_row = malloc(sizeof(int32_t) * bq->tasks);
    bq->qs = malloc(sizeof(float) * nb * m->n_heads * hd);
    bq->tops = malloc(sizeof(float) * bq->tasks * rows), bq->totals = malloc(sizeof(float) * bq->tasks * rows);
    bq->accs = malloc(sizeof(float) * bq->tasks * rows * hd);
    bq->scratch = malloc(sizeof(float) * threads * bq->per_thread);
    if (!bq->task_row || !bq->qs || !bq->tops || !bq->totals || !bq->accs || !bq->scratch)
        return free_batch_quantized(bq), -1;
    for (int64_t s = 0; s < nb; s++)
        for (int64_t t = bq->task_at[s]; t < bq->task_at[s + 1]; t++) bq->task_row[t] = (int32_t)s;
    return 0;
}

/* Layer l's attention for every row over its own quantized cache, by this thread's share
 * of the team: each row's tasks exactly as its step alone splits them, then each (row, KV
 * head)'s merge; q is scaled and reordered in bq->qs. */
static void attend_batch_quantized(const lmsp_model *m, int64_t l, int64_t nb, const int32_t *pos, const int32_t *cap,
                                   const lmsp_cache *caches, const BatchQuantized *bq, float *att) {
    const int64_t hd = m->head_dim, nkv = m->n_kv_heads, rows = m->n_heads / nkv, L = m->n_layers;
    const int64_t words = hd * m->kv_bits / 32, groups = hd / m->kv_group;
    float *scratch = thread_scratch(bq->scratch, bq->per_thread);
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < bq->tasks; t++) {
        const int64_t s = bq->task_row[t], local = t - bq->task_at[s], n = (int64_t)pos[s] + 1;
        const int64_t splits = (bq->task_at[s + 1] - bq->task_at[s]) / nkv, head = local / splits;
        const int64_t p0 = local % splits * bq->split[s], p1 = p0 + bq->split[s] < n ? p0 + bq->split[s] : n;
        const lmsp_cache *c = &caches[s * L + l];
        const lmsp_rows keys = part_rows(c->key_codes, c->key_scales, c->key_biases, cap[s], words, groups);
        const lmsp_rows values = part_rows(c->value_codes, c->value_scales, c->value_biases, cap[s], words, groups);
        lmsp_attention_split(bq->fast, bq->qs + (s * m->n_heads + head * rows) * hd, &keys, &values, 0, head, p0, p1,
                             rows, hd, m->kv_bits, m->kv_group, bq->tops + t * rows, bq->totals + t * rows,
                             bq->accs + t * rows * hd, scratch);
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < nb * nkv; u++) {
        const int64_t s = u / nkv, head = u % nkv, splits = (bq->task_at[s + 1] - bq->task_at[s]) / nkv;
        const int64_t first = bq->task_at[s] + head * splits;
        lmsp_attention_merge(bq->fast, bq->tops + first * rows, bq->totals + first * rows, bq->accs + first * rows * hd,
                             splits, rows, hd, m->kv_bits, att + (s * m->n_heads + head * rows) * hd,
                             scratch + bq->per_thread - hd);
    }
}

/*
 * One pass of `nb` rows, each a token at position pos[s] of its own cache: layer l's cache
 * of row s is caches[s * n_layers + l] (model.h: plain float32 K and V, or with kv_bits a
 * quantized cache's parts), (n_kv_heads, cap[s], ...) with room for pos[s] + 1 positions;
 * K/V at pos[s] are written. A row is one sequence's decode step, or one token of a short
 * prompt chunk: consecutive rows on the same cache at consecutive positions (every row's
 * K/V is stored before any row attends, so row s sees the chunk's earlier rows: causal, as
 * a prefill). cos/sin: (nb, rope_dims / 2), each row's rotation. Logits (n_out, vocab) are
 * computed for rows out_rows[0..n_out-1] only (a chunk needs its last row's). `scratch`
 * holds lmsp_decode_batch_scratch floats. A quantized cache's attention is attention.c's,
 * each row split as its step alone splits it. Returns 0, or -1 out of memory.
 */
int lmsp_decode_batch(const lmsp_model *m, int32_t nb, const int32_t *tokens, const int32_t *pos, const int32_t *cap,
                      const lmsp_cache *caches, const float *cos, const float *sin, int32_t n_out,
                      const int32_t *out_rows, float *logits, float *scratch) {
    const int64_t dim = m->dim, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv_heads, hidden = m->hidden;
    const int64_t L = m->n_layers, half = m->rope_dims / 2, group = nh / nkv, B = nb;
    BatchQuantized bq = {0};
    if (m->kv_bits && prepare_batch_quantized(m, B, pos, &bq) != 0) return -1;
    int64_t *score_at = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!score_at) {
        if (m->kv_bits) free_batch_quantized(&bq);
        return -1;
    }
    score_at[0] = 0;
    for (int64_t s = 0; s < B; s++) score_at[s + 1] = score_at[s] + nh * ((int64_t)pos[s] + 1);
    float *x = scratch, *h = x + B * dim, *q = h + B * dim, *k = q + B * nh * hd, *v = k + B * nkv * hd;
    float *att = v + B * nkv * hd, *gate = att + B * nh * hd, *up = gate + B * hidden, *picked = up + B * hidden;
    float *scores = picked + B * dim;
    for (int64_t s = 0; s < B; s++) memcpy(x + s * dim, m->embed + (int64_t)tokens[s] * dim, (size_t)dim * sizeof(float));
#pragma omp parallel
    {
        for (int64_t l = 0; l < L; l++) {
            const lmsp_layer *ly = &m->layers[l];
#pragma omp for schedule(static)
            for (int64_t s = 0; s < B; s++) rms_norm(x + s * dim, ly->attn_norm, h + s * dim, dim, m->eps);
            gemm_part(ly->wq, h, q, nh * hd, dim, B, 0);
            gemm_part(ly->wk, h, k, nkv * hd, dim, B, 0);
            gemm_part(ly->wv, h, v, nkv * hd, dim, B, 0);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t s = 0; s < B; s++) {
                float *qs = q + s * nh * hd, *ks = k + s * nkv * hd, *vs = v + s * nkv * hd;
                add_bias(qs, ly->bq, nh * hd);
                add_bias(ks, ly->bk, nkv * hd);
                add_bias(vs, ly->bv, nkv * hd);
                for (int64_t j = 0; j < nh; j++) rope_head(qs + j * hd, m->rope_dims, cos + s * half, sin + s * half);
                for (int64_t j = 0; j < nkv; j++) rope_head(ks + j * hd, m->rope_dims, cos + s * half, sin + s * half);
                lmsp_store_cache(m, &caches[s * L + l], cap[s], ks, vs, pos[s]);
                if (m->kv_bits) lmsp_attention_queries(bq.fast, qs, bq.qs + s * nh * hd, nh, hd, m->kv_bits, m->scale);
            }
            if (m->kv_bits) {
                attend_batch_quantized(m, l, B, pos, cap, caches, &bq, att);
            } else {
#pragma omp for schedule(dynamic)
                for (int64_t t = 0; t < B * nh; t++) {
                    const int64_t s = t / nh, j = t % nh, n = (int64_t)pos[s] + 1, kv = j / group;
                    const lmsp_cache *c = &caches[s * L + l];
                    const float *ck = c->keys + kv * cap[s] * hd, *cv = c->values + kv * cap[s] * hd;
                    float *sc = scores + score_at[s] + j * n;
                    if (has_avx2() && hd % 8 == 0)
                        attend_avx2(q + t * hd, ck, cv, sc, att + t * hd, n, hd, m->scale);
                    else
                        attend(q + t * hd, ck, cv, sc, att + t * hd, n, hd, m->scale);
                }
            }
            gemm_part(ly->wo, att, x, dim, nh * hd, B, 1);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t s = 0; s < B; s++) rms_norm(x + s * dim, ly->mlp_norm, h + s * dim, dim, m->eps);
            gemm_part(ly->wgate, h, gate, hidden, dim, B, 0);
            gemm_part(ly->wup, h, up, hidden, dim, B, 0);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t i = 0; i < B * hidden; i++) {
                float g = gate[i];
                gate[i] = g / (1.0f + expf(-g)) * up[i];
            }
            gemm_part(ly->wdown, gate, x, dim, hidden, B, 1);
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int64_t o = 0; o < n_out; o++) rms_norm(x + out_rows[o] * dim, m->final_norm, picked + o * dim, dim, m->eps);
        gemm_part(m->head, picked, logits, m->vocab, dim, n_out, 0);
    }
    free(score_at);
    if (m->kv_bits) free_batch_quantized(&bq);
    return 0;
}
