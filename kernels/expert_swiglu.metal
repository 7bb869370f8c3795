// The SwiGLU MLP of each token's top-k experts, quantized weights, for mx.fast.metal_kernel.
// Twin: expert_swiglu.cu. Reference: reference.expert_swiglu. Launcher: experts.py.
//
// Two kernels. gate_up: one threadgroup per (token-expert pair, block of hidden rows), the
// pairs of a batch that chose one expert taken SHARE at a time by one threadgroup, which
// reads that expert's rows once for all of them (lmsp_members); x is staged in threadgroup memory, each simdgroup takes ROWS hidden rows, its lanes walk the
// row's packed gate and up codes together (x read once for both) and one lane writes
// silu(gate) * up. down: the same shape over the down projection, reading that pair's
// hidden vector. The hidden vector (k x hidden floats per token, 24 KB for a 30B-A3B layer)
// is the one round trip through memory: fusing down into gate_up would leave one
// threadgroup per pair, 8 per token, too few to keep a GPU's memory system busy.
//
// A lane reads a row in chunks of 32 codes: BITS whole words (so no code straddles two
// chunks, whatever the width) under one scale and bias (groups are 32 or 64 codes). The
// 32 lanes read 32 consecutive chunks, 128 * BITS contiguous bytes, per step. A chunk's dot
// product with x is scale * sum(code * x) + bias * sum(x), and the sums of x per chunk are
// computed once per threadgroup, beside x.
//
// A simdgroup works its ROWS rows together: for each chunk a lane takes, it copies the 32
// x values to registers once and reads that chunk of every row (both gate and up), so the
// loads of all rows are independent and in flight at once (ROWS * 2 * BITS words a lane),
// instead of one row's waiting on the previous row's reduction. Rows past the end of the
// matrix re-read its last row and are not written.

// --- header ---
// W and X are deduced: MLX passes an input of fewer than 8 elements in the constant address
// space, x sits in threadgroup memory; no address space is spelled out.
template <int BITS, typename W, typename X>
inline float lmsp_chunk_dot(W w, X x) {
    uint32_t words[BITS];
    for (int j = 0; j < BITS; j++) words[j] = w[j];
    float s = 0.0f;
    for (int i = 0; i < 32; i++) {
        const int off = i * BITS, word = off >> 5, shift = off & 31;
        uint32_t v = words[word] >> shift;
        if (shift + BITS > 32) v |= words[word + 1] << (32 - shift);
        s += float(v & ((1u << BITS) - 1u)) * x[i];
    }
    return s;
}

// Where value i of chunk c sits in the staged x (or hidden) vector. Lane L reads chunk
// L + 32t, so a plain layout (c * 32 + i) puts all 32 lanes' reads of value i in one bank:
// a 32-way conflict on every read of the staged vector (8-way per 16-byte read). Swapping
// the chunk's 16-byte blocks by c & 7 sends eight neighbouring lanes to eight different
// blocks: 16-byte reads without conflict, 4-byte reads at most 4-way. (Those are NVIDIA's
// 32 four-byte banks, which the CUDA twin shares; Apple does not publish its banking.)
// Only the layout changes, not what is summed in which order.
inline int lmsp_staged(int c, int i) { return c * 32 + ((((i >> 2) ^ c) & 7) << 2) + (i & 3); }

// Pairs that chose the same expert share its reads: pair p's threadgroup takes p and the
// next pairs of its expert, in pair order, SHARE at most, where the pairs of that expert
// before p are a multiple of SHARE (their `members`, the count returned); every other
// pair's threadgroup returns 0 and ends, its pair taken by an earlier one. The members'
// rows are read from memory once: the first member's loads bring each chunk into the
// cache, the others' hit it.
template <int SHARE, typename I, typename M>
inline int lmsp_members(I idx, int pairs, int pair, M members) {
    if (SHARE == 1) {
        members[0] = pair;
        return 1;
    }
    const uint32_t expert = idx[pair];
    int before = 0, n = 0;
    for (int q = 0; q < pairs; q++) {
        if (idx[q] != expert) continue;
        if (q < pair) before++;
        else if (n < SHARE) members[n++] = q;
    }
    return before % SHARE == 0 ? n : 0;
}

// --- gate_up ---
// inputs: x (T, D), idx (T*K) uint32, gw/gs/gb and uw/us/ub (E, H, ...); output: hid (T*K, H) float
const uint lane = thread_index_in_simdgroup, warp = simdgroup_index_in_threadgroup;
const int pair = threadgroup_position_in_grid.y;
threadgroup int members[SHARE];
threadgroup int count;
if (thread_index_in_threadgroup == 0) count = lmsp_members<SHARE>(idx, int(threadgroups_per_grid.y), pair, members);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (count == 0) return;  // an earlier threadgroup takes this pair
const int expert = idx[pair];
constexpr int CHUNKS = D / 32, WORDS = D * BITS / 32, GROUPS = D / GS, TRIPS = (CHUNKS + 31) / 32;
threadgroup float xs[SHARE * D];  // each member's x, member m's at m * D
threadgroup float xsum[SHARE * CHUNKS];
for (int m = 0; m < count; m++) {
    const int token = members[m] / K;
    for (int e = thread_index_in_threadgroup; e < D; e += threads_per_threadgroup.x) xs[m * D + lmsp_staged(e >> 5, e & 31)] = float(x[token * D + e]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int mc = thread_index_in_threadgroup; mc < count * CHUNKS; mc += threads_per_threadgroup.x) {
    const int m = mc / CHUNKS, c = mc % CHUNKS;
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += xs[m * D + lmsp_staged(c, i)];
    xsum[m * CHUNKS + c] = s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const int row0 = (threadgroup_position_in_grid.x * WARPS + warp) * ROWS;
for (int m = 0; m < count; m++) {
    float g[ROWS], u[ROWS];
    for (int r = 0; r < ROWS; r++) g[r] = u[r] = 0.0f;
    for (int t = 0; t < TRIPS; t++) {
        const int c = int(lane) + 32 * t;
        if (c < CHUNKS) {
            float xc[32];
            for (int i = 0; i < 32; i++) xc[i] = xs[m * D + lmsp_staged(c, i)];
            for (int r = 0; r < ROWS; r++) {
                const long row = long(expert) * H + min(row0 + r, H - 1);
                const long q = row * GROUPS + c * 32 / GS;
                g[r] += float(gs[q]) * lmsp_chunk_dot<BITS>(gw + row * WORDS + c * BITS, xc) + float(gb[q]) * xsum[m * CHUNKS + c];
                u[r] += float(us[q]) * lmsp_chunk_dot<BITS>(uw + row * WORDS + c * BITS, xc) + float(ub[q]) * xsum[m * CHUNKS + c];
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const float gr = simd_sum(g[r]), ur = simd_sum(u[r]);
        if (lane == 0 && row0 + r < H) hid[long(members[m]) * H + row0 + r] = gr / (1.0f + metal::exp(-gr)) * ur;
    }
}

// --- down ---
// inputs: hid (T*K, H) float, idx (T*K) uint32, dw/ds/db (E, D, ...); output: y (T*K, D)
const uint lane = thread_index_in_simdgroup, warp = simdgroup_index_in_threadgroup;
const int pair = threadgroup_position_in_grid.y;
threadgroup int members[SHARE];
threadgroup int count;
if (thread_index_in_threadgroup == 0) count = lmsp_members<SHARE>(idx, int(threadgroups_per_grid.y), pair, members);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (count == 0) return;
const int expert = idx[pair];
constexpr int CHUNKS = H / 32, WORDS = H * BITS / 32, GROUPS = H / GS, TRIPS = (CHUNKS + 31) / 32;
threadgroup float xs[SHARE * H];  // each member's hidden vector, staged as gate_up stages x
threadgroup float xsum[SHARE * CHUNKS];
for (int m = 0; m < count; m++)
    for (int e = thread_index_in_threadgroup; e < H; e += threads_per_threadgroup.x) xs[m * H + lmsp_staged(e >> 5, e & 31)] = hid[long(members[m]) * H + e];
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int mc = thread_index_in_threadgroup; mc < count * CHUNKS; mc += threads_per_threadgroup.x) {
    const int m = mc / CHUNKS, c = mc % CHUNKS;
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += xs[m * H + lmsp_staged(c, i)];
    xsum[m * CHUNKS + c] = s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const int row0 = (threadgroup_position_in_grid.x * WARPS + warp) * ROWS;
for (int m = 0; m < count; m++) {
    float acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    for (int t = 0; t < TRIPS; t++) {
        const int c = int(lane) + 32 * t;
        if (c < CHUNKS) {
            float hc[32];
            for (int i = 0; i < 32; i++) hc[i] = xs[m * H + lmsp_staged(c, i)];
            for (int r = 0; r < ROWS; r++) {
                const long row = long(expert) * D + min(row0 + r, D - 1);
                const long q = row * GROUPS + c * 32 / GS;
                acc[r] += float(ds[q]) * lmsp_chunk_dot<BITS>(dw + row * WORDS + c * BITS, hc) + float(db[q]) * xsum[m * CHUNKS + c];
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const float s = simd_sum(acc[r]);
        if (lane == 0 && row0 + r < D) y[long(members[m]) * D + row0 + r] = static_cast<Y>(s);
    }
}
