"""VecInfer's fused kernels: decode attention straight from the codes, and the encoder.

Both are written once (veloxquant/kernels.py: one template, CUDA and Metal source) and each has
a pure-MLX twin here that runs everywhere; the twin computes the same function by the same
algebra and is what the kernels are tested against (it is itself tested against the cache's
transient path, the oracle that decodes everything and then attends). On an x86 CPU with the
CPU extension built, decode attention's coded past runs the extension's one-pass kernel instead
(`cpu_kernel_attention`, veloxquant/cpu_kernels.cpp: the same algebra, sums in another order),
and the twin takes what it does not (mask arrays, no extension).

The algebra (per layer, KV head h, query q of one of its G query heads, coded token t at
absolute position m_t, c_k(t) / c_v(t) its decoded codewords in the coded space):

    k̂_t = Had(c_k(t)) ⊙ λ + RoPE_{m_t}(μ_k)            (VecInferCache.decode_keys)
    q·k̂_t = q̃·c_k(t) + Σ_j A_j cos(m_t θ_j) + B_j sin(m_t θ_j),   q̃ = Had(q ⊙ λ)
    (A_j, B_j from q and μ_k on RoPE pair j: the "phase" term of the rotated mean)
    v̂_t = Had(c_v(t)) ⊙ λ_v + μ_v  ⇒  Σ p_t v̂_t = Had(Σ p_t c_v(t)) ⊙ λ_v + μ_v Σ p_t

so scores need one small codebook gather per sub-vector and no key is ever rebuilt, and the
value side transforms one aggregated vector per query head instead of every token.

Decode attention (`attention_kernel_sources`, flash-decoding in two launches):
1. partial: one threadgroup of 128 threads per (sequence split, KV head); it computes q̃ and
   the phase coefficients for its G query heads once (a KV head's codes are read once for all
   of them), then walks its split in tiles of 128·R tokens: each thread scores R consecutive
   tokens from their key codes (the key codebook sits in threadgroup memory, replicated per
   lane when small so random codes hit distinct banks; a chunk of sub-vectors per iteration of
   a loop that is not unrolled, since fetching a fully unrolled loop's instructions, once per
   tile, took longer than its arithmetic) plus the phase term (the tile's start angle exactly, the
   offset within the tile from a host-built table, so no per-token sin/cos; the slow RoPE pairs,
   which barely turn over a tile, as one polynomial in the offset); an online softmax
   per head; then each thread owns one value sub-space for a stride of the tile's tokens and
   accumulates p·C_v[code] for every head. One extra threadgroup per KV head attends the fp16
   sinks, the fp16 window and the call's own token(s) exactly. Each writes (max, sum, output).
2. combine: one threadgroup per query head merges the splits (log-sum-exp), applies the
   Hadamard, λ_v and μ_v once, adds the exact part and writes the output in the model dtype.
   In a decode step whose window is full, the same launch also encodes the token leaving the
   window (`combine_encode_kernel_source`: one more threadgroup per KV head running the
   encoder's code) and, by default (WRITE_IN_PLACE), writes its codes into the cache's code
   buffers and the step's new token over its ring slot: a decode step of a layer is these two
   launches and no other operation. MLX arrays are immutable to MLX itself, so the cache
   keeps those buffers to itself (copies, never views, leave it) and orders every other read
   of them after the write (`VecInferCache._sync`, and the partial launch's `after` input).

Encode (`encode_kernel_source`): one threadgroup per (token, KV head): RoPE_m(μ) subtracted,
smooth scales, Hadamard in threadgroup memory, nearest centroid per sub-vector with the
argmin in registers (the distance in `kmeans.nearest`'s form ‖c‖² − 2x·c, first index on
ties), bit packing; keys and values in one launch for all of a layer's new tokens.

Supported configurations (else callers use the pure-MLX twin): head_dim a power of two in
[32, 256], sub_dim in {1, 2, 4}, bits <= 12, packed rows a whole number of 32-bit words, and
threadgroup arrays within the backend's limit (THREADGROUP_LIMIT: 32 KB on Apple GPUs, so for
instance a 64-dim head with 7 query heads per KV head, 37 KB, runs the kernels on CUDA only).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, fields, replace
from typing import Any

import mlx.core as mx
import numpy as np

import veloxquant.kernels as vk  # its functions looked up per call: tests stub `vk.backend`
from veloxquant import attention, cpu_kernels
from veloxquant.codes import code_bytes, pq_decode
from veloxquant.kernels import (
    TENSOR_CORE_HELPERS,
    KernelSource,
    device_resident,
    launch_params,
    split_target,
)
from veloxquant.rope import (
    TABLE_MIN_LENGTH,
    RopeSpec,
    phase_coefficients,
    phase_table,
    rotate_by_table,
    rotated_mean,
    rotation_table,
)

TILE = 128  # tokens per tile and threads per threadgroup of the partial kernel
NEG = -1.0e30  # finite "minus infinity" for running maxima (no inf arithmetic in kernels)
LOG2E = 1.4426950408889634
# Threadgroup memory one replicated codebook may take, and all of a kernel's arrays may take
# per backend: Apple GPUs have 32 KB per threadgroup, and CUDA takes at most 48 KB of static
# arrays (more needs dynamic shared memory: only the one-launch kernel's tensor-core path uses
# it, for a value book that fits the card, `_mma_value_copies`).
CODEBOOK_BYTES = 8192
THREADGROUP_LIMIT = {"metal": 32768, "cuda": 49152}
# Coded tokens each thread scores per tile: the query's transformed sub-vectors and phase
# coefficients are read from threadgroup memory once for all of them. 4 took 128 registers per
# thread with the key loop unrolled and 144 with it rolled (3 threadgroups per SM on an H200);
# 2 takes 96, and timed faster from cold caches up to 64K tokens
# (benchmarks/results/instruction-fetch-h200.txt).
TOKENS_PER_THREAD = 2
# The tensor-core loop loads the key rows of each SIMD group's first block of a tile one tile
# ahead (the value rows' turn spilled: 128 registers). Faster inside real decode steps on an
# H100 than False (benchmarks/results/mma-loop-h100.txt, `h200_mma.sh loop`'s noahead arm).
KEY_ROWS_AHEAD = True
# Value codes each thread has in flight while it accumulates the previous ones.
VALUE_PREFETCH = 16
# Key sub-vectors scored per iteration of the partial kernel's key loop, which is not unrolled
# beyond that: rounded up to whole 32-bit words of codes, and all KM when that does not divide
# them (so fewer than this when KM is smaller).
KEY_CHUNK = 16
# Exact tokens (sinks, window, new) a SIMD group loads at a time, keys and values together, all
# their loads in flight at once. 4 took 102 registers and was no faster from cold caches; 1 no
# faster either (benchmarks/results/exact-tokens-per-simd-group-h200.txt).
EXACT_BATCH = 2
# The RoPE phase of the key mean: pairs whose angle turns by at most PHASE_TAYLOR_ANGLE over a
# tile (the slow, low-frequency ones: 31 of Llama-3's 64 over a 256-token tile) are summed as
# one polynomial of this order in the token's offset instead of term by term; the truncation error,
# angle^(order+1) / (order+1)!, is 1e-6 of the pairs' coefficients.
PHASE_TAYLOR_ORDER = 5
PHASE_TAYLOR_ANGLE = 0.3
# The tensor-core path sums the slow pairs as one polynomial too (`poly_pairs`), chosen once per
# RoPE for its longest tile (POLY_TOKENS; it takes no longer ones): the pairs turning by at most
# POLY_ANGLE over it, which the CUDA cores' test chooses over the default 256-token tile. Their
# 2 cos / -sin columns each of the phase operand give way to the POLY_ORDER + 1 = 8 power
# columns of one chunk, whose coefficients each SIMD group sums per tile with a few MMAs of
# the pairs' W by a host-built table: at the 8B shape 5 of 8 16-column phase chunks per block,
# and 4 MMAs for the sums. The truncation error, 0.6^8 / 8!, is 4e-7 of the pairs' W. Faster
# inside real decode steps on an H100 than without (benchmarks/results/mma-loop-h100.txt,
# `h200_mma.sh loop`'s nopoly arm); poly_pairs 0 in a Layout turns it off.
POLY_TOKENS = 512
POLY_ANGLE = 0.6
POLY_ORDER = 7
_VEC = {1: "float", 2: "float2", 4: "float4"}
_WORDS = {1: "uint32_t", 2: "uint2", 4: "uint4"}  # key code row loads, by 32-bit words


@dataclass(frozen=True)
class Layout:
    """The static shape of one VecInfer layer, which is what a compiled kernel depends on."""

    head_dim: int
    n_kv_heads: int
    group: int  # query heads per KV head
    key_bits: int
    key_sub_dim: int
    value_bits: int
    value_sub_dim: int
    key_books: int  # H_kv or 1 (shared)
    value_books: int
    hadamard: bool
    center: bool  # key mean present (needs RoPE)
    value_mean: bool
    value_smooth: bool
    rope_traditional: bool
    # trailing RoPE pairs the tensor-core path sums as one polynomial per tile (`poly_pairs`;
    # 0: every pair from the phase table)
    poly_pairs: int = 0

    # A decode step looks memos up by its layout several times per layer: the fields' hash,
    # computed once (a frozen dataclass's own hashes all 14 fields at every lookup)
    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def key_bytes(self) -> int:
        return code_bytes(self.key_bits, self.head_dim // self.key_sub_dim)

    @property
    def value_bytes(self) -> int:
        return code_bytes(self.value_bits, self.head_dim // self.value_sub_dim)

    def unsupported(self, backend: str = "metal") -> str | None:
        """Why the kernels cannot run this layout on `backend` ("cuda" or "metal"; None when
        they can). The default is the stricter backend: what runs there runs everywhere."""
        d = self.head_dim
        if d & (d - 1) or not 32 <= d <= 256:
            return f"head_dim {d} is not a power of two in [32, 256]"
        for side, sub, bits, nbytes in (
            ("key", self.key_sub_dim, self.key_bits, self.key_bytes),
            ("value", self.value_sub_dim, self.value_bits, self.value_bytes),
        ):
            if sub not in _VEC:
                return f"{side}_sub_dim {sub} is not 1, 2 or 4"
            if bits > 12:
                return f"{side}_bits {bits} > 12"
            if nbytes % 4:
                return f"{side} code rows of {nbytes} bytes are not whole 32-bit words"
        if TILE % (d // self.value_sub_dim):
            return "value sub-spaces do not divide the tile"
        if self.value_smooth and (self.value_books > 1 and self.value_books != self.n_kv_heads):
            return "value codebooks neither shared nor per head"
        for kernel, nbytes in (
            ("partial attention", threadgroup_bytes(self, TOKENS_PER_THREAD)),
            ("encode", encode_threadgroup_bytes(self)),
        ):
            if nbytes > THREADGROUP_LIMIT[backend]:
                return (
                    f"the {kernel} kernel needs {nbytes} B of threadgroup memory, more than "
                    f"{backend}'s {THREADGROUP_LIMIT[backend]}"
                )
        return None


# ---------------------------------------------------------------------------------------------
# Kernel sources

# Online-softmax update of one tile of coded tokens: `s[r][g]` is the score (log2 units) of this
# thread's token r for head g (NEG when it has none). Leaves p = exp2(s - m_run) in s_p4 (as
# floats: [(vq_tid * R + r) * GP + g]) and the factor that rescales what was accumulated before
# in s_alpha. A token's GP probabilities are stored as float4s: scalar stores at the 4·R·GP-byte
# stride between threads hit the same banks (16-way at the 8B shape's 64 bytes; ncu counted 69%
# of the shared store wavefronts as conflicts).
_SOFTMAX_TILE = """
    VQ_UNROLL
    for (int g = 0; g < G; ++g) {
      float tmax = s[0][g];
      VQ_UNROLL
      for (int r = 1; r < R; ++r) tmax = VQ_FMAX(tmax, s[r][g]);
      const float wmax = vq_simd_max(tmax);
      if (vq_lane == 0) s_red[vq_warp * G + g] = wmax;
    }
    VQ_BARRIER();
    if (vq_tid < G) {
      float mm = s_red[vq_tid];
      for (int w = 1; w < NWARPS; ++w) mm = VQ_FMAX(mm, s_red[w * G + vq_tid]);
      const float m_new = VQ_FMAX(s_mrun[vq_tid], mm);
      s_alpha[vq_tid] = vq_exp2(s_mrun[vq_tid] - m_new);
      s_mrun[vq_tid] = m_new;
    }
    VQ_BARRIER();
    float pr[R][GP];
    VQ_UNROLL
    for (int g = 0; g < G; ++g) {
      const float mg = s_mrun[g];
      float tsum = 0.0f;
      VQ_UNROLL
      for (int r = 0; r < R; ++r) {
        const float p = s[r][g] > 0.5f * NEG ? vq_exp2(s[r][g] - mg) : 0.0f;
        pr[r][g] = p;
        tsum += p;
      }
      const float wsum = vq_simd_sum(tsum);
      if (vq_lane == 0) s_red[vq_warp * G + g] = wsum;
    }
    VQ_UNROLL
    for (int r = 0; r < R; ++r) {
      VQ_UNROLL
      for (int g = G; g < GP; ++g) pr[r][g] = 0.0f;  // padding of the last float4
      VQ_UNROLL
      for (int k = 0; k < GP / 4; ++k) {
        s_p4[((int)vq_tid * R + r) * (GP / 4) + k] =
            VQ_F4(pr[r][4 * k], pr[r][4 * k + 1], pr[r][4 * k + 2], pr[r][4 * k + 3]);
      }
    }
    VQ_BARRIER();
    if (vq_tid < G) {
      float ss = 0.0f;
      for (int w = 0; w < NWARPS; ++w) ss += s_red[w * G + vq_tid];
      s_lrun[vq_tid] = s_lrun[vq_tid] * s_alpha[vq_tid] + ss;
    }
"""


# The partial kernel's value sums: the code of sub-space mv in word W (and W2, the next word,
# when the code crosses into it), and the contribution of code C for token tl of the tile.
def _value_code(w: str, w2: str) -> str:
    return f"(({w} >> vsh) | (vcross ? {w2} << (32 - vsh) : 0u)) & (uint32_t)(VCODES - 1)"


def _value_sums(code: str) -> str:
    return f"""
            const VVEC cv = vbook[(int)({code}) * VREP];
            float4 pv[GP / 4];
            VQ_UNROLL
            for (int k = 0; k < GP / 4; ++k) pv[k] = s_p4[tl * (GP / 4) + k];
            VQ_UNROLL
            for (int g = 0; g < G; ++g) {{
              const float p = vq_comp(pv[g / 4], g % 4);
              VQ_UNROLL
              for (int i = 0; i < VD; ++i) acc[g][i] += p * vq_comp(cv, i);
            }}"""


# The partial kernel's source, in the pieces its tensor-core variant (`_MMA_BODY`) shares.
_PARTIAL_PARAMS = """
  const int T = iparams[0];          // coded tokens attended
  const int pos0 = iparams[1];       // absolute position of coded token 0
  const int tps = iparams[2];        // coded tokens per split (a multiple of TILE * R)
  const int n_sink = iparams[3];
  const int n_win = iparams[4];
  const int n_new = iparams[5];
  const int cap = iparams[6];        // token capacity of the code buffers
  const int wcap = iparams[7];       // token capacity of the window buffers
  const float qscale = fparams[0];   // attention scale * log2(e)
  const float rscale = fparams[1];   // RoPE position scale
  const int p_exact = iparams[PHASE_PARAM];  // RoPE pairs whose phase is summed term by term
  const int h = (int)vq_gy;
  const int split = (int)vq_gx;
  const int n_splits = T > 0 ? (T + tps - 1) / tps : 0;
"""

_PARTIAL_SHARED = """
  VQ_SHARED float s_q[G * D];            // scaled queries
  VQ_SHARED float4 s_qt[KM * QS / 4];    // q~ per key sub-space m: [m][g][i], padded to QS
  VQ_SHARED float4 s_w[CENTER ? P * WS / 4 : 1];  // phase coefficients at the tile start
  VQ_SHARED float s_tay[CENTER ? G * NTAY : 1];    // the slow pairs' phase polynomial per head
  VQ_SHARED float s_red[NWARPS * G];
  VQ_SHARED float s_mrun[G];
  VQ_SHARED float s_lrun[G];
  VQ_SHARED float s_alpha[G];
  VQ_SHARED float4 s_p4[PBUF / 4];                // p of the tile's tokens: [token][g]
  VQ_SHARED VVEC s_vb[VCODES * VREP];             // value codebook copies
  VQ_SHARED float4 s_big[BIG4];                    // key codebook copies, then the reduction
  VQ_TG KVEC* s_kb = reinterpret_cast<VQ_TG KVEC*>(s_big);
  VQ_TG float* s_acc = reinterpret_cast<VQ_TG float*>(s_big);
  VQ_TG float* s_qtf = reinterpret_cast<VQ_TG float*>(s_qt);
  VQ_TG float* s_wf = reinterpret_cast<VQ_TG float*>(s_w);
"""

_PARTIAL_OPEN = """
  if (vq_tid < G) {
    s_mrun[vq_tid] = NEG;
    s_lrun[vq_tid] = 0.0f;
  }

  if (split < n_splits) {
    // ---- a split of coded tokens. The setup's global reads are issued together (this lane's
    // query and smoothing elements, then the codebooks), and q~ = Had(q * lambda) is formed in
    // registers: a SIMD group per query head, lane l holding elements l * QE .. l * QE + QE - 1,
    // the butterflies within a lane first and then across lanes by shuffles. Done in
    // threadgroup memory, the setup was a chain of dependent loads and eight barriers before
    // the first token.
    float qx[GW][QE], sx[QE];
    VQ_UNROLL
    for (int gi = 0; gi < GW; ++gi) {
      const int g = (int)vq_warp + gi * NWARPS;
      VQ_UNROLL
      for (int e = 0; e < QE; ++e) {
        qx[gi][e] = g < G ? static_cast<float>(q[(h * G + g) * D + (int)vq_lane * QE + e]) : 0.0f;
      }
    }
    VQ_UNROLL
    for (int e = 0; e < QE; ++e) sx[e] = static_cast<float>(smooth[h * D + (int)vq_lane * QE + e]);
"""

_PARTIAL_BOOKS = """    const int kbook = KBOOKS > 1 ? h : 0;
    for (int i = (int)vq_tid; i < KCODES * KREP; i += TILE) {
      const int base = (kbook * KCODES + i / KREP) * KD;
      s_kb[i] = KLOAD;
    }
    const int vbook = VBOOKS > 1 ? h : 0;
    for (int i = (int)vq_tid; i < VCODES * VREP; i += TILE) {
      const int base = (vbook * VCODES + i / VREP) * VD;
      s_vb[i] = VLOAD;
    }
"""

_PARTIAL_QTILDE = """    VQ_UNROLL
    for (int gi = 0; gi < GW; ++gi) {
      const int g = (int)vq_warp + gi * NWARPS;
      if (g < G) {  // the same for the whole SIMD group, as its shuffles need
        float x[QE];
        VQ_UNROLL
        for (int e = 0; e < QE; ++e) {
          const float qs = qx[gi][e] * qscale;
          s_q[g * D + (int)vq_lane * QE + e] = qs;
          x[e] = qs * sx[e];
        }
        if (HAD) {
          VQ_UNROLL
          for (int st = 0; st < QLOG; ++st) {  // strides 1 .. QE / 2, within the lane
            const int len = 1 << st;
            VQ_UNROLL
            for (int e = 0; e < QE; ++e) {
              if ((e & len) == 0) {
                const float a = x[e], b = x[e + len];
                x[e] = a + b;
                x[e + len] = a - b;
              }
            }
          }
          VQ_UNROLL
          for (int st = 0; st < 5; ++st) {  // strides QE .. D / 2: lane masks 1 .. 16
            const int mask = 1 << st;
            const bool upper = ((int)vq_lane & mask) != 0;
            VQ_UNROLL
            for (int e = 0; e < QE; ++e) {
              const float y = vq_shfl_xor(x[e], mask);
              x[e] = upper ? y - x[e] : x[e] + y;
            }
          }
        }
        // q~ in the [m][g][i] layout the key loop reads
        VQ_UNROLL
        for (int e = 0; e < QE; ++e) {
          const int n = (int)vq_lane * QE + e;
          s_qtf[(n / KD) * QS + g * KD + n % KD] = x[e] * (HAD ? INV_SQRT_D : 1.0f);
        }
      }
    }
    if (QS > G * KD) {  // the padding of each sub-space's row
      for (int idx = (int)vq_tid; idx < KM * QS; idx += TILE) {
        if (idx % QS >= G * KD) s_qtf[idx] = 0.0f;
      }
    }
    VQ_BARRIER();
"""

# W = A - iB of (pair j, head g) and the (sin, cos) of its rotation to position mpos: wr, wi,
# sn, cs (the rotated W is wr cs - wi sn, wr sn + wi cs), from the pair's key mean mua, mub
# and frequency fr (_PHASE_W_LOADS, or loaded ahead by the tensor-core path's setup).
_PHASE_W_LOADS = """          const int ia = TRAD ? 2 * j : j;
          const int ib = TRAD ? 2 * j + 1 : j + P;
          const float mua = static_cast<float>(key_mean[h * D + ia]);
          const float mub = static_cast<float>(key_mean[h * D + ib]);
          const float fr = inv_freq[j];
"""
_PHASE_W_PRODUCT = """          const float qa = s_q[g * D + (TRAD ? 2 * j : j)];
          const float qb = s_q[g * D + (TRAD ? 2 * j + 1 : j + P)];
          const float wr = qa * mua + qb * mub;
          const float wi = qa * mub - qb * mua;
"""
_PHASE_W_MATH = (
    _PHASE_W_PRODUCT
    + """          float sn, cs;
          VQ_SINCOS(mpos * fr, sn, cs);
"""
)
_PHASE_W = _PHASE_W_LOADS + _PHASE_W_MATH

# The phase coefficients at a tile's start: PHASE_STORE(re, im) of each (pair j, head g).
_TILE_PHASE = (
    "        // W = A - iB per (pair j, head g), rotated to the tile's first position: exact at\n"
    """        // every tile start; offsets within the tile come from the host table.
        const float mpos = rscale * (float)(pos0 + tile);
        for (int idx = (int)vq_tid; idx < P * G; idx += TILE) {
          const int j = idx / G, g = idx % G;
"""
    + _PHASE_W
    + """          PHASE_STORE(wr * cs - wi * sn, wr * sn + wi * cs)
        }
"""
)

_PARTIAL_EXACT = """  } else {
    // ---- the exact tokens: fp16 sinks, fp16 window, the call's own token(s). Each SIMD group
    // walks its own share of them, FPB tokens at a time, with an online softmax of its own;
    // the SIMD groups merge once at the end. A lane holds elements d = e * 32 + lane of a row
    // (coalesced loads), a token's key and value rows are loaded together after one choice of
    // sink / window / new per token, and every load of a batch is issued before its sums: up
    // to 16K-token contexts this threadgroup was the launch's longest, and its time was
    // rounds of dependent loads and the instructions of a per-element choice, not arithmetic.
    for (int i = (int)vq_tid; i < G * D; i += TILE) {
      s_q[i] = static_cast<float>(q[(h * G) * D + i]) * qscale;
    }
    VQ_BARRIER();
    const int n_fp = n_sink + n_win + n_new;
    float mw[G], lw[G], ow[G][DE];
    VQ_UNROLL
    for (int g = 0; g < G; ++g) {
      mw[g] = NEG;
      lw[g] = 0.0f;
      VQ_UNROLL
      for (int e = 0; e < DE; ++e) ow[g][e] = 0.0f;
    }
    const int lane = (int)vq_lane;
    for (int t0 = (int)vq_warp * FPB; t0 < n_fp; t0 += NWARPS * FPB) {
      float kx[FPB][DE], vx[FPB][DE];
      VQ_UNROLL
      for (int b = 0; b < FPB; ++b) {
        const int t = t0 + b;
        if (t < n_sink) {
          EXACT_ROW(sink_k, sink_v, (h * n_sink + t) * D)
        } else if (t < n_sink + n_win) {
          EXACT_ROW(win_k, win_v, (h * wcap + t - n_sink) * D)
        } else if (t < n_fp) {
          EXACT_ROW(new_k, new_v, (h * n_new + t - n_sink - n_win) * D)
        } else {
          VQ_UNROLL
          for (int e = 0; e < DE; ++e) kx[b][e] = vx[b][e] = 0.0f;
        }
      }
      VQ_UNROLL
      for (int g = 0; g < G; ++g) {
        float sc[FPB];
        float m_new = mw[g];
        VQ_UNROLL
        for (int b = 0; b < FPB; ++b) {
          float part = 0.0f;
          VQ_UNROLL
          for (int e = 0; e < DE; ++e) part += s_q[g * D + e * 32 + lane] * kx[b][e];
          const float full = vq_simd_sum(part);
          sc[b] = t0 + b < n_fp ? full : NEG;
          m_new = VQ_FMAX(m_new, sc[b]);
        }
        const float al = vq_exp2(mw[g] - m_new);
        mw[g] = m_new;
        lw[g] *= al;
        VQ_UNROLL
        for (int e = 0; e < DE; ++e) ow[g][e] *= al;
        VQ_UNROLL
        for (int b = 0; b < FPB; ++b) {
          const float p = sc[b] > 0.5f * NEG ? vq_exp2(sc[b] - m_new) : 0.0f;
          lw[g] += p;
          VQ_UNROLL
          for (int e = 0; e < DE; ++e) ow[g][e] += p * vx[b][e];
        }
      }
    }
    // merge the SIMD groups: the largest max, then each group's share added in turn into
    // s_acc [G][D] (one barrier per SIMD group; once per launch)
    if (vq_lane == 0) {
      VQ_UNROLL
      for (int g = 0; g < G; ++g) s_red[vq_warp * G + g] = mw[g];
    }
    VQ_BARRIER();
    float wscale[G];
    VQ_UNROLL
    for (int g = 0; g < G; ++g) {
      float mm = s_red[g];
      for (int w = 1; w < NWARPS; ++w) mm = VQ_FMAX(mm, s_red[w * G + g]);
      wscale[g] = vq_exp2(mw[g] - mm);
      if (vq_tid == 0) {
        s_mrun[g] = mm;
        s_lrun[g] = 0.0f;
      }
    }
    for (int w = 0; w < NWARPS; ++w) {
      if ((int)vq_warp == w) {
        VQ_UNROLL
        for (int g = 0; g < G; ++g) {
          VQ_UNROLL
          for (int e = 0; e < DE; ++e) {
            const int i = g * D + e * 32 + lane;
            s_acc[i] = (w == 0 ? 0.0f : s_acc[i]) + wscale[g] * ow[g][e];
          }
          if (lane == 0) s_lrun[g] += wscale[g] * lw[g];
        }
      }
      VQ_BARRIER();
    }
    for (int i = (int)vq_tid; i < G * D; i += TILE) {
      part_o[(split * HQ + h * G) * D + i] = s_acc[i];
    }
  }
  if (vq_tid < G) {
    part_m[split * HQ + h * G + vq_tid] = s_mrun[vq_tid];
    part_l[split * HQ + h * G + vq_tid] = s_lrun[vq_tid];
  }
"""

_PARTIAL_BODY = (
    _PARTIAL_PARAMS
    + _PARTIAL_SHARED
    + _PARTIAL_OPEN
    + _PARTIAL_BOOKS
    + _PARTIAL_QTILDE
    + """
    // key code rows read KLV words at a time (16-byte loads when rows are whole 16 bytes: a
    // quarter of the load instructions and L1 wavefronts of 32-bit loads). Aligned because a
    // row is a whole number of KLV words and the buffer starts on a row: MLX allocations are
    // 256-byte aligned above 8 bytes, and the cache's buffers are never byte-offset views.
    const VQ_GLOBAL KLVEC* kvecs = reinterpret_cast<const VQ_GLOBAL KLVEC*>(key_codes);
    const VQ_GLOBAL uint32_t* vwords = reinterpret_cast<const VQ_GLOBAL uint32_t*>(value_codes);
    const VQ_GLOBAL float2* etab = reinterpret_cast<const VQ_GLOBAL float2*>(phase_table);
    const int mv = (int)vq_tid % VM;      // value sub-space this thread accumulates
    const int tg = (int)vq_tid / VM;      // ... for tokens tg, tg + TG, ... of each tile
    const int krep = (int)vq_lane % KREP;
    const int vrep = (int)vq_lane % VREP;
    float acc[G][VD];
    VQ_UNROLL
    for (int g = 0; g < G; ++g) {
      VQ_UNROLL
      for (int i = 0; i < VD; ++i) acc[g][i] = 0.0f;
    }
    const int t_begin = split * tps;
    const int t_end = min(T, t_begin + tps);
    for (int tile = t_begin; tile < t_end; tile += TILE * R) {
      if (CENTER) {
"""
    + _TILE_PHASE.replace(
        "PHASE_STORE(wr * cs - wi * sn, wr * sn + wi * cs)",
        "s_wf[j * WS + 2 * g] = wr * cs - wi * sn;\n"
        "          s_wf[j * WS + 2 * g + 1] = wr * sn + wi * cs;",
    )
    + """        VQ_BARRIER();
        if (p_exact < P) {
          // pairs p_exact.. turn by at most PHASE_TAYLOR_ANGLE over a tile: their summed phase
          // Re(sum_j W_j e^{i d phi_j}) at offset d is the polynomial sum_k c_k d^k, with
          // c_k = Re(sum_j W_j (i phi_j)^k / k!) (truncation error below 1e-6 of sum_j |W_j|)
          for (int g = (int)vq_warp; g < G; g += NWARPS) {
            float c[NTAY];
            VQ_UNROLL
            for (int k = 0; k < NTAY; ++k) c[k] = 0.0f;
            for (int j = p_exact + (int)vq_lane; j < P; j += 32) {
              const float ph = rscale * inv_freq[j];
              const float wr = s_wf[j * WS + 2 * g], wi = s_wf[j * WS + 2 * g + 1];
              float pw = 1.0f;  // phi^k / k!
              VQ_UNROLL
              for (int k = 0; k < NTAY; ++k) {
                // i^k W: real part wr, -wi, -wr, wi for k = 0, 1, 2, 3 (mod 4)
                const float part = (k % 2 == 0) ? wr : wi;
                c[k] += ((k % 4 == 1 || k % 4 == 2) ? -part : part) * pw;
                pw *= ph * (1.0f / (float)(k + 1));  // a constant reciprocal, no division
              }
            }
            VQ_UNROLL
            for (int k = 0; k < NTAY; ++k) {
              const float ck = vq_simd_sum(c[k]);
              if (vq_lane == 0) s_tay[g * NTAY + k] = ck;
            }
          }
          VQ_BARRIER();
        }
      }
      // this thread's R consecutive tokens
      const int t0 = tile + (int)vq_tid * R;
      float s[R][G];
      uint32_t w[R][KW];
      VQ_UNROLL
      for (int r = 0; r < R; ++r) {
        const bool ok = t0 + r < t_end;
        const int row = (h * cap + (ok ? t0 + r : t_begin)) * (KW / KLV);
        VQ_UNROLL
        for (int i = 0; i < KW / KLV; ++i) {
          const KLVEC x = kvecs[row + i];
          VQ_UNROLL
          for (int e = 0; e < KLV; ++e) w[r][i * KLV + e] = vq_word(x, e);
        }
        VQ_UNROLL
        for (int g = 0; g < G; ++g) s[r][g] = 0.0f;
      }
      // KCH sub-vectors (whole code words, KCW of them) per iteration of a loop that is not
      // unrolled: unrolled over all KM, this loop was half of the kernel's code, and fetching
      // those instructions once per tile, not the arithmetic, was its time. After a chunk, the
      // next chunk's words move down (register moves: every word index stays a constant).
      VQ_UNROLL_BY(1)
      for (int mc = 0; mc < KM; mc += KCH) {
        VQ_UNROLL
        for (int m = 0; m < KCH; ++m) {
          float4 qv[QS / 4];
          VQ_UNROLL
          for (int k = 0; k < QS / 4; ++k) qv[k] = s_qt[(mc + m) * (QS / 4) + k];
          const int bit = m * KB;
          VQ_UNROLL
          for (int r = 0; r < R; ++r) {
            uint32_t c = w[r][bit >> 5] >> (bit & 31);
            if ((bit & 31) + KB > 32) c |= w[r][(bit >> 5) + 1] << (32 - (bit & 31));
            c &= (uint32_t)(KCODES - 1);
            const KVEC cv = s_kb[(int)c * KREP + krep];
            VQ_UNROLL
            for (int g = 0; g < G; ++g) {
              VQ_UNROLL
              for (int i = 0; i < KD; ++i) {
                s[r][g] += vq_comp(qv[(g * KD + i) / 4], (g * KD + i) % 4) * vq_comp(cv, i);
              }
            }
          }
        }
        VQ_UNROLL
        for (int r = 0; r < R; ++r) {
          VQ_UNROLL
          for (int i = 0; i + KCW < KW; ++i) w[r][i] = w[r][i + KCW];
        }
      }
      if (CENTER) {
        // phase: Re(W_j * e^{i theta_j (t - tile)}), the offset rotation from the table for
        // the thread's first token and by one step for the next ones. Unrolled a few pairs at
        // a time, not all P: fully unrolled, this loop alone was thousands of instructions and
        // the warps stalled on instruction fetch.
        VQ_UNROLL_BY(4)
        for (int j = 0; j < p_exact; ++j) {
          float2 z = etab[j * (TILE + 1) + (int)vq_tid];
          const float2 st = etab[j * (TILE + 1) + TILE];
          float4 wv[WS / 4];
          VQ_UNROLL
          for (int k = 0; k < WS / 4; ++k) wv[k] = s_w[j * (WS / 4) + k];
          VQ_UNROLL
          for (int r = 0; r < R; ++r) {
            VQ_UNROLL
            for (int g = 0; g < G; ++g) {
              const float wr = vq_comp(wv[(2 * g) / 4], (2 * g) % 4);
              const float wi = vq_comp(wv[(2 * g + 1) / 4], (2 * g + 1) % 4);
              s[r][g] += wr * z.x;  // two fused multiply-adds
              s[r][g] -= wi * z.y;
            }
            if (r + 1 < R) z = VQ_F2(z.x * st.x - z.y * st.y, z.x * st.y + z.y * st.x);
          }
        }
        if (p_exact < P) {
          VQ_UNROLL
          for (int g = 0; g < G; ++g) {
            VQ_UNROLL
            for (int r = 0; r < R; ++r) {
              const float dl = (float)((int)vq_tid * R + r);
              float v = s_tay[g * NTAY + NTAY - 1];
              VQ_UNROLL
              for (int k = NTAY - 2; k >= 0; --k) v = v * dl + s_tay[g * NTAY + k];
              s[r][g] += v;
            }
          }
        }
      }
      VQ_UNROLL
      for (int r = 0; r < R; ++r) {
        if (t0 + r >= t_end) {
          VQ_UNROLL
          for (int g = 0; g < G; ++g) s[r][g] = NEG;
        }
      }
"""
    + _SOFTMAX_TILE
    + """
      VQ_BARRIER();
      VQ_UNROLL
      for (int g = 0; g < G; ++g) {
        const float al = s_alpha[g];
        VQ_UNROLL
        for (int i = 0; i < VD; ++i) acc[g][i] *= al;
      }
      const int tile_len = min(TILE * R, t_end - tile);
      const int vbit = mv * VB;
      const int vsh = vbit & 31;
      const bool vcross = VCROSS && vsh + VB > 32;  // a code split over two words
      const VQ_GLOBAL uint32_t* vcol = vwords + (h * cap + tile) * VW + (vbit >> 5);
      const VQ_TG VVEC* vbook = s_vb + vrep;  // this lane's codebook copy: code c at c * VREP
      // this thread's tokens tg, tg + TG, ...: their code words are loaded VPF tokens at a
      // time, one batch ahead of the batch being accumulated (the loads' latency, not the
      // arithmetic, bounded this loop when each load was consumed by the next instructions)
      if (tile_len == TILE * R) {
        // a whole tile (every tile but a split's last) in straight-line code: no bounds
        // checks, which had the compiler branch around each token's sums and rebuild their
        // addresses inside the branch; the last batch's look-ahead reloads the batch (in
        // bounds)
        const VQ_GLOBAL uint32_t* vrow = vcol + tg * VW;
        uint32_t cw[VPF], cw2[VPF];
        VQ_UNROLL
        for (int u = 0; u < VPF; ++u) {
          cw[u] = vrow[u * TG * VW];
          cw2[u] = vcross ? vrow[u * TG * VW + 1] : 0u;
        }
        for (int b = 0; b < R * VM; b += VPF) {
          // one pointer per batch, so each load is that pointer plus a constant
          const VQ_GLOBAL uint32_t* vnext = vrow + (b + VPF < R * VM ? b + VPF : b) * TG * VW;
          uint32_t nw[VPF], nw2[VPF];
          VQ_UNROLL
          for (int u = 0; u < VPF; ++u) {
            nw[u] = vnext[u * TG * VW];
            nw2[u] = vcross ? vnext[u * TG * VW + 1] : 0u;
          }
          VQ_UNROLL
          for (int u = 0; u < VPF; ++u) {
            const int tl = tg + (b + u) * TG;
"""
    + _value_sums(_value_code("cw[u]", "cw2[u]"))
    + """
            cw[u] = nw[u];
            cw2[u] = nw2[u];
          }
        }
      } else {
        uint32_t cw[VPF], cw2[VPF];
        VQ_UNROLL
        for (int u = 0; u < VPF; ++u) {
          const int tl = tg + u * TG;
          cw[u] = tl < tile_len ? vcol[tl * VW] : 0u;
          cw2[u] = vcross && tl < tile_len ? vcol[tl * VW + 1] : 0u;
        }
        for (int tb = tg; tb < tile_len; tb += VPF * TG) {
          uint32_t nw[VPF], nw2[VPF];
          VQ_UNROLL
          for (int u = 0; u < VPF; ++u) {
            const int tl = tb + (VPF + u) * TG;
            nw[u] = tl < tile_len ? vcol[tl * VW] : 0u;
            nw2[u] = vcross && tl < tile_len ? vcol[tl * VW + 1] : 0u;
          }
          VQ_UNROLL
          for (int u = 0; u < VPF; ++u) {
            const int tl = tb + u * TG;
            if (tl < tile_len) {
"""
    + _value_sums(_value_code("cw[u]", "cw2[u]"))
    + """
            }
            cw[u] = nw[u];
            cw2[u] = nw2[u];
          }
        }
      }
      VQ_BARRIER();
    }
    // reduce the TG token strides' accumulators (the codebook copies are no longer read)
    VQ_UNROLL
    for (int g = 0; g < G; ++g) {
      VQ_UNROLL
      for (int i = 0; i < VD; ++i) s_acc[(tg * G + g) * D + mv * VD + i] = acc[g][i];
    }
    VQ_BARRIER();
    for (int idx = (int)vq_tid; idx < G * D; idx += TILE) {
      float sum = 0.0f;
      for (int k = 0; k < TG; ++k) sum += s_acc[k * G * D + idx];
      part_o[(split * HQ + h * G) * D + idx] = sum;
    }
"""
    + _PARTIAL_EXACT
)


# ---------------------------------------------------------------------------------------------
# The coded tokens on the tensor cores (CUDA one launch; `mma_takes` says where). Per 16-token
# block, a SIMD group scores with mma.sync m16n8k16 (f16 operands, f32 sums):
#   S[tokens][heads] = K[tokens][dims] q~^T + E[tokens][pairs] W^T
# with K's rows looked up straight into A fragments from an f16 copy of the key codebook, q~ as
# B fragments (heads padded to 8) in threadgroup memory, E the cos / -sin of each token's
# offset in the tile per exact RoPE pair (a host-built table already in A-fragment order) and W
# the phase coefficients at the tile start, no per-token trigonometry; the slow pairs
# (`Layout.poly_pairs`) instead take E's columns of the powers of the offset, and W's rows of
# their polynomial's coefficients, summed per tile from those pairs' W. Then
# O^T[dims][heads] += V^T[dims][tokens] P[tokens][heads], V^T looked up from an f16 copy of
# the value codebook and P the scores' own C fragments after the online softmax, rounded to
# f16 and transposed in registers (movmatrix). A fragment's columns may hold any
# dims in any order as long as both operands agree, so a lane's lookups are one contiguous
# slice of a code row: keys, quarter l4 = lane % 4 of the dims (A's columns 2 l4 + {0, 1} and
# 8 + 2 l4 + {0, 1} of chunk c are dims KSD l4 + 4c + {0, 1, 2, 3}); values, eighth
# quad = lane / 4 (A's rows quad and quad + 8 of row-block b are dims VSD quad + 2b + {0, 1}).
# Each SIMD group keeps its own running max and sum over its blocks (no barrier per tile but
# the phase coefficients'), and the SIMD groups merge once per split. On by default: on an H200
# it writes the CUDA cores' codes and window to the bit, its outputs within one bf16 step of
# theirs, and a layer's step is faster from 64K on (benchmarks/results/mma-h200.txt); False
# puts the coded tokens back on the CUDA cores.
MMA = True
# The f16 value codebook's copies where the conflict-free ones do not fit (8 copies of a d4b8
# book, whose gathers then meet 2-way bank conflicts: two lanes of a half-warp share a copy).
# Where they fit MMA_MIN_THREADGROUPS threadgroups per multiprocessor of the card, the book has
# one copy per lane a shared load serves at once (`_mma_value_copies`): 16 of a d4b8 book,
# 32 KB, carved out of dynamic shared memory with the kernel's other arrays.
MMA_VALUE_BOOK_BYTES = 16384
# Threadgroups per multiprocessor the compiler must fit (CUDA `__launch_bounds__`): left to
# itself it took 136 registers for the default layout (3 threadgroups on an H200), 4 needs 128
# (68 bytes of spill stores under nvcc 13), 5 spilled 504 (benchmarks/results/mma-tiles-cpu.md).
MMA_MIN_THREADGROUPS = 4

_MMA_HELPERS = (
    TENSOR_CORE_HELPERS
    + r"""
#ifndef VQ_MMA_HELPERS
#define VQ_MMA_HELPERS
// nb bits from bit b of the words w (b a constant once unrolled)
template <int N>
VQ_FN uint32_t vq_bits(const uint32_t (&w)[N], int b, int nb) {
  const int i = b >> 5, sh = b & 31;
  uint32_t x = w[i] >> sh;
  if (sh + nb > 32) x |= w[i + 1] << (32 - sh);
  return x & ((1u << nb) - 1u);
}
// REPS copies of a codebook of CODES entries of SD f16 values, each as EW 32-bit words (a
// lone half in the low bits), entry c's copy r at words (c * REPS + r) * EW of dst; the
// threadgroup's `threads` threads from thread `tid`
// word w of entry c of a codebook of SD f16 values an entry (halves 2w, 2w + 1; a lone half in
// the low bits)
template <int SD>
VQ_FN uint32_t vq_book16_word(const VQ_GLOBAL unsigned short* bits, int c, int w) {
  const uint32_t hi = SD > 2 * w + 1 ? (uint32_t)bits[c * SD + 2 * w + 1] << 16 : 0u;
  return (uint32_t)bits[c * SD + 2 * w] | hi;
}
// Where entries are whole words (SD == 2 EW and REPS EW % 4 == 0), each of THREADS threads
// loads the entries of its VQ_BOOK16_STORES(...) 16-byte stores of copies, all its loads at once
// (a constant trip count, unrolled; half by half in a rolled loop they were rounds of 16-bit
// loads to L2, the top stall before the tile loop): vq_book16_fetch into registers, and
// vq_book16_put stores them, so that a caller can issue its other loads between the two.
#define VQ_BOOK16_STORES(CODES, REPS, EW, THREADS) \
  (((CODES) * (REPS) * (EW) / 4 + (THREADS) - 1) / (THREADS))
template <int CODES, int REPS, int EW, int THREADS, class H>
VQ_FN void vq_book16_fetch(uint2 (&e)[VQ_BOOK16_STORES(CODES, REPS, EW, THREADS)],
                           const VQ_GLOBAL H* book, int tid) {
  const VQ_GLOBAL uint32_t* words = reinterpret_cast<const VQ_GLOBAL uint32_t*>(book);
  constexpr int stores = CODES * REPS * EW / 4;
  VQ_UNROLL
  for (int k = 0; k < VQ_BOOK16_STORES(CODES, REPS, EW, THREADS); ++k) {
    const int i = tid + k * THREADS, c = i / (REPS * EW / 4);
    e[k].x = e[k].y = 0u;
    if (stores % THREADS == 0 || i < stores) {
      if (EW == 1) {
        e[k].x = words[c];
      } else {
        e[k] = reinterpret_cast<const VQ_GLOBAL uint2*>(words)[c];
      }
    }
  }
}
template <int CODES, int REPS, int EW, int THREADS>
VQ_FN void vq_book16_put(VQ_TG uint32_t* dst,
                         const uint2 (&e)[VQ_BOOK16_STORES(CODES, REPS, EW, THREADS)], int tid) {
  VQ_TG uint4* dst4 = reinterpret_cast<VQ_TG uint4*>(dst);
  constexpr int stores = CODES * REPS * EW / 4;
  VQ_UNROLL
  for (int k = 0; k < VQ_BOOK16_STORES(CODES, REPS, EW, THREADS); ++k) {
    const int i = tid + k * THREADS;
    if (stores % THREADS == 0 || i < stores) {
      uint4 v;
      v.x = v.z = e[k].x;
      v.y = v.w = EW == 1 ? e[k].x : e[k].y;
      dst4[i] = v;
    }
  }
}
template <int CODES, int REPS, int SD, int EW, class H>
VQ_FN void vq_book16(VQ_TG uint32_t* dst, const VQ_GLOBAL H* book, int tid, int threads) {
  const VQ_GLOBAL unsigned short* bits = reinterpret_cast<const VQ_GLOBAL unsigned short*>(book);
  for (int i = tid; i < CODES * REPS; i += threads) {
    VQ_UNROLL
    for (int w = 0; w < EW; ++w) dst[i * EW + w] = vq_book16_word<SD>(bits, i / REPS, w);
  }
}
// entries tid + THREADS k of a codebook of CODES entries of SD f16 values, each as EW 32-bit
// words (a lone half in the low bits), into registers: loaded during the setup and stored by
// vq_book16_store once the setup's arrays that share the copies' memory are read
template <int CODES, int SD, int EW, int THREADS, class H>
VQ_FN void vq_book16_load(uint32_t (&e)[(CODES + THREADS - 1) / THREADS][EW],
                          const VQ_GLOBAL H* book, int tid) {
  const VQ_GLOBAL uint32_t* words = reinterpret_cast<const VQ_GLOBAL uint32_t*>(book);
  const VQ_GLOBAL unsigned short* bits = reinterpret_cast<const VQ_GLOBAL unsigned short*>(book);
  VQ_UNROLL
  for (int k = 0; k < (CODES + THREADS - 1) / THREADS; ++k) {
    const int c = tid + k * THREADS;
    VQ_UNROLL
    for (int w = 0; w < EW; ++w) {
      if (CODES % THREADS != 0 && c >= CODES) {
        e[k][w] = 0u;
      } else {
        e[k][w] = SD == 2 * EW ? words[c * EW + w] : vq_book16_word<SD>(bits, c, w);
      }
    }
  }
}
// ... then 32 / EW copies of each (one per lane of a shared-memory wavefront), entry c's copy r
// at words 32 c + EW r: 128 bytes an entry, stored as 8 uint4s from a start rotated by the
// thread, so that the 8 threads of a store's wavefront write distinct banks
template <int CODES, int EW, int THREADS>
VQ_FN void vq_book16_store(VQ_TG uint4* dst,
                           const uint32_t (&e)[(CODES + THREADS - 1) / THREADS][EW], int tid) {
  VQ_UNROLL
  for (int k = 0; k < (CODES + THREADS - 1) / THREADS; ++k) {
    const int c = tid + k * THREADS;
    if (CODES % THREADS == 0 || c < CODES) {
      uint4 v;
      v.x = e[k][0];
      v.y = e[k][1 % EW];
      v.z = e[k][2 % EW];
      v.w = e[k][3 % EW];
      VQ_UNROLL
      for (int j = 0; j < 8; ++j) dst[c * 8 + ((j + tid) & 7)] = v;
    }
  }
}
// the nb-bit code at bit b of the words w, shifted left by lg (b a constant once unrolled): a
// mask, then a shift that folds into the caller's address add (LEA), where the code lies in
// one word
template <int N>
VQ_FN uint32_t vq_bits_at(const uint32_t (&w)[N], int b, int nb, int lg) {
  const int i = b >> 5, sh = b & 31;
  if (sh + nb > 32) return vq_bits(w, b, nb) << lg;
  const uint32_t x = vq_and_opaque(w[i], ((1u << nb) - 1u) << sh);
  return sh >= lg ? x >> (sh - lg) : x << (lg - sh);
}
// the s_wb / s_wrot slot of slot pair jj = 8 c + 2 l4 + hf and head g: register hf of lane
// 4 g + l4 in chunk c
VQ_FN int vq_wslot(int jj, int g) {
  return ((jj >> 3) * 32 + 4 * g + ((jj & 7) >> 1)) * 2 + (jj & 1);
}
// the word of an f16 codebook entry (one or two 32-bit words) that holds its half i
VQ_FN uint32_t vq_half_word(uint32_t e, int i) { return e; }
VQ_FN uint32_t vq_half_word(uint2 e, int i) { return i < 2 ? e.x : e.y; }
// half i of an f16 codebook entry x (low) and of entry y (high), as one register: a PRMT
template <class E>
VQ_FN uint32_t vq_half_pair(E x, E y, int i) {
  return __byte_perm(vq_half_word(x, i), vq_half_word(y, i), i & 1 ? 0x7632 : 0x5410);
}
// SW words of a code row from bit `sh` of the word at `at`, word `first` of its row (a lane's
// slice starts on a word when ALIGNED, else anywhere): words past the row's RW read as zeros
template <int SW, int RW, bool ALIGNED>
VQ_FN void vq_slice(uint32_t (&out)[SW], const VQ_GLOBAL uint32_t* at, int first, int sh) {
  if (ALIGNED) {
    VQ_UNROLL
    for (int i = 0; i < SW; ++i) out[i] = at[i];
  } else {
    uint32_t w[SW + 1];
    VQ_UNROLL
    for (int i = 0; i <= SW; ++i) w[i] = first + i < RW ? at[i] : 0u;
    VQ_UNROLL
    for (int i = 0; i < SW; ++i) out[i] = sh ? (w[i] >> sh) | (w[i + 1] << (32 - sh)) : w[i];
  }
}
#endif
"""
)

_MMA_SHARED = """
  // f16 value codebook copies. With VBLATE (`_mma_value_copies`) they are written after the
  // setup, which until then keeps its scaled queries and q~ at their start
  VQ_SHARED uint4 s_vb16[(VCODES * VR16 * VEW + 3) / 4];
  VQ_SHARED float s_qown[VBLATE ? 1 : G * D];
  VQ_SHARED float4 s_qtown[VBLATE ? 1 : KM * QS / 4];
  // scaled queries; q~ per key sub-space m: [m][g][i], padded to QS
  VQ_TG float* const s_q = VBLATE ? reinterpret_cast<VQ_TG float*>(s_vb16) : s_qown;
  VQ_TG float4* const s_qt = VBLATE ? reinterpret_cast<VQ_TG float4*>(s_vb16) + G * D / 4 : s_qtown;
  // B fragments of the phase coefficients, then A fragments of the slow pairs' W (two tiles'
  // buffers), and B fragments of q~, per lane: [chunk][lane]
  VQ_SHARED uint2 s_wb[CENTER ? 2 * (PC + NPC) * 32 : 1];
  // per slot pair jj (`phase_slot_pairs`): its rotation from one tile to the next (cos, sin);
  // for the setup, its RoPE pair (-1: none), key mean (a, b) and rotation to the split's start
  VQ_SHARED float2 s_wstep[CENTER ? 8 * (PC + NPC) : 1];
  VQ_SHARED int s_wj[CENTER ? 8 * (PC + NPC) : 1];
  VQ_SHARED float2 s_wmu[CENTER ? 8 * (PC + NPC) : 1];
  VQ_SHARED float2 s_wpos[CENTER ? 8 * (PC + NPC) : 1];
  // the B fragments that sum the polynomial's coefficients from the slow pairs' W
  VQ_SHARED uint2 s_polyb[CENTER ? (NPC > 0 ? NPC : 1) * 32 : 1];
  VQ_SHARED uint2 s_qb[DC * 32];
  VQ_SHARED float s_red[NWARPS * G];
  VQ_SHARED float s_lw[NWARPS * G];
  VQ_SHARED float s_mrun[G];
  VQ_SHARED float s_lrun[G];
  // f16 key codebook copies and, per s_wb slot, W of its (pair j, head g) rotated to the next
  // tile's start (zero for heads past G); then the reduction
  VQ_SHARED float4 s_big[BIG4];
  VQ_TG uint32_t* s_kb16 = reinterpret_cast<VQ_TG uint32_t*>(s_big);
  VQ_TG float2* s_wrot = reinterpret_cast<VQ_TG float2*>(s_big + KBOOK4);
  VQ_TG float* s_acc = reinterpret_cast<VQ_TG float*>(s_big);
  VQ_TG float* s_qtf = reinterpret_cast<VQ_TG float*>(s_qt);
"""

# The coded threadgroups' codebooks: the f16 bits (the pack's books are f16) loaded into
# registers with the setup's other global reads (`_MMA_BOOKS_FETCH`), and copied into threadgroup
# memory once those are all issued (`_MMA_BOOKS_PUT`), so that a SIMD group's random codes hit
# distinct banks. Stored as they landed, the copies held back every later load of the setup by
# a round trip to memory.
_MMA_BOOKS_FETCH = """    const int kbook = KBOOKS > 1 ? h : 0, vbook = VBOOKS > 1 ? h : 0;
    constexpr bool KWHOLE = KD == 2 * KEW && KR16 * KEW % 4 == 0;  // vq_book16_fetch's entries
    constexpr bool VWHOLE = VD == 2 * VEW && VR16 * VEW % 4 == 0;
    uint2 kfetch[VQ_BOOK16_STORES(KCODES, KR16, KEW, TILE)];
    if (KWHOLE) {
      vq_book16_fetch<KCODES, KR16, KEW, TILE>(kfetch, key_book + kbook * KCODES * KD, (int)vq_tid);
    }
    uint32_t vlate[(VCODES + TILE - 1) / TILE][VEW];  // unused (dropped) without VBLATE
    uint2 vfetch[VQ_BOOK16_STORES(VCODES, VR16, VEW, TILE)];  // used only without VBLATE
    if (VBLATE) {
      vq_book16_load<VCODES, VD, VEW, TILE>(vlate, value_book + vbook * VCODES * VD, (int)vq_tid);
    } else if (VWHOLE) {
      vq_book16_fetch<VCODES, VR16, VEW, TILE>(vfetch, value_book + vbook * VCODES * VD,
                                               (int)vq_tid);
    }
"""
_MMA_BOOKS_PUT = """    if (KWHOLE) {
      vq_book16_put<KCODES, KR16, KEW, TILE>(s_kb16, kfetch, (int)vq_tid);
    } else {
      vq_book16<KCODES, KR16, KD, KEW>(s_kb16, key_book + kbook * KCODES * KD, (int)vq_tid, TILE);
    }
    if (!VBLATE) {
      VQ_TG uint32_t* s_vbw = reinterpret_cast<VQ_TG uint32_t*>(s_vb16);
      if (VWHOLE) {
        vq_book16_put<VCODES, VR16, VEW, TILE>(s_vbw, vfetch, (int)vq_tid);
      } else {
        vq_book16<VCODES, VR16, VD, VEW>(s_vbw, value_book + vbook * VCODES * VD, (int)vq_tid,
                                         TILE);
      }
    }
"""

# The coded threadgroups' first key rows (`KAHEAD`), read with the setup's other global reads:
# after the setup, they were a round trip to memory before the first tile's scores.
_MMA_KEYS_AHEAD = """    const int lane = (int)vq_lane, quad = lane >> 2, l4 = lane & 3;
    // mma's k index (a token of a 16-token block: A's rows of the scores, P's k rows) is token
    // `block_token`(k) = 4 (k % 2 + 2 (k / 8)) + (k % 8) / 2, so that the value rows of P's
    // k = 2 l4 + (u & 1) + 8 (u >> 1) are rows 4 u + l4: one load of the SIMD group reads 4
    // consecutive rows, one 128-byte line, where rows 2 l4 + .. took two (`phase_fragments`
    // permutes its rows the same way)
    const int pq = 4 * (quad & 1) + (quad >> 1);  // block_token(quad); of quad + 8: pq + 8
    const VQ_GLOBAL uint32_t* kwords = reinterpret_cast<const VQ_GLOBAL uint32_t*>(key_codes);
    const int kfirst = (l4 * KSB) >> 5, ksh = (l4 * KSB) & 31;  // this lane's key slice
    const int t_begin = split * tps;
    const int t_end = min(T, t_begin + tps);
    const int tlast = (t_end - 1) & ~15;  // the start of the block of the split's last token
    // this lane's first key row (token pq of a block), at its slice
    const VQ_GLOBAL uint32_t* kbase = kwords + (h * cap + pq) * KW + kfirst;
    // the key rows of the SIMD group's first block of a tile, loaded a tile ahead (KAHEAD):
    // that block's scores otherwise wait on a round trip to memory at every tile. The first
    // tile's are loaded with the setup's other global reads.
    uint32_t kahead[2][KSW];
    if (KAHEAD) {
      const VQ_GLOBAL uint32_t* krow = kbase + min(t_begin + (int)vq_warp * WB * 16, tlast) * KW;
      VQ_UNROLL
      for (int r = 0; r < 2; ++r) {
        vq_slice<KSW, KW, KALIGN>(kahead[r], krow + 8 * r * KW, kfirst, ksh);
      }
    }
"""

# The coded threadgroups' phase setup that needs no query, its loads issued with the setup's
# other global reads (before q~ is formed) and its results stored before q~'s barrier, which
# orders them before W's product (`_MMA_TILES`). After q~'s barrier, its loads were a second and
# a third round trip to memory (the slot's pair, then that pair's frequency and key mean) and
# its stores a barrier of their own. W = A - iB per (pair j, head g) at the split's first tile
# is exact; later tiles rotate it by one tile's angle, a complex multiply where a sincos (and
# W's loads) took five times the instructions. It is stored by slot (register hf of lane
# 4 g + l4 in chunk c holds slot pair jj = 8 c + 2 l4 + hf), so that a tile's update is addressed
# by the slot alone; slot_pairs[jj] is its RoPE pair (-1: none; `phase_slot_pairs`). Per slot
# pair: its pair, then that pair's frequency and key mean, then the sines and cosines of one
# tile's angle and of the split's start, by the last NJ threads (the first D / 2 fill the RoPE
# table when the kernel rotates: with NJ + D / 2 > TILE a few threads do both); then W per
# (slot pair, head g < G) from those, over all threads. Done per slot, each slot took the
# sincos of the split's start again (once per head), and as the slots of heads past G (which
# the tiles never read) fell to two of the four SIMD groups, the other two did all the work.
_MMA_PHASE_LOADS = """    constexpr int NJ = 8 * (PC + NPC), NJT = (NJ + TILE - 1) / TILE;
    constexpr int NPT = (NPC * 32 + TILE - 1) / TILE;  // the polynomial's B fragments a thread
    int jv[NJT];
    float fr[NJT], mu_a[NJT], mu_b[NJT];
    uint2 polyb[NPT > 0 ? NPT : 1];
    if (CENTER) {
      VQ_UNROLL
      for (int k = 0; k < NPT; ++k) {
        const int i = (int)vq_tid + k * TILE;
        if ((NPC * 32) % TILE == 0 || i < NPC * 32) {
          polyb[k] = reinterpret_cast<const VQ_GLOBAL uint2*>(poly_frags)[i];
        }
      }
      VQ_UNROLL
      for (int k = 0; k < NJT; ++k) {
        const int jj = (int)vq_tid + k * TILE - (NJT * TILE - NJ);
        jv[k] = jj >= 0 ? slot_pairs[jj] : -1;
      }
      VQ_UNROLL
      for (int k = 0; k < NJT; ++k) {  // pair 0's where there is none: no branch between
        const int j = jv[k] < 0 ? 0 : jv[k];
        fr[k] = inv_freq[j];
        mu_a[k] = static_cast<float>(key_mean[h * D + (TRAD ? 2 * j : j)]);
        mu_b[k] = static_cast<float>(key_mean[h * D + (TRAD ? 2 * j + 1 : j + P)]);
      }
    }
"""
_MMA_PHASE_SETUP = """    if (CENTER) {
      for (int i = (int)vq_tid; i < 2 * (PC + NPC) * 32; i += TILE) {
        uint2 f;
        f.x = f.y = 0u;
        s_wb[i] = f;
      }
      VQ_UNROLL
      for (int k = 0; k < NPT; ++k) {
        const int i = (int)vq_tid + k * TILE;
        if ((NPC * 32) % TILE == 0 || i < NPC * 32) s_polyb[i] = polyb[k];
      }
      const float mpos = rscale * (float)(pos0 + split * tps);
      VQ_UNROLL
      for (int k = 0; k < NJT; ++k) {
        const int jj = (int)vq_tid + k * TILE - (NJT * TILE - NJ);
        float sn = 0.0f, cs = 1.0f, psn = 0.0f, pcs = 1.0f;
        if (jv[k] >= 0) {
          VQ_SINCOS(rscale * (float)TT * fr[k], sn, cs);
          VQ_SINCOS(mpos * fr[k], psn, pcs);
        }
        if (jj >= 0) {
          s_wstep[jj] = VQ_F2(cs, sn);
          s_wpos[jj] = VQ_F2(pcs, psn);
          s_wmu[jj] = VQ_F2(mu_a[k], mu_b[k]);
          s_wj[jj] = jv[k];
        }
      }
    }
"""

_MMA_TILES = (
    """
    // the B fragments, the same for every SIMD group, in threadgroup memory (in registers they
    // cost 32 of them): q~ of head L / 4 (zero past G) at k rows 2 (L % 4) + {0, 1} and
    // 8 + 2 (L % 4) + {0, 1} of chunk c; the phase coefficients' buffers start at zero, so the
    // pairs past P and the heads past G stay zero
    for (int i = (int)vq_tid; i < DC * 32; i += TILE) {
      const int c = i / 32, gq = (i % 32) / 4, n = KSD * (i % 4) + 4 * c;
      float x[4];
      VQ_UNROLL
      for (int e = 0; e < 4; ++e) {
        x[e] = gq < G ? s_qtf[((n + e) / KD) * QS + gq * KD + (n + e) % KD] : 0.0f;
      }
      uint2 f;
      f.x = vq_pack_half2(x[0], x[1]);
      f.y = vq_pack_half2(x[2], x[3]);
      s_qb[i] = f;
    }
    if (CENTER) {
      for (int i = (int)vq_tid; i < NJ * G; i += TILE) {
        const int jj = i / G, g = i % G, j = s_wj[jj];
        float2 w = VQ_F2(0.0f, 0.0f);
        if (j >= 0) {
          const float2 mu = s_wmu[jj], rot = s_wpos[jj];
          const float mua = mu.x, mub = mu.y, cs = rot.x, sn = rot.y;
"""
    + _PHASE_W_PRODUCT
    + """          w = VQ_F2(wr * cs - wi * sn, wr * sn + wi * cs);
        }
        s_wrot[vq_wslot(jj, g)] = w;
      }
    }
    VQ_BARRIER();
    if (VBLATE) {  // s_q and s_qt are read: the value book over them
      vq_book16_store<VCODES, VEW, TILE>(s_vb16, vlate, (int)vq_tid);
      if (!CENTER) VQ_BARRIER();  // else each tile's barrier orders them before its gathers
    }
    // O^T fragments: acc[b][e] is dim VSD quad + 2b + (e >> 1), head 2 l4 + (e & 1)
    float acc[DC][4];
    VQ_UNROLL
    for (int b = 0; b < DC; ++b) {
      VQ_UNROLL
      for (int e = 0; e < 4; ++e) acc[b][e] = 0.0f;
    }
    float m_run[2] = {NEG, NEG}, l_run[2] = {0.0f, 0.0f};  // heads 2 l4, 2 l4 + 1
    const VQ_GLOBAL uint32_t* vwords = reinterpret_cast<const VQ_GLOBAL uint32_t*>(value_codes);
    const VQ_GLOBAL uint4* frags = reinterpret_cast<const VQ_GLOBAL uint4*>(phase_frags);
    // codebook copies by 32-bit threadgroup addresses: this lane's copy plus code << KLG, a
    // mask and a shift-add (LEA) from a code word to a load's address
    const uint32_t kbook_lane = vq_tg_address(s_kb16) + (uint32_t)(lane % KR16) * KEW * 4;
    const uint32_t vbook_lane = vq_tg_address(s_vb16) + (uint32_t)(lane % VR16) * VEW * 4;
    const int vfirst = (quad * VSB) >> 5, vsh = (quad * VSB) & 31;  // ... and value slice
    // this lane's first value row (token l4), at its slice
    const VQ_GLOBAL uint32_t* vbase = vwords + (h * cap + l4) * VW + vfirst;
    for (int tile = t_begin; tile < t_end; tile += TT) {
      // this tile's buffer of s_wb: a SIMD group still on the last tile reads the other one
      const int wbuf = (tile / TT) & 1;
      const VQ_TG uint2* wb = s_wb + wbuf * (PC + NPC) * 32;
      if (CENTER) {
        // W of slot pair jj = 8 c + 2 l4 + hf and head g as f16 (re, im): register hf of lane
        // 4 g + l4 in chunk c
        VQ_TG uint32_t* wbw = reinterpret_cast<VQ_TG uint32_t*>(s_wb + wbuf * (PC + NPC) * 32);
        // the slots of heads below GP2 (the others stay zero): thread tid takes head
        // tid % GP2 of slot pairs tid / GP2 + TILE / GP2 i, whose slots are TILE / GP2 / 8
        // chunks apart (GP2 <= 8)
        const int g0 = (int)vq_tid % GP2, jj0 = (int)vq_tid / GP2;
        const int slot0 = vq_wslot(jj0, g0);
        VQ_UNROLL
        for (int i = 0; i < (8 * (PC + NPC) * GP2 + TILE - 1) / TILE; ++i) {
          const int jj = jj0 + TILE / GP2 * i, slot = slot0 + TILE / GP2 * 8 * i;
          if ((G == GP2 || g0 < G) && (8 * (PC + NPC) * GP2 % TILE == 0 || jj < 8 * (PC + NPC))) {
            const float2 w = s_wrot[slot], st = s_wstep[jj];
            wbw[slot] = vq_pack_half2(w.x, w.y);
            s_wrot[slot] = VQ_F2(w.x * st.x - w.y * st.y, w.x * st.y + w.y * st.x);
          }
        }
        VQ_BARRIER();
      }
      // scores of this SIMD group's WB blocks of the tile: C rows tokens pq and pq + 8
      float sc[WB][4];
      VQ_UNROLL
      for (int k = 0; k < WB; ++k) {
        const int db = (int)vq_warp * WB + k;
        const int tb = tile + db * 16;
        // a block past the split's last token reads that last block's rows (its scores are
        // masked): rows up to the last token's block end, within the buffer (its capacity is
        // a multiple of 16: attention_inputs refuses others); a
        // row past T may be the one this launch's encoder is writing, masked all the same
        const VQ_GLOBAL uint32_t* krow = kbase + min(tb, tlast) * KW;
        uint32_t kw[2][KSW];
        VQ_UNROLL
        for (int r = 0; r < 2; ++r) {
          if (KAHEAD && k == 0) {
            VQ_UNROLL
            for (int i = 0; i < KSW; ++i) kw[r][i] = kahead[r][i];
          } else {
            vq_slice<KSW, KW, KALIGN>(kw[r], krow + 8 * r * KW, kfirst, ksh);
          }
        }
        VQ_UNROLL
        for (int e = 0; e < 4; ++e) sc[k][e] = 0.0f;
        VQ_UNROLL
        for (int c = 0; c < DC; ++c) {
          uint32_t a[4];  // a[2 hf + r]: token r, dims KSD l4 + 4c + 2 hf + {0, 1}
          VQ_UNROLL
          for (int r = 0; r < 2; ++r) {
            VQ_UNROLL
            for (int hf = 0; hf < 2; ++hf) {
              const int n = 4 * c + 2 * hf;  // within the slice
              if (KD == 1) {
                const uint32_t at0 = vq_bits_at(kw[r], n * KB, KB, KLG);
                const uint32_t at1 = vq_bits_at(kw[r], (n + 1) * KB, KB, KLG);
                const uint32_t e0 = vq_lds(kbook_lane + at0, 0u);
                const uint32_t e1 = vq_lds(kbook_lane + at1, 0u);
                a[2 * hf + r] = vq_half_pair(e0, e1, 0);
              } else {
                const uint32_t at = vq_bits_at(kw[r], (n / KD) * KB, KB, KLG) + (n % KD) / 2 * 4;
                a[2 * hf + r] = vq_lds(kbook_lane + at, 0u);
              }
            }
          }
          const uint2 qf = s_qb[c * 32 + lane];
          const uint32_t b[2] = {qf.x, qf.y};
          vq_mma_16816(sc[k], a, b);
        }
      }
      if (KAHEAD) {  // past the split's end: the last block's rows again, never used
        const int tb = tile + TT + (int)vq_warp * WB * 16;
        const VQ_GLOBAL uint32_t* krow = kbase + min(tb, tlast) * KW;
        VQ_UNROLL
        for (int r = 0; r < 2; ++r) {
          vq_slice<KSW, KW, KALIGN>(kahead[r], krow + 8 * r * KW, kfirst, ksh);
        }
      }
      if (CENTER) {
        // the slow pairs' summed phase Re(sum_j W_j e^{i x phi_j}) at x = offset / TT is the
        // polynomial sum_k c_k x^k, c_k = Re(sum_j W_j (i phi_j)^k / k!) (phi_j the pair's
        // angle over a tile): C[g][k] = W[g][pairs] T[pairs][k] by NPC MMAs (heads as rows,
        // rows 8.. zero), whose C fragment (c_2l4, c_2l4+1 of head quad) is the B register
        // of the polynomial chunk's even slots
        uint32_t poly = 0u;
        if (NPOLY > 0) {
          float cp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          VQ_UNROLL
          for (int cc = 0; cc < NPC; ++cc) {
            const uint2 wf = wb[(PC + cc) * 32 + lane], tf = s_polyb[cc * 32 + lane];
            const uint32_t a[4] = {wf.x, 0u, wf.y, 0u};
            const uint32_t b[2] = {tf.x, tf.y};
            vq_mma_16816(cp, a, b);
          }
          poly = vq_pack_half2(cp[0], cp[1]);
        }
        VQ_UNROLL
        for (int pc = 0; pc < PC; ++pc) {
          const uint2 wf = wb[pc * 32 + lane];
          const uint32_t b[2] = {NPOLY > 0 && pc == PF ? poly : wf.x, wf.y};
          VQ_UNROLL
          for (int k = 0; k < WB; ++k) {
            const int db = (int)vq_warp * WB + k;
            const uint4 f = frags[(db * PC + pc) * 32 + lane];
            const uint32_t a[4] = {f.x, f.y, f.z, f.w};
            vq_mma_16816(sc[k], a, b);
          }
        }
      }
      VQ_UNROLL
      for (int k = 0; k < WB; ++k) {
        const int tb = tile + ((int)vq_warp * WB + k) * 16;
        // masked scores sit NEG below any running max (which starts at NEG): their weights
        // are 0 with no test, even in a SIMD group with no unmasked token yet
        if (tb + pq >= t_end) sc[k][0] = sc[k][1] = 2.0f * NEG;
        if (tb + pq + 8 >= t_end) sc[k][2] = sc[k][3] = 2.0f * NEG;
      }
      // the online softmax over the SIMD group's blocks: lanes of one l4 hold the same heads
      float mnew[2];
      VQ_UNROLL
      for (int e = 0; e < 2; ++e) {
        float x = NEG;
        VQ_UNROLL
        for (int k = 0; k < WB; ++k) x = VQ_FMAX(x, VQ_FMAX(sc[k][e], sc[k][e + 2]));
        x = VQ_FMAX(x, vq_shfl_xor(x, 4));
        x = VQ_FMAX(x, vq_shfl_xor(x, 8));
        x = VQ_FMAX(x, vq_shfl_xor(x, 16));
        mnew[e] = VQ_FMAX(m_run[e], x);
        const float al = vq_ex2(m_run[e] - mnew[e]);
        m_run[e] = mnew[e];
        l_run[e] *= al;
        VQ_UNROLL
        for (int b = 0; b < DC; ++b) {
          acc[b][e] *= al;
          acc[b][e + 2] *= al;
        }
      }
      // P as B fragments (k rows 2 l4 + {0, 1} and 8 + 2 l4 + {0, 1}, head quad), then
      // O^T += V^T P per block
      VQ_UNROLL
      for (int k = 0; k < WB; ++k) {
        float p[4];
        VQ_UNROLL
        for (int e = 0; e < 4; ++e) {
          p[e] = vq_ex2(sc[k][e] - mnew[e & 1]);  // masked: at most NEG, so 0
          l_run[e & 1] += p[e];
        }
        const uint32_t pb[2] = {vq_movmatrix_trans(vq_pack_half2(p[0], p[1])),
                                vq_movmatrix_trans(vq_pack_half2(p[2], p[3]))};
        const int tb = tile + ((int)vq_warp * WB + k) * 16;
        const VQ_GLOBAL uint32_t* vrow = vbase + min(tb, tlast) * VW;
        // k rows 2 l4 + {0, 1}, 8 + 2 l4 + {0, 1} (tokens 4 u + l4): this lane's sub-spaces
        VEWT ve[4][VSUB];
        VQ_UNROLL
        for (int u = 0; u < 4; ++u) {
          uint32_t vw[VSW];
          vq_slice<VSW, VW, VALIGN>(vw, vrow + 4 * u * VW, vfirst, vsh);
          VQ_UNROLL
          for (int s = 0; s < VSUB; ++s) {
            ve[u][s] = vq_lds(vbook_lane + vq_bits_at(vw, s * VB, VB, VLG), VEWT());
          }
        }
        VQ_UNROLL
        for (int b = 0; b < DC; ++b) {
          uint32_t a[4];  // a[hf + 2 (u >> 1)]: dim VSD quad + 2b + hf, tokens u (low), u + 1
          VQ_UNROLL
          for (int hf = 0; hf < 2; ++hf) {
            const int n = 2 * b + hf;
            VQ_UNROLL
            for (int uh = 0; uh < 2; ++uh) {
              a[hf + 2 * uh] = vq_half_pair(ve[2 * uh][n / VD], ve[2 * uh + 1][n / VD], n % VD);
            }
          }
          vq_mma_16816(acc[b], a, pb);
        }
      }
    }
    // merge the SIMD groups: the largest max per head, each group's rows scaled into s_acc
    // [w][g][D] (the codebook copies are no longer read), summed in SIMD-group order
    VQ_UNROLL
    for (int e = 0; e < 2; ++e) {
      l_run[e] += vq_shfl_xor(l_run[e], 4);
      l_run[e] += vq_shfl_xor(l_run[e], 8);
      l_run[e] += vq_shfl_xor(l_run[e], 16);
      const int g = 2 * l4 + e;
      if (quad == 0 && g < G) {
        s_red[(int)vq_warp * G + g] = m_run[e];
        s_lw[(int)vq_warp * G + g] = l_run[e];
      }
    }
    VQ_BARRIER();
    VQ_UNROLL
    for (int e = 0; e < 2; ++e) {
      const int g = 2 * l4 + e;
      if (g < G) {
        float mm = s_red[g];
        for (int w = 1; w < NWARPS; ++w) mm = VQ_FMAX(mm, s_red[w * G + g]);
        const float f = vq_exp2(m_run[e] - mm);
        VQ_UNROLL
        for (int b = 0; b < DC; ++b) {
          VQ_UNROLL
          for (int x = 0; x < 2; ++x) {
            const int d = VSD * quad + 2 * b + x;
            s_acc[((int)vq_warp * G + g) * D + d] = acc[b][e + 2 * x] * f;
          }
        }
      }
    }
    if (vq_tid < G) {
      float mm = s_red[vq_tid];
      for (int w = 1; w < NWARPS; ++w) mm = VQ_FMAX(mm, s_red[w * G + vq_tid]);
      float ll = 0.0f;
      for (int w = 0; w < NWARPS; ++w) {
        ll += s_lw[w * G + vq_tid] * vq_exp2(s_red[w * G + vq_tid] - mm);
      }
      s_mrun[vq_tid] = mm;
      s_lrun[vq_tid] = ll;
    }
    VQ_BARRIER();
    for (int idx = (int)vq_tid; idx < G * D; idx += TILE) {
      float sum = 0.0f;
      for (int w = 0; w < NWARPS; ++w) sum += s_acc[w * G * D + idx];
      part_o[(split * HQ + h * G) * D + idx] = sum;
    }
"""
)

_MMA_BODY = (
    _PARTIAL_PARAMS
    + _MMA_SHARED
    + _PARTIAL_OPEN
    + _MMA_BOOKS_FETCH
    + _MMA_KEYS_AHEAD
    + _MMA_PHASE_LOADS
    + _MMA_BOOKS_PUT
    + _MMA_PHASE_SETUP
    + _PARTIAL_QTILDE
    + _MMA_TILES
    + _PARTIAL_EXACT
)

# This lane's elements of exact token b's key and value rows, from row offset `row` of K / V (the
# sinks', the window's or the call's own tokens).
_EXACT_ROW = """
#define EXACT_ROW(K, V, row) \\
  VQ_UNROLL \\
  for (int e = 0; e < DE; ++e) { \\
    kx[b][e] = static_cast<float>(K[(row) + e * 32 + lane]); \\
    vx[b][e] = static_cast<float>(V[(row) + e * 32 + lane]); \\
  }
"""

# The end of the one-launch kernel (CUDA): after its partial, each threadgroup counts itself in
# `counter` [H_kv], and the last of KV head h's n_splits + 1 to finish merges the head's G query
# heads and sets the count back to 0 for the next launch. The exact
# threadgroup, the only one that reads the window ring, then encodes the token leaving it in
# place (iparams[EP] > 0), as the combine with the encoder does. Both use the codebook copies'
# threadgroup array, free once the partial is written (BIG4 covers them).
_ONE_LAUNCH_TAIL = """
  VQ_SHARED int s_last;
  VQ_DEVICE_FENCE();  // this thread's part writes, device-wide before the count
  VQ_BARRIER();
  if (vq_tid == 0) {
    VQ_GLOBAL uint32_t* count = const_cast<VQ_GLOBAL uint32_t*>(counter) + h;
    s_last = vq_atomic_inc(count) == (uint32_t)n_splits ? 1 : 0;
  }
  VQ_BARRIER();
  VQ_TG float* s_tail = reinterpret_cast<VQ_TG float*>(s_big);
  if (s_last) {
    VQ_DEVICE_FENCE();
COMBINE
    if (vq_tid == 0) const_cast<VQ_GLOBAL uint32_t*>(counter)[h] = 0u;
  }
  if (split == n_splits && iparams[EP] > 0) {
    VQ_BARRIER();
    VQ_TG float* s_x = s_tail;
    VQ_TG float* s_best = s_tail + D;
    VQ_TG uint* s_arg = reinterpret_cast<VQ_TG uint*>(s_tail + 2 * D);
    VQ_TG uint* s_code = reinterpret_cast<VQ_TG uint*>(s_tail + 3 * D);
    VQ_TG float* s_book = s_tail + 3 * D + (KM > VM ? KM : VM);
    {
ENCODE
    }
  }
"""

# The Walsh-Hadamard butterfly over s_x[D] in place (unnormalised), by threads d < D / 2; every
# thread of the threadgroup takes part in its barriers.
_HADAMARD = """    for (int len = 1; len < D; len <<= 1) {
      if (d < D / 2) {
        const int i = (d / len) * 2 * len + (d % len);
        const float a = s_x[i], b = s_x[i + len];
        s_x[i] = a + b;
        s_x[i + len] = a - b;
      }
      VQ_BARRIER();
    }
"""

# The combine's statements, one query head per threadgroup of D threads (its one threadgroup
# array, s_x[D], is declared by the caller: the combine alone, or the combine with the encoder,
# which shares it). The one-launch kernel merges a KV head's G query heads at once instead
# (_COMBINE_HEADS); the two launches (Metal's path) keep this one, which timed faster per head
# on the H200 than the G-head merge run with one head
# (benchmarks/results/one-launch-per-layer-h200.txt).
_COMBINE_ONE_HEAD = (
    """
  const int T = iparams[0];
  const int tps = iparams[2];
  const int n_splits = T > 0 ? (T + tps - 1) / tps : 0;
  const int hq = (int)vq_gx;
  const int h = hq / G;
  const int d = (int)vq_tid;
  // the splits' largest max, by every thread at once (a serial pass over the splits' maxima
  // was a chain of dependent loads); then the merge, unrolled so that several splits' loads
  // are in flight at once (the order of its sums is that of one pass)
  float mloc = NEG;
  for (int s = d; s <= n_splits; s += D) mloc = VQ_FMAX(mloc, part_m[s * HQ + hq]);
  mloc = vq_simd_max(mloc);
  if (vq_lane == 0) s_x[vq_warp] = mloc;
  VQ_BARRIER();
  float M = s_x[0];
  for (int w = 1; w < D / 32; ++w) M = VQ_FMAX(M, s_x[w]);
  VQ_BARRIER();
  float acc = 0.0f, lc = 0.0f;
  VQ_UNROLL_BY(8)
  for (int s = 0; s < n_splits; ++s) {
    const float w = vq_exp2(part_m[s * HQ + hq] - M);
    acc += w * part_o[(s * HQ + hq) * D + d];
    lc += w * part_l[s * HQ + hq];
  }
  const float wf = vq_exp2(part_m[n_splits * HQ + hq] - M);
  const float of = wf * part_o[(n_splits * HQ + hq) * D + d];
  const float lf = wf * part_l[n_splits * HQ + hq];
  s_x[d] = acc;
  VQ_BARRIER();
  if (VHAD) {
"""
    + _HADAMARD
    + """  }
  float v = s_x[d] * (VHAD ? INV_SQRT_D : 1.0f);
  if (VSMOOTH) v *= static_cast<float>(value_smooth[h * D + d]);
  if (VMEAN) v += static_cast<float>(value_mean[h * D + d]) * lc;
  out[hq * D + d] = static_cast<OUT_T>((v + of) / (lc + lf));
"""
)

# the scalar merge's loop over a chunk's splits (`_COMBINE_FLOAT4_EDITS` replaces it)
_COMBINE_ROWS = """    VQ_UNROLL_BY(CUN)
    for (int s = 0; s < cn; ++s) {
      VQ_UNROLL
      for (int k = 0; k < CPS; ++k) {
        const int g = slot + k * (CNT / D);
        if (g < CNH) {
          acc[k] += s_cw[s * CNH + g] * vq_load_cg(part_o + ((c0 + s) * HQ + hq0 + g) * D + d);
        }
      }
    }"""

# The one-launch kernel's combine: its threadgroup of CNT threads (a multiple of D) merges the
# splits of the CNH query heads from COMBINE_FIRST (a KV head's G), D threads per head (slot
# vq_tid / D takes heads slot, slot + CNT / D, ...), in the threadgroup array COMBINE_SCRATCH
# (`combine_floats`). The heads' maxima (CWH SIMD groups per head), the exact threadgroup's
# parts, and then each chunk of CCH splits' weights 2^(m - M) and sums are read by all threads
# at once, so that the only serial loads left are the output rows, every head's in flight
# together (_COMBINE_ONE_HEAD over the heads in turn was a chain of dependent rounds to L2:
# benchmarks/results/one-launch-per-layer-h200.txt). A head's output rows are summed in split
# order, its sum by one SIMD group. The parts are read with vq_load_cg: other threadgroups of
# the launch wrote them.
_COMBINE_HEADS = (
    """
  {
  // n_splits is the kernel's own: read again from iparams here, after the device fence, it
  // was two dependent rounds to L2 (T, then tps) at the start of the kernel's tail
  const int hq0 = COMBINE_FIRST;
  const int h = hq0 / G;
  const int d = (int)vq_tid % D;
  const int slot = (int)vq_tid / D;
  VQ_TG float* s_cm = COMBINE_SCRATCH;    // [CNH] each head's largest max
  VQ_TG float* s_cs = s_cm + CNH;         // [CNH] each head's merged sum
  VQ_TG float* s_cx = s_cs + CNH;         // [CNH][CWH] the SIMD groups' maxima
  VQ_TG float* s_cw = s_cx + CNH * CWH;   // [CCH][CNH] a chunk's weights
  VQ_TG float* s_cl = s_cw + CCH * CNH;   // [CCH][CNH] ... and its sums
  VQ_TG float* s_ch = s_cl + CCH * CNH;   // [CNH][D] the merged value sums
  // the first chunk's maxima and sums (splits below CCH, the exact part's at n_splits among
  // them), every thread's loads at once, into the chunk's arrays: read from there for each
  // head's largest max and again for the chunk's weights, where two loops of loads to L2 (the
  // second after the first's barrier) took rounds one after another in the kernel's tail
  const int cfirst = min(n_splits + 1, CCH);
  VQ_UNROLL
  for (int k = 0; k < (CCH * CNH + CNT - 1) / CNT; ++k) {
    const int i = (int)vq_tid + k * CNT;
    if (i < cfirst * CNH) {
      s_cw[i] = vq_load_cg(part_m + (i / CNH) * HQ + hq0 + i % CNH);
      s_cl[i] = vq_load_cg(part_l + (i / CNH) * HQ + hq0 + i % CNH);
    }
  }
  VQ_BARRIER();
  // each head's largest max: CWH SIMD groups per head, a split per lane
  const int wpart = (int)vq_warp / CNH;
  for (int g = (int)vq_warp % CNH; wpart < CWH && g < CNH; g += CNT / 32) {
    float mloc = NEG;
    for (int s = (int)vq_lane + 32 * wpart; s <= n_splits; s += 32 * CWH) {
      mloc = VQ_FMAX(mloc, s < CCH ? s_cw[s * CNH + g] : vq_load_cg(part_m + s * HQ + hq0 + g));
    }
    mloc = vq_simd_max(mloc);
    if (vq_lane == 0) s_cx[g * CWH + wpart] = mloc;
  }
  VQ_BARRIER();
  if ((int)vq_tid < CNH) {
    float mm = s_cx[vq_tid * CWH];
    for (int k = 1; k < CWH; ++k) mm = VQ_FMAX(mm, s_cx[vq_tid * CWH + k]);
    s_cm[vq_tid] = mm;
    s_cs[vq_tid] = 0.0f;
  }
  // the exact threadgroup's parts (at n_splits) and this dim's value scale and mean, in flight
  // while the splits are merged (read at the end, they were one more round to memory there)
  const float vsm = VSMOOTH ? static_cast<float>(value_smooth[h * D + d]) : 1.0f;
  const float vmn = VMEAN ? static_cast<float>(value_mean[h * D + d]) : 0.0f;
  float mf[CPS], of[CPS], lf[CPS], acc[CPS];
  VQ_UNROLL
  for (int k = 0; k < CPS; ++k) {
    const int g = min(slot + k * (CNT / D), CNH - 1);
    mf[k] = vq_load_cg(part_m + n_splits * HQ + hq0 + g);
    of[k] = vq_load_cg(part_o + (n_splits * HQ + hq0 + g) * D + d);
    lf[k] = vq_load_cg(part_l + n_splits * HQ + hq0 + g);
    acc[k] = 0.0f;
  }
  VQ_BARRIER();
  for (int c0 = 0; c0 < n_splits; c0 += CCH) {
    const int cn = min(CCH, n_splits - c0);
    for (int i = (int)vq_tid; i < cn * CNH; i += CNT) {
      const int s = c0 + i / CNH, g = i % CNH;
      const float m = c0 == 0 ? s_cw[i] : vq_load_cg(part_m + s * HQ + hq0 + g);
      s_cw[i] = vq_exp2(m - s_cm[g]);
      if (c0 > 0) s_cl[i] = vq_load_cg(part_l + s * HQ + hq0 + g);
    }
    VQ_BARRIER();
"""
    + _COMBINE_ROWS
    + """
    // each head's sum, by one SIMD group (a split per lane, then across lanes)
    for (int g = (int)vq_warp; g < CNH; g += CNT / 32) {
      float part = 0.0f;
      for (int s = (int)vq_lane; s < cn; s += 32) part += s_cw[s * CNH + g] * s_cl[s * CNH + g];
      part = vq_simd_sum(part);
      if (vq_lane == 0) s_cs[g] += part;
    }
    VQ_BARRIER();
  }
  VQ_UNROLL
  for (int k = 0; k < CPS; ++k) {
    const int g = slot + k * (CNT / D);
    if (g < CNH) s_ch[g * D + d] = acc[k];
  }
  VQ_BARRIER();
  if (VHAD && !C4HAD) {
    for (int len = 1; len < D; len <<= 1) {
      for (int j = (int)vq_tid; j < CNH * (D / 2); j += CNT) {
        const int p = j % (D / 2);
        const int i = (j / (D / 2)) * D + (p / len) * 2 * len + (p % len);
        const float a = s_ch[i], b = s_ch[i + len];
        s_ch[i] = a + b;
        s_ch[i + len] = a - b;
      }
      VQ_BARRIER();
    }
  }
  VQ_UNROLL
  for (int k = 0; k < CPS; ++k) {
    const int g = slot + k * (CNT / D);
    if (g < CNH) {
      const float wf = vq_exp2(mf[k] - s_cm[g]);
      const float lc = s_cs[g];
      float v = s_ch[g * D + d] * (VHAD ? INV_SQRT_D : 1.0f);
      if (VSMOOTH) v *= vsm;
      if (VMEAN) v += vmn * lc;
      out[(hq0 + g) * D + d] = static_cast<OUT_T>((v + wf * of[k]) / (lc + wf * lf[k]));
    }
  }
  }
"""
)
COMBINE_CHUNK = 128  # CCH: splits whose weights are read at once
COMBINE_LOADS = 8  # output-row loads in flight per thread (the split loop's unroll x heads)
# The one-launch merge reads its output rows as float4s, COMBINE_LOADS4 in flight per thread
# (`_COMBINE_FLOAT4_EDITS`), where the scalar loads had 8: it was about one L2 round trip per
# split, the kernel's tail while the other SMs idle. The same sums in the same order, so the
# output is bit-identical to the scalar merge's (False); `bash benchmarks/h200_mma.sh merge4`
# compares the two (benchmarks/results/combine-float4-h200.txt).
COMBINE_FLOAT4 = True
COMBINE_LOADS4 = 16
# (text of _COMBINE_HEADS, what replaces it) for COMBINE_FLOAT4: item i < CNH * D / 4 of the
# rows is head i / (D / 4), dims 4 (i % (D / 4)) + 0..3, thread vq_tid taking items vq_tid,
# vq_tid + CNT, ... (CP4 of them). C4ALL is true when every thread has all its items, and then
# no bounds check sits between the loads: with one, nvcc branched around each load into the
# same registers, one in flight at a time (b049963, slower than the scalar merge). The rows
# start 16-byte aligned: part_o is 2 part_stride floats (a multiple of 4) into the parts, D too.
_COMBINE_FLOAT4_EDITS = (
    ("  float mf[CPS], of[CPS], lf[CPS], acc[CPS];", "  float mf[CPS], of[CPS], lf[CPS];"),
    (
        "    acc[k] = 0.0f;\n  }\n  VQ_BARRIER();",
        "  }\n  float4 acc4[CP4];\n  VQ_UNROLL\n"
        "  for (int k = 0; k < CP4; ++k) acc4[k] = VQ_F4(0.0f, 0.0f, 0.0f, 0.0f);\n  VQ_BARRIER();",
    ),
    (
        _COMBINE_ROWS,
        """    VQ_UNROLL_BY(C4U)
    for (int s = 0; s < cn; ++s) {
      VQ_UNROLL
      for (int k = 0; k < CP4; ++k) {
        const int i = (int)vq_tid + k * CNT;
        if (C4ALL || i < CNH * (D / 4)) {
          const int g = i / (D / 4);
          const float w = s_cw[s * CNH + g];
          const float4 o = vq_load_cg4(part_o + ((c0 + s) * HQ + hq0 + g) * D + 4 * (i % (D / 4)));
          acc4[k].x += w * o.x;
          acc4[k].y += w * o.y;
          acc4[k].z += w * o.z;
          acc4[k].w += w * o.w;
        }
      }
    }""",
    ),
    (
        """  VQ_UNROLL
  for (int k = 0; k < CPS; ++k) {
    const int g = slot + k * (CNT / D);
    if (g < CNH) s_ch[g * D + d] = acc[k];
  }""",
        """  VQ_UNROLL
  for (int k = 0; k < CP4; ++k) {
    const int i = (int)vq_tid + k * CNT;
    float4 x = acc4[k];
    if (VHAD && C4HAD) {
      // the value Hadamard's butterfly in registers (C4HAD): item i is dims 4 j..4 j + 3 of
      // one head, j = i % (D / 4), and a head's D / 4 items are lanes of one SIMD group, so
      // the levels past the item's own two are shuffles with lane j ^ m; the same sums in the
      // same order as the butterfly in threadgroup memory, whose log2(D) barriers were about
      // 1.7 us of the merge, the kernel's tail (benchmarks/results/merge-hadamard-h100.txt)
      const int j = i % (D / 4);
      float t = x.x;
      x.x = t + x.y;
      x.y = t - x.y;
      t = x.z;
      x.z = t + x.w;
      x.w = t - x.w;
      t = x.x;
      x.x = t + x.z;
      x.z = t - x.z;
      t = x.y;
      x.y = t + x.w;
      x.w = t - x.w;
      VQ_UNROLL
      for (int m = 1; m < D / 4; m <<= 1) {
        const float ox = vq_shfl_xor(x.x, m), oy = vq_shfl_xor(x.y, m);
        const float oz = vq_shfl_xor(x.z, m), ow = vq_shfl_xor(x.w, m);
        const bool hi = (j & m) != 0;  // the pair's upper element: (lower) - (upper)
        x.x = hi ? ox - x.x : x.x + ox;
        x.y = hi ? oy - x.y : x.y + oy;
        x.z = hi ? oz - x.z : x.z + oz;
        x.w = hi ? ow - x.w : x.w + ow;
      }
    }
    if (C4ALL || i < CNH * (D / 4)) {
      VQ_TG float* row = s_ch + (i / (D / 4)) * D + 4 * (i % (D / 4));
      row[0] = x.x;
      row[1] = x.y;
      row[2] = x.z;
      row[3] = x.w;
    }
  }""",
    ),
)


def combine_floats(heads: int, head_dim: int, threads: int | None = None) -> int:
    """Floats of the combine's threadgroup array for `heads` query heads merged by `threads`
    threads (default head_dim)."""
    warps = (head_dim if threads is None else threads) // 32
    per_head = max(1, warps // heads)
    return 2 * heads + heads * per_head + 2 * COMBINE_CHUNK * heads + heads * head_dim


def _combine_statements(first: str, heads: int, threads: int, head_dim: int, scratch: str) -> str:
    """_COMBINE_HEADS for `heads` query heads from the expression `first` merged by `threads`
    threads in the threadgroup array `scratch`, its sizes written in as literals."""
    per_slot = -(-heads // (threads // head_dim))
    sizes = {"CNH": heads, "CNT": threads, "CCH": COMBINE_CHUNK, "CPS": per_slot}
    sizes["CWH"] = max(1, threads // 32 // heads)  # SIMD groups per head for the maxima
    # about COMBINE_LOADS output-row loads in flight per thread: more raised the one-launch
    # kernel's registers above the partial's, which set them otherwise
    sizes["CUN"] = max(1, COMBINE_LOADS // per_slot)
    # the float4 merge's value Hadamard in registers: a head's items within one SIMD group
    whole = COMBINE_FLOAT4 and head_dim % 4 == 0 and 32 % (head_dim // 4) == 0
    sizes["C4HAD"] = "true" if whole and threads % 32 == 0 else "false"
    body = _COMBINE_HEADS
    if COMBINE_FLOAT4:
        for old, new in _COMBINE_FLOAT4_EDITS:
            if body.count(old) != 1:
                raise RuntimeError(f"_COMBINE_FLOAT4_EDITS no longer fit _COMBINE_HEADS: {old!r}")
            body = body.replace(old, new)
        per_thread4 = -(-heads * head_dim // 4 // threads)  # CP4
        sizes["CP4"], sizes["C4U"] = per_thread4, max(1, COMBINE_LOADS4 // per_thread4)
        sizes["C4ALL"] = "true" if per_thread4 * threads == heads * head_dim // 4 else "false"
    names = "|".join(sizes)
    body = re.sub(rf"\b({names})\b", lambda m: str(sizes[m.group(1)]), body)
    return body.replace("COMBINE_FIRST", first).replace("COMBINE_SCRATCH", scratch)


# The nearest codeword of each of the NM sub-vectors of s_x (NSD dims each) into s_code: NS
# threads per sub-vector each scan a contiguous NCODES / NS of the codes, then the first of
# their candidates with the least distance wins, which is the code one thread scanning all of
# them finds (kmeans.nearest's first index on ties). One thread per sub-vector scanning every
# code was the encoder's critical path, with most of the threadgroup idle.
_NEAREST = """
  if (d < NM * NS) {
    const int m = d / NS;
    const int c0 = (d % NS) * (NCODES / NS);
    float xs[NSD];
    VQ_UNROLL
    for (int i = 0; i < NSD; ++i) xs[i] = s_x[m * NSD + i];
    float best = 3.0e38f;
    uint arg = 0;
    for (int c = c0; c < c0 + NCODES / NS; ++c) {
      float cc = 0.0f;
      float dot = 0.0f;
      VQ_UNROLL
      for (int i = 0; i < NSD; ++i) {
        const float ci = s_book[c * NSD + i];
        cc += ci * ci;
        dot += xs[i] * (-2.0f * ci);
      }
      const float dist = dot + cc;
      if (dist < best) { best = dist; arg = (uint)c; }
    }
    s_best[d] = best;
    s_arg[d] = arg;
  }
  VQ_BARRIER();
  if (d < NM) {
    float best = s_best[d * NS];
    uint arg = s_arg[d * NS];
    for (int p = 1; p < NS; ++p) {
      if (s_best[d * NS + p] < best) { best = s_best[d * NS + p]; arg = s_arg[d * NS + p]; }
    }
    s_code[d] = arg;
  }
  VQ_BARRIER();
"""


def _nearest(side: str) -> str:
    """_NEAREST for the key ("K") or value ("V") codebook's constants."""
    names = {"NM": side + "M", "NSD": side + "D", "NS": side + "S", "NCODES": side + "CODES"}
    return re.sub(r"\b(NM|NSD|NS|NCODES)\b", lambda m: names[m.group(1)], _NEAREST)


def _scaled_hadamard(flag: str) -> str:
    """The orthonormal Hadamard of s_x where the compile-time `flag` is set."""
    scale = "    if (d < D) s_x[d] *= INV_SQRT_D;\n    VQ_BARRIER();\n"
    return f"  if ({flag}) {{\n{_HADAMARD}{scale}  }}\n"


def _pack_codes(side: str, dst: str) -> str:
    """Statements packing s_code's sub-vector codes (`side`M of `side`B bits) little-endian into
    the `side`BYTES bytes of row CODE_ROW of `dst`."""
    m, b, nbytes = side + "M", side + "B", side + "BYTES"
    return f"""  for (int b = d; d < D && b < {nbytes}; b += D) {{
    uint byte = 0;
    for (int k = 0; k < 8; ++k) {{
      const int p = 8 * b + k;
      if (p < {m} * {b}) byte |= ((s_code[p / {b}] >> (p % {b})) & 1u) << k;
    }}
    {dst}[CODE_ROW * {nbytes} + b] = (uint8_t)byte;
  }}
"""


# The encoder's threadgroup arrays (at function scope, as Metal requires) and its statements;
# EP is where its four parameters start in iparams, ENC_TOKEN / ENC_HEAD which (token, KV head)
# a threadgroup encodes: the grid's x / y in the encoder alone, and the threadgroups after the
# combine's in the combine with the encoder.
_ENCODE_SHARED = """
  VQ_SHARED float s_x[D];
  VQ_SHARED uint s_code[KM > VM ? KM : VM];
  VQ_SHARED float s_book[(KCODES * KD > VCODES * VD ? KCODES * KD : VCODES * VD)];
  VQ_SHARED float s_best[D];
  VQ_SHARED uint s_arg[D];
"""

_ENCODE_MAIN = (
    """
  const int n = iparams[EP];          // tokens to encode
  const int first = iparams[EP + 1];  // their index in the input rows
  const int rows = iparams[EP + 2];   // rows (tokens) per head in the inputs
  const int pos = iparams[EP + 3];    // absolute position of the first one
  const float rscale = fparams[1];
  const int i_tok = ENC_TOKEN;
  const int h = ENC_HEAD;
  const int d = (int)vq_tid;
  const int row = (h * rows + first + i_tok) * D;

  // keys: k - RoPE_m(mu), / lambda, Hadamard, nearest codeword per sub-vector. Threads d >= D
  // (a launch of more threads than D) only take part in the barriers.
  if (d < D) {
  float x = static_cast<float>(k_in[row + d]);
  RING_K_WRITE
  if (CENTER) {
    const int j = TRAD ? d / 2 : d % P;
    const int ia = TRAD ? 2 * j : j;
    const int ib = TRAD ? 2 * j + 1 : j + P;
    const float mua = static_cast<float>(key_mean[h * D + ia]);
    const float mub = static_cast<float>(key_mean[h * D + ib]);
    // the angle as mx.fast.rope forms it: (scale * position) * inv_freq, in float32
    const float theta = (rscale * (float)(pos + i_tok)) * inv_freq[j];
    float sn, cs;
    VQ_SINCOS(theta, sn, cs);
    x -= (d == ia) ? (mua * cs - mub * sn) : (mua * sn + mub * cs);
  }
  s_x[d] = x / static_cast<float>(smooth[h * D + d]);
  const int kbook = KBOOKS > 1 ? h : 0;
  for (int i = d; i < KCODES * KD; i += D) {
    s_book[i] = static_cast<float>(key_book[kbook * KCODES * KD + i]);
  }
  }
  VQ_BARRIER();
"""
    + _scaled_hadamard("HAD")
    + _nearest("K")
    + _pack_codes("K", "KEY_DST")
    + """  VQ_BARRIER();

  // values: v - mu_v, then (when calibrated so) / lambda_v and Hadamard
  if (d < D) {
  float y = static_cast<float>(v_in[row + d]);
  RING_V_WRITE
  if (VMEAN) y -= static_cast<float>(value_mean[h * D + d]);
  if (VSMOOTH) y /= static_cast<float>(value_smooth[h * D + d]);
  s_x[d] = y;
  const int vbook = VBOOKS > 1 ? h : 0;
  for (int i = d; i < VCODES * VD; i += D) {
    s_book[i] = static_cast<float>(value_book[vbook * VCODES * VD + i]);
  }
  }
  VQ_BARRIER();
"""
    + _scaled_hadamard("VHAD")
    + _nearest("V")
    + _pack_codes("V", "VALUE_DST")
)

# Component i of a float / float2 / float4 (i a constant after unrolling).
_HELPERS = """
#ifndef VQ_VECINFER_HELPERS
#define VQ_VECINFER_HELPERS
VQ_FN float vq_comp(float v, int i) { return v; }
VQ_FN float vq_comp(float2 v, int i) { return i == 0 ? v.x : v.y; }
VQ_FN float vq_comp(float4 v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}
VQ_FN uint32_t vq_word(uint32_t v, int i) { return v; }
VQ_FN uint32_t vq_word(uint2 v, int i) { return i == 0 ? v.x : v.y; }
VQ_FN uint32_t vq_word(uint4 v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}
#endif
"""


def _load_expr(sub: int, book: str) -> str:
    """Expression building one codeword (float / float2 / float4) from fp16 book[base + i]."""
    parts = [f"static_cast<float>({book}[base + {i}])" for i in range(sub)]
    if sub == 1:
        return parts[0]
    return f"VQ_F{sub}(" + ", ".join(parts) + ")"


def _common_constants(lay: Layout) -> dict[str, Any]:
    d = lay.head_dim
    return {
        "D": d,
        "P": d // 2,
        "G": lay.group,
        "HQ": lay.group * lay.n_kv_heads,
        "HKV": lay.n_kv_heads,
        "KB": lay.key_bits,
        "KD": lay.key_sub_dim,
        "KM": d // lay.key_sub_dim,
        "KCODES": 1 << lay.key_bits,
        "KBYTES": lay.key_bytes,
        "KW": lay.key_bytes // 4,
        "VB": lay.value_bits,
        "VD": lay.value_sub_dim,
        "VM": d // lay.value_sub_dim,
        "VCODES": 1 << lay.value_bits,
        # the encoder's threads per sub-vector in its nearest-codeword search
        "KS": min(lay.key_sub_dim, 1 << lay.key_bits),
        "VS": min(lay.value_sub_dim, 1 << lay.value_bits),
        "VBYTES": lay.value_bytes,
        "VW": lay.value_bytes // 4,
        "KBOOKS": lay.key_books,
        "VBOOKS": lay.value_books,
        "HAD": lay.hadamard,
        "VHAD": lay.value_smooth and lay.hadamard,
        "CENTER": lay.center,
        "VMEAN": lay.value_mean,
        "VSMOOTH": lay.value_smooth,
        "TRAD": lay.rope_traditional,
        "INV_SQRT_D": 1.0 / math.sqrt(d),
        "NEG": NEG,
    }


# The exact tokens' rows: fp16 sinks, the window ring, the call's own token(s).
EXACT_INPUTS = ("sink_k", "sink_v", "win_k", "win_v", "new_k", "new_v")
PARTIAL_INPUTS = (
    "q",
    "iparams",
    "fparams",
    "key_codes",
    "value_codes",
    "key_book",
    "value_book",
    "smooth",
    "key_mean",
    "inv_freq",
    "phase_table",
    *EXACT_INPUTS,
    # not read: the output of the cache's latest launch (or a placeholder), so that MLX orders
    # this launch after it (and after its in-place writes and count) even when the two steps
    # share one evaluation
    "after",
)


def _replicas(codes: int, sub: int, budget: int = CODEBOOK_BYTES) -> int:
    """Copies of a codebook of `sub` 32-bit words per entry (float32 values, or the tensor-core
    path's f16 pairs) in threadgroup memory: enough that a SIMD group's random codes hit
    distinct banks (accesses of 4·sub bytes are served 32·4 / (4·sub) lanes at a time),
    within `budget` bytes."""
    reps = 32 // sub
    while reps > 1 and codes * sub * 4 * reps > budget:
        reps //= 2
    return reps


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def threadgroup_bytes(lay: Layout, r: int, one_launch: bool = False, rope_in: bool = False) -> int:
    """Threadgroup memory of the partial kernel (Apple GPUs allow 32 KB), or of the one-launch
    kernel: its codebook array is at least `one_launch_big4`, and a flag (`mma_bytes` where
    it runs its coded tokens on the tensor cores), and with `rope_in` the RoPE table."""
    rope = 4 * lay.head_dim if rope_in else 0  # _ROPE_IN_TABLE
    if one_launch and mma_takes(lay, r):
        return mma_bytes(lay, r) + rope
    c = _partial_constants(lay, r)
    big4 = one_launch_big4(lay, c["BIG4"]) if one_launch else c["BIG4"]
    # s_w and s_tay; without a key mean their placeholders are never read, and compilers drop them
    phase = c["P"] * c["WS"] + lay.group * c["NTAY"] if lay.center else 0
    floats = lay.group * lay.head_dim + c["KM"] * c["QS"] + phase + c["PBUF"]
    floats += 4 * big4 + 3 * lay.group + c["NWARPS"] * lay.group
    books = c["VCODES"] * c["VREP"] * lay.value_sub_dim * 4
    return 4 * floats + books + (4 if one_launch else 0) + rope


def one_launch_big4(lay: Layout, big4: int) -> int:
    """The one-launch kernel's codebook array (float4s): the partial's `big4`, or more when its
    last threadgroup's merge or its exact threadgroup's encoder need more (they reuse it)."""
    tail = max(4 * combine_floats(lay.group, lay.head_dim, TILE), encode_threadgroup_bytes(lay))
    return max(big4, -(-tail // 16))


def mma_takes(lay: Layout, r: int | None = None) -> bool:
    """Whether the one-launch kernel runs its coded tokens on the tensor cores (`_MMA_TILES`):
    MMA on, head_dim a multiple of 16, at most 8 query heads per KV head (mma's N), tiles of at
    most POLY_TOKENS tokens when the layout has polynomial pairs and its threadgroup arrays
    within CUDA's limit (with the compact value book: the conflict-free one only where it fits,
    `_mma_value_copies`). It reads whole 16-token blocks of code rows, so the code buffers'
    capacity must be a multiple of 16 (the cache grows them by CODE_STEP)."""
    if not MMA:
        return False
    r = TOKENS_PER_THREAD if r is None else r
    # memoised: a decode step asks once per layer, and mma_bytes costs the host ~8 us (the
    # module constants it reads are in the key, as tests change them)
    key = (lay, r, TILE, COMBINE_CHUNK, THREADGROUP_LIMIT["cuda"], MMA_VALUE_BOOK_BYTES)
    takes = _MMA_TAKES.get(key)
    if takes is None:
        takes = _MMA_TAKES[key] = (
            lay.head_dim % 16 == 0
            and lay.group <= 8
            and (lay.poly_pairs == 0 or TILE * r <= POLY_TOKENS)
            and _mma_compact_bytes(lay, r) <= THREADGROUP_LIMIT["cuda"]
        )
    return takes


_MMA_TAKES: dict[tuple, bool] = {}


def _mma_constants(lay: Layout, r: int, compact: bool = False) -> dict[str, Any]:
    d, kd, vd = lay.head_dim, lay.key_sub_dim, lay.value_sub_dim
    kew, vew = max(1, kd // 2), max(1, vd // 2)
    ksb = d // 4 // kd * lay.key_bits  # bits of a lane's key slice (a quarter of the dims)
    vsb = d // 8 // vd * lay.value_bits  # ... and value slice (an eighth)
    kr = _replicas(1 << lay.key_bits, kew)
    vr = _replicas(1 << lay.value_bits, vew, MMA_VALUE_BOOK_BYTES)
    exact, full, chunks, poly_chunks = _phase_plan(lay)
    c = {
        "TT": TILE * r,  # tokens per tile
        "WB": TILE * r // (TILE // 32 * 16),  # 16-token blocks per SIMD group and tile
        "DC": d // 16,  # 16-dim chunks (key A columns, value A row blocks)
        # 16-column chunks of the phase operand (`_phase_plan`): PF of the exact pairs'
        # cos / -sin, then with NPOLY slow pairs one of the polynomial's powers (even slots)
        # and the last exact pairs (odd slots); NPC chunks of the slow pairs' W (A fragments)
        "PC": chunks,
        "PF": full,
        "PE": exact,
        "NPOLY": lay.poly_pairs,
        "NPC": poly_chunks,
        "GP2": 1 << (lay.group - 1).bit_length(),  # heads rounded up to a power of two
        "KSD": d // 4,
        "KSB": ksb,
        "KSW": -(-ksb // 32),
        "KALIGN": ksb % 32 == 0,
        "VSD": d // 8,
        "VSUB": d // 8 // vd,
        "VSB": vsb,
        "VSW": -(-vsb // 32),
        "VALIGN": vsb % 32 == 0,
        "KEW": kew,
        "VEW": vew,
        "VEWT": "uint2" if vew == 2 else "uint32_t",
        "KR16": kr,
        "VR16": vr,
        "KBOOK4": -(-((1 << lay.key_bits) * kr * kew) // 4),  # float4s of the key book copies
        "KLG": (kr * kew * 4).bit_length() - 1,  # log2 of a code's bytes in the copies' array
        "VLG": (vr * vew * 4).bit_length() - 1,
        "VBLATE": False,
        "KAHEAD": KEY_ROWS_AHEAD,  # first key rows of a tile loaded one tile ahead
    }
    if not compact:
        vr, late = _mma_value_copies(lay, r, c)
        c.update(VR16=vr, VLG=(vr * vew * 4).bit_length() - 1, VBLATE=late)
    return c


def _mma_value_copies(lay: Layout, r: int, c: dict[str, Any]) -> tuple[int, bool]:
    """(copies of the tensor-core path's f16 value book, VBLATE): one per lane that a shared
    load of its entries serves at once (32 / VEW: a SIMD group's random codes then never share
    a bank) where the threadgroup's memory with them, its RoPE table included, still fits
    MMA_MIN_THREADGROUPS per multiprocessor of the card; else the compact `c["VR16"]`. The
    large book is written after the setup (VBLATE) with the setup's scaled queries and q~ at
    its start until then, where it holds them: 4 threadgroups of the 8B shape fit an H100's
    228 KB only so."""
    full = 32 // c["VEW"]
    if c["VR16"] >= full:
        return c["VR16"], False
    p = _partial_constants(lay, r)
    book = (1 << lay.value_bits) * full * c["VEW"] * 4
    late = book >= 4 * (lay.group * lay.head_dim + p["KM"] * p["QS"])
    group = _mma_array_bytes(lay, r, {**c, "VR16": full, "VBLATE": late}) + 4 + 4 * lay.head_dim
    per_multiprocessor, reserved = _card_shared_memory()
    if per_multiprocessor // (group + reserved) >= MMA_MIN_THREADGROUPS:
        return full, late
    return c["VR16"], False


def _card_shared_memory() -> tuple[int, int]:
    """The CUDA card's (shared memory per multiprocessor, bytes kept per threadgroup), or the
    timed card's where MLX does not run on CUDA (sources built for tests and tools)."""
    if vk.backend() != "cuda":
        return vk.TIMED_CARD_SHARED_MEMORY
    try:
        return vk.cuda_shared_memory()
    except RuntimeError as e:  # its fix (TARGET_GROUPS) covers the splits, not the value book
        raise RuntimeError(
            f"{e}; the one-launch kernel's tensor-core value book is sized to the card's shared "
            "memory too: set MMA = False (or ONE_LAUNCH = False) in "
            "veloxquant.methods.vecinfer.kernels to run without asking"
        ) from e


def _phase_plan(lay: Layout) -> tuple[int, int, int, int]:
    """The tensor-core path's phase operand: (exact pairs PE, chunks PF of exact pairs only,
    chunks PC of the phase operand, chunks NPC of the slow pairs' W). A chunk is 8 slots of
    2 columns: slot 2·l4 + hf is register hf of lanes 4g + l4 in B (`phase_slot_pairs`)."""
    pairs, poly = lay.head_dim // 2, lay.poly_pairs
    if not poly:
        return pairs, -(-pairs // 8), -(-pairs // 8), 0
    exact = pairs - poly
    full = -(-max(0, exact - 4) // 8)  # the polynomial's chunk holds 4 exact pairs
    return exact, full, full + 1, -(-poly // 8)


def phase_slot_pairs(lay: Layout) -> np.ndarray:
    """The RoPE pair of each slot jj = 8·chunk + 2·l4 + hf of the tensor-core path's phase
    coefficients (the PC chunks of B, then the NPC chunks of the slow pairs' W), -1 for none:
    the exact pairs in order, the last ones in the polynomial chunk's odd slots (its even ones
    are the powers' coefficients), then the slow pairs in order."""
    exact, full, chunks, poly_chunks = _phase_plan(lay)
    pairs = lay.head_dim // 2
    out = np.full(8 * (chunks + poly_chunks), -1)
    out[: min(exact, 8 * full)] = np.arange(min(exact, 8 * full))
    if lay.poly_pairs:
        last = np.arange(8 * full, exact)  # at most 4
        out[8 * full + 1 + 2 * np.arange(last.size)] = last
        out[8 * chunks : 8 * chunks + pairs - exact] = np.arange(exact, pairs)
    return out


def _mma_big4(lay: Layout, r: int) -> int:
    """float4s of the tensor-core path's key codebook copies and rotated phase coefficients,
    then its SIMD groups' rows."""
    c = _mma_constants(lay, r, compact=True)  # the value book is not in it
    loop = 16 * c["KBOOK4"] + (8 * 64 * (c["PC"] + c["NPC"]) if lay.center else 0)
    return -(-max(loop, 4 * (TILE // 32) * lay.group * lay.head_dim) // 16)


def _mma_array_bytes(lay: Layout, r: int, c: dict[str, Any]) -> int:
    """Bytes of `_MMA_SHARED`'s arrays with the tensor-core constants `c`, as `_dynamic_arrays`
    carves them out of dynamic shared memory: in order, each from a 16-byte boundary."""
    p = _partial_constants(lay, r)
    g, d, late = lay.group, lay.head_dim, c["VBLATE"]
    slots = 8 * (c["PC"] + c["NPC"]) if lay.center else 1
    arrays = [
        16 * -(-((1 << lay.value_bits) * c["VR16"] * c["VEW"]) // 4),  # s_vb16
        4 * (1 if late else g * d),  # s_qown
        16 * (1 if late else p["KM"] * p["QS"] // 4),  # s_qtown
        8 * (2 * 4 * slots if lay.center else 1),  # s_wb
        8 * slots,  # s_wstep
        4 * slots,  # s_wj
        8 * slots,  # s_wmu
        8 * slots,  # s_wpos
        8 * (max(1, c["NPC"]) * 32 if lay.center else 1),  # s_polyb
        8 * 32 * c["DC"],  # s_qb
        4 * p["NWARPS"] * g,  # s_red
        4 * p["NWARPS"] * g,  # s_lw
        4 * g,  # s_mrun
        4 * g,  # s_lrun
        16 * one_launch_big4(lay, _mma_big4(lay, r)),  # s_big
    ]
    return sum(-(-n // 16) * 16 for n in arrays)


def mma_bytes(lay: Layout, r: int) -> int:
    """Threadgroup memory of the one-launch kernel on the tensor cores: `_MMA_SHARED`'s arrays
    in dynamic shared memory, and the merge's flag."""
    return _mma_array_bytes(lay, r, _mma_constants(lay, r)) + 4


def _mma_compact_bytes(lay: Layout, r: int) -> int:
    """`mma_bytes` with the compact value book (MMA_VALUE_BOOK_BYTES)."""
    return _mma_array_bytes(lay, r, _mma_constants(lay, r, compact=True)) + 4


def _dynamic_arrays(shared: str) -> str:
    """The threadgroup arrays declared in `shared` carved out of one dynamic shared memory array
    (`s_dynamic`, DYN4 uint4s), each from a 16-byte boundary (`_mma_array_bytes` counts them
    so). All of them move: MLX raises a kernel's limit past CUDA's 48 KB only for a dynamic
    request of over 48000 bytes, and static arrays count towards that limit too."""
    decl = re.compile(r"^(\s*)VQ_SHARED (\w+) (s_\w+)\[(.+)\];(.*)$", re.M)
    n = 0

    def carve(m: re.Match) -> str:
        nonlocal n
        indent, t, name, count, comment = m.groups()
        n += 1
        at, end = f"VQ_DYN{n - 1}", f"VQ_DYN{n}"
        return (
            f"{indent}VQ_TG {t}* const {name} =\n"
            f"{indent}    reinterpret_cast<VQ_TG {t}*>(s_dynamic + {at} / 16);{comment}\n"
            f"{indent}constexpr int {end} = ({at} + (int)sizeof({t}) * ({count}) + 15) & ~15;"
        )

    out = decl.sub(carve, shared)
    check = f'  static_assert(VQ_DYN{n} == 16 * DYN4, "_mma_array_bytes counts other arrays");\n'
    head = "  VQ_DYNAMIC_SHARED(uint4, s_dynamic, DYN4);\n  constexpr int VQ_DYN0 = 0;\n"
    return head + out + check


def encode_threadgroup_bytes(lay: Layout) -> int:
    """Threadgroup memory of the encoder, alone or inside the combine (_ENCODE_SHARED)."""
    d = lay.head_dim
    km, vm = d // lay.key_sub_dim, d // lay.value_sub_dim
    book = max((1 << lay.key_bits) * lay.key_sub_dim, (1 << lay.value_bits) * lay.value_sub_dim)
    return 4 * (d + max(km, vm) + book + 2 * d)


def _partial_constants(lay: Layout, r: int) -> dict[str, Any]:
    c = _common_constants(lay)
    vm = lay.head_dim // lay.value_sub_dim
    tg = TILE // vm
    krep = _replicas(1 << lay.key_bits, lay.key_sub_dim)
    gp = _round4(lay.group)
    kw = lay.key_bytes // 4
    klv = 4 if kw % 4 == 0 else (2 if kw % 2 == 0 else 1)
    km = lay.head_dim // lay.key_sub_dim
    whole = 32 // math.gcd(lay.key_bits, 32)  # sub-vectors whose codes fill whole words
    kch = -(-KEY_CHUNK // whole) * whole
    kch = kch if km % kch == 0 else km
    return {
        **c,
        "TILE": TILE,
        "R": r,
        "NWARPS": TILE // 32,
        "KREP": krep,
        "VREP": _replicas(1 << lay.value_bits, lay.value_sub_dim),
        "TG": tg,
        "QS": _round4(lay.group * lay.key_sub_dim),
        "WS": _round4(2 * lay.group),
        "GP": gp,
        "PBUF": _round4(max(TILE * r * gp, lay.group * lay.head_dim)),
        # key codebook copies, then the reduction of the token strides (`one_launch_big4`: and
        # then the one-launch kernel's merge and encoder)
        "BIG4": -(
            -max(
                (1 << lay.key_bits) * krep * lay.key_sub_dim * 4, tg * lay.group * lay.head_dim * 4
            )
            // 16
        ),
        "DE": lay.head_dim // 32,  # a row's elements per lane (exact tokens)
        "QE": lay.head_dim // 32,  # ... and of a query head's (its Hadamard in registers)
        "GW": -(-lay.group // (TILE // 32)),  # query heads per SIMD group in that Hadamard
        "QLOG": (lay.head_dim // 32).bit_length() - 1,  # log2(QE)
        "FPB": EXACT_BATCH,
        "KVEC": _VEC[lay.key_sub_dim],
        "KLV": klv,
        "KLVEC": _WORDS[klv],
        "VVEC": _VEC[lay.value_sub_dim],
        # a divisor of a thread's R * VM value tokens per tile, which the whole-tile loop
        # walks in batches of VPF
        "VPF": math.gcd(VALUE_PREFETCH, r * vm),
        "KCH": kch,
        "KCW": kch * lay.key_bits // 32,  # code words per chunk (rows are whole words)
        "NTAY": PHASE_TAYLOR_ORDER + 1,
        "PHASE_PARAM": PHASE_PARAM,
        "VCROSS": 32 % lay.value_bits != 0,
    }


def attention_kernel_sources(
    lay: Layout, out_dtype: mx.Dtype, r: int | None = None
) -> tuple[KernelSource, KernelSource]:
    """(partial, combine) kernel sources of decode attention for one layout, with r coded
    tokens per thread (default TOKENS_PER_THREAD); the combine writes `out_dtype`."""
    r = TOKENS_PER_THREAD if r is None else r
    key = ("attention", lay, str(out_dtype), r)
    if key not in _SOURCES:  # built once: decode calls this per layer and token
        _SOURCES[key] = _attention_kernel_sources(lay, out_dtype, r)
    return _SOURCES[key]


_SOURCES: dict[Any, Any] = {}


def _attention_kernel_sources(
    lay: Layout, out_dtype: mx.Dtype, r: int
) -> tuple[KernelSource, KernelSource]:
    partial = KernelSource(
        name="vq_vecinfer_attn_partial",
        inputs=PARTIAL_INPUTS,
        outputs=("part_m", "part_l", "part_o"),
        body=_EXACT_ROW
        + _PARTIAL_BODY.replace("KLOAD", _load_expr(lay.key_sub_dim, "key_book")).replace(
            "VLOAD", _load_expr(lay.value_sub_dim, "value_book")
        ),
        constants=_partial_constants(lay, r),
        threads=TILE,
        helpers=_HELPERS,
    )
    combine = KernelSource(
        name="vq_vecinfer_attn_combine",
        inputs=COMBINE_INPUTS,
        outputs=("out",),
        body="\n  VQ_SHARED float s_x[D];\n" + _COMBINE_ONE_HEAD,
        constants={**_common_constants(lay), "OUT_T": out_dtype},
        threads=lay.head_dim,
    )
    return partial, combine


COMBINE_INPUTS = ("part_m", "part_l", "part_o", "iparams", "value_smooth", "value_mean")


# The one-launch kernel's arguments. Each argument costs MLX's CUDA launch ~0.3 us of host time
# per call and each output ~1.5 us, per layer and decode step
# (benchmarks/results/kernel-arguments-h200.txt), so a layer's constants (the float
# parameters, the finished-threadgroup count, the codebooks, the transforms, the RoPE tables)
# travel in one buffer of the cache's own, `layer_pack`, and the splits' parts in one output.
ONE_LAUNCH_INPUTS = (
    "q",
    "iparams",
    "key_codes",
    "value_codes",
    "layer_pack",
    *EXACT_INPUTS,
    "after",  # as in PARTIAL_INPUTS
)
PACK_TYPES = {"float32": np.float32, "float16": np.float16, "uint32": np.uint32, "int32": np.int32}

# The names the partial kernel and the encoder read, as views of the pack (CUDA: the one-launch
# kernel is CUDA-only).
_ONE_LAUNCH_PACK = """
  const float* fparams = reinterpret_cast<const float*>(layer_pack + OFF_FPARAMS);
  const uint32_t* counter = layer_pack + OFF_COUNTER;
  const HALF_T* key_book = reinterpret_cast<const HALF_T*>(layer_pack + OFF_KEY_BOOK);
  const HALF_T* value_book = reinterpret_cast<const HALF_T*>(layer_pack + OFF_VALUE_BOOK);
  const HALF_T* smooth = reinterpret_cast<const HALF_T*>(layer_pack + OFF_SMOOTH);
  const HALF_T* key_mean = reinterpret_cast<const HALF_T*>(layer_pack + OFF_KEY_MEAN);
  const HALF_T* value_smooth = reinterpret_cast<const HALF_T*>(layer_pack + OFF_VALUE_SMOOTH);
  const HALF_T* value_mean = reinterpret_cast<const HALF_T*>(layer_pack + OFF_VALUE_MEAN);
  const float* inv_freq = reinterpret_cast<const float*>(layer_pack + OFF_INV_FREQ);
  const float* phase_table = reinterpret_cast<const float*>(layer_pack + OFF_PHASE_TABLE);
  const uint32_t* phase_frags = layer_pack + OFF_PHASE_FRAGS;
  const uint32_t* poly_frags = layer_pack + OFF_POLY_FRAGS;
  const int* slot_pairs = reinterpret_cast<const int*>(layer_pack + OFF_SLOT_PAIRS);
"""

# Every split's running max, sum and output rows in the one output `parts`: [part_m][part_l]
# [part_o], each of the first two n_splits + 1 by HQ plus 8 spare floats, rounded to float4s.
_ONE_LAUNCH_PARTS = """
  const int part_stride = ((n_splits + 1) * HQ + 8 + 3) & ~3;
  float* part_m = parts;
  float* part_l = parts + part_stride;
  float* part_o = parts + 2 * part_stride;
"""


def pack_segments(lay: Layout, r: int | None = None) -> dict[str, tuple[int, int, str]]:
    """{name: (offset in 32-bit words, elements, dtype)} of `layer_pack`'s segments for r coded
    tokens per thread (default TOKENS_PER_THREAD), each on a 16-byte boundary; a segment the
    kernel never reads has no elements."""
    r = TOKENS_PER_THREAD if r is None else r
    h, d, p = lay.n_kv_heads, lay.head_dim, lay.head_dim // 2
    hd = h * d
    mma = mma_takes(lay, r)
    _, _, chunks, poly_chunks = _phase_plan(lay)
    frags = TILE * r // 16 * chunks * 32 * 8  # [blocks, chunks, lanes, 8]
    sizes = {
        "fparams": (8, "float32"),
        "counter": (max(8, h), "uint32"),
        "key_book": (lay.key_books * (1 << lay.key_bits) * lay.key_sub_dim, "float16"),
        "value_book": (lay.value_books * (1 << lay.value_bits) * lay.value_sub_dim, "float16"),
        "smooth": (hd, "float16"),
        "key_mean": (hd if lay.center else 0, "float16"),
        "value_smooth": (hd if lay.value_smooth else 0, "float16"),
        "value_mean": (hd if lay.value_mean else 0, "float16"),
        "inv_freq": (p if lay.center else 0, "float32"),
        "phase_table": (p * (TILE + 1) * 2 if lay.center and not mma else 0, "float32"),
        "phase_frags": (frags if lay.center and mma else 0, "float16"),
        "poly_frags": (poly_chunks * 32 * 4 if lay.center and mma else 0, "float16"),
        "slot_pairs": (8 * (chunks + poly_chunks) if lay.center and mma else 0, "int32"),
    }
    out, off = {}, 0
    for name, (n, dtype) in sizes.items():
        out[name] = (off, n, dtype)
        words = -(-n * np.dtype(PACK_TYPES[dtype]).itemsize // 4)
        off += -(-words // 4) * 4
    out["end"] = (off, 0, "uint32")
    return out


def layer_pack(cache: Any, n_q_heads: int, r: int, scale: float) -> mx.array:
    """The one-launch kernel's `layer_pack` for this cache (uint32 words; `pack_segments`):
    copies of its constant arrays, the float parameters of attention scale `scale` and a
    finished-threadgroup count at zero, which every launch leaves at zero. Memoised on the
    cache with its other constants; a copy of the cache gets a pack, and a count, of its own."""
    return _layer_pack(cache, layout_of(cache, n_q_heads), layer_constants(cache, r), r, scale)


def kernel_bytes(cache: Any) -> int:
    """Bytes of the buffers the kernels keep on `cache` (its layer packs)."""
    memo = cache.__dict__.get("_kernel_memo", {})
    return sum(v.nbytes for k, v in memo.items() if isinstance(k, tuple) and k[0] == "pack")


def _layer_pack(cache: Any, lay: Layout, const: dict, r: int, scale: float) -> mx.array:
    fparams = (scale * LOG2E, const["rscale"], const["log2_base"])
    memo = cache.__dict__["_kernel_memo"]
    mma = mma_takes(lay, r)
    key = ("pack", lay, r, fparams, mma)
    if key not in memo:
        arrays = {
            "fparams": _float_params(*fparams),
            "key_book": cache.key_codebook,
            "value_book": cache.value_codebook,
            "smooth": cache.smooth,
            "key_mean": cache.key_mean,
            "value_smooth": cache.value_smooth,
            "value_mean": cache.value_mean,
            "inv_freq": const["inv_freq"],
            "phase_table": const["table"],
            "phase_frags": (
                mx.array(phase_fragments(cache.rope, lay, r)) if mma and lay.center else None
            ),
            "poly_frags": (
                mx.array(poly_fragments(cache.rope, lay, r)) if mma and lay.center else None
            ),
            "slot_pairs": mx.array(phase_slot_pairs(lay).astype(np.int32)),
        }
        segments = pack_segments(lay, r)
        pack = np.zeros(segments["end"][0] * 4, np.uint8)
        for name, (off, n, dtype) in segments.items():
            if not n or name == "counter":
                continue
            x = np.array(arrays[name].astype(getattr(mx, dtype))).reshape(-1)
            if x.size != n:
                raise ValueError(
                    f"vecinfer: the cache's {name} has {x.size} elements where its layout reads "
                    f"{n}; the cache's arrays do not match its own shapes (a corrupt state?)"
                )
            pack[off * 4 : off * 4 + x.nbytes] = x.view(np.uint8)
        # host-made: on CUDA copied to device memory, where the last layers' packs no longer
        # share a managed page with the arrays the host makes later (launch-params-h100.txt)
        memo[key] = device_resident(mx.array(pack.view(np.uint32)))
    return memo[key]


# Element n of the RoPE of `row` (D elements, pairs (n, n + D/2), or (2j, 2j + 1) when
# traditional) from the cosine and sine of its pair j (`rope`: D/2 cosines, then D/2 sines), as
# mx.fast.rope forms it: x1 c - x2 s and x1 s + x2 c in float32, and one rounding to the model's
# dtype T (what the model's own rotation hands on). Each sum rounds where the machine code of
# MLX's CUDA rope kernels rounds it, fma(x1, c, -(x2 s)) and fma(x1, s, x2 c) (their SASS in
# MLX 0.32.4's libmlx.so, sm_90a): left to contract `x1 * sn + x2 * cs` itself, NVRTC made it
# fma(x2, c, x1 s), which rounds differently, so the rows were not the model's bit for bit
# (rope-in-kernel-h100.txt). The partner element is read from memory
# rather than shuffled in: the callers hold their elements in different lane layouts, and the
# row is one cached line.
# The table is filled once per threadgroup (`_ROPE_IN_TABLE`): an accurate sincosf at every read
# cost the launch about three times what the SFU's approximations (which differ from
# mx.fast.rope's) did (rope-in-kernel-h100.txt). Its call is kept out of line: inlined,
# sincosf's slow path for angles past 1e5 rad (128K tokens reach 1.3e5), a local array and its
# registers, cost the tile loop spills (`kernel_code_size.py --one-launch`).
_ROPE_IN_HELPER = """
#ifndef VQ_ROPE_IN_HELPER
#define VQ_ROPE_IN_HELPER
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define VQ_NOINLINE __noinline__
#else
#define VQ_NOINLINE
#endif
VQ_NOINLINE __device__ void vq_rope_sincos(float theta, float* sn, float* cs) {
  VQ_SINCOS(theta, *sn, *cs);
}
// element n's mate in its RoPE pair
template <int D_, bool TRAD_>
VQ_FN int vq_rope_mate(int n) {
  return TRAD_ ? (n ^ 1) : (n < D_ / 2 ? n + D_ / 2 : n - D_ / 2);
}
// element n of a row rotated, from its value `own` and its mate's `mate`
template <typename T, int D_, bool TRAD_>
VQ_FN float vq_rope_turn(float own, float mate, int n, const VQ_TG float* rope) {
  const bool first = TRAD_ ? (n & 1) == 0 : n < D_ / 2;
  const int j = TRAD_ ? n / 2 : (first ? n : n - D_ / 2);
  const float x1 = first ? own : mate, x2 = first ? mate : own;
  const float cs = rope[j], sn = rope[D_ / 2 + j];
  return static_cast<float>(
      static_cast<T>(first ? VQ_FMA(x1, cs, -VQ_MUL(x2, sn)) : VQ_FMA(x1, sn, VQ_MUL(x2, cs))));
}
template <typename T, int D_, bool TRAD_, typename X>
VQ_FN float vq_rope_in(const VQ_GLOBAL X* row, int n, const VQ_TG float* rope) {
  const float own = static_cast<float>(row[n]);
  const float mate = static_cast<float>(row[vq_rope_mate<D_, TRAD_>(n)]);
  return vq_rope_turn<T, D_, TRAD_>(own, mate, n, rope);
}
#endif
"""

# The cosine and sine of each RoPE pair at the step's position iparams[ROPE_POS]: one sincosf
# per thread of the first D/2. Its barrier is each branch's (`_ROPE_IN_SYNC`): a coded
# threadgroup's setup reads then (its query unrotated, the codebooks, the phase setup's tables)
# are issued before it, not a round trip after. A RoPE given by its
# base (fparams[2], `rope_log2_base`, not 0) takes each pair's frequency as mx.fast.rope's GPU
# kernel forms it, exp2f(-(j / (D/2)) * log2(base)) on the GPU: the host's float32 exp2
# (rope_inv_freq, which the coded tokens' phases keep) can be an ulp or two away, and at 64K
# tokens one ulp of a frequency near 1 turns the angle by 4e-3 rad, a bf16 step of the rotated
# rows. With the model's frequencies (`freqs`) both read the same 1 / freqs.
_ROPE_IN_TABLE = """
  VQ_SHARED float s_rope[D];
  // this thread's pair's angle (the first D / 2), its reads issued first: the model's frequency
  // read whether or not it is the one taken, so that its load waits on no other
  const float rope_model_freq = inv_freq[min((int)vq_tid, D / 2 - 1)];
  const float rope_angle = fparams[1] * (float)iparams[ROPE_POS] * (fparams[2] != 0.0f
      ? exp2f(-((float)vq_tid / (float)(D / 2)) * fparams[2]) : rope_model_freq);
"""
_ROPE_IN_FILL = """    if ((int)vq_tid < D / 2) {
      float sn, cs;
      vq_rope_sincos(rope_angle, &sn, &cs);
      s_rope[vq_tid] = cs;
      s_rope[D / 2 + vq_tid] = sn;
    }
"""

# The statements of the one-launch kernel that read the step's own query and key, and what they
# read instead when the kernel rotates them (`rope_in`): the split threadgroups' query load (each
# element and its mate, rotated once the RoPE table's barrier is passed), the exact
# threadgroup's query and new-token rows, and the in-place encoder's ring write.
_SPLIT_Q_LOAD = (
    "qx[gi][e] = g < G ? static_cast<float>(q[(h * G + g) * D + (int)vq_lane * QE + e]) : 0.0f;"
)
_ROPE_IN_READS = {
    "float qx[GW][QE], sx[QE];": "float qx[GW][QE], qm[GW][QE], sx[QE];",
    _SPLIT_Q_LOAD: (
        _SPLIT_Q_LOAD + "\n        qm[gi][e] = g < G ? static_cast<float>(q[(h * G + g) * D + "
        "vq_rope_mate<D, TRAD>((int)vq_lane * QE + e)]) : 0.0f;"
    ),
    "const float qs = qx[gi][e] * qscale;": (
        "const float qs = vq_rope_turn<OUT_T, D, TRAD>(qx[gi][e], qm[gi][e], "
        "(int)vq_lane * QE + e, s_rope) * qscale;"
    ),
    "static_cast<float>(q[(h * G) * D + i])": "VQ_ROPE_IN(q + (h * G + i / D) * D, i % D)",
    "EXACT_ROW(new_k, new_v, (h * n_new + t - n_sink - n_win) * D)": (
        "EXACT_ROW_ROPE(new_k, new_v, (h * n_new + t - n_sink - n_win) * D)"
    ),
    "static_cast<float>(new_k[h * D + d])": "VQ_ROPE_IN(new_k + h * D, d)",
}
_ROPE_IN_MACROS = """
#define VQ_ROPE_IN(X, n) \\
  vq_rope_in<OUT_T, D, TRAD>((X), (n), s_rope)
#define EXACT_ROW_ROPE(K, V, row) \\
  VQ_UNROLL \\
  for (int e = 0; e < DE; ++e) { \\
    kx[b][e] = VQ_ROPE_IN(K + (row), e * 32 + lane); \\
    vx[b][e] = static_cast<float>(V[(row) + e * 32 + lane]); \\
  }
"""


# The RoPE table filled (`_ROPE_IN_FILL`) and its barrier, in each branch before its first read
# of the table: a coded threadgroup's once its setup's global reads are issued, before q~ is
# formed; the exact threadgroup's first thing.
_ROPE_IN_SYNC = {
    _PARTIAL_QTILDE: (_ROPE_IN_FILL + "    VQ_BARRIER();  // the RoPE table\n" + _PARTIAL_QTILDE),
    "  } else {\n    // ---- the exact tokens": (
        "  } else {\n"
        + _ROPE_IN_FILL
        + "    VQ_BARRIER();  // the RoPE table\n    // ---- the exact tokens"
    ),
}


def one_launch_kernel_source(
    lay: Layout,
    out_dtype: mx.Dtype,
    window_dtype: mx.Dtype,
    r: int | None = None,
    rope_in: bool = False,
) -> KernelSource:
    """Decode attention in one launch (CUDA only; `_ONE_LAUNCH_TAIL`): the partial kernel,
    whose last threadgroup per KV head merges the splits into `out` (as the combine does) and
    whose exact threadgroup encodes the token leaving the window in place (as the in-place
    combine with the encoder does, when iparams[EP] says there is one). The window ring is
    `window_dtype`. Needs head_dim <= TILE. A decode step's layer is then one custom-kernel call
    instead of two. With `rope_in` (a layout with the key mean: a cache with the model's RoPE)
    the step's query and new key arrive unrotated and the kernel rotates them to position
    iparams[ROPE_POS_PARAM] (`_ROPE_IN_READS`): the model's two RoPE launches per layer go."""
    r = TOKENS_PER_THREAD if r is None else r
    mma = mma_takes(lay, r)
    if rope_in and not lay.center:
        raise ValueError("rope_in needs a layout with the key mean (a cache with the RoPE)")
    key = ("one_launch", lay, str(out_dtype), str(window_dtype), r, COMBINE_CHUNK, mma)
    key += (COMBINE_FLOAT4, COMBINE_LOADS, COMBINE_LOADS4, KEY_ROWS_AHEAD)
    key += (MMA_MIN_THREADGROUPS, rope_in, MMA_VALUE_BOOK_BYTES)
    key += (_card_shared_memory() if mma else None,)
    if key not in _SOURCES:
        partial = attention_kernel_sources(lay, out_dtype, r)[0]
        if mma:  # the same kernel with its coded tokens on the tensor cores
            constants = {**partial.constants, **_mma_constants(lay, r), "BIG4": _mma_big4(lay, r)}
            constants["DYN4"] = (mma_bytes(lay, r) - 4) // 16
            body = _EXACT_ROW + _MMA_BODY.replace(_MMA_SHARED, _dynamic_arrays(_MMA_SHARED))
            helpers = partial.helpers + _MMA_HELPERS
            partial = replace(partial, body=body, constants=constants, helpers=helpers)
            partial = replace(partial, min_threadgroups=MMA_MIN_THREADGROUPS)
        combine = _combine_statements("h * G", lay.group, TILE, lay.head_dim, "s_tail")
        encode = _encode_statements("0", "(int)vq_gy", in_place=True)
        encode = re.sub(r"\bk_in\b", "win_k", re.sub(r"\bv_in\b", "win_v", encode))
        tail = _ONE_LAUNCH_TAIL.replace("COMBINE", combine).replace("ENCODE", encode)
        splits = "  const int n_splits = T > 0 ? (T + tps - 1) / tps : 0;\n"
        assert partial.body.count(splits) == 1
        body = partial.body.replace(splits, splits + _ONE_LAUNCH_PARTS)
        helpers = partial.helpers
        if rope_in:
            body += tail
            for read, rotated in (*_ROPE_IN_SYNC.items(), *_ROPE_IN_READS.items()):
                assert body.count(read) == 1, read
                body = body.replace(read, rotated)
            body, tail = _ROPE_IN_MACROS + _ROPE_IN_TABLE + body, ""
            helpers += _ROPE_IN_HELPER
        offsets = {f"OFF_{n.upper()}": off for n, (off, _, _) in pack_segments(lay, r).items()}
        _SOURCES[key] = KernelSource(
            name="vq_vecinfer_attn_one_launch",
            inputs=ONE_LAUNCH_INPUTS,
            outputs=("parts", "out"),
            body=_ONE_LAUNCH_PACK + body + tail,
            constants={
                **partial.constants,
                **offsets,
                "BIG4": one_launch_big4(lay, partial.constants["BIG4"]),
                "OUT_T": out_dtype,
                "WIN_T": window_dtype,
                "EP": ENCODE_PARAM,
                "ROPE_POS": ROPE_POS_PARAM,
                "HALF_T": mx.float16,
            },
            threads=TILE,
            helpers=helpers,
            backends=("cuda",),
            min_threadgroups=partial.min_threadgroups,
            dynamic_shared=16 * partial.constants["DYN4"] if mma else 0,
        )
    return _SOURCES[key]


def combine_encode_kernel_source(
    lay: Layout, out_dtype: mx.Dtype, window_dtype: mx.Dtype | None = None
) -> KernelSource:
    """The combine and the encoder in one launch (a decode step whose window is full: the
    token leaving it is encoded while the splits are merged, one launch fewer per layer).
    Threadgroups 0 .. HQ-1 combine as `attention_kernel_sources`' combine does; threadgroup
    HQ + t·HKV + h encodes token t of KV head h from iparams[EP..EP+3] as the encoder does.

    With `window_dtype` (the dtype of the cache's window ring) the launch also updates the
    cache in place, so a decode step needs no other operation: it writes the codes into the
    cache's code buffers (`IN_PLACE_INPUTS`; row iparams[0], the coded count, of iparams[6]
    rows) and the step's new token over the ring slot it encodes. Without, it returns the
    codes as key_out / value_out [1, H, 1, bytes] for the caller to append."""
    key = ("combine_encode", lay, str(out_dtype), str(window_dtype))
    if key not in _SOURCES:
        in_place = window_dtype is not None
        constants = {**_common_constants(lay), "OUT_T": out_dtype, "EP": ENCODE_PARAM}
        if in_place:
            constants["WIN_T"] = window_dtype
        _SOURCES[key] = KernelSource(
            name="vq_vecinfer_attn_combine_encode" + ("_in_place" if in_place else ""),
            inputs=COMBINE_INPUTS
            + ENCODE_INPUTS[:2]
            + ENCODE_INPUTS[3:7]
            + ENCODE_INPUTS[9:]
            + (IN_PLACE_INPUTS if in_place else ()),
            outputs=("out",) if in_place else ("out", "key_out", "value_out"),
            body=_ENCODE_SHARED
            + "  if ((int)vq_gx < HQ) {\n"
            + _COMBINE_ONE_HEAD
            + "  } else {\n"
            + _encode_statements("((int)vq_gx - HQ) / HKV", "((int)vq_gx - HQ) % HKV", in_place)
            + "  }\n",
            constants=constants,
            threads=lay.head_dim,
        )
    return _SOURCES[key]


# What the in-place combine also takes: the code buffers it appends to and the new token it
# writes into the ring (the ring itself is its k_in / v_in).
IN_PLACE_INPUTS = ("key_codes", "value_codes", "new_k", "new_v")


def _encode_statements(token: str, head: str, in_place: bool) -> str:
    """The encoder's statements for the threadgroup of (token, KV head) given by the two
    expressions. In place (a decode step's one token), each thread writes the new token's
    element of the ring row it has just read, and the codes go to row iparams[0] + token of
    the cache's code buffers; otherwise the codes go to key_out / value_out [1, H, n, bytes]."""
    if in_place:
        ring = (
            "const_cast<VQ_GLOBAL WIN_T*>({src})[row + d] = "
            "static_cast<WIN_T>(static_cast<float>({new}[h * D + d]));"
        )
        names = {
            "RING_K_WRITE": ring.format(src="k_in", new="new_k"),
            "RING_V_WRITE": ring.format(src="v_in", new="new_v"),
            "KEY_DST": "const_cast<VQ_GLOBAL uint8_t*>(key_codes)",
            "VALUE_DST": "const_cast<VQ_GLOBAL uint8_t*>(value_codes)",
            "CODE_ROW": "(h * iparams[6] + iparams[0] + i_tok)",
        }
    else:
        names = {"RING_K_WRITE": "", "RING_V_WRITE": "", "KEY_DST": "key_out"}
        names.update(VALUE_DST="value_out", CODE_ROW="((h * n) + i_tok)")
    body = _ENCODE_MAIN.replace("ENC_TOKEN", token).replace("ENC_HEAD", head)
    for name, text in names.items():
        body = body.replace(name, text)
    return body


ENCODE_INPUTS = (
    "k_in",
    "v_in",
    "iparams",
    "fparams",
    "smooth",
    "key_mean",
    "inv_freq",
    "value_smooth",
    "value_mean",
    "key_book",
    "value_book",
)


def encode_kernel_source(lay: Layout) -> KernelSource:
    key = ("encode", lay)
    if key not in _SOURCES:
        _SOURCES[key] = _encode_kernel_source(lay)
    return _SOURCES[key]


def _encode_kernel_source(lay: Layout) -> KernelSource:
    return KernelSource(
        name="vq_vecinfer_encode",
        inputs=ENCODE_INPUTS,
        outputs=("key_out", "value_out"),
        body=_ENCODE_SHARED + _encode_statements("(int)vq_gx", "(int)vq_gy", in_place=False),
        constants={**_common_constants(lay), "EP": 0},
        threads=lay.head_dim,
    )


# ---------------------------------------------------------------------------------------------
# Host side: the cache's arrays as kernel inputs

# Threadgroups the split kernel aims for, so that one query's attention fills the GPU: None is
# one wave of the one-launch kernel on CUDA, GROUPS_PER_MULTIPROCESSOR on each multiprocessor
# (528 on an H100 or H200, the count timed there), 528 on Metal (not timed); an int overrides
# it. Splits never go below MIN_SPLIT tokens.
TARGET_GROUPS: int | None = None
GROUPS_PER_MULTIPROCESSOR = 4  # the one-launch kernel's launch bounds (MMA_MIN_THREADGROUPS)
MIN_SPLIT = 512
PARAMS = 16  # int32 slots of iparams (>= 8 elements, see veloxquant.kernels.launch)
# Where the encoder's four parameters start in a decode step's iparams (slots 0-7 are the
# attention's), so that one array serves the partial and the combine with the encoder.
ENCODE_PARAM = 8
# Where the partial kernel finds how many RoPE pairs it sums term by term (`exact_pairs`).
PHASE_PARAM = 12
# Where the one-launch kernel that rotates the step's own query and key (`rope_in`) finds their
# position.
ROPE_POS_PARAM = 13
# Whether a decode step whose query and key reach the cache unrotated (the model's rope tapped,
# `veloxquant.rope.RopeTap`) rotates them inside the one-launch kernel; benchmarks compare the
# two.
ROPE_IN_KERNEL = True
# Whether a decode step's combine launch writes the leaving token's codes and the new token
# into the cache's buffers itself (the default: the step is its two launches and nothing else)
# or returns the codes for the cache to append with slice updates, the new token going into
# the ring by slice updates too (four more operations per layer); benchmarks compare the two.
WRITE_IN_PLACE = True
# Whether a decode step's attention is one launch where it can be (`takes_one_launch`): the
# partial kernel's last threadgroup per KV head merges the splits and its exact threadgroup
# encodes, instead of a second launch doing both; benchmarks compare the two.
ONE_LAUNCH = True


def layout_of(cache: Any, n_q_heads: int) -> Layout:
    """The cache's Layout for `n_q_heads` query heads, memoised on the cache (a cache's shape
    and transforms are fixed once built; `VecInferCache.state` clears the memo on load)."""
    memo = cache.__dict__.setdefault("_kernel_memo", {})
    if n_q_heads not in memo:
        memo[n_q_heads] = _layout(cache, n_q_heads)
    return memo[n_q_heads]


def layer_constants(cache: Any, r: int) -> dict[str, Any]:
    """The launch inputs of a cache that no decode step changes (RoPE tables, the key mean and
    the value transforms, or the placeholders of absent ones), memoised with its Layout: a
    decode step rebuilds only what moves, the codes, window and counts."""
    memo = cache.__dict__.setdefault("_kernel_memo", {})
    key = ("constants", r)
    if key not in memo:
        inv_freq, table, rscale = _rope_arrays(cache.rope, int(cache.smooth.shape[1]), r)
        fill = cache.smooth  # placeholder the kernels never read (the layout says so)
        memo[key] = {
            "inv_freq": inv_freq,
            "table": table,
            "rscale": rscale,
            "log2_base": rope_log2_base(cache.rope),
            "exact_pairs": exact_pairs(cache.rope, int(cache.smooth.shape[1]), r),
            "key_mean": fill if cache.key_mean is None else cache.key_mean,
            "value_smooth": fill if cache.value_smooth is None else cache.value_smooth,
            "value_mean": fill if cache.value_mean is None else cache.value_mean,
        }
    return memo[key]


def kernels_take(cache: Any, n_q_heads: int) -> bool:
    """Whether the GPU kernels run for this cache here: a GPU backend and a supported layout."""
    which = vk.backend()
    if which is None:
        return False
    memo = cache.__dict__.setdefault("_kernel_memo", {})
    key = ("supported", n_q_heads, which)
    if key not in memo:
        memo[key] = layout_of(cache, n_q_heads).unsupported(which) is None
    return memo[key]


def clear_memos(caches: list = ()) -> None:
    """Forget every built kernel source and constant array, and the memos of `caches`: for
    benchmarks that swap a kernel body or TILE and rebuild."""
    _SOURCES.clear()
    _CONSTS.clear()
    _MMA_TAKES.clear()
    _one_launch_fits.cache_clear()
    for c in caches:
        c.__dict__.pop("_kernel_memo", None)


def _layout(cache: Any, n_q_heads: int) -> Layout:
    h, d = cache.smooth.shape
    return Layout(
        head_dim=int(d),
        n_kv_heads=int(h),
        group=int(n_q_heads) // int(h),
        key_bits=cache.key_bits,
        key_sub_dim=cache.key_sub_dim,
        value_bits=cache.value_bits,
        value_sub_dim=cache.value_sub_dim,
        key_books=int(cache.key_codebook.shape[0]),
        value_books=int(cache.value_codebook.shape[0]),
        hadamard=cache.hadamard,
        center=cache.key_mean is not None,
        value_mean=cache.value_mean is not None,
        value_smooth=cache.value_smooth is not None,
        rope_traditional=bool(cache.rope.traditional) if cache.rope is not None else False,
        poly_pairs=poly_pairs(cache.rope, int(d)) if cache.key_mean is not None else 0,
    )


def exact_pairs(rope: RopeSpec | None, head_dim: int, r: int) -> int:
    """How many RoPE pairs (from the first) the partial kernel sums term by term: all but the
    trailing ones whose angle turns by at most PHASE_TAYLOR_ANGLE over a tile of TILE·r
    tokens, which it sums as one polynomial."""
    return _exact_pairs_over(rope, head_dim, TILE * r, PHASE_TAYLOR_ANGLE)


def _exact_pairs_over(rope: RopeSpec | None, head_dim: int, tokens: int, angle: float) -> int:
    pairs = head_dim // 2
    if rope is None:
        return pairs
    turn = float(rope.scale) * rope_inv_freq(rope, head_dim).astype(np.float64) * (tokens - 1)
    n = pairs
    while n > 0 and turn[n - 1] <= angle:
        n -= 1
    return n


def poly_pairs(rope: RopeSpec | None, head_dim: int) -> int:
    """How many trailing RoPE pairs the tensor-core path sums as one polynomial per tile: those
    that turn by at most POLY_ANGLE over POLY_TOKENS tokens, when that takes fewer 16-column
    chunks of its phase operand (`_phase_plan`) than their cos / -sin columns would (else 0)."""
    pairs = head_dim // 2
    exact = _exact_pairs_over(rope, head_dim, POLY_TOKENS, POLY_ANGLE)
    if -(-max(0, exact - 4) // 8) + 1 >= -(-pairs // 8):
        return 0
    return pairs - exact


def rope_log2_base(rope: RopeSpec | None) -> float:
    """log2 of the RoPE's base in float32, as mx.fast.rope hands it to its GPU kernel (which
    forms each pair's frequency from it with the GPU's exp2f), or 0.0 where the model gives its
    frequencies (`freqs`) or has no RoPE: the one-launch kernel's RoPE table then reads
    rope_inv_freq's."""
    if rope is None or rope.freqs is not None:
        return 0.0
    return float(np.float32(math.log2(np.float32(rope.base))))


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """θ_j [D/2] float32 as MLX's rope kernels form them: 1 / freqs, or
    exp2(-(j / (D/2)) * log2(base)) in float32 (numpy's exp2 here, where MLX's GPU kernel takes
    the GPU's exp2f, which can be an ulp or two away; the one-launch kernel's RoPE table forms
    those on the GPU as it does, `_ROPE_IN_TABLE`)."""
    half = head_dim // 2
    if rope.freqs is not None:
        return (1.0 / np.asarray(rope.freqs, np.float64)).astype(np.float32)
    d = np.arange(half, dtype=np.float32) / np.float32(half)
    return np.exp2(-d * np.float32(np.log2(np.float32(rope.base)))).astype(np.float32)


_CONSTS: dict[Any, Any] = {}


def _rope_arrays(
    rope: RopeSpec | None, head_dim: int, r: int = 1
) -> tuple[mx.array, mx.array, float]:
    """(inv_freq [P] f32; phase table [P, TILE + 1, 2] f32: entry (j, t < TILE) is cos/sin
    of scale·(t·r)·θ_j, the offset of thread t's first token in a tile, entry (j, TILE) one
    token's step, so that a SIMD group's reads of one pair j are contiguous; the RoPE
    position scale), built once per RoPE and shared by every layer."""
    if rope is None:  # placeholders the kernel never reads; fresh ones would cost a fill each
        return _dummy((8,), mx.float32), _dummy((8,), mx.float32), 1.0
    key = ("rope", head_dim, r, tuple(sorted(rope.meta().items())), id(rope.freqs))
    if key not in _CONSTS:
        inv = rope_inv_freq(rope, head_dim)
        offs = np.concatenate([np.arange(TILE, dtype=np.float64) * r, [1.0]])
        ang = float(rope.scale) * offs[None, :] * inv.astype(np.float64)[:, None]
        table = np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)
        _CONSTS[key] = (mx.array(inv), mx.array(table), float(rope.scale), rope.freqs)
    inv, table, scale, _ = _CONSTS[key]
    return inv, table, scale


def block_token(k: np.ndarray | int) -> np.ndarray | int:
    """The token of a 16-token block that the tensor-core tile loop's mma k index (A's row of
    the scores, P's k row) stands for: 4·(k % 2 + 2·(k // 8)) + (k % 8) // 2 (`_MMA_TILES`)."""
    return 4 * (k % 2 + 2 * (k // 8)) + (k % 8) // 2


def phase_fragments(rope: RopeSpec, lay: Layout, r: int) -> np.ndarray:
    """The tensor-core path's phase operand (`_MMA_TILES`), f16 [TILE·r / 16, PC, 32, 8]: for
    block db of a tile, chunk c and lane L (quad = L / 4, l4 = L % 4), mma's A fragment
    a0..a3 = rows (quad, slot 8c + 2·l4), (quad + 8, that slot), (quad, slot + 1), (quad + 8,
    slot + 1). A slot of pair j (`phase_slot_pairs`) holds (cos, -sin) of the row's token
    offset 16·db + block_token(row) times scale·θ_j; the polynomial chunk's even slot 2·l4
    holds the powers (x^2l4, x^2l4+1) of x = offset / (TILE·r); other slots are zero. Built once
    per RoPE, layout and r, shared by every layer's pack."""
    key = ("frags", lay, r, tuple(sorted(rope.meta().items())), id(rope.freqs))
    if key not in _CONSTS:
        _, full, chunks, _ = _phase_plan(lay)
        pair = phase_slot_pairs(lay)[: 8 * chunks]
        phi = float(rope.scale) * rope_inv_freq(rope, lay.head_dim).astype(np.float64)
        db, c, lane = np.meshgrid(
            np.arange(TILE * r // 16), np.arange(chunks), np.arange(32), indexing="ij"
        )
        out = np.zeros((*db.shape, 8))
        for slot, (row8, hf) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
            offset = 16 * db + block_token(lane // 4 + 8 * row8)
            j = pair[8 * c + 2 * (lane % 4) + hf]
            angle = offset * phi[np.maximum(j, 0)]
            out[..., 2 * slot] = np.where(j >= 0, np.cos(angle), 0.0)
            out[..., 2 * slot + 1] = np.where(j >= 0, -np.sin(angle), 0.0)
            if lay.poly_pairs and hf == 0:
                x, k = offset / (TILE * r), 2 * (lane % 4)
                out[..., 2 * slot] = np.where(c == full, x**k, out[..., 2 * slot])
                out[..., 2 * slot + 1] = np.where(c == full, x ** (k + 1), out[..., 2 * slot + 1])
        _CONSTS[key] = (out.astype(np.float16), rope.freqs)
    return _CONSTS[key][0]


def poly_fragments(rope: RopeSpec, lay: Layout, r: int) -> np.ndarray:
    """The table by which the tensor-core path sums its phase polynomial's coefficients from the
    slow pairs' W, as mma B fragments, f16 [NPC, 32, 4]: c_k = Re(sum_j W_j (i phi_j)^k / k!)
    (phi_j the pair's angle over a tile of TILE·r tokens) is column k of the product of the
    W's A fragments (row g: head g's (re, im) of the chunk's slot 2·l4 + hf at columns
    8·hf + 2·l4 + {0, 1}) with this table, k < POLY_ORDER + 1 = 8, mma's N. Lane (k = quad,
    l4) holds rows 2·l4 + {0, 1} and 8 + 2·l4 + {0, 1}: the factors of (re, im) of slots 2·l4
    and 2·l4 + 1."""
    key = ("poly", lay, r, tuple(sorted(rope.meta().items())), id(rope.freqs))
    if key not in _CONSTS:
        exact, _, chunks, poly_chunks = _phase_plan(lay)
        assert POLY_ORDER + 1 == 8 and exact + lay.poly_pairs == lay.head_dim // 2
        phi = float(rope.scale) * rope_inv_freq(rope, lay.head_dim).astype(np.float64) * TILE * r
        pair = phase_slot_pairs(lay)[8 * chunks :].reshape(poly_chunks, 4, 2)  # [cc][l4][hf]
        k = np.arange(32)[None, :, None] // 4  # [1, lane, 1]
        j = pair[:, np.arange(32) % 4, :]  # [cc, lane, hf]
        scaled = np.where(
            j >= 0,
            phi[np.maximum(j, 0)] ** k / np.array([math.factorial(i) for i in range(8)])[k],
            0.0,
        )
        # Re(W i^k) = re, -im, -re, im for k = 0, 1, 2, 3 (mod 4)
        re = np.where(k % 2 == 0, np.where(k % 4 == 0, scaled, -scaled), 0.0)
        im = np.where(k % 2 == 1, np.where(k % 4 == 1, -scaled, scaled), 0.0)
        out = np.stack([re[..., 0], im[..., 0], re[..., 1], im[..., 1]], axis=-1)
        _CONSTS[key] = (out.astype(np.float16), rope.freqs)
    return _CONSTS[key][0]


def _float_params(*values: float) -> mx.array:
    """The float parameters of a launch, [8] f32, one array per distinct value set: they are
    constant per model, and every fresh array costs each decode step a host-to-device copy."""
    key = ("fparams", values)
    if key not in _CONSTS:
        _CONSTS[key] = mx.array(list(values) + [0.0] * (8 - len(values)), mx.float32)
    return _CONSTS[key]


def _int_params(values: list[int]) -> mx.array:
    """[PARAMS] int32 launch parameters (`veloxquant.kernels.launch_params`): every layer of one
    decode step attends with the same counts, so one array serves them all."""
    return launch_params(tuple(values) + (0,) * (PARAMS - len(values)))


def _dummy(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    key = ("dummy", shape, str(dtype))
    if key not in _CONSTS:
        _CONSTS[key] = mx.zeros(shape, dtype)
    return _CONSTS[key]


def target_groups(threadgroup_bytes: int = 0) -> int:
    """TARGET_GROUPS, or where it is None, GROUPS_PER_MULTIPROCESSOR per CUDA multiprocessor, or
    as many threadgroups of `threadgroup_bytes` as one holds at once where the card's shared
    memory holds fewer (an A100's 164 KB hold 3 of the 8B shape's 43 KB; 528 on Metal). Read at
    call time, so that a benchmark can sweep it."""
    return split_target(TARGET_GROUPS, GROUPS_PER_MULTIPROCESSOR, 528, threadgroup_bytes)


def split_tokens(n_coded: int, n_kv_heads: int, r: int, target: int | None = None) -> int:
    """Coded tokens per split (a multiple of the TILE·r tokens of a tile): enough splits for
    about `target` threadgroups (default `target_groups()`)."""
    target = target_groups() if target is None else target
    step = TILE * r
    if n_coded == 0:
        return step
    splits = max(1, min(-(-n_coded // max(MIN_SPLIT, step)), -(-target // n_kv_heads)))
    per = -(-n_coded // splits)
    return -(-per // step) * step


def attention_inputs(
    cache: Any,
    queries: mx.array,
    scale: float,
    pending: dict,
    r: int | None = None,
    one_launch: bool | None = None,
) -> dict:
    """Everything the decode-attention launches take, for a one-token query [1, H_q, 1, D]:
    {'layout', 'sources': (partial, combine) or (one-launch kernel,), 'partial': [inputs of
    the first launch, PARTIAL_INPUTS or ONE_LAUNCH_INPUTS], 'combine_extra': [iparams,
    value_smooth, value_mean, and the encoder's inputs when pending has a token to encode;
    empty for one launch], 'groups', 'n_splits', 'r', 'encode': whether the launch that
    merges also encodes, 'in_place', 'rope_in': whether the launch rotates the unrotated query
    and key of pending["rotate"] (one launch in place, a layout with the key mean)}. `one_launch`
    (default: `takes_one_launch`) picks one launch where the step allows it (the encode, if
    any, in place); benchmarks of the partial kernel alone pass False."""
    _, n_q, _, d = queries.shape
    r = TOKENS_PER_THREAD if r is None else r
    encode = pending.get("encode")  # (ring slot, position) of the token leaving the window
    kbuf, vbuf = cache._kbuf, cache._vbuf
    sk, sv = cache.sink_keys, cache.sink_values
    win = pending["win"]
    nk, nv = pending["new"]
    last = cache._last_launch
    step = _step_kind(cache, queries, scale, r, one_launch, encode, kbuf, sk, win, nk, nv, last)
    lay, h, one, in_place = step["layout"], step["n_kv_heads"], step["one"], step["in_place"]
    rotate = pending.get("rotate")
    rope_in = step["may_rotate"] and _rotates(queries, pending)
    n_coded = int(pending["n_coded"])
    # the splits fill one wave of the launch's threadgroups: as many as the card holds at once
    tps = split_tokens(n_coded, h, r, target_groups(step["group_bytes"][rope_in]))
    n_splits = -(-n_coded // tps) if n_coded else 0
    if kbuf is None:  # nothing coded, and nothing to write
        kbuf, vbuf = step["no_codes"]
    if sk is None:
        sk = sv = step["no_rows"]
        n_sink = 0
    else:
        n_sink = int(sk.shape[2])
    if win is None:
        wk = wv = step["no_rows"]
        n_win = 0
    else:
        wk, wv = win
        n_win = int(wk.shape[2])
    if rope_in:
        queries, nk = rotate[0], rotate[1]
    n_rows, ring = int(kbuf.shape[2]), int(wk.shape[2])
    iparams = [n_coded, cache.sinks, tps, n_sink, n_win, int(nk.shape[2]), n_rows, ring]
    iparams += [1, encode[0], ring, encode[1]] if encode is not None else [0, 0, 0, 0]
    iparams.append(step["exact_pairs"])  # at PHASE_PARAM
    iparams.append(int(rotate[2]) if rope_in else 0)  # at ROPE_POS_PARAM
    iparams = _int_params(iparams)
    if last is None:
        last = step["no_launch"]
    if one and n_splits and n_rows % 16 and step["mma"]:
        raise ValueError(
            f"vecinfer: the code buffers hold {n_rows} tokens, not a multiple of 16, "
            "and the tensor-core kernel reads whole 16-token blocks; grow them with "
            "VecInferCache._reserve_codes (as fused_attention does) or set kernels.MMA = False"
        )
    const = step["constants"]
    if one:  # ONE_LAUNCH_INPUTS
        partial = [queries, iparams, kbuf, vbuf, step["pack"], sk, sv, wk, wv, nk, nv, last]
        extra = []
    else:  # PARTIAL_INPUTS
        fparams = _float_params(scale * LOG2E, const["rscale"])
        key_mean, inv_freq = const["key_mean"], const["inv_freq"]
        partial = [queries, iparams, fparams, kbuf, vbuf, cache.key_codebook]
        partial += [cache.value_codebook, cache.smooth, key_mean, inv_freq, const["table"]]
        partial += [sk, sv, wk, wv, nk, nv, last]
        extra = [iparams, const["value_smooth"], const["value_mean"]]
        if encode is not None:  # the combine with the encoder: its inputs after the combine's
            extra += [wk, wv, fparams, cache.smooth, key_mean, inv_freq]
            extra += [cache.key_codebook, cache.value_codebook]
        if in_place:
            extra += [kbuf, vbuf, nk, nv]
    plan = step["plans"][rope_in]
    if plan is None:
        if one:
            sources = (one_launch_kernel_source(lay, queries.dtype, wk.dtype, r, rope_in),)
        else:
            sources = attention_kernel_sources(lay, queries.dtype, r)
            if encode is not None:
                window = wk.dtype if in_place else None
                combine = combine_encode_kernel_source(lay, queries.dtype, window)
                sources = (sources[0], combine)
        plan = step["plans"][rope_in] = {"sources": sources, "launchers": None}
    return {
        "layout": lay,
        "sources": plan["sources"],
        "plan": plan,
        "partial": partial,
        "combine_extra": extra,
        "groups": (n_splits + 1, h, 1),
        "n_splits": n_splits,
        "r": r,
        "encode": encode is not None,
        "in_place": in_place,
        "rope_in": rope_in,
    }


def _step_kind(
    cache: Any,
    queries: mx.array,
    scale: float,
    r: int,
    one_launch: bool | None,
    encode: tuple | None,
    kbuf: mx.array | None,
    sk: mx.array | None,
    win: tuple | None,
    nk: mx.array,
    nv: mx.array,
    last: mx.array | None,
) -> dict:
    """What attention_inputs takes that only the kind of decode step decides (the layout, one
    launch or two, in place, the constants, the layer pack, the kernels), memoised on the cache
    under everything it depends on: the step's shapes and dtypes, which inputs are
    placeholders, and the module switches that tests and benchmarks flip between steps. A
    decode step then looks up one key per layer instead of building each part's own."""
    n_q = queries.shape[1]
    key = (
        "step", n_q, r, one_launch, encode is None, scale, queries.dtype, kbuf is None,
        None if sk is None else (sk.dtype, cache.sink_values.dtype),
        None if win is None else (win[0].dtype, win[1].dtype),
        nk.dtype, nv.dtype, None if last is None else last.dtype,
        MMA, TILE, COMBINE_CHUNK, COMBINE_FLOAT4, COMBINE_LOADS, COMBINE_LOADS4, KEY_ROWS_AHEAD,
        WRITE_IN_PLACE, ONE_LAUNCH, ROPE_IN_KERNEL, THREADGROUP_LIMIT["cuda"], MMA_VALUE_BOOK_BYTES,
        MMA_MIN_THREADGROUPS, _card_shared_memory() if ONE_LAUNCH and MMA else None,
    )  # fmt: skip
    memo = cache.__dict__.setdefault("_kernel_memo", {})
    step = memo.get(key)
    if step is not None:
        return step
    lay = layout_of(cache, n_q)
    h, d = lay.n_kv_heads, queries.shape[3]
    one, in_place = _launch_kind(lay, r, encode is not None, one_launch)
    const = layer_constants(cache, r)
    # by whether the launch rotates (rope_in): its RoPE table is threadgroup memory too
    group_bytes = [threadgroup_bytes(lay, r, one), threadgroup_bytes(lay, r, one, True)]
    step = memo[key] = {
        "layout": lay,
        "n_kv_heads": h,
        "one": one,
        "in_place": in_place,
        "may_rotate": bool(
            ROPE_IN_KERNEL
            and one
            and in_place
            and lay.center
            and (mma_takes(lay, r) or group_bytes[True] <= THREADGROUP_LIMIT["cuda"])
        ),
        "group_bytes": group_bytes,
        "constants": const,
        "exact_pairs": const["exact_pairs"],
        "mma": mma_takes(lay, r),
        "pack": _layer_pack(cache, lay, const, r, scale) if one else None,
        "no_codes": (
            _dummy((1, h, 1, lay.key_bytes), mx.uint8),
            _dummy((1, h, 1, lay.value_bytes), mx.uint8),
        ),
        "no_rows": _dummy((1, h, 1, d), mx.float16),
        "no_launch": _dummy((8,), queries.dtype),
        "plans": {False: None, True: None},  # by whether the launch rotates (rope_in)
    }
    return step


def _launch_kind(lay: Layout, r: int, encodes: bool, one_launch: bool | None) -> tuple[bool, bool]:
    """(one launch, in place) for a decode step that encodes a token leaving the window or not
    (_step_kind, which memoises it)."""
    in_place = encodes and WRITE_IN_PLACE
    if one_launch is None:
        one_launch = takes_one_launch(lay, r)
    if one_launch and lay.head_dim > TILE:
        raise ValueError(f"one launch needs head_dim <= {TILE}, not {lay.head_dim}")
    return one_launch and (not encodes or in_place), in_place


def _rotates(queries: mx.array, pending: dict) -> bool:
    # the step's own query and key unrotated (`pending["rotate"]`: query, key, position, from
    # the model's tapped rope), of the query's dtype and shapes: a launch that may rotate
    # (_step_kind's "may_rotate") rotates them, and writes the key into the ring
    rotate = pending.get("rotate")
    return bool(
        rotate is not None
        and rotate[0].dtype == rotate[1].dtype == queries.dtype
        and rotate[0].shape == queries.shape
        and rotate[1].shape == pending["new"][0].shape
    )


def takes_one_launch(lay: Layout, r: int | None = None) -> bool:
    """Whether a decode step's attention (and in-place encode) is one launch here: ONE_LAUNCH
    on, MLX on CUDA (the threadgroups hand over through a device-scope fence, which Metal lacks),
    head_dim <= TILE (the merge and the encoder take D threads of the TILE) and its threadgroup
    arrays, with r coded tokens per thread (default TOKENS_PER_THREAD), within CUDA's limit
    (on the tensor cores, those with the compact value book: its arrays are dynamic shared
    memory, the conflict-free book only where it fits the card) (else the step is the two
    launches)."""
    from veloxquant.kernels import backend

    r = TOKENS_PER_THREAD if r is None else r
    return ONE_LAUNCH and backend() == "cuda" and _one_launch_fits(lay, r, MMA)


@functools.lru_cache(maxsize=64)
def _one_launch_fits(lay: Layout, r: int, mma: bool) -> bool:  # mma: MMA, a key of the cache
    # the tensor-core kernel's arrays are dynamic shared memory, sized to fit (`mma_takes`)
    fits = mma_takes(lay, r) or threadgroup_bytes(lay, r, True) <= THREADGROUP_LIMIT["cuda"]
    return lay.head_dim <= TILE and fits


def decode_attention(
    cache: Any, queries: mx.array, scale: float, pending: dict
) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
    """Fused decode attention on the GPU: [1, H_q, 1, D] queries → ([1, H_q, 1, D] output,
    the leaving token's (key codes, value codes) [1, H, 1, bytes] when `pending` has one to
    encode and WRITE_IN_PLACE is off, else None). In place, the launch writes those codes at
    row `pending["n_coded"]` of the cache's code buffers (which must have room) and the
    call's new token over the leaving token's ring slot."""
    return launch_attention(attention_inputs(cache, queries, scale, pending), queries)


def part_shapes(a: dict, n_q: int, head_dim: int) -> list[tuple[int, ...]]:
    """Shapes of the partial kernel's outputs for inputs from `attention_inputs`: every split's
    (and the exact threadgroup's) running max and sum per query head (8 spare elements, see
    `veloxquant.kernels.launch`), and its output rows."""
    ns = a["n_splits"] + 1
    return [(ns * n_q + 8,), (ns * n_q + 8,), (ns * n_q * head_dim,)]


def one_launch_shapes(a: dict, n_q: int, head_dim: int) -> list[tuple[int, ...]]:
    """Shapes of the one-launch kernel's outputs: the splits' parts (`_ONE_LAUNCH_PARTS`), then
    the attention output."""
    ns = a["n_splits"] + 1
    stride = -(-(ns * n_q + 8) // 4) * 4
    return [(2 * stride + ns * n_q * head_dim,), (1, n_q, 1, head_dim)]


def launch_partial(a: dict, queries: mx.array) -> list[mx.array]:
    """The first decode-attention launch on inputs from `attention_inputs` (of two launches):
    every split's (and the exact threadgroup's) running max, sum and output per query head,
    float32."""
    if len(a["sources"]) != 2:
        raise ValueError("launch_partial: inputs of the one-launch kernel (one_launch=False)")
    shapes = part_shapes(a, queries.shape[1], queries.shape[3])
    return _launchers(a)[0](a["partial"], a["groups"], shapes, [mx.float32] * 3)


def _launchers(a: dict) -> list:
    """The launchers of a's kernels (`veloxquant.kernels.launcher`), built and their inputs
    checked at the first step of a kind, then kept with the cache's plan for it."""
    plan = a["plan"]
    if plan["launchers"] is None:
        inputs = [a["partial"]]
        if len(a["sources"]) == 2:  # the combine takes the partial's three float32 outputs
            parts = [_dummy((8,), mx.float32)] * 3
            inputs.append(parts + a["combine_extra"])
        launchers = []
        for src, ins in zip(a["sources"], inputs, strict=True):
            vk.check_inputs(src, ins)
            launchers.append(vk.launcher(src, tuple([x.dtype for x in ins])))
        plan["launchers"] = launchers
    return plan["launchers"]


def launch_attention(
    a: dict, queries: mx.array
) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
    """The decode-attention launches on inputs from `attention_inputs`: one (CUDA), or the
    partial and the combine (which also encodes the token leaving the window, when there is
    one)."""
    lay = a["layout"]
    n_q, d = queries.shape[1], queries.shape[3]
    if len(a["sources"]) == 1:  # one launch: partial, merge and encode
        shapes = one_launch_shapes(a, n_q, d)
        _, out = _launchers(a)[0](a["partial"], a["groups"], shapes, [mx.float32, queries.dtype])
        return out, None
    combine = _launchers(a)[1]  # the combine with the encoder if a["encode"]
    parts = [*launch_partial(a, queries), *a["combine_extra"]]
    if not a["encode"]:
        (out,) = combine(parts, (n_q, 1, 1), [(1, n_q, 1, d)], [queries.dtype])
        return out, None
    h = lay.n_kv_heads
    if a["in_place"]:
        (out,) = combine(parts, (n_q + h, 1, 1), [(1, n_q, 1, d)], [queries.dtype])
        return out, None
    out, kc, vc = combine(
        parts,
        (n_q + h, 1, 1),
        [(1, n_q, 1, d), (1, h, 1, lay.key_bytes), (1, h, 1, lay.value_bytes)],
        [queries.dtype, mx.uint8, mx.uint8],
    )
    return out, (kc, vc)


def encode_inputs(cache: Any, k_src: mx.array, v_src: mx.array, first: int, n: int, pos: int):
    """Inputs of the encode launch: rows first .. first+n-1 of k_src / v_src [1, H, R, D]."""
    const = layer_constants(cache, 1)
    return [
        k_src,
        v_src,
        _int_params([n, first, int(k_src.shape[2]), pos]),
        _float_params(0.0, const["rscale"]),
        cache.smooth,
        const["key_mean"],
        const["inv_freq"],
        const["value_smooth"],
        const["value_mean"],
        cache.key_codebook,
        cache.value_codebook,
    ]


def encode(cache: Any, k_src: mx.array, v_src: mx.array, first: int, n: int, pos: int):
    """Packed key and value codes [1, H, n, bytes] of rows first .. first+n-1 of k_src / v_src
    (any float dtype), the first at absolute position `pos`: one launch."""
    from veloxquant.kernels import launch

    h, d = cache.smooth.shape
    lay = layout_of(cache, int(h))
    src = encode_kernel_source(lay)
    kc, vc = launch(
        src,
        encode_inputs(cache, k_src, v_src, first, n, pos),
        (n, int(h), 1),
        [(1, int(h), n, lay.key_bytes), (1, int(h), n, lay.value_bytes)],
        [mx.uint8, mx.uint8],
    )
    return kc, vc


# ---------------------------------------------------------------------------------------------
# The pure-MLX twin: the same algebra in MLX ops, over pieces of the coded past

# Fused attention on the CPU attends the coded past with the CPU extension's one-pass kernel
# (`cpu_kernel_attention`) where it takes the call, and with the twin's pieces otherwise.
CPU_KERNEL = True
# Scores alive at once in one piece (float32 elements): bounds prefill's peak memory.
PIECE_ELEMENTS = 1 << 25
PIECE_TOKENS = 16384


def reference_attention(
    cache: Any, queries: mx.array, scale: float, mask: Any, pending: dict
) -> mx.array:
    """Attention of queries [B, H_q, N, D] over the cache's sinks, its first n_coded coded
    tokens and the pending exact tokens, by the fused algebra (q̃·codeword + phase, value
    codewords aggregated before the inverse transform), with an online softmax over pieces of
    the coded past so no more than a piece is ever decoded. Float32 math."""
    rows = _query_rows(cache, queries, scale)
    exact = attention.exact_tokens(cache, pending)
    coded = _coded_pieces(cache, rows, mask, pending, exact)
    return _finish_attention(cache, rows, coded, mask, pending, exact)


def cpu_kernel_attention(
    cache: Any, queries: mx.array, scale: float, mask: Any, pending: dict
) -> mx.array:
    """`reference_attention` with the coded past attended in one pass of the CPU extension's
    `vecinfer_coded_attention` (veloxquant.cpu_kernels), straight from the packed codes: no
    piece of keys or values is decoded into an array. Takes what `cpu_kernel_takes` accepts."""
    rows = _query_rows(cache, queries, scale)
    b, h, g, n, d = rows["shape"]
    n_coded = int(pending["n_coded"])
    if n_coded == 0:
        coded = _no_coded(rows)
    else:
        ab = phases = None
        if cache.key_mean is not None:
            mean = cache.key_mean.astype(mx.float32)[None, :, None, :]
            ab = phase_coefficients(rows["q"], mean, cache.rope)
            # one table for the whole coded span, the same for every layer at this step
            phases = phase_table(cache.rope, cache.sinks, n_coded)
        m, l_code, o_code = cpu_kernels.vecinfer_coded_attention(
            rows["qt"],
            ab,
            cache._kbuf,
            cache.key_codebook.astype(mx.float32),
            cache._vbuf,
            cache.value_codebook.astype(mx.float32),
            phases,
            n_coded,
            cache.key_bits,
            cache.value_bits,
        )
        coded = (
            m.reshape(b, h, g, n, 1),
            l_code.reshape(b, h, g, n, 1),
            o_code.reshape(b, h, g, n, d),
        )
    exact = attention.exact_tokens(cache, pending)
    return _finish_attention(cache, rows, coded, mask, pending, exact)


def cpu_kernel_here() -> bool:
    """Whether fused attention runs the CPU kernel here: CPU_KERNEL on, MLX on the CPU, and the
    extension built (veloxquant.cpu_kernels.available, which says once in the log why not)."""
    return CPU_KERNEL and mx.default_device() == mx.cpu and cpu_kernels.available()


def cpu_kernel_takes(cache: Any, queries: mx.array, mask: Any) -> bool:
    """Whether `cpu_kernel_attention` takes this call: `cpu_kernel_here()`, code buffers of the
    cache's batch, and a mask under which every query sees every coded token (none, or
    "causal": the coded past precedes every query); a mask array (a sliding window, left
    padding) takes the twin."""
    return (
        (mask is None or (isinstance(mask, str) and mask == "causal"))
        and cpu_kernel_here()
        and (cache._kbuf is None or cache._kbuf.shape[0] == queries.shape[0])
    )


def _query_rows(cache: Any, queries: mx.array, scale: float) -> dict:
    """The scaled queries as rows of their KV head, q [B, H, G·N, D] (KV head h serves query
    heads hG .. hG+G-1), and q̃ = Had(q ⊙ λ), float32."""
    b, n_q, n, d = queries.shape
    h = cache.smooth.shape[0]
    g = n_q // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, g * n, d)
    qt = q * cache.smooth.astype(mx.float32)[:, None, :]
    if cache.hadamard:
        qt = mx.hadamard_transform(qt)
    return {"q": q, "qt": qt, "shape": (b, h, g, n, d), "dtype": queries.dtype}


def _no_coded(rows: dict) -> tuple[mx.array, mx.array, mx.array]:
    # a finite floor: a piece whose every column is masked (a sliding window) leaves it, where
    # -inf would give exp(-inf - -inf) = NaN
    b, h, g, n, d = rows["shape"]
    f32 = mx.float32
    return (
        mx.full((b, h, g, n, 1), NEG, f32),
        mx.zeros((b, h, g, n, 1), f32),
        mx.zeros((b, h, g, n, d), f32),
    )


def _coded_pieces(
    cache: Any, rows: dict, mask: Any, pending: dict, exact: tuple
) -> tuple[mx.array, mx.array, mx.array]:
    """The coded past in pieces, each decoded and attended with an online softmax: (running
    max [B, H, G, N, 1], sum, Σ p · value codewords [B, H, G, N, D]); `exact` is
    attention.exact_tokens' (for the mask's columns)."""
    b, h, g, n, d = rows["shape"]
    q, qt = rows["q"], rows["qt"]
    n_coded = int(pending["n_coded"])
    n_q = h * g
    f32 = mx.float32
    fk, _, n_sink = exact
    total = n_coded + int(fk.shape[2])
    m_run, l_code, o_code = _no_coded(rows)
    piece = max(TILE, min(PIECE_TOKENS, PIECE_ELEMENTS // max(1, b * n_q * n)))
    kbuf, vbuf = cache._kbuf, cache._vbuf
    mean = None if cache.key_mean is None else cache.key_mean.astype(f32)
    if mean is not None and n_coded >= TABLE_MIN_LENGTH:
        # one table for the whole coded span, the same for every layer at this step
        cos, sin = rotation_table(cache.rope, cache.sinks, n_coded)
    for a in range(0, n_coded, piece):
        e = min(n_coded, a + piece)
        kt = pq_decode(kbuf[:, :, a:e], cache.key_codebook, cache.key_sub_dim, cache.key_bits, d)
        s = qt @ kt.swapaxes(-1, -2)
        if mean is not None:
            if n_coded >= TABLE_MIN_LENGTH:
                mu = rotate_by_table(mean, cache.rope, cos[a:e], sin[a:e])
            else:
                mu = rotated_mean(mean, cache.rope, cache.sinks + a, e - a)
            s = s + q @ mu.swapaxes(-1, -2)
        s = s.reshape(b, h, g, n, e - a)
        s = attention.apply_mask(s, attention.mask_columns(mask, n, total, n_sink + a, e - a))
        m_new = mx.maximum(m_run, s.max(axis=-1, keepdims=True))
        alpha = mx.exp(m_run - m_new)
        p = mx.exp(s - m_new)
        vt = pq_decode(
            vbuf[:, :, a:e], cache.value_codebook, cache.value_sub_dim, cache.value_bits, d
        )
        pv = p.reshape(b, h, g * n, e - a) @ vt
        o_code = o_code * alpha + pv.reshape(b, h, g, n, d)
        l_code = l_code * alpha + p.sum(axis=-1, keepdims=True)
        m_run = m_new
        if n > 1:  # prefill: keep one piece's intermediates alive at a time
            mx.eval(m_run, l_code, o_code)
    return m_run, l_code, o_code


def _finish_attention(
    cache: Any,
    rows: dict,
    coded: tuple[mx.array, mx.array, mx.array],
    mask: Any,
    pending: dict,
    exact: tuple,
) -> mx.array:
    """The exact tokens (sinks, then the pending window and the call's tokens, in position
    order) merged with the coded past's running (max, sum, output), the value transform
    applied once, normalized: the attention output [B, H_q, N, D] in the queries' dtype."""
    b, h, g, n, d = rows["shape"]
    q = rows["q"]
    m_run, l_code, o_code = coded
    n_coded = int(pending["n_coded"])
    fk, fv, n_sink = exact
    total = n_coded + int(fk.shape[2])
    s = (q @ fk.swapaxes(-1, -2)).reshape(b, h, g, n, -1)
    fp_cols = [(0, n_sink)] if n_sink else []
    fp_cols.append((n_sink + n_coded, int(fk.shape[2]) - n_sink))
    masks = [attention.mask_columns(mask, n, total, st, ln) for st, ln in fp_cols]
    fm = None if masks[0] is None else mx.concatenate(masks, axis=-1)
    s = attention.apply_mask(s, fm)
    m_new = mx.maximum(m_run, s.max(axis=-1, keepdims=True))
    alpha = mx.exp(m_run - m_new)
    p = mx.exp(s - m_new)
    o_fp = (p.reshape(b, h, g * n, -1) @ fv).reshape(b, h, g, n, d)
    l_fp = p.sum(axis=-1, keepdims=True)
    o_code, l_code = o_code * alpha, l_code * alpha

    # Σ p v̂ = Had(Σ p c_v) ⊙ λ_v + μ_v Σ p (coded part), plus the exact part
    if cache.value_smooth is not None:
        if cache.hadamard:
            o_code = mx.hadamard_transform(o_code)
        o_code = o_code * cache.value_smooth.astype(mx.float32)[None, :, None, None, :]
    if cache.value_mean is not None:
        o_code = o_code + cache.value_mean.astype(mx.float32)[None, :, None, None, :] * l_code
    out = (o_code + o_fp) / (l_code + l_fp)
    return out.reshape(b, h * g, n, d).astype(rows["dtype"])
