/*
 * Decode attention over mlx-lm's QuantizedKVCache (attention.c), in the pieces that
 * lmsp_decode_attention runs, for a caller that runs its own OpenMP team: decode.c's
 * compiled step, whose threads are already inside a parallel region when a layer's
 * attention comes (a nested region would run on one thread).
 *
 * The pieces: the query rows scaled and put in the order the decoded rows come in
 * (lmsp_attention_queries); each (KV head, SPLIT positions) task's running softmax state
 * (lmsp_attention_split, one scratch of lmsp_attention_scratch floats per thread); a KV
 * head's splits merged into its output rows (lmsp_attention_merge). The layout's writer
 * is quant.h's.
 */
#ifndef LMSP_ATTENTION_H
#define LMSP_ATTENTION_H

#include <stdint.h>

#define LMSP_SPLIT 512 /* positions a task takes: 32 tasks per KV head at 16K, plenty for the cores */

/* One cache tensor's rows: packed codes, scales and biases, (batch, head, row) strides in elements. */
typedef struct {
    const uint32_t *w;
    const float *s, *b;
    int64_t ws[3], ss[3], bs[3];
} lmsp_rows;

/* Whether this CPU and width take the AVX2 path (its rows are in chunk order, simd.h). */
int lmsp_attention_fast(int bits);

/* qs = q * scale for `count` rows of d, in the order the `fast` path decodes rows in. */
void lmsp_attention_queries(int fast, const float *q, float *qs, int64_t count, int64_t d, int bits, float scale);

/* Floats of scratch one thread needs for lmsp_attention_split. */
int64_t lmsp_attention_scratch(int64_t rows, int64_t d);

/* Positions [p0, p1) of KV head (batch, head) against its `rows` query rows qs: the running
 * maxima, sums and weighted value sums left in top (rows), total (rows), acc (rows x d). */
void lmsp_attention_split(int fast, const float *qs, const lmsp_rows *keys, const lmsp_rows *values, int64_t batch,
                          int64_t head, int64_t p0, int64_t p1, int64_t rows, int64_t d, int bits, int group,
                          float *top, float *total, float *acc, float *scratch);

/* One KV head's `splits` states (split-major: tops[s * rows + r], accs[(s * rows + r) * d])
 * merged into its `rows` output rows out (rows x d, in the vectors' own order); `row` holds
 * d floats of scratch. */
void lmsp_attention_merge(int fast, const float *tops, const float *totals, const float *accs, int64_t splits,
                          int64_t rows, int64_t d, int bits, float *out, float *row);

#endif
