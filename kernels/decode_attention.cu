// Decode attention over mlx-lm's QuantizedKVCache, for mx.fast.cuda_kernel.
// Twin of decode_attention.metal (same algorithm, same names; see its comment): one block
// per (batch, KV head, split of CHUNK positions), WARPS warps taking batches of BATCH
// positions round-robin, the 32 lanes splitting the head dimension, an online softmax per
// query head in registers, warps merged in shared memory, splits merged by the second
// kernel, `merge`.

// --- header ---
template <int BITS, int GS, int EPL, typename S>
__device__ inline void lmsp_unpack(const uint32_t* w, const S* scales, const S* biases, int e0, float* out) {
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int e = e0 + i, off = e * BITS, word = off >> 5, shift = off & 31;
        uint32_t v = w[word] >> shift;
        if (shift + BITS > 32) v |= w[word + 1] << (32 - shift);
        v &= (1u << BITS) - 1u;
        out[i] = static_cast<float>(scales[e / GS]) * static_cast<float>(v) + static_cast<float>(biases[e / GS]);
    }
}

__device__ inline float lmsp_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// --- body ---
constexpr int EPL = D / 32;
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int bh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
const int hkv = kw_shape[1], b = bh / hkv, h = bh % hkv;
const int start = split * CHUNK, stop = min(start + CHUNK, kw_shape[2]);
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
#pragma unroll
    for (int g = 0; g < G; g++) {
        float s[BATCH], top = m[g];
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < EPL; i++) dot += qv[g][i] * kv[j][i];
            dot = lmsp_warp_sum(dot);
            s[j] = p0 + j < stop ? dot : neg_inf;
            top = fmaxf(top, s[j]);
        }
        const float fade = __expf(m[g] - top);
        l[g] *= fade;
#pragma unroll
        for (int i = 0; i < EPL; i++) acc[g][i] *= fade;
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            const float w = __expf(s[j] - top);
            l[g] += w;
#pragma unroll
            for (int i = 0; i < EPL; i++) acc[g][i] += w * vv[j][i];
        }
        m[g] = top;
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

// --- merge ---
// One warp per query row (batch, KV head, row of the group): the splits' states rescaled
// to the overall maximum and summed, then normalised, in the queries' dtype T.
constexpr int EPL = D / 32;
const int lane = threadIdx.x % 32;
const int row = blockIdx.y, bh = row / G, g = row % G;
const int splits = acc_shape[1];
float top = -cuda::std::numeric_limits<float>::infinity();
for (int s = 0; s < splits; s++) top = fmaxf(top, tops[(bh * splits + s) * G + g]);
float total = 0.0f, sums[EPL];
#pragma unroll
for (int i = 0; i < EPL; i++) sums[i] = 0.0f;
for (int s = 0; s < splits; s++) {
    const int at = (bh * splits + s) * G + g;
    const float f = __expf(tops[at] - top);
    total += f * totals[at];
#pragma unroll
    for (int i = 0; i < EPL; i++) sums[i] += f * acc[at * D + lane * EPL + i];
}
#pragma unroll
for (int i = 0; i < EPL; i++) out[row * D + lane * EPL + i] = static_cast<T>(sums[i] / total);
