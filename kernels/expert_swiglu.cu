// The SwiGLU MLP of each token's top-k experts, quantized weights, for mx.fast.cuda_kernel.
// Twin of expert_swiglu.metal (same two kernels, same names; see its comment).

// --- header ---
template <int BITS, int GS, typename S>
__device__ inline float lmsp_code(const uint32_t* w, const S* scales, const S* biases, int e) {
    int off = e * BITS, word = off >> 5, shift = off & 31;
    uint32_t v = w[word] >> shift;
    if (shift + BITS > 32) v |= w[word + 1] << (32 - shift);
    v &= (1u << BITS) - 1u;
    return static_cast<float>(scales[e / GS]) * static_cast<float>(v) + static_cast<float>(biases[e / GS]);
}

__device__ inline float lmsp_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// --- gate_up ---
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int pair = blockIdx.y, token = pair / K;
const int expert = idx[pair];
__shared__ float xs[D];
for (int e = threadIdx.x; e < D; e += blockDim.x) xs[e] = static_cast<float>(x[token * D + e]);
__syncthreads();
const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
constexpr int WORDS = D * BITS / 32, GROUPS = D / GS;
for (int r = row0; r < min(row0 + ROWS, H); r++) {
    const long row = long(expert) * H + r;
    float g = 0.0f, u = 0.0f;
    for (int e = lane; e < D; e += 32) {
        g += lmsp_code<BITS, GS>(gw + row * WORDS, gs + row * GROUPS, gb + row * GROUPS, e) * xs[e];
        u += lmsp_code<BITS, GS>(uw + row * WORDS, us + row * GROUPS, ub + row * GROUPS, e) * xs[e];
    }
    g = lmsp_warp_sum(g);
    u = lmsp_warp_sum(u);
    if (lane == 0) hid[long(pair) * H + r] = g / (1.0f + __expf(-g)) * u;
}

// --- down ---
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int pair = blockIdx.y;
const int expert = idx[pair];
__shared__ float hs[H];
for (int e = threadIdx.x; e < H; e += blockDim.x) hs[e] = hid[long(pair) * H + e];
__syncthreads();
const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
constexpr int WORDS = H * BITS / 32, GROUPS = H / GS;
for (int r = row0; r < min(row0 + ROWS, D); r++) {
    const long row = long(expert) * D + r;
    float s = 0.0f;
    for (int e = lane; e < H; e += 32) s += lmsp_code<BITS, GS>(dw + row * WORDS, ds + row * GROUPS, db + row * GROUPS, e) * hs[e];
    s = lmsp_warp_sum(s);
    if (lane == 0) y[long(pair) * D + r] = static_cast<Y>(s);
}
