// The SwiGLU MLP of each token's top-k experts, quantized weights, for mx.fast.metal_kernel.
// Twin: expert_swiglu.cu. Reference: reference.expert_swiglu. Launcher: experts.py.
//
// Two kernels. gate_up: one threadgroup per (token-expert pair, block of hidden rows); x is
// staged in threadgroup memory, each simdgroup takes ROWS hidden rows, its lanes walk the
// row's packed gate and up codes together (x read once for both) and one lane writes
// silu(gate) * up. down: the same shape over the down projection, reading that pair's
// hidden vector. The hidden vector (k x hidden floats per token, 24 KB for a 30B-A3B layer)
// is the one round trip through memory: fusing down into gate_up would leave one
// threadgroup per pair, 8 per token, too few to keep a GPU's memory system busy.

// --- header ---
// W and P are deduced (device or constant address space: MLX passes inputs of fewer than 8
// elements as constant).
template <int BITS, int GS, typename W, typename P>
inline float lmsp_code(W w, P scales, P biases, int e) {
    int off = e * BITS, word = off >> 5, shift = off & 31;
    uint32_t v = w[word] >> shift;
    if (shift + BITS > 32) v |= w[word + 1] << (32 - shift);
    v &= (1u << BITS) - 1u;
    return float(scales[e / GS]) * float(v) + float(biases[e / GS]);
}

// --- gate_up ---
// inputs: x (T, D), idx (T*K) uint32, gw/gs/gb and uw/us/ub (E, H, ...); output: hid (T*K, H) float
const uint lane = thread_index_in_simdgroup, warp = simdgroup_index_in_threadgroup;
const int pair = threadgroup_position_in_grid.y, token = pair / K;
const int expert = idx[pair];
threadgroup float xs[D];
for (int e = thread_index_in_threadgroup; e < D; e += threads_per_threadgroup.x) xs[e] = float(x[token * D + e]);
threadgroup_barrier(mem_flags::mem_threadgroup);
const int row0 = (threadgroup_position_in_grid.x * WARPS + warp) * ROWS;
constexpr int WORDS = D * BITS / 32, GROUPS = D / GS;
for (int r = row0; r < min(row0 + ROWS, H); r++) {
    const long row = long(expert) * H + r;
    float g = 0.0f, u = 0.0f;
    for (int e = lane; e < D; e += 32) {
        g += lmsp_code<BITS, GS>(gw + row * WORDS, gs + row * GROUPS, gb + row * GROUPS, e) * xs[e];
        u += lmsp_code<BITS, GS>(uw + row * WORDS, us + row * GROUPS, ub + row * GROUPS, e) * xs[e];
    }
    g = simd_sum(g);
    u = simd_sum(u);
    if (lane == 0) hid[long(pair) * H + r] = g / (1.0f + metal::exp(-g)) * u;
}

// --- down ---
// inputs: hid (T*K, H) float, idx (T*K) uint32, dw/ds/db (E, D, ...); output: y (T*K, D)
const uint lane = thread_index_in_simdgroup, warp = simdgroup_index_in_threadgroup;
const int pair = threadgroup_position_in_grid.y;
const int expert = idx[pair];
threadgroup float hs[H];
for (int e = thread_index_in_threadgroup; e < H; e += threads_per_threadgroup.x) hs[e] = hid[long(pair) * H + e];
threadgroup_barrier(mem_flags::mem_threadgroup);
const int row0 = (threadgroup_position_in_grid.x * WARPS + warp) * ROWS;
constexpr int WORDS = H * BITS / 32, GROUPS = H / GS;
for (int r = row0; r < min(row0 + ROWS, D); r++) {
    const long row = long(expert) * D + r;
    float s = 0.0f;
    for (int e = lane; e < H; e += 32) s += lmsp_code<BITS, GS>(dw + row * WORDS, ds + row * GROUPS, db + row * GROUPS, e) * hs[e];
    s = simd_sum(s);
    if (lane == 0) y[long(pair) * D + r] = static_cast<Y>(s);
}
