// The SwiGLU MLP of each token's top-k experts, quantized weights, for mx.fast.cuda_kernel.
// Twin of expert_swiglu.metal (same two kernels, same names, the same 32-code chunks; see
// its comment), plus `fused`, both in one launch for decode, at the end.

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

// The kernels' input row (x, or a pair's hidden vector) into shared memory in the staged
// layout, `xs`, and each chunk's sum, `xsum`, as member m of the block's pairs (at m * N and
// m * N / 32). Every thread of the block calls it. (The arrays are template parameters so
// tests/simt.py can hand in its traced arrays.)
template <int N, typename In, typename Staged, typename Sums>
__device__ inline void lmsp_stage(const In* row, Staged& xs, Sums& xsum, int m = 0) {
    for (int e = threadIdx.x; e < N; e += blockDim.x) xs[m * N + lmsp_staged(e >> 5, e & 31)] = static_cast<float>(row[e]);
    __syncthreads();
    for (int c = threadIdx.x; c < N / 32; c += blockDim.x) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += xs[m * N + lmsp_staged(c, i)];
        xsum[m * (N / 32) + c] = s;
    }
    __syncthreads();
}

// Pairs that chose the same expert share its reads (see the Metal twin): pair p's block
// takes p and the next pairs of its expert, SHARE at most, where the pairs of that expert
// before p are a multiple of SHARE; every other pair's block gets 0 and ends.
template <int SHARE, typename M>
__device__ inline int lmsp_members(const uint32_t* idx, int pairs, int pair, M& members) {
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

// A warp's ROWS gate and up rows, `first` on, of `expert` (rows past H re-read row H - 1)
// against the staged x: silu(gate) * up of each, on every lane. For each chunk a lane
// takes it copies the chunk's 32 x values to registers once and reads that chunk of every
// row, gate and up, so all their loads are in flight together.
template <int ROWS, int BITS, int D, int H, int GS, typename S, typename Staged, typename Sums>
__device__ inline void lmsp_gate_up_rows(const uint32_t* gw, const S* gs, const S* gb, const uint32_t* uw,
                                         const S* us, const S* ub, int expert, int first, Staged& xs, Sums& xsum,
                                         int lane, float* hidden, int m = 0) {
    constexpr int CHUNKS = D / 32, WORDS = D * BITS / 32, GROUPS = D / GS, TRIPS = (CHUNKS + 31) / 32;
    float g[ROWS], u[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) g[r] = u[r] = 0.0f;
#pragma unroll
    for (int t = 0; t < TRIPS; t++) {
        const int c = lane + 32 * t;
        if (c < CHUNKS) {
            float xc[32];
#pragma unroll
            for (int i = 0; i < 32; i++) xc[i] = xs[m * D + lmsp_staged(c, i)];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const long row = long(expert) * H + min(first + r, H - 1);
                const long q = row * GROUPS + c * 32 / GS;
                g[r] += static_cast<float>(gs[q]) * lmsp_chunk_dot<BITS>(gw + row * WORDS + c * BITS, xc) + static_cast<float>(gb[q]) * xsum[m * CHUNKS + c];
                u[r] += static_cast<float>(us[q]) * lmsp_chunk_dot<BITS>(uw + row * WORDS + c * BITS, xc) + static_cast<float>(ub[q]) * xsum[m * CHUNKS + c];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float gr = lmsp_warp_sum(g[r]), ur = lmsp_warp_sum(u[r]);
        hidden[r] = gr / (1.0f + __expf(-gr)) * ur;
    }
}

// --- gate_up ---
// inputs: x (T, D), idx (T*K) uint32, gw/gs/gb and uw/us/ub (E, H, ...); output: hid (T*K, H) float
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int pair = blockIdx.y;
__shared__ int members[SHARE];
__shared__ int count;
if (threadIdx.x == 0) count = lmsp_members<SHARE>(idx, gridDim.y, pair, members);
__syncthreads();
if (count == 0) return;  // an earlier block takes this pair
const int expert = idx[pair];
__shared__ float xs[SHARE * D];  // member m's x at m * D
__shared__ float xsum[SHARE * (D / 32)];
for (int m = 0; m < count; m++) lmsp_stage<D>(x + long(members[m] / K) * D, xs, xsum, m);
const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
for (int m = 0; m < count; m++) {
    float hidden[ROWS];
    lmsp_gate_up_rows<ROWS, BITS, D, H, GS>(gw, gs, gb, uw, us, ub, expert, row0, xs, xsum, lane, hidden, m);
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        if (lane == 0 && row0 + r < H) hid[long(members[m]) * H + row0 + r] = hidden[r];
}

// --- down ---
// inputs: hid (T*K, H) float, idx (T*K) uint32, dw/ds/db (E, D, ...); output: y (T*K, D)
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int pair = blockIdx.y;
__shared__ int members[SHARE];
__shared__ int count;
if (threadIdx.x == 0) count = lmsp_members<SHARE>(idx, gridDim.y, pair, members);
__syncthreads();
if (count == 0) return;
const int expert = idx[pair];
constexpr int CHUNKS = H / 32, WORDS = H * BITS / 32, GROUPS = H / GS, TRIPS = (CHUNKS + 31) / 32;
__shared__ float xs[SHARE * H];  // each member's hidden vector, staged as gate_up stages x
__shared__ float xsum[SHARE * CHUNKS];
for (int m = 0; m < count; m++) lmsp_stage<H>(hid + long(members[m]) * H, xs, xsum, m);
const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
for (int m = 0; m < count; m++) {
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
#pragma unroll
    for (int t = 0; t < TRIPS; t++) {
        const int c = lane + 32 * t;
        if (c < CHUNKS) {
            float hc[32];
#pragma unroll
            for (int i = 0; i < 32; i++) hc[i] = xs[m * H + lmsp_staged(c, i)];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const long row = long(expert) * D + min(row0 + r, D - 1);
                const long q = row * GROUPS + c * 32 / GS;
                acc[r] += static_cast<float>(ds[q]) * lmsp_chunk_dot<BITS>(dw + row * WORDS + c * BITS, hc) + static_cast<float>(db[q]) * xsum[m * CHUNKS + c];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float s = lmsp_warp_sum(acc[r]);
        if (lane == 0 && row0 + r < D) y[long(members[m]) * D + row0 + r] = static_cast<Y>(s);
    }
}

// --- fused ---
// One launch for decode (CUDA only): one block per (token-expert pair, slice of SLICE hidden
// rows). The block computes its slice of silu(gate) * up into shared memory, multiplies it
// by the same slice of every down row (SLICE / 32 chunks a row) and writes that partial
// output, float, to `scratch`; the pair's last block to finish (a counter per pair after
// the partials, zeroed with them by the launch's init_value) sums the pair's partials in
// slice order, so the result does not depend on which block finished last, and writes y.
// The hidden vector never leaves the block, and a call is one MLX operation instead of
// two: on the H200 every launch shape took 60-90 us, far above its reads, which points at
// MLX's cost per operation (kernel_sweep.py times both forms).
// inputs: x, idx, gate/up (as gate_up), dw/ds/db (as down); outputs: y (T*K, D),
// scratch (T*K * SLICES * D floats, then T*K counters)
static_assert(SLICE % 32 == 0 && H % SLICE == 0 && SLICE % (WARPS * ROWS) == 0, "SLICE: whole chunks, whole rounds");
constexpr int SLICES = H / SLICE, PER = SLICE / 32;
const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
const int slice = blockIdx.x, pair = blockIdx.y, pairs = gridDim.y, token = pair / K;
const int expert = idx[pair];
constexpr int H_WORDS = H * BITS / 32, H_GROUPS = H / GS;
__shared__ float xs[D];
__shared__ float xsum[D / 32];
__shared__ float hsl[SLICE];
__shared__ bool last;
lmsp_stage<D>(x + long(token) * D, xs, xsum);
// The slice's gate and up rows, ROWS a warp at a time, as gate_up computes them.
for (int r0 = warp * ROWS; r0 < SLICE; r0 += WARPS * ROWS) {
    float hidden[ROWS];
    lmsp_gate_up_rows<ROWS, BITS, D, H, GS>(gw, gs, gb, uw, us, ub, expert, slice * SLICE + r0, xs, xsum, lane,
                                            hidden);
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        if (lane == 0) hsl[r0 + r] = hidden[r];
}
__syncthreads();
// Every down row's slice against it: a thread a row, all threads reading the same hidden
// values (a broadcast), consecutive threads on consecutive rows.
float hc[PER][32], hsum[PER];
#pragma unroll
for (int p = 0; p < PER; p++) {
    hsum[p] = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        hc[p][i] = hsl[p * 32 + i];
        hsum[p] += hc[p][i];
    }
}
// A thread's rows are a compile-time count, unrolled 8 at a time, so the loads of 8 rows
// are in flight together rather than one row's at a time.
constexpr int THREADS = 32 * WARPS, MINE = (D + THREADS - 1) / THREADS;
float* partial = scratch + (long(pair) * SLICES + slice) * D;
#pragma unroll 8
for (int j = 0; j < MINE; j++) {
    const int d = threadIdx.x + j * THREADS;
    const long row = long(expert) * D + min(d, D - 1);
    float acc = 0.0f;
#pragma unroll
    for (int p = 0; p < PER; p++) {
        const int c = slice * PER + p;
        const long q = row * H_GROUPS + c * 32 / GS;
        acc += static_cast<float>(ds[q]) * lmsp_chunk_dot<BITS>(dw + row * H_WORDS + c * BITS, hc[p]) + static_cast<float>(db[q]) * hsum[p];
    }
    if (d < D) partial[d] = acc;
}
// The last block of the pair: its partials, and every other block's, are in memory before
// the counter says so (each thread fences its own writes, then one thread counts).
__threadfence();
__syncthreads();
if (threadIdx.x == 0) {
    unsigned int* counters = reinterpret_cast<unsigned int*>(scratch + long(pairs) * SLICES * D);
    last = atomicAdd(counters + pair, 1u) == SLICES - 1;
}
__syncthreads();
if (last) {
    __threadfence();
    const float* mine = scratch + long(pair) * SLICES * D;
    for (int d = threadIdx.x; d < D; d += THREADS) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < SLICES; k++) s += __ldcg(mine + long(k) * D + d);  // past L1: other SMs wrote these
        y[long(pair) * D + d] = static_cast<Y>(s);
    }
}
