"""One kernel source, two GPU backends: the template scheme of veloxquant's fused kernels.

A kernel is written once, as the body of a function in a small portable dialect (C-like code
plus the `VQ_*` macros below), and `KernelSource` turns it into
- the body for `mx.fast.cuda_kernel` (MLX's CUDA backend), and
- the body for `mx.fast.metal_kernel` (Apple GPUs),
each with a prelude (`CUDA_PRELUDE`, `METAL_PRELUDE`) that defines the macros for that backend.
MLX generates the function signature itself from the input and output names; the prologue
added here binds the thread and threadgroup indices under backend-neutral names. Compile-time
constants (head dim, bit widths, tile sizes) are baked into the source as `constexpr` lines, so
one configuration is one kernel name and MLX compiles it once.

The dialect (what a body may use besides plain C arithmetic):
    vq_tid              thread index in the threadgroup (1-D threadgroups only)
    vq_gx, vq_gy, vq_gz threadgroup index in the grid
    vq_lane, vq_warp    lane in the 32-wide SIMD group (warp), SIMD group index
    VQ_SHARED           qualifier of threadgroup (shared) arrays, declared at function scope
    VQ_TG               address space of threadgroup memory in pointer types and casts
    VQ_FN               qualifier of helper functions (in `helpers`)
    VQ_GLOBAL           address space of device buffers in casts (`const VQ_GLOBAL uint32_t*`)
    VQ_BARRIER()        threadgroup barrier (with threadgroup memory ordering)
    VQ_UNROLL           full unroll of the next loop (its bounds must be constants)
    VQ_UNROLL_BY(n)     unroll the next loop n iterations at a time
    VQ_F2(a, b), VQ_F4  float2 / float4 constructors (members .x .y .z .w on both backends)
    vq_simd_sum/max(x)  reductions over the 32 lanes of a SIMD group (all lanes take part)
    vq_shfl_xor(x, m)   x of lane (lane ^ m) of the SIMD group (all lanes take part)
    vq_load_cg(p)       *p read past the multiprocessor's L1 (on CUDA): for data other
                        threadgroups of the same launch wrote
    vq_load_cg4(p)      the same for the float4 at p (a float pointer, 16-byte aligned)
    VQ_DEVICE_FENCE(), vq_atomic_inc(p)  (CUDA only) this thread's global writes ordered
                        before its later ones device-wide; atomic ++*p returning the old
                        value. Metal has no device-scope fence before MSL 3.2, so kernels
                        whose threadgroups hand results to each other within one launch are
                        CUDA-only (`KernelSource.backends`).
    vq_exp2, VQ_FMAX, VQ_FMIN, VQ_SINCOS(x, s, c) (accurate), VQ_FAST_SINCOS (small angles)
    VQ_FMA(a, b, c), VQ_MUL(a, b)  a * b + c with one rounding, and a * b, that the compiler
                        never fuses with anything (CUDA's __fmaf_rn / __fmul_rn): for sums
                        that must round where another kernel's compiled code rounds
    uint, uint8_t, uint32_t, half; dtype constants (e.g. Q_T) are `using` aliases.
Both backends have 32-wide SIMD groups and at least 32 KB of threadgroup memory, which is what
the kernels assume.

Nothing here needs a GPU: the sources are plain strings, so CI (CPU) checks that every kernel
generates both and that the Metal one is well-formed (`check_metal_source`). `compiled` builds
the callable for the backend MLX runs on, or returns None on the CPU, where callers take the
pure-MLX reference path instead. On CUDA, MLX is handed an #include of the body and header,
written once per process to a temporary directory (`CUDA_SOURCE_FILES`): MLX copies and hashes
the source it holds at every call.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from veloxquant.io import write_bytes_atomic

SIMD_WIDTH = 32

CUDA_PRELUDE = r"""
#ifndef VQ_PRELUDE
#define VQ_PRELUDE
typedef unsigned int uint;
#ifndef VQ_SHARED
#define VQ_SHARED __shared__
#endif
#ifndef VQ_TG
#define VQ_TG
#endif
#define VQ_GLOBAL
#define VQ_FN __device__ inline
#define VQ_BARRIER() __syncthreads()
#define VQ_UNROLL _Pragma("unroll")
#define VQ_PRAGMA(x) _Pragma(#x)
#define VQ_UNROLL_BY(n) VQ_PRAGMA(unroll n)
#define VQ_F2(a, b) make_float2((a), (b))
#define VQ_F4(a, b, c, d) make_float4((a), (b), (c), (d))
#define VQ_FMAX(a, b) fmaxf((a), (b))
#define VQ_FMIN(a, b) fminf((a), (b))
#define vq_exp2(x) exp2f(x)
#define VQ_SINCOS(x, s, c) sincosf((x), &(s), &(c))
#define VQ_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define VQ_MUL(a, b) __fmul_rn((a), (b))
#define VQ_FAST_SINCOS(x, s, c) __sincosf((x), &(s), &(c))
__device__ inline float vq_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float vq_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ inline float vq_shfl_xor(float x, int mask) {
  return __shfl_xor_sync(0xffffffffu, x, mask);
}
#define vq_load_cg(p) __ldcg(p)
#define vq_load_cg4(p) __ldcg(reinterpret_cast<const float4*>(p))
#define VQ_DEVICE_FENCE() __threadfence()
#define vq_atomic_inc(p) atomicAdd((p), 1u)
#endif
"""

# Tensor-core helpers of CUDA-only kernels (`KernelSource.helpers`): mma.sync and friends as
# inline PTX. The kernel emulator (tests/kernel_emulator.py) defines VQ_WARP_MMA and its own
# versions, by the PTX fragment layouts.
TENSOR_CORE_HELPERS = r"""
#ifndef VQ_TENSOR_CORE_HELPERS
#define VQ_TENSOR_CORE_HELPERS
#ifndef VQ_WARP_MMA
// c += A B: A 16x16 (row-major), B 16x8 (column-major) f16, c f32, as mma.sync fragments
__device__ inline void vq_mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// the transpose of an 8x8 f16 matrix held as fragments (lane L: row L / 4, cols 2 (L % 4) + {0, 1})
__device__ inline uint32_t vq_movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// two floats as f16 (round to nearest), lo in the low half
__device__ inline uint32_t vq_pack_half2(float lo, float hi) {
  return (uint32_t)__half_as_ushort(__float2half_rn(lo)) |
         ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
}
// x & m, opaque to the compiler's front end: it would otherwise rewrite (x & m) >> k as
// (x >> k) & (m >> k), and the shift could no longer fold into the address add
__device__ inline uint32_t vq_and_opaque(uint32_t x, uint32_t m) {
  uint32_t y;
  asm("and.b32 %0, %1, %2;\n" : "=r"(y) : "r"(x), "r"(m));
  return y;
}
// a 32- or 64-bit word of threadgroup memory at the shared-window address `at`: addresses
// kept as 32-bit integers fold an add into the address arithmetic (a pointer into threadgroup
// memory carries the window base as a separate add)
__device__ inline uint32_t vq_lds(uint32_t at, uint32_t) {
  uint32_t y;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(y) : "r"(at) : "memory");
  return y;
}
__device__ inline uint2 vq_lds(uint32_t at, uint2) {
  uint2 y;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(y.x), "=r"(y.y) : "r"(at) : "memory");
  return y;
}
// 2^x by the SFU alone (relative error 2^-22, flushing results below 2^-126 to zero): exp2f's
// guard for those costs five more instructions, for weights that become f16 MMA operands
__device__ inline float vq_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ inline uint32_t vq_tg_address(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
// 16 bytes from global to threadgroup memory without a register (cp.async, sm_80+), in the
// thread's current group of copies; `vq_cp_async_commit` closes the group, and
// `vq_cp_async_wait<N>` waits until at most N of the thread's latest groups are in flight (each
// thread waits for its own copies: a barrier after the wait shows them to the others)
__device__ inline void vq_cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
               :
               : "r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ inline void vq_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ inline void vq_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" : : "n"(N) : "memory");
}
// x rounded to f16 and back: x - vq_round_half(x) is what an f16 copy of x leaves out
__device__ inline float vq_round_half(float x) { return __half2float(__float2half_rn(x)); }
// a threadgroup array of n T's in dynamic shared memory (`KernelSource.dynamic_shared` bytes;
// one such array per kernel): the static arrays stop at CUDA's 48 KB
#define VQ_DYNAMIC_SHARED(T, name, n) extern __shared__ T name[]
// two small codes as an f16 pair: the halves of x and y that `sel` picks (PRMT: 0x5410 the
// low halves, 0x7632 the high ones) masked to their codes (`mask` in each half), ORed into
// 1024's f16 pattern (1024 + code, exact) and 1024 subtracted
__device__ inline uint32_t vq_codes_half2(uint32_t x, uint32_t y, uint32_t sel, uint32_t mask) {
  const uint32_t h = (__byte_perm(x, y, sel) & mask) | 0x64006400u;
  uint32_t r;
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(h), "r"(0x64006400u));
  return r;
}
#endif
#endif
"""

METAL_PRELUDE = r"""
#ifndef VQ_PRELUDE
#define VQ_PRELUDE
#include <metal_stdlib>
using namespace metal;
#ifndef VQ_SHARED
#define VQ_SHARED threadgroup
#endif
#ifndef VQ_TG
#define VQ_TG threadgroup
#endif
#define VQ_GLOBAL device
#define VQ_FN inline
#define VQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define VQ_UNROLL _Pragma("clang loop unroll(full)")
#define VQ_PRAGMA(x) _Pragma(#x)
#define VQ_UNROLL_BY(n) VQ_PRAGMA(clang loop unroll_count(n))
#define VQ_F2(a, b) float2((a), (b))
#define VQ_F4(a, b, c, d) float4((a), (b), (c), (d))
#define VQ_FMAX(a, b) metal::fmax((a), (b))
#define VQ_FMIN(a, b) metal::fmin((a), (b))
#define vq_exp2(x) metal::exp2(x)
#define VQ_SINCOS(x, s, c) (s) = metal::precise::sincos((x), (c))
#define VQ_FMA(a, b, c) metal::fma((a), (b), (c))
#define VQ_MUL(a, b) ((a) * (b))
#define VQ_FAST_SINCOS(x, s, c) (s) = metal::fast::sincos((x), (c))
inline float vq_simd_sum(float x) { return simd_sum(x); }
inline float vq_simd_max(float x) { return simd_max(x); }
inline float vq_shfl_xor(float x, int mask) { return simd_shuffle_xor(x, (ushort)mask); }
#define vq_load_cg(p) (*(p))
#define vq_load_cg4(p) (*reinterpret_cast<const device float4*>(p))
#endif
"""

# Thread and threadgroup indices under backend-neutral names. MLX's Metal signature writer adds
# an attribute argument for every attribute name the *body* mentions, so these names must
# appear in the body itself (not in a header).
CUDA_PROLOGUE = """\
  const uint vq_tid = threadIdx.x;
  const uint vq_gx = blockIdx.x;
  const uint vq_gy = blockIdx.y;
  const uint vq_gz = blockIdx.z;
  const uint vq_lane = threadIdx.x & 31u;
  const uint vq_warp = threadIdx.x >> 5;
"""

METAL_PROLOGUE = """\
  const uint vq_tid = thread_position_in_threadgroup.x;
  const uint vq_gx = threadgroup_position_in_grid.x;
  const uint vq_gy = threadgroup_position_in_grid.y;
  const uint vq_gz = threadgroup_position_in_grid.z;
  const uint vq_lane = thread_index_in_simdgroup;
  const uint vq_warp = simdgroup_index_in_threadgroup;
"""

# The attributes METAL_PROLOGUE uses, in the order MLX's signature writer lists them.
METAL_ATTRIBUTES = (
    ("simdgroup_index_in_threadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
)

CUDA_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "uint8": "uint8_t",
    "uint32": "uint32_t",
    "int32": "int32_t",
}
METAL_TYPES = {
    "float32": "float",
    "float16": "half",
    "bfloat16": "bfloat16_t",
    "uint8": "uint8_t",
    "uint32": "uint32_t",
    "int32": "int",
}


def dtype_name(dtype: mx.Dtype) -> str:
    """'float16', 'bfloat16', 'uint8', ... for an mx dtype."""
    return str(dtype).rsplit(".", 1)[-1]


def _constant_lines(constants: dict[str, Any], types: dict[str, str]) -> str:
    lines = []
    for name, value in constants.items():
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        elif isinstance(value, float):
            lines.append(f"  constexpr float {name} = {value!r}f;")
        elif isinstance(value, mx.Dtype):
            lines.append(f"  using {name} = {types[dtype_name(value)]};")
        elif isinstance(value, str):  # a type spelled the same on both backends (float2 ...)
            lines.append(f"  using {name} = {value};")
        else:
            raise TypeError(f"kernel constant {name}: unsupported value {value!r}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class KernelSource:
    """One kernel written once; `cuda_body()` / `metal_body()` are what MLX's kernel builders
    take as `source`, `header()` their `header`.

    name       base name; the constants' digest is appended so each configuration is its own
               kernel (MLX caches compiled kernels by name and source).
    inputs     input buffer names, in call order; outputs likewise.
    body       the portable body (see the module docstring for the dialect).
    constants  name -> int / float / bool / mx.Dtype, baked in as constexpr / using lines.
    threads    threads per threadgroup (1-D).
    helpers    optional portable helper code placed after the prelude (no attribute names).
    backends   the backends the body is written for ("cuda", "metal"); the others' bodies
               are refused.
    min_threadgroups  CUDA: threadgroups per multiprocessor the compiler must fit registers
               for (`__launch_bounds__(threads, min_threadgroups)`); 0 leaves it its choice.
    dynamic_shared  CUDA: bytes of dynamic shared memory per threadgroup, for the body's one
               `VQ_DYNAMIC_SHARED` array (MLX raises the kernel's limit past CUDA's 48 KB
               for a request of over 48000 bytes).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: str
    constants: dict[str, Any] = field(default_factory=dict)
    threads: int = 128
    helpers: str = ""
    backends: tuple[str, ...] = ("cuda", "metal")
    min_threadgroups: int = 0
    dynamic_shared: int = 0

    @functools.cached_property
    def kernel_name(self) -> str:
        # MLX compiles a kernel once per name and process: whatever changes the code, the
        # helpers included, must change the name (two revisions' kernels side by side in a
        # benchmark otherwise share the first one's binary)
        key = repr(sorted((k, str(v)) for k, v in self.constants.items())) + self.body
        key += "|helpers " + self.helpers
        key += f"|bounds {self.min_threadgroups}" if self.min_threadgroups else ""
        key += f"|dynamic {self.dynamic_shared}" if self.dynamic_shared else ""
        return f"{self.name}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def header(self, backend: str) -> str:
        prelude = CUDA_PRELUDE if backend == "cuda" else METAL_PRELUDE
        return prelude + self.helpers

    def cuda_body(self) -> str:
        return CUDA_PROLOGUE + _constant_lines(self.constants, CUDA_TYPES) + self.body

    def metal_body(self) -> str:
        if "metal" not in self.backends:
            raise ValueError(f"{self.name} is written for {', '.join(self.backends)} only")
        return METAL_PROLOGUE + _constant_lines(self.constants, METAL_TYPES) + self.body

    # -- the whole translation unit MLX would compile (for offline compilers and checks) -----

    def cuda_translation_unit(self, input_dtypes: list[str], output_dtypes: list[str]) -> str:
        """The source MLX 0.32's `cuda_kernel` hands NVRTC for inputs of these dtypes (its
        `build_kernel`), for nvcc checks here and the CPU emulator in the tests."""
        args = [
            f"    const {CUDA_TYPES[d]}* {n}"
            for n, d in zip(self.inputs, input_dtypes, strict=True)
        ]
        args += [
            f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(self.outputs, output_dtypes, strict=True)
        ]
        return (
            '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
            + self.header("cuda")
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {self.launch_bounds()}custom_kernel_{self.kernel_name}(\n"
            + ",\n".join(args)
            + ") {\n"
            + self.cuda_body()
            + "\n}\n\n} // namespace mlx::core::cu\n"
        )

    def launch_bounds(self) -> str:
        """CUDA's `__launch_bounds__` for the kernel's signature, with a trailing space ("" when
        min_threadgroups is 0)."""
        if not self.min_threadgroups:
            return ""
        return f"__launch_bounds__({self.threads}, {self.min_threadgroups}) "

    def metal_translation_unit(self, input_dtypes: list[str], output_dtypes: list[str]) -> str:
        """The source MLX 0.32's `metal_kernel` compiles for inputs of these dtypes (its
        `write_signature`; every input is assumed to hold >= 8 elements, i.e. `device`)."""
        args, index = [], 0
        for n, d in zip(self.inputs, input_dtypes, strict=True):
            args.append(f"  const device {METAL_TYPES[d]}* {n} [[buffer({index})]]")
            index += 1
        for n, d in zip(self.outputs, output_dtypes, strict=True):
            args.append(f"  device {METAL_TYPES[d]}* {n} [[buffer({index})]]")
            index += 1
        body = self.metal_body()
        for attr, typ in METAL_ATTRIBUTES:
            if attr in body:
                args.append(f"  {typ} {attr} [[{attr}]]")
        return (
            self.header("metal")
            + f"[[kernel]] void custom_kernel_{self.kernel_name}(\n"
            + ",\n".join(args)
            + ") {\n"
            + body
            + "\n}\n"
        )


# A split attention kernel's exact tokens in position order: sinks, window, the call's own
# ([1, H, n, D] arrays `sink`, `win`, `cur`; the body's n_sink, n_win, n_new and kvh).
EXACT_AT = """
#define VQ_EXACT_AT(sink, win, cur, t, c) \\
  ((t) < n_sink ? static_cast<float>(sink[(kvh * n_sink + (t)) * D + (c)]) \\
   : (t) < n_sink + n_win ? static_cast<float>(win[(kvh * n_win + (t) - n_sink) * D + (c)]) \\
   : static_cast<float>(cur[(kvh * n_new + (t) - n_sink - n_win) * D + (c)]))
"""


# ---------------------------------------------------------------------------------------------
# The flash-decoding merge every split attention kernel ends with

# One threadgroup of TILE threads per query head r (grid x) merges the n_splits + 1 partials of
# its row (iparams[2] = n_splits): the running maxes m (log2 units), sums l and unnormalised
# outputs o, o = Σ 2^(m_s - M)·o_s / Σ 2^(m_s - M)·l_s, written in the model's dtype. `heads`
# holds 4 ints per KV head of the partial launch, the first the KV head itself.
SPLIT_COMBINE_BODY = """
  const int r = (int)vq_gx;
  const int n_part = iparams[2] + 1;
  const int tid = (int)vq_tid;
  const int row = r * n_part;
  constexpr int NW = TILE / 32;
  constexpr int CPL = (D + 31) / 32;  // channels per lane
  VQ_SHARED float s_red[NW];
  VQ_SHARED float s_sum[NW];
  VQ_SHARED float s_o[NW][D];
  float m = NEG;
  for (int s = tid; s < n_part; s += TILE) m = VQ_FMAX(m, part_m[row + s]);
  m = vq_simd_max(m);
  if (vq_lane == 0) s_red[vq_warp] = m;
  VQ_BARRIER();
  float big = s_red[0];
  for (int w = 1; w < NW; ++w) big = VQ_FMAX(big, s_red[w]);
  // SIMD group w sums splits w, w + NW, ..., COMBINE_UNROLL of them a trip; a split past the
  // end reads the last one with weight 0 (no branch around the loads, which are then in
  // flight together)
  float l = 0.0f;
  float o[CPL];
  VQ_UNROLL
  for (int j = 0; j < CPL; ++j) o[j] = 0.0f;
  for (int s0 = (int)vq_warp; s0 < n_part; s0 += NW * COMBINE_UNROLL) {
    VQ_UNROLL
    for (int u = 0; u < COMBINE_UNROLL; ++u) {
      const int s = s0 + u * NW;
      const int at = row + (s < n_part ? s : n_part - 1);
      const float w = s < n_part ? vq_exp2(part_m[at] - big) : 0.0f;
      l += w * part_l[at];
      VQ_UNROLL
      for (int j = 0; j < CPL; ++j) {
        const int c = (int)vq_lane + 32 * j;
        if (D % 32 == 0 || c < D) o[j] += w * part_o[at * D + c];
      }
    }
  }
  VQ_UNROLL
  for (int j = 0; j < CPL; ++j) {
    const int c = (int)vq_lane + 32 * j;
    if (D % 32 == 0 || c < D) s_o[vq_warp][c] = o[j];
  }
  if (vq_lane == 0) s_sum[vq_warp] = l;
  VQ_BARRIER();
  float total = 0.0f;
  for (int w = 0; w < NW; ++w) total += s_sum[w];
  // row r is query g of the partial launch's head r / GQ: query head kvh·GQ + g
  const int qh = heads[4 * (r / GQ)] * GQ + r % GQ;
  for (int c = tid; c < D; c += TILE) {
    float o_sum = 0.0f;
    for (int w = 0; w < NW; ++w) o_sum += s_o[w][c];
    out[qh * D + c] = static_cast<OUT_T>(o_sum / total);
  }
"""


SPLIT_COMBINE_INPUTS = ("part_m", "part_l", "part_o", "heads", "iparams")
NEG = -1.0e30  # finite "minus infinity" of the split kernels (no inf arithmetic in kernels)


@functools.lru_cache(maxsize=64)
def split_combine_source(
    name: str,
    head_dim: int,
    queries_per_kv: int,
    out_dtype: mx.Dtype,
    threads: int = 128,
    unroll: int = 4,
) -> KernelSource:
    """The merge of a split attention kernel's partials (`SPLIT_COMBINE_BODY`) as kernel
    `name`, `unroll` splits per SIMD group and trip."""
    constants = {
        "TILE": threads,
        "NEG": NEG,
        "D": head_dim,
        "GQ": queries_per_kv,
        "OUT_T": out_dtype,
        "COMBINE_UNROLL": unroll,
    }
    return KernelSource(
        name=name,
        inputs=SPLIT_COMBINE_INPUTS,
        outputs=("out",),
        body=SPLIT_COMBINE_BODY,
        constants=constants,
        threads=threads,
    )


# ---------------------------------------------------------------------------------------------
# Running them


def backend() -> str | None:
    """'cuda' or 'metal' when MLX runs on a GPU that takes custom kernels, else None (CPU)."""
    if mx.default_device() != mx.gpu:
        return None
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


# CUdevice_attribute values (the CUDA driver's cuda.h)
_CU_MULTIPROCESSOR_COUNT = 16
_CU_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
_CU_RESERVED_SHARED_MEMORY_PER_BLOCK = 111
_TARGET_FIX = "set TARGET_GROUPS in veloxquant.methods.vecinfer.kernels and .kivi.kernels to an int"


@functools.lru_cache(maxsize=8)
def _cuda_attribute(attribute: int, what: str, least: int) -> int:
    """CUDA device 0's `attribute` (the GPU MLX runs on: CUDA_VISIBLE_DEVICES picks the card),
    read from the CUDA driver once; an error that names the fix where it is below `least`."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(
            f"cannot load the CUDA driver to read the {what} ({e}); {_TARGET_FIX}"
        ) from e
    device, value = ctypes.c_int(0), ctypes.c_int(-1)
    status = lib.cuInit(0)
    if status == 0:
        status = lib.cuDeviceGet(ctypes.byref(device), 0)
    if status == 0:
        status = lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device)
    if status != 0 or value.value < least:
        raise RuntimeError(
            f"the CUDA driver did not give device 0's {what} (CUresult {status}, value "
            f"{value.value}); {_TARGET_FIX}"
        )
    return value.value


# The card the CUDA kernels were timed on (an H100 or H200): multiprocessors, and (shared memory
# per multiprocessor, bytes kept per threadgroup) as cuda_shared_memory gives them. Tests and
# tools that stand in a CUDA backend where there is no driver to ask split a step's work as there.
TIMED_CARD_MULTIPROCESSORS = 132
TIMED_CARD_SHARED_MEMORY = (233472, 1024)


def cuda_multiprocessors() -> int:
    """Streaming multiprocessors of CUDA device 0, from the CUDA driver: MLX does not report it,
    and the decode kernels split one query's work into whole waves of threadgroups over them."""
    return _cuda_attribute(_CU_MULTIPROCESSOR_COUNT, "multiprocessor count", 1)


def cuda_shared_memory() -> tuple[int, int]:
    """(bytes of shared memory one multiprocessor of CUDA device 0 can give its threadgroups,
    bytes the driver keeps per threadgroup), from the CUDA driver: 228 KB and 1 KB on an H100 or
    H200, 164 KB on an A100, 100 KB on an RTX 4090."""
    return (
        _cuda_attribute(_CU_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, "shared memory per SM", 1),
        _cuda_attribute(_CU_RESERVED_SHARED_MEMORY_PER_BLOCK, "reserved shared memory", 0),
    )


def resident_groups(bound: int, threadgroup_bytes: int) -> int:
    """Threadgroups with `threadgroup_bytes` of threadgroup memory that one multiprocessor of
    the CUDA GPU runs at once: `bound` (the kernel's launch bounds, which hold its registers to
    that many), or fewer where the card's shared memory holds fewer."""
    per_multiprocessor, reserved = cuda_shared_memory()
    return max(1, min(bound, per_multiprocessor // (threadgroup_bytes + reserved)))


def split_target(
    override: int | None, per_multiprocessor: int, elsewhere: int, threadgroup_bytes: int = 0
) -> int:
    """Threadgroups one decode query's splits aim for: `override` when set, else
    `per_multiprocessor` on each of the CUDA GPU's multiprocessors, or as many of a launch's
    threadgroups of `threadgroup_bytes` as one holds at once where that is fewer (whole waves:
    a count past what the card runs at once leaves its last groups running alone), or
    `elsewhere` (Metal)."""
    if override is not None:
        return override
    if backend() == "cuda":
        per = per_multiprocessor
        if threadgroup_bytes:
            per = resident_groups(per, threadgroup_bytes)
        return per * cuda_multiprocessors()
    return elsewhere


# A decode step's launch parameters (counts, positions, the ring slot) change at every step. On
# MLX's CUDA backend an array made from host values lives in managed memory: most likely the
# first kernel to read it faults its page over to the GPU, and other host-made arrays on that
# page (the layers' packs) fault back in their next kernels. Inside real decode steps on an
# H100, a step's first launch (and at some lengths its last four) took 200-450 us against 25-80,
# and with this remedy they are even (benchmarks/results/launch-params-h100.txt). So on CUDA a
# new value set is the nearest recent one (of as many values) plus their difference, added on
# the GPU: a GPU op's output, normally device memory that no host write touches (MLX's buffer
# cache may still hand it a freed managed buffer). The differences repeat from step to step (a
# token more, the ring a slot on), so each is made once and copied to the GPU
# (`device_resident`). The nearest, not the latest: with two kinds of launch (or two models)
# taking turns, the latest set is the other kind's, and the difference would be new at every
# step. Off (False), every set is a host array.
DEVICE_LAUNCH_PARAMS = True
LAUNCH_PARAMS_KEPT = 16  # recent value sets kept: every layer of a step asks for the same one
_PARAMS_LOCK = threading.Lock()
_PARAMS: OrderedDict[tuple[int, ...], mx.array] = OrderedDict()
_STEPS: dict[tuple[int, ...], mx.array] = {}  # differences between value sets, on the GPU
_LATEST_PARAMS: tuple[tuple[int, ...] | None, mx.array | None] = (None, None)


def launch_params(values: tuple[int, ...]) -> mx.array:
    """An int32 array of `values` for a kernel launch, one array per value set among recent
    calls (see DEVICE_LAUNCH_PARAMS for how a new set is made on CUDA). A value outside int32
    is a ValueError."""
    latest = _LATEST_PARAMS  # every layer of a decode step asks for the same set: no lock
    if latest[0] == values:
        return latest[1]
    with _PARAMS_LOCK:
        made = _PARAMS.get(values)
        if made is not None:
            _PARAMS.move_to_end(values)
            _set_latest(values, made)
            return made
        if not all(-(2**31) <= v < 2**31 for v in values):
            raise ValueError(f"launch parameters {values} do not fit int32")
        if DEVICE_LAUNCH_PARAMS and backend() == "cuda":
            made = _from_recent(values)
        if made is None:
            made = mx.array(list(values), mx.int32)
        else:
            # started now, under the lock: a set is shared between threads, and two threads
            # must not evaluate the same unevaluated array
            mx.async_eval(made)
        _PARAMS[values] = made
        if len(_PARAMS) > LAUNCH_PARAMS_KEPT:
            _PARAMS.popitem(last=False)
        _set_latest(values, made)
        return made


def _set_latest(values: tuple[int, ...], made: mx.array) -> None:
    global _LATEST_PARAMS
    _LATEST_PARAMS = (values, made)  # one tuple: a reader sees the old pair or the new one


def _from_recent(values: tuple[int, ...]) -> mx.array | None:
    """`values` as a recent set plus a difference: the first of the 4 latest sets (of as many
    values) whose difference to them is already an array, else the nearest of them."""
    near, far, seen = None, 2**30, 0  # the difference must fit int32
    for old, array in reversed(_PARAMS.items()):
        if len(old) != len(values):
            continue
        step = tuple([v - u for v, u in zip(values, old, strict=True)])
        made = _STEPS.get(step)
        if made is not None:
            return array + made
        size = sum(map(abs, step))
        if size < far:
            near, far = (step, array), size
        seen += 1
        if seen == 4:
            break
    if near is None:
        return None
    step, array = near
    _STEPS[step] = device_resident(mx.array(list(step), mx.int32))
    if len(_STEPS) > 64:
        _STEPS.pop(next(iter(_STEPS)))
    return array + _STEPS[step]


def device_resident(x: mx.array) -> mx.array:
    """`x` copied by a GPU op on CUDA (normally device memory, which no host write shares a page
    with; see DEVICE_LAUNCH_PARAMS), `x` itself elsewhere: for a host-made array that kernels
    read at every launch. Evaluated here, while `x` is still held: a temporary input's buffer
    would otherwise be donated to the copy, which would then be `x`'s managed memory again."""
    if not (DEVICE_LAUNCH_PARAMS and backend() == "cuda"):
        return x
    copy = x + 0
    mx.eval(copy)
    return copy


_COMPILED: dict[tuple[str, str, tuple[str, ...], bool], Any] = {}


def compiled_name(source: KernelSource, input_dtypes: tuple[str, ...]) -> str:
    """The name a kernel is compiled under for these input dtypes. MLX's CUDA backend caches a
    compiled module by kernel name alone (its signature, which spells the input types, is not
    part of the key), so one name must never see two dtype sets: a cache whose window is
    bfloat16 and a call with a float16 placeholder would otherwise share one binary."""
    digest = hashlib.sha1(",".join(input_dtypes).encode()).hexdigest()[:8]
    return f"{source.kernel_name}_{digest}"


# MLX's CUDA backend copies a custom kernel's whole source into the primitive of every call
# and hashes it at every evaluation (mlx/backend/cuda/custom_kernel.cpp, 0.32): per layer and
# decode step, for the 34 KB attention kernel. With CUDA_SOURCE_FILES the source MLX holds is
# one #include line of a file written once per process, which NVRTC reads when it compiles.
CUDA_SOURCE_FILES = True
_SOURCE_DIR: list[Path] = []  # this process's directory of included sources, made on first use


def cuda_kernel_text(source: KernelSource, name: str = "") -> tuple[str, str]:
    """(source, header) to hand `mx.fast.cuda_kernel` for `source` compiled under `name`
    (`compiled_name`): its body and header as they are, or (CUDA_SOURCE_FILES) one #include
    line each of a file holding that text. MLX writes the signature itself
    (`__global__ void custom_kernel_<name>(`), so a kernel's launch bounds reach it as a macro of
    that name: defined at the header's end, undefined at the body's (before NVRTC reads MLX's
    name expression of the kernel, which the macro would break)."""
    body, header = source.cuda_body(), source.header("cuda")
    if source.min_threadgroups:
        if not name:
            raise ValueError(f"{source.name}: launch bounds need the name it is compiled under")
        fn = f"custom_kernel_{name}"
        header += f"#define {fn} {source.launch_bounds()}{fn}\n"
        body += f"\n#undef {fn}\n"
    if not CUDA_SOURCE_FILES:
        return body, header
    # MLX passes an input's shape, strides or ndim only when the source it holds names them
    for name in source.inputs:
        for suffix in ("_shape", "_strides", "_ndim"):
            if name + suffix in body:
                raise ValueError(
                    f"{source.name}: the body reads {name + suffix}, which MLX passes only when "
                    "it sees the name in the source; set kernels.CUDA_SOURCE_FILES = False"
                )
    return _include_line(body), _include_line(header)


def _include_line(text: str) -> str:
    if not _SOURCE_DIR:
        path = Path(tempfile.mkdtemp(prefix="veloxquant-cuda-"))
        if '"' in str(path) or "\\" in str(path):
            path.rmdir()
            raise RuntimeError(
                f"{path}: NVRTC cannot #include from a directory whose name holds a quote or a "
                "backslash; point TMPDIR elsewhere, or set kernels.CUDA_SOURCE_FILES = False"
            )
        atexit.register(_remove_source_dir, path, os.getpid())
        _SOURCE_DIR.append(path)
    path = _SOURCE_DIR[0] / f"{hashlib.sha1(text.encode()).hexdigest()}.cuh"
    if not path.exists():  # named by its content: an existing file holds this text
        write_bytes_atomic(path, text.encode())
    return f'#include "{path}"\n'


def _remove_source_dir(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child's exit: the parent may still compile from it
        shutil.rmtree(path, ignore_errors=True)


def compiled(source: KernelSource, input_dtypes: tuple[str, ...]) -> Any | None:
    """The MLX kernel object for the current backend (built once per configuration and input
    dtypes), or None on the CPU. Call it with MLX's usual keyword arguments (inputs, grid,
    threadgroup, output_shapes, output_dtypes); the grid counts threads, as in MLX."""
    which = backend()
    if which is None:
        return None
    if which not in source.backends:
        raise ValueError(f"{source.name} is written for {', '.join(source.backends)} only")
    key = (which, source.kernel_name, input_dtypes, which == "cuda" and CUDA_SOURCE_FILES)
    if key not in _COMPILED:
        name = compiled_name(source, input_dtypes)
        if which == "cuda":
            text, header = cuda_kernel_text(source, name)
            _COMPILED[key] = mx.fast.cuda_kernel(
                name=name,
                input_names=list(source.inputs),
                output_names=list(source.outputs),
                source=text,
                header=header,
                shared_memory=source.dynamic_shared,
            )
        else:
            _COMPILED[key] = mx.fast.metal_kernel(
                name=name,
                input_names=list(source.inputs),
                output_names=list(source.outputs),
                source=source.metal_body(),
                header=source.header("metal"),
            )
    return _COMPILED[key]


_LAUNCHERS: dict[tuple[Any, ...], Any] = {}


def launch(
    source: KernelSource,
    inputs: list[mx.array],
    grid: tuple[int, int, int],
    output_shapes: list[tuple[int, ...]],
    output_dtypes: list[mx.Dtype],
) -> list[mx.array]:
    """Run `source` on the current GPU backend. `grid` counts threadgroups (not threads);
    every input must hold at least 8 elements (Metal passes smaller ones in the constant
    address space, which the dialect's `VQ_GLOBAL` casts do not expect)."""
    check_inputs(source, inputs)
    run = launcher(source, tuple([x.dtype for x in inputs]))
    return run(inputs, grid, output_shapes, output_dtypes)


def check_inputs(source: KernelSource, inputs: list[mx.array]) -> None:
    """Raise unless `inputs` are one per input of `source`, each of at least 8 elements."""
    if len(inputs) != len(source.inputs) or min([x.size for x in inputs], default=8) < 8:
        for name, x in zip(source.inputs, inputs, strict=True):
            if x.size < 8:
                raise ValueError(f"{source.name}: input {name} has {x.size} < 8 elements")


def launcher(source: KernelSource, input_dtypes: tuple[mx.Dtype, ...]) -> Any:
    """`launch` bound to `source` and one set of input dtypes: call it as
    `run(inputs, grid, output_shapes, output_dtypes)`. For a hot path that launches the same
    kernel on inputs of the same dtypes at every decode step and has checked them once
    (`check_inputs`): launch()'s scan of every input's dtype and size, a few microseconds of
    host time per call, is then not repeated."""
    # memo by the dtype objects: spelling every input's dtype as a string each call was most of
    # launch()'s own cost
    key = (backend(), source.kernel_name, input_dtypes, CUDA_SOURCE_FILES)
    kernel = _LAUNCHERS.get(key)
    if kernel is None:
        kernel = compiled(source, tuple(str(d) for d in input_dtypes))
        if kernel is None:
            raise RuntimeError(f"{source.name}: no GPU kernel backend (MLX runs on the CPU)")
        _LAUNCHERS[key] = kernel
    t = source.threads

    def run(
        inputs: list[mx.array],
        grid: tuple[int, int, int],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[mx.Dtype],
    ) -> list[mx.array]:
        return kernel(
            inputs=inputs,
            grid=(grid[0] * t, grid[1], grid[2]),
            threadgroup=(t, 1, 1),
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
        )

    return run


# ---------------------------------------------------------------------------------------------
# Checks that need no GPU


def check_metal_source(source: KernelSource, input_dtypes: list[str], output_dtypes: list[str]):
    """Problems with the Metal translation unit of `source` (empty when well-formed): one
    `[[kernel]]` entry point with the expected name; buffer bindings 0..n-1 in order, one per
    input and output, inputs const; the thread-index attributes the prologue uses declared;
    balanced braces and parentheses; no CUDA-only spellings left in the body."""
    tu = source.metal_translation_unit(input_dtypes, output_dtypes)
    problems = []
    entries = re.findall(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\(", tu)
    if entries != [f"custom_kernel_{source.kernel_name}"]:
        problems.append(f"entry points {entries}")
    bindings = re.findall(r"(const\s+)?device\s+\w+\*\s+(\w+)\s+\[\[buffer\((\d+)\)\]\]", tu)
    names = [b[1] for b in bindings]
    if names != list(source.inputs) + list(source.outputs):
        problems.append(f"buffer names {names}")
    if [int(b[2]) for b in bindings] != list(range(len(bindings))):
        problems.append(f"buffer indices {[b[2] for b in bindings]}")
    n_in = len(source.inputs)
    if any(not b[0] for b in bindings[:n_in]) or any(b[0] for b in bindings[n_in:]):
        problems.append("inputs must be const device buffers, outputs writable")
    for attr, _ in METAL_ATTRIBUTES:
        if attr in source.metal_body() and f"[[{attr}]]" not in tu:
            problems.append(f"attribute {attr} used but not declared")
    for a, b in ("{}", "()", "[]"):
        if tu.count(a) != tu.count(b):
            problems.append(f"unbalanced {a}{b}")
    body = source.metal_body()
    for cuda_only in ("__shared__", "__syncthreads", "threadIdx", "blockIdx", "__shfl", "__half"):
        if cuda_only in body:
            problems.append(f"CUDA spelling {cuda_only} in the Metal body")
    return problems
