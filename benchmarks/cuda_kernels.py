"""The CUDA twins' own GPU time, outside MLX: CUDA events around graph replays.

    python -m benchmarks.cuda_kernels [--arch sm_90] [--build-only DIR] [--out benchmarks/results] [--append]

benchmarks/kernels.py times a kernel the way a model calls it through MLX, and on the H200
every launch shape came out near the same 60-75 µs: MLX's cost per operation (Python,
the graph node, its update), not the kernel. This measures the kernel alone, to hold it
against the memory-bandwidth bound: each body is compiled as MLX assembles it
(kernels/cuda_source.py) into a small CUDA program that fills random inputs, checks one
call against a float computation on the host, then captures a graph of calls (each call
reading its own copy of the KV cache, or its own 8 of 128 experts, so reads come from
memory, not the 50 MB L2) and times its replays with CUDA events (median of 20).

Reported per call: µs, the bytes it must read, its share of the read bandwidth measured
in the same run (a float4 sum over 1 GiB), "of bound" (time over bytes / bandwidth), and
the launch floor (a graph of empty kernels: the least two launches can take).
Shapes are benchmarks/kernels.py's (Qwen3-30B-A3B decode; 32/4 heads of 128). Each
launch shape of kernel_sweep.py's best is timed too. Needs nvcc and an NVIDIA GPU;
--build-only compiles without running (the test suite does that where nvcc exists).
Writes cuda_kernels.csv (with the run's provenance columns; `--append` adds to its history).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import Provenance, output_arguments, write_rows
from lmsp_mlx.kernels.attention import float_bits
from lmsp_mlx.kernels.cuda_source import STAND_IN, extras, kernel
from lmsp_mlx.kernels.sources import body as section_body, sections

HIDDEN, EXPERT_HIDDEN, EXPERTS, TOP_K = 2048, 768, 128, 8
KV_HEADS, ROWS_PER_KV, HEAD_DIM, GROUP = 4, 8, 128, 64  # 32 query heads over 4 KV heads
CONTEXTS = (8192, 16384, 32768)
SPREAD = 256 << 20  # bytes one graph's calls read in all: five times the H200's L2
# (bits, WARPS, BATCH, CHUNK, fused): the default first, then kernel_sweep.py's runners-up;
# fused: the splits merged by the last one in the same launch ("state+body+last"), else by `merge`
ATTENTION = [(4, 4, 4, 256, True), (8, 4, 4, 256, True), (4, 4, 4, 256, False), (4, 8, 4, 512, True),
             (4, 4, 8, 512, True), (4, 4, 2, 256, True)]
# (bits, WARPS, ROWS, SLICE): SLICE 0 is the two launches (gate_up, down), else the fused one
EXPERT = [(4, 4, 4, 0), (2, 4, 4, 0), (4, 4, 2, 0), (4, 2, 8, 0), (4, 8, 4, 32), (2, 8, 4, 32), (4, 8, 4, 64)]
HALF, U32 = "__half", "uint32_t"

COMMON = r"""
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __host__ inline uint32_t mix(uint64_t i, uint32_t seed) {  // splitmix-style hash
    uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return uint32_t(z ^ (z >> 31));
}
__global__ void fill_bits(uint32_t* p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = mix(i, seed);
}
__global__ void fill_uniform(__half* p, size_t n, float lo, float hi, uint32_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = __float2half(lo + (hi - lo) * (mix(i, seed) >> 8) * (1.0f / 16777216.0f));
}
__global__ void empty_kernel() {}
// What MLX's init_value does before a one-launch kernel: a fill kernel per output.
__global__ void fill_zero(uint32_t* p, size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = 0;
}
#define FILL_ZERO(p, bytes) fill_zero<<<256, 256, 0, s>>>(reinterpret_cast<uint32_t*>(p), (bytes) / 4)
__global__ void read_sum(const float4* p, size_t n, float* out) {
    float s = 0.0f;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        float4 v = p[i];
        s += v.x + v.y + v.z + v.w;
    }
    if (s == 1234.5f) out[0] = s;  // keeps the reads (the compiler cannot know it never holds)
}

static uint32_t* bits_buffer(size_t n, uint32_t seed) {
    uint32_t* p; CHECK(cudaMalloc(&p, n * 4)); fill_bits<<<1024, 256>>>(p, n, seed); return p;
}
static __half* half_buffer(size_t n, float lo, float hi, uint32_t seed) {
    __half* p; CHECK(cudaMalloc(&p, n * 2)); fill_uniform<<<1024, 256>>>(p, n, lo, hi, seed); return p;
}
template <typename T> static std::vector<T> host(const T* p, size_t n) {
    std::vector<T> v(n); CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost)); return v;
}
static std::vector<float> host_float(const __half* p, size_t n) {
    auto h = host(p, n); std::vector<float> f(n);
    for (size_t i = 0; i < n; i++) f[i] = __half2float(h[i]);
    return f;
}
// Row r's code i of an MLX affine-packed matrix: little-endian bit stream in uint32 words.
static float dequant(const std::vector<uint32_t>& w, const std::vector<float>& s, const std::vector<float>& b,
                     size_t row, int cols, int bits, int gs, int i) {
    size_t words = size_t(cols) * bits / 32, off = size_t(i) * bits, wi = row * words + off / 32;
    int shift = off % 32;
    uint64_t v = w[wi] >> shift;
    if (shift + bits > 32) v |= uint64_t(w[wi + 1]) << (32 - shift);
    v &= (1u << bits) - 1u;
    size_t g = row * (cols / gs) + i / gs;
    return s[g] * float(v) + b[g];
}
static Shape shape4(int a, int b, int c, int d) { Shape s{}; s[0] = a; s[1] = b; s[2] = c; s[3] = d; return s; }
static Strides strides4(long a, long b, long c, long d) { Strides s{}; s[0] = a; s[1] = b; s[2] = c; s[3] = d; return s; }

// Median µs of one replay of a graph of the calls that `launch` makes on `stream`.
template <typename F> static double graph_us(cudaStream_t stream, F launch, int replays = 20) {
    cudaGraph_t graph; cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch();
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int i = 0; i < replays; i++) {
        CHECK(cudaEventRecord(a, stream)); CHECK(cudaGraphLaunch(exec, stream)); CHECK(cudaEventRecord(b, stream));
        CHECK(cudaEventSynchronize(b));
        float t; CHECK(cudaEventElapsedTime(&t, a, b)); ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CHECK(cudaGraphExecDestroy(exec)); CHECK(cudaGraphDestroy(graph));
    return ms[ms.size() / 2] * 1e3;
}
"""

BANDWIDTH_MAIN = r"""
int main() {
    cudaStream_t s; CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    size_t n = (size_t(1) << 30) / 16;
    float4* p; float* out; CHECK(cudaMalloc(&p, n * 16)); CHECK(cudaMalloc(&out, 4));
    fill_bits<<<1024, 256>>>(reinterpret_cast<uint32_t*>(p), n * 4, 1);
    CHECK(cudaDeviceSynchronize());
    int sms; CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    double us = graph_us(s, [&] { read_sum<<<sms * 8, 512, 0, s>>>(p, n, out); });
    printf("CSV,bandwidth,read 1 GiB,0,0,%.3f,%zu,0\n", us, n * 16);
    const int calls = 64;
    double floor_us = graph_us(s, [&] { for (int i = 0; i < 2 * calls; i++) empty_kernel<<<1, 32, 0, s>>>(); });
    printf("CSV,floor,two empty launches,0,0,%.3f,0,0\n", floor_us / calls);
    return 0;
}
"""


def call(name: str, grid: str, block: str, inputs: list[str], outputs: list[str], stem: str, section: str) -> str:
    """A launch of kernel `name`, its arguments in MLX's order (host variables named alike)."""
    body = section_body(f"{stem}.cu", section)
    args = []
    for arg in inputs:
        args += [arg, *(f"{arg}_{kind}" for kind in extras(body, arg))]
    return f"{name}<<<{grid}, {block}, 0, s>>>({', '.join(args + outputs)});"


def attention_program(bits: int, warps: int, batch: int, chunk: int, fused: bool = False) -> str:
    """Times one launch shape: body then merge, or (fused) state+body+last, which, as under
    MLX's init_value, zeroes each of its outputs with a fill kernel before each launch."""
    tag = f"b{bits}_w{warps}_t{batch}_c{chunk}_{'f' if fused else 'm'}"
    scale = HEAD_DIM**-0.5
    section = "state+body+last" if fused else "body"
    states = ["o_acc", "out"] if fused else ["o_acc", "o_max", "o_sum"]  # fused: o_acc is the whole state
    body = kernel("decode_attention", section,
                  [("q", HALF), ("kw", U32), ("ks", HALF), ("kb", HALF), ("vw", U32), ("vs", HALF), ("vb", HALF),
                   ("first", "int32_t")],
                  [("state", "float"), ("result", HALF)] if fused
                  else [("o_acc", "float"), ("o_max", "float"), ("o_sum", "float")],
                  [("T", HALF), ("S", HALF), ("D", HEAD_DIM), ("G", ROWS_PER_KV), ("BITS", bits), ("GS", GROUP),
                   ("WARPS", warps), ("BATCH", batch), ("CHUNK", chunk), ("SCALE", float_bits(scale))], name=f"body_{tag}")
    merge = kernel("decode_attention", "merge", [("acc", "float"), ("tops", "float"), ("totals", "float")],
                   [("out", HALF)], [("T", HALF), ("D", HEAD_DIM), ("G", ROWS_PER_KV)], name="merge_kernel")
    launches = call(f"mlx::core::cu::body_{tag}", "dim3(1, H, splits)", f"dim3({32 * warps})",
                    ["q", "kw", "ks", "kb", "vw", "vs", "vb", "first"], states, "decode_attention", section)
    if fused:
        launches = ("FILL_ZERO(o_acc, (size_t(H) * splits * G * (D + 2) + H) * 4); "
                    "FILL_ZERO(out, size_t(H) * G * D * 2);\n            " + launches)
    else:
        launches += "\n            " + call("mlx::core::cu::merge_kernel", "dim3(1, H * G)", "dim3(32)",
                                             ["acc", "tops", "totals"], ["out"], "decode_attention", "merge")
    config = f"WARPS={warps} BATCH={batch} CHUNK=%d{' one launch' if fused else ''}"
    return f"""{STAND_IN}{COMMON}
{sections('decode_attention.cu')['header']}
{body}
{merge}
int main() {{
    const int H = {KV_HEADS}, G = {ROWS_PER_KV}, D = {HEAD_DIM}, BITS = {bits}, GS = {GROUP}, CHUNK = {chunk};
    const float scale = {scale!r}f;
    cudaStream_t s; CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int n : {{{', '.join(map(str, CONTEXTS))}}}) {{
        const int words = D * BITS / 32, groups = D / GS, splits = (n + CHUNK - 1) / CHUNK;
        const size_t wn = size_t(H) * n * words, sn = size_t(H) * n * groups;
        const size_t bytes = 2 * (wn * 4 + 2 * sn * 2);
        const int copies = std::max<size_t>(1, std::min<size_t>(64, ({SPREAD}ull + bytes - 1) / bytes));
        std::vector<uint32_t*> kws, vws; std::vector<__half*> kss, kbs, vss, vbs;
        const float lo = 0.5f / (1 << BITS), hi = 1.5f / (1 << BITS);
        for (int c = 0; c < copies; c++) {{
            kws.push_back(bits_buffer(wn, 6 * c + 1)); vws.push_back(bits_buffer(wn, 6 * c + 2));
            kss.push_back(half_buffer(sn, lo, hi, 6 * c + 3)); kbs.push_back(half_buffer(sn, -1.0f, 0.0f, 6 * c + 4));
            vss.push_back(half_buffer(sn, lo, hi, 6 * c + 5)); vbs.push_back(half_buffer(sn, -1.0f, 0.0f, 6 * c + 6));
        }}
        __half* q = half_buffer(size_t(H) * G * D, -1.0f, 1.0f, 999);
        int32_t* first; CHECK(cudaMalloc(&first, 4)); CHECK(cudaMemset(first, 0, 4));  // one sequence, no padding
        CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy stream; `s` does not wait for it
        float *o_acc, *o_max, *o_sum; __half* out;  // fused: o_acc is big enough for the whole state
        CHECK(cudaMalloc(&o_acc, (size_t(H) * splits * G * (D + 2) + H) * 4));
        CHECK(cudaMalloc(&o_max, size_t(H) * splits * G * 4));
        CHECK(cudaMalloc(&o_sum, (size_t(H) * splits * G + H) * 4)); CHECK(cudaMalloc(&out, size_t(H) * G * D * 2));
        float *acc = o_acc, *tops = o_max, *totals = o_sum;
        const Shape kw_shape = shape4(1, H, n, words), acc_shape = shape4(H, splits, G, D);
        const Strides kw_strides = strides4(long(H) * n * words, long(n) * words, words, 1), vw_strides = kw_strides;
        const Strides ks_strides = strides4(long(H) * n * groups, long(n) * groups, groups, 1);
        const Strides kb_strides = ks_strides, vs_strides = ks_strides, vb_strides = ks_strides;
        auto one = [&](int c) {{
            const uint32_t *kw = kws[c], *vw = vws[c];
            const __half *ks = kss[c], *kb = kbs[c], *vs = vss[c], *vb = vbs[c];
            {launches}
        }};
        // One call against a float computation on the host (copy 0).
        CHECK(cudaMemset(out, 0xff, size_t(H) * G * D * 2));  // NaNs (zeros once a fused launch fills it): unwritten shows as error
        CHECK(cudaDeviceSynchronize());
        one(0);
        CHECK(cudaStreamSynchronize(s)); CHECK(cudaGetLastError());
        auto got = host_float(out, size_t(H) * G * D), qh = host_float(q, size_t(H) * G * D);
        auto kw0 = host(kws[0], wn), vw0 = host(vws[0], wn);
        auto ks0 = host_float(kss[0], sn), kb0 = host_float(kbs[0], sn), vs0 = host_float(vss[0], sn), vb0 = host_float(vbs[0], sn);
        double err = 0, ref = 0;
        std::vector<double> score(size_t(G) * n), acc_h(size_t(G) * D), row(D);
        for (int h = 0; h < H; h++) {{
            for (int p = 0; p < n; p++) {{  // each cached row decoded once, against the head's G query rows
                for (int i = 0; i < D; i++) row[i] = dequant(kw0, ks0, kb0, size_t(h) * n + p, D, BITS, GS, i);
                for (int g = 0; g < G; g++) {{
                    double dot = 0;
                    for (int i = 0; i < D; i++) dot += qh[(h * G + g) * D + i] * row[i];
                    score[size_t(g) * n + p] = dot * scale;
                }}
            }}
            std::vector<double> top(G, -1e300), total(G, 0.0);
            for (int g = 0; g < G; g++) for (int p = 0; p < n; p++) top[g] = std::max(top[g], score[size_t(g) * n + p]);
            std::fill(acc_h.begin(), acc_h.end(), 0.0);
            for (int p = 0; p < n; p++) {{
                for (int i = 0; i < D; i++) row[i] = dequant(vw0, vs0, vb0, size_t(h) * n + p, D, BITS, GS, i);
                for (int g = 0; g < G; g++) {{
                    double w = std::exp(score[size_t(g) * n + p] - top[g]); total[g] += w;
                    for (int i = 0; i < D; i++) acc_h[size_t(g) * D + i] += w * row[i];
                }}
            }}
            for (int g = 0; g < G; g++) for (int i = 0; i < D; i++) {{
                double want = acc_h[size_t(g) * D + i] / total[g], have = got[(h * G + g) * D + i];
                err = std::max(err, std::isnan(have) ? 1e300 : std::fabs(have - want)); ref = std::max(ref, std::fabs(want));
            }}
        }}
        double us = graph_us(s, [&] {{ for (int c = 0; c < copies; c++) one(c); }}) / copies;
        printf("CSV,attention,{config},%d,%d,%.3f,%zu,%.3g\\n", CHUNK, n, BITS, us, bytes, err / ref);
        fflush(stdout);
        for (int c = 0; c < copies; c++) {{
            CHECK(cudaFree(kws[c])); CHECK(cudaFree(vws[c])); CHECK(cudaFree(kss[c])); CHECK(cudaFree(kbs[c]));
            CHECK(cudaFree(vss[c])); CHECK(cudaFree(vbs[c]));
        }}
        CHECK(cudaFree(q)); CHECK(cudaFree(first)); CHECK(cudaFree(o_acc)); CHECK(cudaFree(o_max)); CHECK(cudaFree(o_sum)); CHECK(cudaFree(out));
    }}
    return 0;
}}
"""


def expert_program(bits: int, warps: int, rows: int, slice_: int = 0) -> str:
    """Times one launch shape: the two launches, or (slice_ > 0) the fused one, which, as
    under MLX's init_value, zeroes each of its outputs with a fill kernel before each launch."""
    tag = f"b{bits}_w{warps}_r{rows}_s{slice_}"
    common = [("S", HALF), ("D", HIDDEN), ("H", EXPERT_HIDDEN), ("BITS", bits), ("GS", GROUP), ("WARPS", warps),
              ("ROWS", rows)]
    inputs = [("x", HALF), ("idx", U32), ("gw", U32), ("gs", HALF), ("gb", HALF), ("uw", U32), ("us", HALF),
              ("ub", HALF)]
    if slice_:
        kernels = kernel("expert_swiglu", "fused", inputs + [("dw", U32), ("ds", HALF), ("db", HALF)],
                         [("y", HALF), ("scratch", "float")],
                         [*common, ("SLICE", slice_), ("X", HALF), ("Y", HALF), ("K", TOP_K)], name=f"fused_{tag}")
        scratch = f"size_t(K) * {EXPERT_HIDDEN // slice_ * HIDDEN + 1}"
        launches = (f"FILL_ZERO(y, size_t(K) * D * 2); FILL_ZERO(scratch, {scratch} * 4);\n        "
                    + call(f"mlx::core::cu::fused_{tag}", f"dim3({EXPERT_HIDDEN // slice_}, K)", f"dim3({32 * warps})",
                           [n for n, _ in inputs] + ["dw", "ds", "db"], ["y", "scratch"], "expert_swiglu", "fused"))
    else:
        gate_up = kernel("expert_swiglu", "gate_up", inputs, [("hid", "float")],
                         [*common, ("X", HALF), ("K", TOP_K), ("SHARE", 1)],
                         name=f"gate_up_{tag}")
        down = kernel("expert_swiglu", "down", [("hid", "float"), ("idx", U32), ("dw", U32), ("ds", HALF), ("db", HALF)],
                      [("y", HALF)], [*common, ("Y", HALF), ("SHARE", 1)], name=f"down_{tag}")
        kernels = gate_up + down
        scratch = "1"
        per_group = warps * rows
        launches = (call(f"mlx::core::cu::gate_up_{tag}", f"dim3({-(-EXPERT_HIDDEN // per_group)}, K)",
                         f"dim3({32 * warps})", [n for n, _ in inputs], ["hid"], "expert_swiglu", "gate_up")
                    + "\n        " +
                    call(f"mlx::core::cu::down_{tag}", f"dim3({-(-HIDDEN // per_group)}, K)", f"dim3({32 * warps})",
                         ["hid", "idx", "dw", "ds", "db"], ["y"], "expert_swiglu", "down"))
    config = f"fused SLICE={slice_} WARPS={warps} ROWS={rows}" if slice_ else f"WARPS={warps} ROWS={rows}"
    return f"""{STAND_IN}{COMMON}
{sections('expert_swiglu.cu')['header']}
{kernels}
int main() {{
    const int D = {HIDDEN}, H = {EXPERT_HIDDEN}, E = {EXPERTS}, K = {TOP_K}, BITS = {bits}, GS = {GROUP};
    cudaStream_t s; CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const size_t in_words = size_t(E) * H * D * BITS / 32, in_groups = size_t(E) * H * (D / GS);
    const size_t down_words = size_t(E) * D * H * BITS / 32, down_groups = size_t(E) * D * (H / GS);
    const float lo = 0.5f / (1 << BITS) / 8, hi = 1.5f / (1 << BITS) / 8;  // rows of about +-1/16 (sums over 2048)
    uint32_t *gw = bits_buffer(in_words, 1), *uw = bits_buffer(in_words, 2), *dw = bits_buffer(down_words, 3);
    __half *gs = half_buffer(in_groups, lo, hi, 4), *gb = half_buffer(in_groups, -1.0f / 16, 0.0f, 5);
    __half *us = half_buffer(in_groups, lo, hi, 6), *ub = half_buffer(in_groups, -1.0f / 16, 0.0f, 7);
    __half *ds = half_buffer(down_groups, lo, hi, 8), *db = half_buffer(down_groups, -1.0f / 16, 0.0f, 9);
    const int calls = 64;  // each its own token and 8 distinct experts of 128 (stride 37 is prime to 128)
    std::vector<uint32_t> picks(size_t(calls) * K);
    for (int c = 0; c < calls; c++) for (int k = 0; k < K; k++) picks[c * K + k] = (mix(c, 77) + 37u * k) % E;
    uint32_t* idx_all; CHECK(cudaMalloc(&idx_all, picks.size() * 4));
    CHECK(cudaMemcpy(idx_all, picks.data(), picks.size() * 4, cudaMemcpyHostToDevice));
    __half* x_all = half_buffer(size_t(calls) * D, -1.0f, 1.0f, 10);
    float *hid, *scratch; __half* y;
    CHECK(cudaMalloc(&hid, size_t(K) * H * 4)); CHECK(cudaMalloc(&y, size_t(K) * D * 2));
    CHECK(cudaMalloc(&scratch, {scratch} * 4));
    CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy stream; `s` does not wait for it
    auto one = [&](int c) {{
        const __half* x = x_all + size_t(c) * D;
        const uint32_t* idx = idx_all + size_t(c) * K;
        {launches}
    }};
    CHECK(cudaMemset(y, 0xff, size_t(K) * D * 2));
    CHECK(cudaDeviceSynchronize());
    one(0);
    CHECK(cudaStreamSynchronize(s)); CHECK(cudaGetLastError());
    auto got = host_float(y, size_t(K) * D), xh = host_float(x_all, D);
    auto gw0 = host(gw, in_words), uw0 = host(uw, in_words), dw0 = host(dw, down_words);
    auto gs0 = host_float(gs, in_groups), gb0 = host_float(gb, in_groups), us0 = host_float(us, in_groups);
    auto ub0 = host_float(ub, in_groups), ds0 = host_float(ds, down_groups), db0 = host_float(db, down_groups);
    double err = 0, ref = 0;
    std::vector<double> h(H);
    for (int k = 0; k < K; k++) {{
        const size_t e = picks[k];
        for (int r = 0; r < H; r++) {{
            double g = 0, u = 0;
            for (int i = 0; i < D; i++) {{
                g += xh[i] * dequant(gw0, gs0, gb0, e * H + r, D, BITS, GS, i);
                u += xh[i] * dequant(uw0, us0, ub0, e * H + r, D, BITS, GS, i);
            }}
            h[r] = g / (1 + std::exp(-g)) * u;
        }}
        for (int d = 0; d < D; d++) {{
            double want = 0;
            for (int r = 0; r < H; r++) want += h[r] * dequant(dw0, ds0, db0, e * D + d, H, BITS, GS, r);
            double have = got[size_t(k) * D + d];
            err = std::max(err, std::isnan(have) ? 1e300 : std::fabs(have - want)); ref = std::max(ref, std::fabs(want));
        }}
    }}
    // The bytes one call must read: its 8 experts' packed rows, scales and biases.
    const size_t bytes = size_t(K) * ((in_words * 2 + down_words) * 4 + (in_groups * 2 + down_groups) * 2 * 2) / E;
    double us_ = graph_us(s, [&] {{ for (int c = 0; c < calls; c++) one(c); }}) / calls;
    printf("CSV,expert,{config},0,%d,%.3f,%zu,%.3g\\n", BITS, us_, bytes, err / ref);
    return 0;
}}
"""


def programs() -> dict[str, str]:
    out = {"bandwidth": f"{STAND_IN}{COMMON}{BANDWIDTH_MAIN}"}
    for bits, warps, batch, chunk, fused in ATTENTION:
        name = f"attention_b{bits}_w{warps}_t{batch}_c{chunk}{'_f' if fused else ''}"
        out[name] = attention_program(bits, warps, batch, chunk, fused)
    for bits, warps, rows, slice_ in EXPERT:
        out[f"expert_b{bits}_w{warps}_r{rows}_s{slice_}"] = expert_program(bits, warps, rows, slice_)
    return out


def build(directory: Path, arch: str, names: list[str] | None = None) -> dict[str, Path]:
    """Compiles the programs (all, or those `names`) in parallel; returns name -> executable."""
    directory.mkdir(parents=True, exist_ok=True)

    def one(item: tuple[str, str]) -> tuple[str, Path]:
        name, text = item
        source, exe = directory / f"{name}.cu", directory / name
        source.write_text(text)
        done = subprocess.run(["nvcc", "-O3", "-std=c++17", f"-arch={arch}", "-o", str(exe), str(source)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed for {name}:\n{done.stderr[-4000:]}")
        return name, exe

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(pool.map(one, [(n, t) for n, t in programs().items() if names is None or n in names]))


def run(executables: dict[str, Path]) -> list[dict]:
    """Runs each program (a failing one is reported and the rest still run)."""
    rows = []
    for name, exe in executables.items():
        done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            print(f"{name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
        for line in done.stdout.splitlines():
            if line.startswith("CSV,"):
                kind, config, context, bits, us, nbytes, err = line.split(",")[1:]
                rows.append({"kernel": kind, "config": config, "context": int(context), "bits": int(bits),
                             "us": float(us), "bytes": int(nbytes), "rel_err": float(err)})
                print(f"{kind:9s} {config:28s} {context:>6s} {bits}-bit {float(us):9.2f} us  err {float(err):.2g}",
                      flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90", help="nvcc -arch (sm_90: H100/H200)")
    p.add_argument("--build-only", type=Path, metavar="DIR", help="compile into DIR and stop")
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    if args.build_only:
        for name, exe in build(args.build_only, args.arch).items():
            print(name, exe)
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(build(Path(tmp), args.arch))
    table = [r for r in rows if r["kernel"] in ("attention", "expert")]
    if not table or not any(r["kernel"] == "bandwidth" for r in rows):
        sys.exit("no timings: see the failures above")
    bandwidth = next(r["bytes"] / r["us"] * 1e-3 for r in rows if r["kernel"] == "bandwidth")  # GB/s
    floor = next(r["us"] for r in rows if r["kernel"] == "floor")
    for r in table:
        r["bound_us"] = r["bytes"] / (bandwidth * 1e3)
        r["of_bound"] = r["us"] / r["bound_us"]
        r["bandwidth_gbs"] = bandwidth
        r["launch_floor_us"] = floor
    write_rows("cuda_kernels", table, provenance, out=args.out, append=args.append)
    print(f"\nread bandwidth {bandwidth:.0f} GB/s; two empty launches in a graph {floor:.2f} us\n")
    print("| kernel | launch shape | context | bits | µs | bound µs | of bound | rel. error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['kernel']} | {r['config']} | {r['context'] or ''} | {r['bits']} | {r['us']:.2f} "
              f"| {r['bound_us']:.2f} | {r['of_bound']:.1f} | {r['rel_err']:.1g} |")


if __name__ == "__main__":
    main()
