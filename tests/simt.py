"""Run a kernel body from kernels/ on the CPU, one fiber per GPU thread.

No GPU is needed to check what a kernel computes: the body is compiled as C++ (g++) inside
a small emulation of the SIMT model:
- every thread of a threadgroup (CUDA block) is a fiber (ucontext) of one OS thread, run
  round-robin: a barrier or simd operation switches to the next fiber; threadgroups run
  one after another;
- threadgroup / __shared__ arrays are statics, shared by the group's threads;
- barriers (threadgroup_barrier, __syncthreads) are a std::barrier of the group;
- the simdgroup / warp operations (simd_sum, __shfl_xor_sync) exchange values through slots
  behind a barrier of the 32 lanes;
- the thread attributes (thread_index_in_simdgroup, blockIdx, ...) are the running fiber's.

The signature is assembled as MLX assembles it: inputs, their `_shape`/`_strides` where
the body names them, outputs, and template args as constants at the top of the body.

Metal bodies are compiled as C++14, the language Metal's (MSL 3) is based on, so a later
C++ feature in them fails here; CUDA bodies as C++17, as MLX's NVRTC builds take them.

What this cannot check: address spaces, memory ordering beyond the barriers, half and
bfloat16 arithmetic (float only here), the GPUs' exp and fused multiply-adds, and
performance. It checks the indexing, the synchronisation structure and the math.

One property of performance it can check: the bank pattern of threadgroup / shared memory.
With `trace=True` every access to a threadgroup array is logged (array, barrier interval,
source line, index), and `Trace.worst` replays the log as the GPU serves it: one execution
of a line by the lanes of a simdgroup / warp is one request, and lanes that hit one bank
of 32 four-byte banks at different addresses are served one after another. This is the
bank model of NVIDIA GPUs; Apple does not publish its GPUs' threadgroup-memory banking.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmsp_mlx.kernels.sources import body as section_body, sections

PRELUDE = r"""
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <vector>
#include <ucontext.h>
using std::max; using std::min;
typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
// The threads of a threadgroup are fibers of one OS thread (ucontext), run round-robin
// by `launch`: a barrier or simd operation switches to the next fiber, far cheaper than
// waking OS threads. Threads that diverge at a barrier leave a round in which no fiber
// moves on; the launch then reports failure instead of hanging.
struct Access;
struct Group;
struct Lane {
    ucontext_t ctx; Group* group; uint3 tid, gid, ntg, tpg;
    std::vector<Access>* trace = nullptr; int epoch = 0; bool done = false;
};
static Lane* cur;  // the fiber running now: what a GPU thread's built-ins read
static ucontext_t scheduler;
static long progress = 0;  // arrivals at barriers and ends of fibers
static bool stuck = false;
struct Barrier {
    int n, count = 0; long generation = 0;
    explicit Barrier(int n) : n(n) {}
    void wait() {
        const long g = generation;
        progress++;
        if (++count == n) { count = 0; generation++; return; }
        while (generation == g) swapcontext(&cur->ctx, &scheduler);
    }
};
struct Warp { Barrier bar{32}; float slot[32]; };
struct Group {
    Barrier bar; std::vector<Warp*> warps;
    explicit Group(int n) : bar(n) { for (int i = 0; i < n / 32; i++) warps.push_back(new Warp()); }
    ~Group() { for (auto* w : warps) delete w; }
};
#define tl_group (cur->group)
#define tl_tid (cur->tid)
#define tl_gid (cur->gid)
#define tl_ntg (cur->ntg)
#define tl_tpg (cur->tpg)
#define tl_trace (cur->trace)
#define tl_epoch (cur->epoch)
// Tracing (run(trace=True)): a thread's accesses to its group's threadgroup arrays, in
// program order, with the barrier interval they fall in.
struct Access { int array, epoch, line, index; };
// `xs[i]` in a traced body reads `xs(__LINE__)[i]`: the access knows its source line.
template <int N> struct Logged {
    int id; float v[N];
    struct Ref {
        Logged* t; int line, i;
        operator float() const { t->note(line, i); return t->v[i]; }
        Ref& operator=(float x) { t->note(line, i); t->v[i] = x; return *this; }
        Ref& operator=(const Ref& r) { return *this = float(r); }
    };
    struct At { Logged* t; int line; Ref operator[](int i) const { return {t, line, i}; } };
    void note(int line, int i) { if (tl_trace) tl_trace->push_back({id, tl_epoch, line, i}); }
    At operator()(int line) { return {this, line}; }
};
static inline Warp& tl_warp() { return *tl_group->warps[tl_tid.x / 32]; }
static inline float lane_exchange(float v, int from) {
    Warp& w = tl_warp();
    w.slot[tl_tid.x % 32] = v; w.bar.wait();
    float r = w.slot[from]; w.bar.wait();
    return r;
}
static inline float warp_total(float v) {
    Warp& w = tl_warp();
    w.slot[tl_tid.x % 32] = v; w.bar.wait();
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += w.slot[i];
    w.bar.wait();
    return s;
}
// Metal
#define device
#define thread
#define constant
#define threadgroup static
namespace mem_flags { constexpr int mem_threadgroup = 0; }
static inline void threadgroup_barrier(int) { tl_group->bar.wait(); tl_epoch++; }
namespace metal { using std::exp; }
template <typename T, typename U> static inline T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U), "as_type: same size");
    T t; std::memcpy(&t, &u, sizeof t); return t;
}
static inline float simd_sum(float v) { return warp_total(v); }
typedef unsigned short ushort;
static inline float simd_shuffle_xor(float v, ushort mask) { return lane_exchange(v, (tl_tid.x % 32) ^ mask); }
static inline float simd_shuffle(float v, ushort from) { return lane_exchange(v, from); }
#define thread_index_in_simdgroup (tl_tid.x % 32)
#define simdgroup_index_in_threadgroup (tl_tid.x / 32)
#define thread_index_in_threadgroup (tl_tid.x)
#define threadgroup_position_in_grid (tl_gid)
#define threadgroups_per_grid (tl_ntg)
#define threads_per_threadgroup (tl_tpg)
// CUDA
#define __device__
#define __global__
#define __shared__ static
#define __grid_constant__
namespace cuda { namespace std { using ::std::numeric_limits; } }
static inline void __syncthreads() { tl_group->bar.wait(); tl_epoch++; }
static inline float __shfl_xor_sync(unsigned, float v, int o) { return lane_exchange(v, (tl_tid.x % 32) ^ o); }
static inline float __shfl_sync(unsigned, float v, int from) { return lane_exchange(v, from); }
#define __expf(x) std::exp(x)  // a macro: glibc declares an __expf of its own
static inline float __int_as_float(int v) { return as_type<float>(v); }
// Threadgroups run one after another here, so a kernel's "last block" logic always sees
// the earlier blocks' writes: these check its arithmetic and indexing, not its ordering.
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T> static inline T __ldcg(const T* p) { return *p; }
#define threadIdx (tl_tid)
#define blockIdx (tl_gid)
#define gridDim (tl_ntg)
#define blockDim (tl_tpg)
using Shape = std::array<int32_t, 8>;
using Strides = std::array<int64_t, 8>;
"""

CTYPES = {np.float32: "float", np.uint32: "uint32_t", np.int32: "int32_t"}


def _array(kind: str, values) -> str:
    return "{" + ", ".join(str(int(v)) for v in values) + "}"


@dataclass
class Trace:
    """Every access a run made to its threadgroup arrays: `log` rows are (threadgroup,
    thread, array, barrier interval, source line, j: the line's j-th execution by the
    thread in the interval, index), `names` the arrays in declaration order."""

    names: list[str]
    log: np.ndarray

    def worst(self, width: int = 4) -> dict[str, int]:
        """Per array, the most passes any one request needed: 1 is conflict-free.

        width=4: 4-byte accesses, 32 banks; a request is the j-th execution of one source
        line by the lanes of a warp in one barrier interval (lanes that skip it are
        inactive), and lanes at different addresses in one bank are served one after
        another (the same address is a broadcast).
        width=16: the same requests as 16-byte accesses (the 4-byte accesses of one
        aligned block merged, as nvcc merges unrolled neighbouring reads into LDS.128):
        served a quarter-warp (8 lanes) a pass, 8 four-bank slots."""
        requests: dict[tuple, dict[int, set]] = {}
        for group, thread, array, epoch, line, j, index in self.log.tolist():
            unit = index if width == 4 else index // 4
            lanes = 0 if width == 4 else (thread % 32) // 8  # which lanes are served together
            key = (group, thread // 32, epoch, line, j, lanes)
            slot = unit % 32 if width == 4 else unit % 8
            requests.setdefault(key, {}).setdefault(slot, set()).add((array, unit))
        worst: dict[str, int] = {}
        for key, slots in requests.items():
            arrays = {array for units in slots.values() for array, _ in units}
            passes = max(len(units) for units in slots.values())
            for array in arrays:
                worst[self.names[array]] = max(worst.get(self.names[array], 0), passes)
        return worst


_SHARED = re.compile(r"^(\s*)(?:__shared__|threadgroup) float ([^;]+);[ \t]*(//.*)?$", re.M)


def _logged(body: str) -> tuple[str, list[str]]:
    """The body with its threadgroup float arrays replaced by logged ones."""
    names: list[str] = []

    def one(match: re.Match) -> str:
        decls = []
        for name, size in re.findall(r"(\w+)\[([^\]]+)\]", match.group(2)):
            decls.append(f"static Logged<({size})> {name}{{{len(names)}}};")
            names.append(name)
        return match.group(1) + " ".join(decls)

    return _at_lines(_SHARED.sub(one, body), names), names


def _at_lines(text: str, names: list[str]) -> str:
    """`name[` as `name(__LINE__)[` for each logged array: the access knows its line. Also
    applied to the header, whose helpers take the arrays by these names."""
    for name in names:
        text = re.sub(rf"\b{name}\[", f"{name}(__LINE__)[", text)
    return text


def run(stem: str, section: str, dialect: str, inputs: dict[str, np.ndarray], outputs: dict[str, tuple],
        template: dict[str, int | str], grid: tuple[int, int, int], threads: int,
        trace: bool = False) -> dict[str, np.ndarray] | tuple[dict[str, np.ndarray], Trace]:
    """Run section `section` of `stem`.`dialect` ('metal' or 'cu') over `grid` threadgroups
    of `threads` threads. `inputs` are float32/uint32/int32 numpy arrays, views included
    (the kernel gets their strides in elements, as MLX passes a view's); `outputs` maps a
    name to its shape (float32). With `trace`, also the run's threadgroup-memory accesses."""
    src = sections(f"{stem}.{dialect}")
    body = section_body(f"{stem}.{dialect}", section)
    names: list[str] = []
    if trace:
        body, names = _logged(body)
    params, args, lines = [], [], []
    for i, (name, a) in enumerate(inputs.items()):
        ctype = CTYPES[a.dtype.type]
        params.append(f"const {ctype}* {name}")
        args.append(f"(const {ctype}*)in[{i}]")
        st = tuple(s // a.itemsize for s in a.strides)
        for kind, values, ctype2 in (("shape", a.shape, "int32_t"), ("strides", st, "int64_t")):
            if f"{name}_{kind}" not in body:
                continue
            lines.append(f"static const {ctype2} {name}_{kind}_v[8] = {_array(kind, values)};")
            if dialect == "metal":
                params.append(f"const {ctype2}* {name}_{kind}")
                args.append(f"{name}_{kind}_v")
            else:
                t = "Shape" if kind == "shape" else "Strides"
                params.append(f"const {t} {name}_{kind}")
                args.append(f"{t}{{" + ", ".join(f"{name}_{kind}_v[{k}]" for k in range(8)) + "}")
    for j, name in enumerate(outputs):
        params.append(f"float* {name}")
        args.append(f"(float*)out[{j}]")
    consts = "".join(f"constexpr int {k} = {v};\n" if isinstance(v, int) else f"using {k} = {v};\n"
                     for k, v in template.items())
    # `half` is a type in Metal: a body naming a variable so must not compile here either
    dialect_prelude = "#define half float\n" if dialect == "metal" else ""
    header = _at_lines(src.get("header", ""), names)
    code = (PRELUDE + dialect_prelude + header + "\n" + "\n".join(lines)
            + f"\nstatic void kernel_body({', '.join(params)}) {{\n{consts}{body}\n}}\n"
            + f"""static std::vector<int> trace_log;
extern "C" long trace_size() {{ return long(trace_log.size()); }}
extern "C" void trace_copy(int* to) {{ std::memcpy(to, trace_log.data(), trace_log.size() * sizeof(int)); }}
static void (*lane_body)(Lane&);  // what each fiber of the launch runs
static void lane_main() {{ lane_body(*cur); cur->done = true; progress++; }}
static void** lane_in;
static void** lane_out;
static int lane_group;
static void run_lane(Lane& lane) {{
    std::vector<Access> mine;
    lane.trace = &mine;
    void** in = lane_in;
    void** out = lane_out;
    kernel_body({', '.join(args)});
    std::map<std::pair<int, int>, int> seen;  // (interval, line): executions so far
    for (const Access& a : mine) {{
        const int j = seen[{{a.epoch, a.line}}]++;
        trace_log.insert(trace_log.end(), {{lane_group, int(lane.tid.x), a.array, a.epoch, a.line, j, a.index}});
    }}
}}
extern "C" int launch(void** in, void** out, unsigned gx, unsigned gy, unsigned gz, unsigned n) {{
    constexpr size_t STACK = 1 << 20;  // malloc'd, so only the pages a fiber touches are used
    std::vector<void*> stacks(n);
    for (auto& st : stacks) st = std::malloc(STACK);
    std::vector<Lane> lanes(n);
    stuck = false;
    trace_log.clear();
    lane_body = run_lane; lane_in = in; lane_out = out;
    for (unsigned z = 0; z < gz && !stuck; z++) for (unsigned y = 0; y < gy && !stuck; y++)
    for (unsigned x = 0; x < gx && !stuck; x++) {{
        Group group(n);
        lane_group = int((z * gy + y) * gx + x);
        for (unsigned t = 0; t < n; t++) {{
            Lane& l = lanes[t];
            l.group = &group; l.tid = {{t, 0, 0}}; l.gid = {{x, y, z}}; l.ntg = {{gx, gy, gz}}; l.tpg = {{n, 1, 1}};
            l.epoch = 0; l.done = false; l.trace = nullptr;
            getcontext(&l.ctx);
            l.ctx.uc_stack.ss_sp = stacks[t]; l.ctx.uc_stack.ss_size = STACK; l.ctx.uc_link = &scheduler;
            makecontext(&l.ctx, lane_main, 0);
        }}
        for (unsigned live = n; live > 0;) {{
            const long before = progress;
            for (unsigned t = 0; t < n; t++) {{
                if (lanes[t].done) continue;
                cur = &lanes[t];
                swapcontext(&scheduler, &lanes[t].ctx);
                live -= lanes[t].done;
            }}
            if (live > 0 && progress == before) {{ stuck = true; break; }}  // the fibers left hang; their stacks go
        }}
    }}
    for (auto* st : stacks) std::free(st);
    return stuck ? 1 : 0;
}}
""")
    # Metal's language is C++14 (MSL 3); MLX's NVRTC builds take C++17
    lib = _build(code, "c++14" if dialect == "metal" else "c++17")
    results = {name: np.zeros(shape, np.float32) for name, shape in outputs.items()}
    ins = (ctypes.c_void_p * len(inputs))(*[a.ctypes.data for a in inputs.values()])
    outs = (ctypes.c_void_p * len(results))(*[a.ctypes.data for a in results.values()])
    if lib.launch(ins, outs, *grid, threads):
        raise RuntimeError("the kernel's threads did not all reach a barrier or simd operation together")
    if not trace:
        return results
    log = np.zeros(lib.trace_size(), np.int32)
    lib.trace_copy(log.ctypes.data)
    return results, Trace(names, log.reshape(-1, 7))


_built: dict[str, ctypes.CDLL] = {}
_scratch = tempfile.TemporaryDirectory(prefix="simt-")  # removed when the test process exits


def _build(code: str, std: str) -> ctypes.CDLL:
    key = hashlib.sha1((std + code).encode()).hexdigest()
    if key not in _built:
        out = Path(_scratch.name) / f"k{key[:12]}.so"
        done = subprocess.run(["g++", f"-std={std}", "-O1", "-w", "-shared", "-fPIC", "-pthread", "-x", "c++", "-",
                               "-o", str(out)], input=code, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"the kernel does not compile as C++:\n{done.stderr[:4000]}")
        lib = ctypes.CDLL(str(out))
        lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 4
        lib.launch.restype = ctypes.c_int
        lib.trace_size.restype = ctypes.c_long
        lib.trace_copy.argtypes = [ctypes.c_void_p]
        _built[key] = lib
    return _built[key]
