// Decode attention over mlx-lm's QuantizedKVCache, for mx.fast.metal_kernel.
// Twin: decode_attention.cu. Reference: reference.decode_attention. Launcher: attention.py.
//
// One threadgroup per (batch, KV head, split of CHUNK positions); its WARPS simdgroups take
// batches of BATCH positions round-robin, and the 32 lanes of a simdgroup split the head
// dimension (EPL values each). For each position the lanes unpack that position's K and V once and use
// them for all G query heads of the group (grouped-query attention), keeping an online
// softmax (running max, sum, weighted V) per head in registers: no score row is stored.
// The simdgroups' states are merged in threadgroup memory; the splits' partial results
// (max, sum, unnormalised output) are merged by the second kernel, `merge`, flash-decoding
// style. Two launches in all: at decode sizes a launch costs about what the reads do.
// The length is read off the cache view's shape and the scale is a template constant (its
// float bits), so no per-call scalar array is made and copied.

// --- header ---
// W and P are deduced: MLX passes an input of fewer than 8 elements in the constant address
// space instead of device memory (a 1-token cache with one KV head), so no space is spelled out.
template <int BITS, int GS, int EPL, typename W, typename P>
inline void lmsp_unpack(W w, P scales, P biases, int e0, thread float* out) {
    for (int i = 0; i < EPL; i++) {
        int e = e0 + i, off = e * BITS, word = off >> 5, shift = off & 31;
        uint32_t v = w[word] >> shift;
        if (shift + BITS > 32) v |= w[word + 1] << (32 - shift);
        v &= (1u << BITS) - 1u;
        out[i] = float(scales[e / GS]) * float(v) + float(biases[e / GS]);
    }
}

// --- body ---
constexpr int EPL = D / 32;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const int bh = threadgroup_position_in_grid.y, split = threadgroup_position_in_grid.z;
const int splits = threadgroups_per_grid.z;
const int hkv = kw_shape[1], b = bh / hkv, h = bh % hkv;
const int start = split * CHUNK, stop = min(start + CHUNK, kw_shape[2]);
const float scale = as_type<float>(SCALE);
const int e0 = lane * EPL;

float qv[G][EPL], m[G], l[G], acc[G][EPL];
for (int g = 0; g < G; g++) {
    for (int i = 0; i < EPL; i++) {
        qv[g][i] = float(q[(bh * G + g) * D + e0 + i]) * scale;
        acc[g][i] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
}
auto kwh = kw + b * kw_strides[0] + h * kw_strides[1];
auto vwh = vw + b * vw_strides[0] + h * vw_strides[1];
auto ksh = ks + b * ks_strides[0] + h * ks_strides[1];
auto kbh = kb + b * kb_strides[0] + h * kb_strides[1];
auto vsh = vs + b * vs_strides[0] + h * vs_strides[1];
auto vbh = vb + b * vb_strides[0] + h * vb_strides[1];
// A simdgroup takes BATCH consecutive positions at a time: their K and V loads are issued
// together (a batch past `stop` re-reads the last position and masks its scores), so
// 2 * BATCH rows are in flight per simdgroup, and the softmax rescales once per batch.
for (int p0 = start + int(warp) * BATCH; p0 < stop; p0 += WARPS * BATCH) {
    float kv[BATCH][EPL], vv[BATCH][EPL];
    for (int j = 0; j < BATCH; j++) {
        const int p = min(p0 + j, stop - 1);
        lmsp_unpack<BITS, GS, EPL>(kwh + p * kw_strides[2], ksh + p * ks_strides[2], kbh + p * kb_strides[2], e0, kv[j]);
        lmsp_unpack<BITS, GS, EPL>(vwh + p * vw_strides[2], vsh + p * vs_strides[2], vbh + p * vb_strides[2], e0, vv[j]);
    }
    for (int g = 0; g < G; g++) {
        float s[BATCH], top = m[g];
        for (int j = 0; j < BATCH; j++) {
            float dot = 0.0f;
            for (int i = 0; i < EPL; i++) dot += qv[g][i] * kv[j][i];
            dot = simd_sum(dot);
            s[j] = p0 + j < stop ? dot : -INFINITY;
            top = max(top, s[j]);
        }
        const float fade = metal::exp(m[g] - top);
        l[g] *= fade;
        for (int i = 0; i < EPL; i++) acc[g][i] *= fade;
        for (int j = 0; j < BATCH; j++) {
            const float w = metal::exp(s[j] - top);
            l[g] += w;
            for (int i = 0; i < EPL; i++) acc[g][i] += w * vv[j][i];
        }
        m[g] = top;
    }
}

threadgroup float sm[WARPS * G], sl[WARPS * G], sacc[WARPS * G * D];
for (int g = 0; g < G; g++) {
    if (lane == 0) {
        sm[warp * G + g] = m[g];
        sl[warp * G + g] = l[g];
    }
    for (int i = 0; i < EPL; i++) sacc[(warp * G + g) * D + e0 + i] = acc[g][i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (warp == 0) {
    const int out = bh * splits + split;
    for (int g = 0; g < G; g++) {
        float top = -INFINITY;
        for (int w = 0; w < WARPS; w++) top = max(top, sm[w * G + g]);
        float total = 0.0f, sums[EPL];
        for (int i = 0; i < EPL; i++) sums[i] = 0.0f;
        if (top > -INFINITY) {
            for (int w = 0; w < WARPS; w++) {
                float f = metal::exp(sm[w * G + g] - top);
                total += f * sl[w * G + g];
                for (int i = 0; i < EPL; i++) sums[i] += f * sacc[(w * G + g) * D + e0 + i];
            }
        }
        for (int i = 0; i < EPL; i++) o_acc[(out * G + g) * D + e0 + i] = sums[i];
        if (lane == 0) {
            o_max[out * G + g] = top;
            o_sum[out * G + g] = total;
        }
    }
}

// --- merge ---
// One simdgroup per query row (batch, KV head, row of the group): the splits' states
// rescaled to the overall maximum and summed, then normalised, in the queries' dtype T.
constexpr int EPL = D / 32;
const uint lane = thread_index_in_simdgroup;
const int row = threadgroup_position_in_grid.y, bh = row / G, g = row % G;
const int splits = acc_shape[1];
float top = -INFINITY;
for (int s = 0; s < splits; s++) top = max(top, tops[(bh * splits + s) * G + g]);
float total = 0.0f, sums[EPL];
for (int i = 0; i < EPL; i++) sums[i] = 0.0f;
for (int s = 0; s < splits; s++) {
    const int at = (bh * splits + s) * G + g;
    const float f = metal::exp(tops[at] - top);
    total += f * totals[at];
    for (int i = 0; i < EPL; i++) sums[i] += f * acc[at * D + lane * EPL + i];
}
for (int i = 0; i < EPL; i++) out[row * D + lane * EPL + i] = static_cast<T>(sums[i] / total);
