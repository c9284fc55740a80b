"""Run veloxquant's generated GPU kernels on the CPU: both the CUDA and the Metal translation
unit, compiled as C++ with a shim that emulates a threadgroup (one fiber per GPU thread, each
running until it waits at a barrier, the threadgroup's or its 32-lane SIMD group's; an exchange
buffer per SIMD group for shuffles and reductions; threadgroup arrays become statics, shared by
the threads of the one threadgroup that runs at a time). A barrier that not every thread it
spans reaches stops the process with a message (on a GPU it would hang or be undefined).

This executes the exact kernel text MLX would compile, so the kernel logic (indexing, packing,
barriers, the online softmax) is tested against the pure-MLX reference in CI, without a GPU
and for the Metal source as much as the CUDA one. It does not test what only hardware shows:
speed, the real compilers, memory-model corner cases beyond barrier-ordered threadgroup memory.
Needs a C++20 compiler (`g++`); tests skip when there is none.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from veloxquant.io import atomic_path, write_bytes_atomic
from veloxquant.kernels import CUDA_TYPES, METAL_ATTRIBUTES, METAL_TYPES, KernelSource

CXX = shutil.which("g++")

_COMMON = r"""
#pragma once
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>
#include <algorithm>
using std::max;
using std::min;
struct vq_half {
  _Float16 v;
  vq_half() = default;
  vq_half(float f) : v((_Float16)f) {}
  operator float() const { return (float)v; }
};
struct vq_bf16 {
  uint16_t bits;
  vq_bf16() = default;
  vq_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = (uint16_t)(u >> 16);
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
struct float2 {
  float x, y;
  float2() = default;
  float2(float a, float b) : x(a), y(b) {}
};
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
};
struct uint2 {
  uint32_t x, y;
};
struct uint4 {
  uint32_t x, y, z, w;
};
struct vq_emu_state {
  float xchg[32][32];
  uint32_t xfrag[32][32][6];  // per SIMD group and lane: mma and movmatrix operands
};
inline vq_emu_state vq_emu;
// A threadgroup's threads are fibers (ucontext) of the one OS thread that runs the launch: each
// runs until it waits at a barrier, and a barrier lets its waiters go on once every thread it
// spans waits there (all the threadgroup's, or the 32 of a SIMD group). An OS thread per GPU
// thread, with std::barrier, spent most of the emulated tests' time creating threads and in
// the scheduler's wakeups on a 2-core machine.
enum { VQ_EMU_RUN = -3, VQ_EMU_DONE = -2, VQ_EMU_BLOCK = -1 };  // else: the SIMD group waited at
struct vq_emu_fibers {
  int cur = 0;
  std::vector<ucontext_t> ctx;
  std::vector<std::vector<char>> stacks;
  std::vector<int> at;
  ucontext_t main;
  std::function<void(unsigned)> body;
};
inline vq_emu_fibers vq_fib;
inline unsigned vq_emu_tid = 0;
// cp.async: a thread's copies land only when it waits for their group (so that a kernel that
// reads a buffer before waiting reads what was there before)
struct vq_emu_copy {
  void* dst;
  const void* src;
};
inline std::vector<std::vector<std::vector<vq_emu_copy>>> vq_emu_copies;  // [thread][group]
inline void vq_emu_wait(int what) {
  const int t = vq_fib.cur;
  vq_fib.at[t] = what;
  swapcontext(&vq_fib.ctx[t], &vq_fib.main);
}
inline void vq_emu_block_barrier() { vq_emu_wait(VQ_EMU_BLOCK); }
inline void vq_emu_warp_barrier() { vq_emu_wait((int)(vq_emu_tid >> 5)); }
inline void vq_emu_fiber() {
  vq_emu_copies[vq_fib.cur].assign(1, {});
  vq_fib.body((unsigned)vq_fib.cur);
  vq_fib.at[vq_fib.cur] = VQ_EMU_DONE;  // then back to the scheduler (uc_link)
}
[[noreturn]] inline void vq_emu_stuck(const char* why) {
  std::fprintf(stderr, "kernel emulator: %s\n", why);
  std::abort();
}
inline float vq_emu_shfl_xor(float v, int m) {
  const unsigned lane = vq_emu_tid & 31u, w = vq_emu_tid >> 5;
  vq_emu.xchg[w][lane] = v;
  vq_emu_warp_barrier();
  const float r = vq_emu.xchg[w][lane ^ (unsigned)m];
  vq_emu_warp_barrier();
  return r;
}
template <class F>
void vq_emu_run(int gx, int gy, int gz, int threads, int reverse, F&& body) {
  const size_t stack = size_t(1) << 18;
  vq_emu_fibers& f = vq_fib;
  f.ctx.resize(threads);
  f.at.resize(threads);
  if ((int)f.stacks.size() < threads) f.stacks.resize(threads);
  if ((int)vq_emu_copies.size() < threads) vq_emu_copies.resize(threads);
  const int warps = (threads + 31) / 32;
  std::vector<int> waiting(warps);
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int i = 0; i < gx; ++i) {
        const int x = reverse ? gx - 1 - i : i;
        f.body = [&](unsigned t) { body(t, (unsigned)x, (unsigned)y, (unsigned)z); };
        for (int t = 0; t < threads; ++t) {
          if (f.stacks[t].size() < stack) f.stacks[t].resize(stack);
          getcontext(&f.ctx[t]);
          f.ctx[t].uc_stack.ss_sp = f.stacks[t].data();
          f.ctx[t].uc_stack.ss_size = stack;
          f.ctx[t].uc_link = &f.main;
          makecontext(&f.ctx[t], vq_emu_fiber, 0);
          f.at[t] = VQ_EMU_RUN;
        }
        for (;;) {
          for (int t = 0; t < threads; ++t) {
            if (f.at[t] != VQ_EMU_RUN) continue;
            f.cur = t;
            vq_emu_tid = (unsigned)t;
            swapcontext(&f.main, &f.ctx[t]);
          }
          int done = 0, block = 0;
          std::fill(waiting.begin(), waiting.end(), 0);
          for (int t = 0; t < threads; ++t) {
            done += f.at[t] == VQ_EMU_DONE;
            block += f.at[t] == VQ_EMU_BLOCK;
            if (f.at[t] >= 0) ++waiting[f.at[t]];
          }
          if (done == threads) break;
          bool released = false;
          if (block == threads) {
            std::fill(f.at.begin(), f.at.end(), (int)VQ_EMU_RUN);
            released = true;
          }
          for (int w = 0; w < warps; ++w) {
            if (waiting[w] == std::min(32, threads - 32 * w)) {
              for (int t = 32 * w; t < std::min(threads, 32 * w + 32); ++t) f.at[t] = VQ_EMU_RUN;
              released = true;
            }
          }
          if (!released) {
            vq_emu_stuck(done ? "a barrier that some threads of the threadgroup have left"
                              : "threads wait at different barriers");
          }
        }
      }
}
"""

_CUDA_SHIM = (
    _COMMON
    + r"""
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __launch_bounds__(...)
#define VQ_SHARED static
#define VQ_TG
typedef vq_half __half;
typedef vq_bf16 __nv_bfloat16;
struct vq_dim3 { unsigned x, y, z; };
#define threadIdx (vq_dim3{vq_emu_tid, 0u, 0u})
inline vq_dim3 blockIdx;
inline void __syncthreads() { vq_emu_block_barrier(); }
inline float __shfl_xor_sync(unsigned, float v, int m) { return vq_emu_shfl_xor(v, m); }
inline float2 make_float2(float a, float b) { return float2(a, b); }
inline float4 make_float4(float a, float b, float c, float d) { return float4(a, b, c, d); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline float exp2f(float x) { return std::exp2(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fminf(float a, float b) { return std::fmin(a, b); }
template <class T>
inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
namespace cooperative_groups {}
// veloxquant's tensor-core helpers (`_MMA_HELPERS`) by their PTX fragment layouts (g = L / 4,
// t = L % 4 of lane L; pairs in the low then high half of a register): mma m16n8k16 holds
// A[g][2t..], A[g + 8][2t..], A[g][2t + 8..], A[g + 8][2t + 8..], B[2t..][g], B[2t + 8..][g]
// and C[g][2t..], C[g + 8][2t..]; an 8x8 b16 fragment holds M[g][2t..]
#define VQ_WARP_MMA
inline uint16_t vq_emu_bits(vq_half h) {
  uint16_t u;
  std::memcpy(&u, &h.v, 2);
  return u;
}
inline float vq_emu_half(uint32_t w, int upper) {
  const uint16_t u = (uint16_t)(upper ? w >> 16 : w & 0xffffu);
  vq_half h;
  std::memcpy(&h.v, &u, 2);
  return (float)h;
}
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t bytes = ((uint64_t)y << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    r |= (uint32_t)((bytes >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  }
  return r;
}
inline uint32_t vq_pack_half2(float lo, float hi) {
  return (uint32_t)vq_emu_bits(vq_half(lo)) | ((uint32_t)vq_emu_bits(vq_half(hi)) << 16);
}
inline void vq_mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const unsigned lane = vq_emu_tid & 31u, w = vq_emu_tid >> 5;
  for (int i = 0; i < 4; ++i) vq_emu.xfrag[w][lane][i] = a[i];
  for (int i = 0; i < 2; ++i) vq_emu.xfrag[w][lane][4 + i] = b[i];
  vq_emu_warp_barrier();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const uint32_t* f = vq_emu.xfrag[w][l];
    for (int u = 0; u < 2; ++u) {
      A[g][2 * t + u] = vq_emu_half(f[0], u);
      A[g + 8][2 * t + u] = vq_emu_half(f[1], u);
      A[g][2 * t + 8 + u] = vq_emu_half(f[2], u);
      A[g + 8][2 * t + 8 + u] = vq_emu_half(f[3], u);
      B[2 * t + u][g] = vq_emu_half(f[4], u);
      B[2 * t + 8 + u][g] = vq_emu_half(f[5], u);
    }
  }
  const int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int m = g + (e >> 1) * 8, n = 2 * t + (e & 1);
    float sum = c[e];
    for (int k = 0; k < 16; ++k) sum += A[m][k] * B[k][n];
    c[e] = sum;
  }
  vq_emu_warp_barrier();
}
inline uint32_t vq_and_opaque(uint32_t x, uint32_t m) { return x & m; }
inline void vq_cp_async16(void* dst, const void* src) {
  vq_emu_copies[vq_emu_tid].back().push_back({dst, src});
}
inline void vq_cp_async_commit() { vq_emu_copies[vq_emu_tid].emplace_back(); }
template <int N>
inline void vq_cp_async_wait() {
  // the committed groups are all but the last (open) one; all but the newest N of them land
  std::vector<std::vector<vq_emu_copy>>& groups = vq_emu_copies[vq_emu_tid];
  while ((int)groups.size() - 1 > N) {
    for (const vq_emu_copy& c : groups.front()) std::memcpy(c.dst, c.src, 16);
    groups.erase(groups.begin());
  }
}
inline float vq_round_half(float x) { return (float)vq_half(x); }
// dynamic shared memory: a static like the other threadgroup arrays (named s_*, counted by
// threadgroup_bytes)
#define VQ_DYNAMIC_SHARED(T, name, n) static T name[n]
inline uint32_t vq_codes_half2(uint32_t x, uint32_t y, uint32_t sel, uint32_t mask) {
  const uint32_t p = __byte_perm(x, y, sel) & mask;
  return vq_pack_half2((float)(p & 0xffffu), (float)(p >> 16));
}
inline float vq_ex2(float x) {
  const float y = std::exp2(x);
  return y < 0x1p-126f ? 0.0f : y;
}
// threadgroup addresses as 32-bit offsets from an anchor: the kernel's threadgroup arrays are
// statics of the same library, well within 2 GB of it either way
inline char vq_emu_anchor;
inline uint32_t vq_tg_address(const void* p) {
  return (uint32_t)(static_cast<const char*>(p) - &vq_emu_anchor);
}
inline uint32_t vq_lds(uint32_t at, uint32_t) {
  uint32_t y;
  std::memcpy(&y, &vq_emu_anchor + (int32_t)at, 4);
  return y;
}
inline uint2 vq_lds(uint32_t at, uint2) {
  uint2 y;
  std::memcpy(&y, &vq_emu_anchor + (int32_t)at, 8);
  return y;
}
inline uint32_t vq_movmatrix_trans(uint32_t x) {
  const unsigned lane = vq_emu_tid & 31u, w = vq_emu_tid >> 5;
  vq_emu.xfrag[w][lane][0] = x;
  vq_emu_warp_barrier();
  // M^T[g][2t + u] = M[2t + u][g]: half g % 2 of the register of lane 4 (2t + u) + g / 2
  const unsigned g = lane >> 2, t = lane & 3u;
  uint32_t y = 0;
  for (unsigned u = 0; u < 2; ++u) {
    const uint32_t src = vq_emu.xfrag[w][4 * (2 * t + u) + g / 2][0];
    y |= (g % 2 ? src >> 16 : src & 0xffffu) << (16 * u);
  }
  vq_emu_warp_barrier();
  return y;
}
"""
)

_METAL_SHIM = (
    _COMMON
    + r"""
#define VQ_SHARED static
#define VQ_TG
#define device
#define threadgroup
#define constant
typedef unsigned int uint;
typedef unsigned short ushort;
typedef vq_half half;
typedef vq_bf16 bfloat16_t;
struct uint3 { unsigned x, y, z; };
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { vq_emu_block_barrier(); }
inline float simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += vq_emu_shfl_xor(x, o);
  return x;
}
inline float simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = std::fmax(x, vq_emu_shfl_xor(x, o));
  return x;
}
inline float simd_shuffle_xor(float x, unsigned short m) { return vq_emu_shfl_xor(x, m); }
namespace metal {
inline float exp2(float x) { return std::exp2(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
namespace precise {
inline float sincos(float x, float& c) { c = std::cos(x); return std::sin(x); }
}
namespace fast {
inline float sincos(float x, float& c) { c = std::cos(x); return std::sin(x); }
}
}
"""
)

_CACHE = Path(os.environ.get("VELOXQUANT_EMU_CACHE", tempfile.gettempdir())) / "vq_kernel_emu"


def _shim_dir() -> Path:
    root = _CACHE / "shim"
    files = {
        "mlx/backend/cuda/device/utils.cuh": _CUDA_SHIM,
        "cooperative_groups.h": "#pragma once\n",
        "metal_stdlib": _METAL_SHIM,
    }
    for name, text in files.items():
        path = root / name
        if not path.exists() or path.read_text() != text:
            write_bytes_atomic(path, text.encode())  # another worker may be compiling with it
    return root


def _stub(source: KernelSource, backend: str, in_types: list[str], out_types: list[str]) -> str:
    types = CUDA_TYPES if backend == "cuda" else METAL_TYPES
    args = [f"(const {types[t]}*)bufs[{i}]" for i, t in enumerate(in_types)]
    n = len(in_types)
    args += [f"({types[t]}*)bufs[{n + i}]" for i, t in enumerate(out_types)]
    name = f"custom_kernel_{source.kernel_name}"
    if backend == "cuda":
        call = f"mlx::core::cu::{name}({', '.join(args)});"
        pre = "blockIdx = vq_dim3{x, y, z};"
    else:
        values = {
            "simdgroup_index_in_threadgroup": "t / 32u",
            "thread_index_in_simdgroup": "t % 32u",
            "thread_position_in_threadgroup": "uint3{t, 0, 0}",
            "threadgroup_position_in_grid": "uint3{x, y, z}",
        }
        body = source.metal_body()
        args += [values[a] for a, _ in METAL_ATTRIBUTES if a in body]
        call = f"{name}({', '.join(args)});"
        pre = ""
    return (
        'extern "C" void vq_run(void** bufs, int gx, int gy, int gz, int threads, int rev) {\n'
        "  vq_emu_run(gx, gy, gz, threads, rev,\n"
        "             [&](unsigned t, unsigned x, unsigned y, unsigned z) {\n"
        f"    {pre}\n    {call}\n  }});\n}}\n"
    )


def build(source: KernelSource, backend: str, in_types: list[str], out_types: list[str]):
    """Compile the `backend` ("cuda" or "metal") translation unit of `source` for these
    input / output dtype names; returns the loaded library (cached by source)."""
    if CXX is None:
        raise RuntimeError("no C++ compiler")
    if backend == "cuda":
        tu = source.cuda_translation_unit(in_types, out_types)
    else:
        tu = source.metal_translation_unit(in_types, out_types)
    tu += "\n" + _stub(source, backend, in_types, out_types)
    # the shim is part of what a library was built with: its emulator state is one object per
    # process (an inline variable, which the loader unifies across libraries), so libraries
    # built against two versions of the shim must never be loaded together
    digest = hashlib.sha1((tu + _CUDA_SHIM + _METAL_SHIM).encode()).hexdigest()[:16]
    lib = _CACHE / f"{source.name}_{backend}_{digest}.so"
    if not lib.exists():
        # pytest-xdist workers may build the same library at once: each writes through its
        # own temp file and the last rename wins (the same bytes), so none reads or loads a
        # half-written one
        src = lib.with_suffix(".cpp")
        write_bytes_atomic(src, tu.encode())
        with atomic_path(lib) as tmp:
            cmd = [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread"]
            cmd += ["-I", str(_shim_dir()), "-o", str(tmp), str(src)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(
                    f"{backend} source of {source.name} failed to compile:\n{res.stderr}"
                )
    return ctypes.CDLL(str(lib))


def threadgroup_bytes(lib: ctypes.CDLL) -> int:
    """Bytes of the threadgroup arrays of a library from `build`: they are the kernel's
    function-scope statics here (named s_*), whose sizes the symbol table holds."""
    res = subprocess.run(["nm", "-S", "-C", lib._name], capture_output=True, text=True, check=True)
    total = 0
    for line in res.stdout.splitlines():
        fields = line.split(maxsplit=3)
        if len(fields) == 4 and "::s_" in fields[3] and "guard variable" not in fields[3]:
            total += int(fields[1], 16)
    return total


def run(
    source: KernelSource,
    backend: str,
    inputs: list[np.ndarray],
    grid: tuple[int, int, int],
    output_shapes: list[tuple[int, ...]],
    output_dtypes: list[str],
    reverse: bool = False,
    input_dtypes: list[str] | None = None,
) -> list[np.ndarray]:
    """Run `source` on numpy inputs (dtypes float32/float16/uint8/int32, or bfloat16 given as
    uint16 bit patterns with name 'bfloat16' in `input_dtypes` (default: each input's numpy
    dtype) or `output_dtypes`); grid counts threadgroups,
    which run one at a time, in grid order (x fastest, descending with `reverse`: kernels whose
    threadgroups hand over to the last one to finish must work in any order). Outputs are
    pre-filled with NaN (or 0xAB bytes) so an unwritten element shows."""
    names = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
    names.update({np.dtype(np.uint8): "uint8", np.dtype(np.int32): "int32"})
    names[np.dtype(np.uint32)] = "uint32"
    in_types = input_dtypes or [names[np.asarray(x).dtype] for x in inputs]
    lib = build(source, backend, in_types, list(output_dtypes))
    np_types = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}
    np_types.update({"int32": np.int32, "bfloat16": np.uint16, "uint32": np.uint32})
    ins = [np.ascontiguousarray(x) for x in inputs]
    outs = []
    for shape, dt in zip(output_shapes, output_dtypes, strict=True):
        o = np.empty(shape, np_types[dt])
        if dt in ("float32", "float16"):
            o.fill(np.nan)
        else:
            o.view(np.uint8).fill(0xAB)
        outs.append(o)
    ptrs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[a.ctypes.data for a in ins + outs])
    lib.vq_run(ptrs, grid[0], grid[1], grid[2], source.threads, int(reverse))
    return outs


def launch_for(backend: str):
    """`veloxquant.kernels.launch` with this emulator (of `backend`'s source) for the GPU: MLX
    arrays in and out, each input checked as `launch` checks it (>= 8 elements), bfloat16
    carried as its uint16 bit pattern (numpy has no bfloat16)."""
    import mlx.core as mx

    from veloxquant.kernels import check_inputs, dtype_name

    def launch(source, inputs, grid, output_shapes, output_dtypes):
        check_inputs(source, inputs)
        mx.eval(inputs)
        bf16 = mx.bfloat16
        arrays = [np.array(x.view(mx.uint16) if x.dtype == bf16 else x) for x in inputs]
        in_names = [dtype_name(x.dtype) for x in inputs]
        names = [dtype_name(dt) for dt in output_dtypes]
        shapes = [tuple(s) for s in output_shapes]
        outs = run(source, backend, arrays, grid, shapes, names, input_dtypes=in_names)
        return [
            mx.array(o).view(bf16) if dt == bf16 else mx.array(o)
            for o, dt in zip(outs, output_dtypes, strict=True)
        ]

    return launch
