// Decode attention over mlx-lm's QuantizedKVCache, for mx.fast.metal_kernel.
// Twin: decode_attention.cu. Reference: reference.decode_attention. Launcher: attention.py.
//
// One threadgroup per (batch, KV head, split of CHUNK positions); its WARPS simdgroups take
// batches of BATCH positions round-robin, and the 32 lanes of a simdgroup split the head
// dimension (EPL values each). The lanes unpack each position's K and V once and use them
// for all G query heads of the group (grouped-query attention), keeping an online softmax
// (running max, sum, weighted V) per head in registers: no score row is stored.
//
// The batch's G * BATCH scores are summed across the lanes in one reduce-scatter (each
// lane ends with one score), so each lane takes one exp for its score and the weights
// travel back by shuffles: at G = 8 that is about 75 shuffles and G + 1 exps a batch of
// 4, where a warp sum per score took 160 shuffles and 40 exps. The score arithmetic, not
// the reads, bounds this kernel for large query groups.
// The simdgroups' states are merged in threadgroup memory; the splits' partial results
// (max, sum, unnormalised output) are merged by the second kernel, `merge`, flash-decoding
// style. Two launches in all: at decode sizes a launch costs about what the reads do.
// The length is read off the cache view's shape and the scale is a template constant (its
// float bits), so no per-call scalar array is made and copied.

// --- header ---
// W and P are deduced: MLX passes an input of fewer than 8 elements in the constant address
// space instead of device memory (a 1-token cache with one KV head), so no space is spelled out.
// A lane's EPL values of one cached row. Where they span at most 32 bits (head sizes up to
// 256 at 4 bits, 128 at 8) the lane loads its one or two words and its group's scale and
// bias once, and cuts the codes out of a 64-bit window; wider spans go value by value.
template <int BITS, int GS, int EPL, typename W, typename P>
inline void lmsp_unpack(W w, P scales, P biases, int e0, thread float* out) {
    constexpr int SPAN = EPL * BITS;  // also the row's length in words: D = 32 * EPL
    constexpr bool ONE_GROUP = GS % EPL == 0;  // a lane's values never cross a group
    if (SPAN <= 32) {
        const int bit0 = e0 * BITS, first = bit0 >> 5, base = bit0 & 31;
        ulong window = w[first];
        if (32 % SPAN != 0 && first + 1 < SPAN) window |= ulong(w[first + 1]) << 32;  // may straddle
        const float s0 = float(scales[e0 / GS]), b0 = float(biases[e0 / GS]);
        for (int i = 0; i < EPL; i++) {
            const float code = float(uint32_t(window >> (base + i * BITS)) & ((1u << BITS) - 1u));
            const int group = (e0 + i) / GS;
            out[i] = ONE_GROUP ? s0 * code + b0 : float(scales[group]) * code + float(biases[group]);
        }
        return;
    }
    for (int i = 0; i < EPL; i++) {
        int e = e0 + i, off = e * BITS, word = off >> 5, shift = off & 31;
        uint32_t v = w[word] >> shift;
        if (shift + BITS > 32) v |= w[word + 1] << (32 - shift);
        v &= (1u << BITS) - 1u;
        out[i] = float(scales[e / GS]) * float(v) + float(biases[e / GS]);
    }
}

// Sums NV per-lane values across the simdgroup, 32 at a time, by recursive halving: in
// round r lane L ends with the total of value r * 32 + L. 31 shuffles a round, where 32
// separate simd_sums would each reduce all 32 lanes.
template <int NV>
inline void lmsp_reduce_scatter(thread const float* in, thread float* out, uint lane) {
    for (int r = 0; r < (NV + 31) / 32; r++) {
        float v[32];
        for (int k = 0; k < 32; k++) v[k] = r * 32 + k < NV ? in[r * 32 + k] : 0.0f;
        for (int step = 0; step < 5; step++) {  // counted, not shifted: the compiler unrolls it
            const int width = 16 >> step;  // not `half`: a type in Metal
            const bool upper = lane & width;
            for (int k = 0; k < 16; k++) {  // a fixed count (k < width inside) unrolls fully
                if (k >= width) break;
                const float send = upper ? v[k] : v[k + width], keep = upper ? v[k + width] : v[k];
                v[k] = keep + simd_shuffle_xor(send, ushort(width));
            }
        }
        out[r] = v[0];
    }
}

// --- body ---
static_assert(BATCH >= 1 && BATCH <= 32 && (BATCH & (BATCH - 1)) == 0, "BATCH: a power of two up to 32");
constexpr int EPL = D / 32;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const int bh = threadgroup_position_in_grid.y, split = threadgroup_position_in_grid.z;
const int splits = threadgroups_per_grid.z;
const int hkv = kw_shape[1], b = bh / hkv, h = bh % hkv;
// A batch row attends from its `first` position: the positions before it are the left
// padding of a batch of sequences of different lengths (a split wholly inside it is empty).
const int stop = min(split * CHUNK + CHUNK, kw_shape[2]);
const int start = max(split * CHUNK, int(first[b]));
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
    // The batch's G * BATCH dot products: each lane's share, then one reduce-scatter, after
    // which lane L of round r holds the score of (g, j) = divmod(r * 32 + L, BATCH).
    constexpr int NV = G * BATCH, ROUNDS = (NV + 31) / 32;
    float dots[NV], own[ROUNDS], best[ROUNDS], w[ROUNDS];
    for (int g = 0; g < G; g++) {
        for (int j = 0; j < BATCH; j++) {
            float dot = 0.0f;
            for (int i = 0; i < EPL; i++) dot += qv[g][i] * kv[j][i];
            dots[g * BATCH + j] = dot;
        }
    }
    lmsp_reduce_scatter<NV>(dots, own, lane);
    // Each query row's batch maximum: over its BATCH neighbouring lanes.
    for (int r = 0; r < ROUNDS; r++) {
        const int idx = r * 32 + int(lane);
        if (idx >= NV || p0 + idx % BATCH >= stop) own[r] = -INFINITY;
        best[r] = own[r];
        for (int o = 1; o < BATCH; o <<= 1) best[r] = max(best[r], simd_shuffle_xor(best[r], ushort(o)));
    }
    // Every lane keeps every row's running state: rescale it to the new maxima.
    float top[G];
    for (int g = 0; g < G; g++) {
        top[g] = max(m[g], simd_shuffle(best[g * BATCH / 32], ushort(g * BATCH % 32)));
        const float fade = metal::exp(m[g] - top[g]);
        l[g] *= fade;
        for (int i = 0; i < EPL; i++) acc[g][i] *= fade;
        m[g] = top[g];
    }
    // Each lane weighs its own score, then every weight goes to every lane for its V share.
    for (int r = 0; r < ROUNDS; r++) {
        const int row = (r * 32 + int(lane)) / BATCH;
        float t = 0.0f;
        for (int g = 0; g < G; g++) t = row == g ? top[g] : t;
        w[r] = own[r] == -INFINITY ? 0.0f : metal::exp(own[r] - t);
    }
    for (int g = 0; g < G; g++) {
        for (int j = 0; j < BATCH; j++) {
            const float wj = simd_shuffle(w[(g * BATCH + j) / 32], ushort((g * BATCH + j) % 32));
            l[g] += wj;
            for (int i = 0; i < EPL; i++) acc[g][i] += wj * vv[j][i];
        }
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
