// The SwiGLU MLP of each token's top-k experts, quantized weights, for mx.fast.cuda_kernel.
// Twin of expert_swiglu.metal (same two kernels, same names, the same 32-code chunks; see
// its comment).

// --- header ---
template <int BITS, typename W, typename X>
__device__ inline float lmsp_chunk_dot(const W* w, const X* x) {
    uint32_t words[BITS];
#pragma unroll
    for (int j = 0; j < BITS; j++) words[j] = w[j];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        const int off = i * BITS, word = off >> 5, shift = off & 31;
        uint32_t v = words[word] >> shift;
        if (shift + BITS > 32) v |= words[word + 1] << (32 - shift);
        s += static_cast<float>(v & ((1u << BITS) - 1u)) * x[i];
    }
    return s;
}

__device__ inline float lmsp_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Where value i of chunk c sits in the staged x (or hidden) vector. Lane L reads chunk
// L + 32t, so a plain layout (c * 32 + i) puts all 32 lanes' reads of value i in one bank:
// a 32-way conflict on every read of the staged vector (8-way per 16-byte read). Swapping
// the chunk's 16-byte blocks by c & 7 sends eight neighbouring lanes to eight different
// blocks: 16-byte reads without conflict, 4-byte reads at most 4-way. Only the layout
// changes, not what is summed in which order.
__device__ inline int lmsp_staged(int c, int i) { return c * 32 + ((((i >> 2) ^ c) & 7) << 2) + (i & 3); }

// --- gate_up ---
// inputs: x (T, D), idx (T*K) uint32, gw/gs/gb and uw/us/ub (E, H, ...); output: hid (T*K, H) float
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int pair = blockIdx.y, token = pair / K;
const int expert = idx[pair];
constexpr int CHUNKS = D / 32, WORDS = D * BITS / 32, GROUPS = D / GS, TRIPS = (CHUNKS + 31) / 32;
__shared__ float xs[D];
__shared__ float xsum[CHUNKS];
for (int e = threadIdx.x; e < D; e += blockDim.x) xs[lmsp_staged(e >> 5, e & 31)] = static_cast<float>(x[token * D + e]);
__syncthreads();
for (int c = threadIdx.x; c < CHUNKS; c += blockDim.x) {
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += xs[lmsp_staged(c, i)];
    xsum[c] = s;
}
__syncthreads();
const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
float g[ROWS], u[ROWS];
#pragma unroll
for (int r = 0; r < ROWS; r++) g[r] = u[r] = 0.0f;
#pragma unroll
for (int t = 0; t < TRIPS; t++) {
    const int c = lane + 32 * t;
    if (c < CHUNKS) {
        float xc[32];
#pragma unroll
        for (int i = 0; i < 32; i++) xc[i] = xs[lmsp_staged(c, i)];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const long row = long(expert) * H + min(row0 + r, H - 1);
            const long q = row * GROUPS + c * 32 / GS;
            g[r] += static_cast<float>(gs[q]) * lmsp_chunk_dot<BITS>(gw + row * WORDS + c * BITS, xc) + static_cast<float>(gb[q]) * xsum[c];
            u[r] += static_cast<float>(us[q]) * lmsp_chunk_dot<BITS>(uw + row * WORDS + c * BITS, xc) + static_cast<float>(ub[q]) * xsum[c];
        }
    }
}
#pragma unroll
for (int r = 0; r < ROWS; r++) {
    const float gr = lmsp_warp_sum(g[r]), ur = lmsp_warp_sum(u[r]);
    if (lane == 0 && row0 + r < H) hid[long(pair) * H + row0 + r] = gr / (1.0f + __expf(-gr)) * ur;
}

// --- down ---
// inputs: hid (T*K, H) float, idx (T*K) uint32, dw/ds/db (E, D, ...); output: y (T*K, D)
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int pair = blockIdx.y;
const int expert = idx[pair];
constexpr int CHUNKS = H / 32, WORDS = H * BITS / 32, GROUPS = H / GS, TRIPS = (CHUNKS + 31) / 32;
__shared__ float hs[H];
__shared__ float hsum[CHUNKS];
for (int e = threadIdx.x; e < H; e += blockDim.x) hs[lmsp_staged(e >> 5, e & 31)] = hid[long(pair) * H + e];
__syncthreads();
for (int c = threadIdx.x; c < CHUNKS; c += blockDim.x) {
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += hs[lmsp_staged(c, i)];
    hsum[c] = s;
}
__syncthreads();
const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
float acc[ROWS];
#pragma unroll
for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
#pragma unroll
for (int t = 0; t < TRIPS; t++) {
    const int c = lane + 32 * t;
    if (c < CHUNKS) {
        float hc[32];
#pragma unroll
        for (int i = 0; i < 32; i++) hc[i] = hs[lmsp_staged(c, i)];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const long row = long(expert) * D + min(row0 + r, D - 1);
            const long q = row * GROUPS + c * 32 / GS;
            acc[r] += static_cast<float>(ds[q]) * lmsp_chunk_dot<BITS>(dw + row * WORDS + c * BITS, hc) + static_cast<float>(db[q]) * hsum[c];
        }
    }
}
#pragma unroll
for (int r = 0; r < ROWS; r++) {
    const float s = lmsp_warp_sum(acc[r]);
    if (lane == 0 && row0 + r < D) y[long(pair) * D + row0 + r] = static_cast<Y>(s);
}
