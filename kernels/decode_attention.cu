// Decode attention over mlx-lm's QuantizedKVCache, for mx.fast.cuda_kernel.
// Twin of decode_attention.metal (same algorithm, same names; see its comment): one block
// per (batch, KV head, split of CHUNK positions), WARPS warps taking batches of BATCH
// positions round-robin, the 32 lanes splitting the head dimension, an online softmax per
// query head in registers, warps merged in shared memory, splits merged by the second
// kernel, `merge`, or, in one launch, by `last` appended to the body (`state` before it).

// --- header ---
// A lane's EPL values of one cached row. Where they span at most 32 bits (head sizes up to
// 256 at 4 bits, 128 at 8) the lane loads its one or two words and its group's scale and
// bias once, and cuts the codes out of a 64-bit window; wider spans go value by value.
template <int BITS, int GS, int EPL, typename S>
__device__ inline void lmsp_unpack(const uint32_t* w, const S* scales, const S* biases, int e0, float* out) {
    constexpr int SPAN = EPL * BITS;  // also the row's length in words: D = 32 * EPL
    constexpr bool ONE_GROUP = GS % EPL == 0;  // a lane's values never cross a group
    if (SPAN <= 32) {
        const int bit0 = e0 * BITS, first = bit0 >> 5, base = bit0 & 31;
        uint64_t window = w[first];
        if (32 % SPAN != 0 && first + 1 < SPAN) window |= uint64_t(w[first + 1]) << 32;  // may straddle
        const float s0 = static_cast<float>(scales[e0 / GS]), b0 = static_cast<float>(biases[e0 / GS]);
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            const float code = static_cast<float>(uint32_t(window >> (base + i * BITS)) & ((1u << BITS) - 1u));
            const int group = (e0 + i) / GS;
            out[i] = ONE_GROUP ? s0 * code + b0
                               : static_cast<float>(scales[group]) * code + static_cast<float>(biases[group]);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int e = e0 + i, off = e * BITS, word = off >> 5, shift = off & 31;
        uint32_t v = w[word] >> shift;
        if (shift + BITS > 32) v |= w[word + 1] << (32 - shift);
        v &= (1u << BITS) - 1u;
        out[i] = static_cast<float>(scales[e / GS]) * static_cast<float>(v) + static_cast<float>(biases[e / GS]);
    }
}

// Sums NV per-lane values across the warp, 32 at a time, by recursive halving: in round r
// lane L ends with the total of value r * 32 + L. 31 shuffles a round, where 32 separate
// warp sums take 160.
template <int NV>
__device__ inline void lmsp_reduce_scatter(const float* in, float* out, int lane) {
#pragma unroll
    for (int r = 0; r < (NV + 31) / 32; r++) {
        float v[32];
#pragma unroll
        for (int k = 0; k < 32; k++) v[k] = r * 32 + k < NV ? in[r * 32 + k] : 0.0f;
#pragma unroll
        for (int step = 0; step < 5; step++) {  // counted, not shifted: the compiler unrolls it
            const int width = 16 >> step;  // not `half`: a type in Metal
            const bool upper = lane & width;
#pragma unroll
            for (int k = 0; k < 16; k++) {  // a fixed count (k < width inside) unrolls fully
                if (k >= width) break;
                const float send = upper ? v[k] : v[k + width], keep = upper ? v[k + width] : v[k];
                v[k] = keep + __shfl_xor_sync(0xffffffffu, send, width);
            }
        }
        out[r] = v[0];
    }
}

// Query row g of (batch, KV head) bh: the splits' states (maxima, sums, accumulators)
// rescaled to the overall maximum, summed in split order, normalised, written to out in
// T. One warp: its lanes read 32 splits' maxima at a time, then the splits go by in
// order, each split's weight shuffled from the lane that computed it, so the loads of 8
// splits are in flight together. Loads go past L1 (__ldcg): in the one-launch form other
// SMs wrote these during this kernel.
template <int D, int G, typename T>
__device__ inline void lmsp_merge_row(const float* tops, const float* totals, const float* acc, int bh, int splits,
                                      int g, int lane, T* out) {
    constexpr int EPL = D / 32;
    float top = -cuda::std::numeric_limits<float>::infinity();
    for (int s = lane; s < splits; s += 32) top = fmaxf(top, __ldcg(tops + (bh * splits + s) * G + g));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float total = 0.0f, sums[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) sums[i] = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += 32) {
        const int mine = min(s0 + lane, splits - 1), count = min(32, splits - s0);
        const float weight = __expf(__ldcg(tops + (bh * splits + mine) * G + g) - top);
#pragma unroll 8
        for (int j = 0; j < count; j++) {
            const int at = (bh * splits + s0 + j) * G + g;
            const float f = __shfl_sync(0xffffffffu, weight, j);
            total += f * __ldcg(totals + at);
#pragma unroll
            for (int i = 0; i < EPL; i++) sums[i] += f * __ldcg(acc + long(at) * D + lane * EPL + i);
        }
    }
#pragma unroll
    for (int i = 0; i < EPL; i++) out[long(bh * G + g) * D + lane * EPL + i] = static_cast<T>(sums[i] / total);
}

// --- body ---
static_assert(BATCH >= 1 && BATCH <= 32 && (BATCH & (BATCH - 1)) == 0, "BATCH: a power of two up to 32");
constexpr int EPL = D / 32;
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int bh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
const int hkv = kw_shape[1], b = bh / hkv, h = bh % hkv;
// A batch row attends from its `first` position: the positions before it are the left
// padding of a batch of sequences of different lengths (a split wholly inside it is empty).
const int stop = min(split * CHUNK + CHUNK, kw_shape[2]);
const int start = max(split * CHUNK, int(first[b]));
const float scale = __int_as_float(SCALE);
const int e0 = lane * EPL;
const float neg_inf = -cuda::std::numeric_limits<float>::infinity();

float qv[G][EPL], m[G], l[G], acc[G][EPL];
#pragma unroll
for (int g = 0; g < G; g++) {
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        qv[g][i] = static_cast<float>(q[(bh * G + g) * D + e0 + i]) * scale;
        acc[g][i] = 0.0f;
    }
    m[g] = neg_inf;
    l[g] = 0.0f;
}
const auto* kwh = kw + b * kw_strides[0] + h * kw_strides[1];
const auto* vwh = vw + b * vw_strides[0] + h * vw_strides[1];
const auto* ksh = ks + b * ks_strides[0] + h * ks_strides[1];
const auto* kbh = kb + b * kb_strides[0] + h * kb_strides[1];
const auto* vsh = vs + b * vs_strides[0] + h * vs_strides[1];
const auto* vbh = vb + b * vb_strides[0] + h * vb_strides[1];
// Batches of BATCH positions per warp, loads issued together (see the Metal twin).
for (int p0 = start + warp * BATCH; p0 < stop; p0 += WARPS * BATCH) {
    float kv[BATCH][EPL], vv[BATCH][EPL];
#pragma unroll
    for (int j = 0; j < BATCH; j++) {
        const int p = min(p0 + j, stop - 1);
        lmsp_unpack<BITS, GS, EPL, S>(kwh + p * kw_strides[2], ksh + p * ks_strides[2], kbh + p * kb_strides[2], e0, kv[j]);
        lmsp_unpack<BITS, GS, EPL, S>(vwh + p * vw_strides[2], vsh + p * vs_strides[2], vbh + p * vb_strides[2], e0, vv[j]);
    }
    // The batch's G * BATCH dot products: each lane's share, then one reduce-scatter, after
    // which lane L of round r holds the score of (g, j) = divmod(r * 32 + L, BATCH).
    constexpr int NV = G * BATCH, ROUNDS = (NV + 31) / 32;
    float dots[NV], own[ROUNDS], best[ROUNDS], w[ROUNDS];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < EPL; i++) dot += qv[g][i] * kv[j][i];
            dots[g * BATCH + j] = dot;
        }
    }
    lmsp_reduce_scatter<NV>(dots, own, lane);
    // Each query row's batch maximum: over its BATCH neighbouring lanes.
#pragma unroll
    for (int r = 0; r < ROUNDS; r++) {
        const int idx = r * 32 + lane;
        if (idx >= NV || p0 + idx % BATCH >= stop) own[r] = neg_inf;
        best[r] = own[r];
#pragma unroll
        for (int o = 1; o < BATCH; o <<= 1) best[r] = fmaxf(best[r], __shfl_xor_sync(0xffffffffu, best[r], o));
    }
    // Every lane keeps every row's running state: rescale it to the new maxima.
    float top[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        top[g] = fmaxf(m[g], __shfl_sync(0xffffffffu, best[g * BATCH / 32], g * BATCH % 32));
        const float fade = __expf(m[g] - top[g]);
        l[g] *= fade;
#pragma unroll
        for (int i = 0; i < EPL; i++) acc[g][i] *= fade;
        m[g] = top[g];
    }
    // Each lane weighs its own score, then every weight goes to every lane for its V share.
#pragma unroll
    for (int r = 0; r < ROUNDS; r++) {
        const int row = (r * 32 + lane) / BATCH;
        float t = 0.0f;
#pragma unroll
        for (int g = 0; g < G; g++) t = row == g ? top[g] : t;
        w[r] = own[r] == neg_inf ? 0.0f : __expf(own[r] - t);
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            const float wj = __shfl_sync(0xffffffffu, w[(g * BATCH + j) / 32], (g * BATCH + j) % 32);
            l[g] += wj;
#pragma unroll
            for (int i = 0; i < EPL; i++) acc[g][i] += wj * vv[j][i];
        }
    }
}

__shared__ float sm[WARPS * G], sl[WARPS * G], sacc[WARPS * G * D];
#pragma unroll
for (int g = 0; g < G; g++) {
    if (lane == 0) {
        sm[warp * G + g] = m[g];
        sl[warp * G + g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < EPL; i++) sacc[(warp * G + g) * D + e0 + i] = acc[g][i];
}
__syncthreads();
if (warp == 0) {
    const int out = bh * splits + split;
    for (int g = 0; g < G; g++) {
        float top = neg_inf;
        for (int w = 0; w < WARPS; w++) top = fmaxf(top, sm[w * G + g]);
        float total = 0.0f, sums[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) sums[i] = 0.0f;
        if (top > neg_inf) {
            for (int w = 0; w < WARPS; w++) {
                float f = __expf(sm[w * G + g] - top);
                total += f * sl[w * G + g];
#pragma unroll
                for (int i = 0; i < EPL; i++) sums[i] += f * sacc[(w * G + g) * D + e0 + i];
            }
        }
#pragma unroll
        for (int i = 0; i < EPL; i++) o_acc[(out * G + g) * D + e0 + i] = sums[i];
        if (lane == 0) {
            o_max[out * G + g] = top;
            o_sum[out * G + g] = total;
        }
    }
}

// --- state ---
// Prepended to the one-launch form ("state+body+last", CUDA): the splits' partial states
// in one float output, `state` (o_acc, then o_max, then o_sum and a counter per (batch,
// KV head)), because MLX's init_value fills every output with a kernel of its own: two
// outputs (state, result) are two fills where four outputs were four.
float* o_acc = state;
float* o_max = o_acc + long(gridDim.y) * gridDim.z * G * D;
float* o_sum = o_max + long(gridDim.y) * gridDim.z * G;

// --- last ---
// Appended to the body for the one-launch form: the last split of each (batch, KV head)
// to finish (the counters after o_sum, zeroed by the launch's init_value) merges every
// split into `result` with `merge`'s code (lmsp_merge_row), a warp a query row.
// output: result (B * Hkv * G, D) in T
__threadfence();  // this thread's partial state is in memory before the count below
__syncthreads();
__shared__ bool last;
if (threadIdx.x == 0) {
    unsigned int* counters = reinterpret_cast<unsigned int*>(o_sum + long(gridDim.y) * splits * G);
    last = atomicAdd(counters + bh, 1u) == unsigned(splits - 1);
}
__syncthreads();
if (last) {
    __threadfence();
    for (int g = warp; g < G; g += WARPS) lmsp_merge_row<D, G>(o_max, o_sum, o_acc, bh, splits, g, lane, result);
}

// --- merge ---
// One warp per query row (batch, KV head, row of the group), in the queries' dtype T.
const int row = blockIdx.y;
lmsp_merge_row<D, G>(tops, totals, acc, row / G, acc_shape[1], row % G, threadIdx.x % 32, out);
