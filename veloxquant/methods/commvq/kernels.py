"""CommVQ's fused decode attention: GPU kernels for one decode query, and their pure-MLX twin.

The sums (KV head h, coded token n at absolute position n, RoPE pair j as a complex number):
- the key is k_n = RoPE_n(s_n·scale_j·Z_j + μ_j), Z_j = Σ_r g_rj·(A_j[a_r] + i·A_j[b_r]): the
  shared atoms A (int8 or fp16, one set per head or per layer, scale_j per pair), the per-stage
  complex gains g and the token's R codes (a_r, b_r);
- its score is Σ_j Re(conj(q_j)·k_n,j) for each of the KV head's query heads; the value is the
  sum of its product-VQ codewords, as VecInfer's.

Two launches per layer and decode step (`decode_attention`), flash-decoding style:
1. `partial`: threadgroup (split, KV head). Splits 0 .. S-1 each walk their range of the coded
   past, a token per SIMD group at a time: each lane rebuilds Z on its RoPE pairs from the atoms
   and gains (in threadgroup memory), rotates it at the token's position (the angle as
   mx.fast.rope forms it, one accurate sincos per pair), and the SIMD group sums the scores;
   an online softmax per SIMD group in registers, the values summed from the value codebook.
   Split S attends the exact tokens (fp16 sinks and window, the call's own). Each writes its
   running max m (log2 units), sum l and unnormalised output o.
2. the combine (`veloxquant.kernels.split_combine_source`): one threadgroup per query head
   merges the S + 1 partials and writes the output in the model's dtype.

A token costs 2·R·D/2 atom reads and R·D/2 complex multiply-adds per KV head (R = 21 stages at
D = 128 and 2 bits: 2688 and 1344, shared by the KV head's query heads), against D multiply-adds of
a plain dot product: the kernel saves memory (no dequantized past, ever) and the transient
path's per-step dequantization, not the arithmetic of fp16 attention (README, "CommVQ decode").

The kernels take the default codebook form, shared atoms with per-stage gains (`unsupported`
says what they do not take: the paper's free θ per stage does not fit a threadgroup's memory).

`reference_attention` is the pure-MLX twin: the same tokens (the sinks, the coded past as it was
before the call, the window and the call's own tokens), the coded past decoded one piece at a
time (`CommVQCache.decode_keys` at the piece's positions, `decode_values`) under an online
softmax, so no call holds the whole dequantized past. It serves the CPU, prefill chunks, batches
and layouts the kernels do not take, and it is the oracle the emulated kernels are tested
against (tests/test_commvq_kernels.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant import attention, cpu_kernels
from veloxquant.codes import code_bytes
from veloxquant.rope import RopeSpec, phase_table
from veloxquant.kernels import (
    EXACT_AT,
    NEG,
    KernelSource,
    backend,
    device_resident,
    launch,
    launch_params,
    split_combine_source,
    split_target,
)

# Scores alive at once in one piece of the twin (float32 elements): bounds prefill's peak memory.
PIECE_ELEMENTS = 1 << 25
PIECE_TOKENS = 16384

TILE = 128  # threads per threadgroup: four SIMD groups, a token each at a time
MAX_QUERIES_PER_KV = 8
MAX_HEAD_DIM = 256
THREADGROUP_LIMIT = {"metal": 32768, "cuda": 49152}
# threadgroups to aim for per partial launch: None is GROUPS_PER_MULTIPROCESSOR on each CUDA
# multiprocessor (fewer where its shared memory holds fewer), 1056 on Metal; an int overrides it
TARGET_GROUPS: int | None = None
GROUPS_PER_MULTIPROCESSOR = 4
MIN_SPLIT = 64  # coded tokens a split takes at least (each of its SIMD groups a few)
# a coded token's key code row read as 32-bit words where its length is whole words (R = 21 at
# D = 128 and 2 bits: 32 bytes), else byte by byte
CODE_WORDS = True
# bytes per atom component in threadgroup memory: None takes float32 where it fits the backend's
# limit, else float16 (`atom_bytes`); 2 forces float16 (more threadgroups per multiprocessor,
# a conversion per read)
ATOM_BYTES: int | None = None
PARAMS = 16  # int32 slots of iparams
# the CPU extension's one-pass attention over the coded past (`cpu_kernel_attention`) where it
# is built; False keeps the twin on the CPU
CPU_KERNEL = True
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Layout:
    """What one partial kernel is compiled for."""

    head_dim: int
    stages: int
    queries_per_kv: int
    value_bits: int
    value_sub_dim: int
    traditional: bool
    center: bool
    atom_heads: int  # 1: the layer's heads share one atom set; else one per KV head
    gain_heads: int  # likewise for the stage gains
    value_heads: int  # likewise for the value codebook
    n_heads: int

    @property
    def key_bytes(self) -> int:
        return self.stages + (self.stages + 1) // 2

    @property
    def value_bytes(self) -> int:
        return code_bytes(self.value_bits, self.head_dim // self.value_sub_dim)


def threadgroup_bytes(lay: Layout, atom_bytes: int) -> int:
    """Threadgroup memory of the partial kernel: the atoms [64, P] (x, y) at `atom_bytes` each,
    the gains [R, P] (x, y) in float32, the queries and the SIMD groups' merged output
    [G, D], their maxes and sums."""
    p = lay.head_dim // 2
    nw = TILE // 32
    return (
        2 * 64 * p * atom_bytes
        + 8 * lay.stages * p
        + 8 * lay.queries_per_kv * lay.head_dim
        + (8 * nw * lay.queries_per_kv)
    )


def atom_bytes(lay: Layout, which: str) -> int:
    """Bytes per atom component in threadgroup memory: float32 where it fits `which`'s limit,
    else float16 (exact: the atoms are int8 or fp16), 0 where neither fits."""
    for size in (4, 2):
        if threadgroup_bytes(lay, size) <= THREADGROUP_LIMIT[which]:
            return size
    return 0


def layout(cache: Any, n_q_heads: int) -> Layout:
    h = cache.n_heads
    return Layout(
        head_dim=cache.head_dim,
        stages=cache.stages,
        queries_per_kv=n_q_heads // h,
        value_bits=cache.value_bits,
        value_sub_dim=cache.value_sub_dim,
        traditional=cache.rope_traditional,
        center=cache.key_mean is not None,
        atom_heads=int(cache.theta.shape[0]),
        gain_heads=int(cache.key_gain.shape[0]),
        value_heads=int(cache.value_codebook.shape[0]),
        n_heads=h,
    )


def unsupported(cache: Any, n_q_heads: int, which: str | None = None) -> str | None:
    """Why the kernels do not take this cache (None when they do) on backend `which` (default:
    the one MLX runs on, CUDA's answer on the CPU)."""
    which = which or backend() or "cuda"
    if cache.key_gain is None:
        return (
            "a free θ per stage (the paper's codebook): R x 64 atoms per pair do not fit a "
            "threadgroup's memory; the kernels take shared atoms with per-stage gains"
        )
    h = cache.n_heads
    uneven = _uneven_sets(cache)
    if uneven:
        return uneven
    if n_q_heads % h or n_q_heads // h > MAX_QUERIES_PER_KV:
        return f"{n_q_heads} query heads over {h} KV heads (at most {MAX_QUERIES_PER_KV} each)"
    if cache.head_dim > MAX_HEAD_DIM:
        return f"head_dim {cache.head_dim} (at most {MAX_HEAD_DIM})"
    if cache.value_bits > 16:
        return f"{cache.value_bits}-bit value codes (at most 16)"
    lay = layout(cache, n_q_heads)
    if not atom_bytes(lay, which):
        need, limit = threadgroup_bytes(lay, 2), THREADGROUP_LIMIT[which]
        return f"{need} bytes of threadgroup memory (at most {limit} on {which})"
    return None


def _uneven_sets(cache: Any) -> str | None:
    """What the kernels (GPU and CPU) refuse in a shared-atom cache whose atoms, gains or value
    codebooks come in sets neither one per layer nor one per KV head (only a hand-made cache
    has them: calibration shares them by layer or by head)."""
    h = cache.n_heads
    sets = {
        "atom": cache.theta.shape[0],
        "gain": cache.key_gain.shape[0],
        "value codebook": cache.value_codebook.shape[0],
    }
    for what, n in sets.items():
        if n not in (1, h):
            return f"{n} {what} sets for {h} KV heads (the kernels take one, or one per head)"
    return None


def _memo(cache: Any) -> dict:
    """The cache's own memo of its kernel inputs and decisions: its codebook arrays do not change
    between calls (`state` and `__init__` reset it)."""
    return cache.__dict__.setdefault("_kernel_memo", {})


def kernel_bytes(cache: Any) -> int:
    """Bytes of the arrays the GPU kernels keep on `cache` beside its own (the codebook laid out
    for them, the combine's head table; `codebook_inputs`), each counted once."""
    own = {id(a) for a in cache._arrays().values() if a is not None}
    kept = {}
    for value in cache.__dict__.get("_kernel_memo", {}).values():
        for a in value if isinstance(value, tuple) else (value,):
            if isinstance(a, mx.array) and id(a) not in own:
                kept[id(a)] = a.nbytes
    return sum(kept.values())


def kernels_take(cache: Any, n_q_heads: int) -> bool:
    """Whether decode attention of this cache runs in the GPU kernels: a GPU backend and a
    codebook form and shape they take (`unsupported`)."""
    which = backend()
    if which is None:
        return False
    key = ("takes", which, n_q_heads)
    memo = _memo(cache)
    if key not in memo:
        memo[key] = unsupported(cache, n_q_heads, which) is None
    return memo[key]


# ---------------------------------------------------------------------------------------------
# The kernels (veloxquant.kernels dialect)

_HELPERS = r"""
#ifndef VQ_COMMVQ_HELPERS
#define VQ_COMMVQ_HELPERS
// the `bits`-bit code at bit offset `off` of a little-endian bit stream of bytes (bits <= 16)
VQ_FN uint vq_cvq_code(const VQ_GLOBAL uint8_t* row, int off, int bits) {
  const int at = off >> 3, sh = off & 7;
  uint x = (uint)row[at] >> sh;
  if (sh + bits > 8) x |= (uint)row[at + 1] << (8 - sh);
  if (sh + bits > 16) x |= (uint)row[at + 2] << (16 - sh);
  return x & ((1u << bits) - 1u);
}
#endif
"""

# One token's softmax step for every query head (scores in `sc`, log2 units, the same in every
# lane) and its value rows added: `VALUE(i, e)` is element e of the lane's i-th value sub-vector.
_SOFTMAX_STEP = """
#define VQ_CVQ_SOFTMAX_STEP(VALUE) \\
  { \\
    float p[GQ]; \\
    VQ_UNROLL \\
    for (int g = 0; g < GQ; ++g) { \\
      const float mn = VQ_FMAX(m[g], sc[g]); \\
      const float corr = vq_exp2(m[g] - mn); \\
      p[g] = vq_exp2(sc[g] - mn); \\
      l[g] = l[g] * corr + p[g]; \\
      m[g] = mn; \\
      VQ_UNROLL \\
      for (int i = 0; i < SPL; ++i) { \\
        VQ_UNROLL \\
        for (int e = 0; e < VD; ++e) o[g][i][e] *= corr; \\
      } \\
    } \\
    VQ_UNROLL \\
    for (int i = 0; i < SPL; ++i) { \\
      if (M % 32 == 0 || lane + 32 * i < M) { \\
        VQ_UNROLL \\
        for (int e = 0; e < VD; ++e) { \\
          const float v = VALUE(i, e); \\
          VQ_UNROLL \\
          for (int g = 0; g < GQ; ++g) o[g][i][e] += p[g] * v; \\
        } \\
      } \\
    } \\
  }
"""

_PARTIAL_BODY = (
    EXACT_AT
    + _SOFTMAX_STEP
    + """
  constexpr int NW = TILE / 32;
  constexpr int P = D / 2;
  constexpr int PPL = (P + 31) / 32;  // RoPE pairs per lane
  constexpr int M = D / VD;  // value sub-vectors per token
  constexpr int SPL = (M + 31) / 32;  // value sub-vectors per lane
  const int n_coded = iparams[0], per_split = iparams[1], n_splits = iparams[2];
  const int n_sink = iparams[3], n_win = iparams[4], n_new = iparams[5];
  const int stride = iparams[6];  // coded tokens per head in the code arrays
  const int first_pos = iparams[7];  // absolute position of coded token 0
  const int split = (int)vq_gx;
  const int kvh = (int)vq_gy;
  const int tid = (int)vq_tid;
  const int lane = (int)vq_lane;
  const int warp = (int)vq_warp;
  const bool exact = split == n_splits;
  const int abook = ATOM_HEADS > 1 ? kvh : 0;
  const int gbook = GAIN_HEADS > 1 ? kvh : 0;
  const int vbook = VALUE_HEADS > 1 ? kvh : 0;
  // [atom][pair] (x, y): a SIMD group's lanes read consecutive pairs of one atom
@@ATOM_DECL@@
  VQ_SHARED float2 s_gain[R * P];  // [stage][pair] (x, y)
  VQ_SHARED float s_q[GQ * D];
  VQ_SHARED float s_o[GQ * D];
  VQ_SHARED float s_ml[2 * NW * GQ];

  if (!exact) {
    for (int i = tid; i < 64 * P; i += TILE) {
      const float ax = static_cast<float>(atoms[2 * (abook * 64 * P + i)]);
      const float ay = static_cast<float>(atoms[2 * (abook * 64 * P + i) + 1]);
@@ATOM_STORE@@
    }
    for (int i = tid; i < R * P; i += TILE)
      s_gain[i] = VQ_F2(gains[2 * (gbook * R * P + i)], gains[2 * (gbook * R * P + i) + 1]);
  }
  for (int i = tid; i < GQ * D; i += TILE)
    s_q[i] = static_cast<float>(queries[kvh * GQ * D + i]) * fparams[0];
  VQ_BARRIER();

  float m[GQ], l[GQ], o[GQ][SPL][VD];
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g) {
    m[g] = NEG;
    l[g] = 0.0f;
    VQ_UNROLL
    for (int i = 0; i < SPL; ++i) {
      VQ_UNROLL
      for (int e = 0; e < VD; ++e) o[g][i][e] = 0.0f;
    }
  }

  if (!exact) {
    // this lane's RoPE pairs j = lane + 32 k (clamped: a lane past the last pair computes a
    // copy of it with a zero query): the query and key mean pairs, the atoms' scale, the
    // frequency as mx.fast.rope's GPU kernel forms it
    float qa[GQ][PPL], qb[GQ][PPL], mua[PPL], mub[PPL], psc[PPL], ifr[PPL];
    int pj[PPL];
    VQ_UNROLL
    for (int k = 0; k < PPL; ++k) {
      const int j0 = lane + 32 * k;
      const bool live = P % 32 == 0 || j0 < P;
      const int j = live ? j0 : P - 1;
      const int ia = TRAD ? 2 * j : j;
      const int ib = TRAD ? 2 * j + 1 : j + P;
      pj[k] = j;
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) {
        qa[g][k] = live ? s_q[g * D + ia] : 0.0f;
        qb[g][k] = live ? s_q[g * D + ib] : 0.0f;
      }
      mua[k] = CENTER ? key_mean[kvh * D + ia] : 0.0f;
      mub[k] = CENTER ? key_mean[kvh * D + ib] : 0.0f;
      psc[k] = pair_scale[abook * P + j];
      ifr[k] = vq_exp2(-((float)j / (float)P) * fparams[2]);
    }
    const int t0 = split * per_split;
    const int t1 = min(t0 + per_split, n_coded);
    for (int t = t0 + warp; t < t1; t += NW) {
      const VQ_GLOBAL uint8_t* kr = key_codes + (size_t)(kvh * stride + t) * KB;
      // the row's bytes as 32-bit words where rows are whole words (KB % 4 == 0: one load
      // per 4 bytes, not per byte)
      constexpr int KWORDS = CODE_WORDS && KB % 4 == 0 ? KB / 4 : 1;
      uint kw[KWORDS];
      if (CODE_WORDS && KB % 4 == 0) {
        VQ_UNROLL
        for (int w = 0; w < KWORDS; ++w) kw[w] = ((const VQ_GLOBAL uint32_t*)kr)[w];
      }
#define VQ_CVQ_KEY_BYTE(i) \\
  (CODE_WORDS && KB % 4 == 0 ? (kw[(i) >> 2] >> (((i) & 3) * 8)) & 255u : (uint)kr[i])
      float zx[PPL], zy[PPL];
      VQ_UNROLL
      for (int k = 0; k < PPL; ++k) {
        zx[k] = 0.0f;
        zy[k] = 0.0f;
      }
      // Z = sum over stages of g_r (A[a_r] + i A[b_r]); code r = (high byte r) << 4 | nibble r
      VQ_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint code =
            (VQ_CVQ_KEY_BYTE(r) << 4) | ((VQ_CVQ_KEY_BYTE(R + (r >> 1)) >> ((r & 1) * 4)) & 15u);
        const int a = (int)(code >> 6), b = (int)(code & 63u);
        VQ_UNROLL
        for (int k = 0; k < PPL; ++k) {
          const int j = pj[k];
@@ATOM_LOAD@@
          const float ux = ta.x - tb.y, uy = ta.y + tb.x;
          const float2 g = s_gain[r * P + j];
          // four multiply-adds into the sums (each product fused with its add)
          zx[k] += g.x * ux;
          zx[k] -= g.y * uy;
          zy[k] += g.x * uy;
          zy[k] += g.y * ux;
        }
      }
#undef VQ_CVQ_KEY_BYTE
      const float s_tok = static_cast<float>(key_scales[kvh * stride + t]);
      float sc[GQ];
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = 0.0f;
      VQ_UNROLL
      for (int k = 0; k < PPL; ++k) {
        const float kx = zx[k] * psc[k] * s_tok + mua[k];
        const float ky = zy[k] * psc[k] * s_tok + mub[k];
        // the angle as mx.fast.rope forms it: (scale * position) * inv_freq, in float32
        const float theta = (fparams[1] * (float)(first_pos + t)) * ifr[k];
        float sn, cs;
        VQ_SINCOS(theta, sn, cs);
        const float rx = kx * cs - ky * sn, ry = kx * sn + ky * cs;
        VQ_UNROLL
        for (int g = 0; g < GQ; ++g) sc[g] += qa[g][k] * rx + qb[g][k] * ry;
      }
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = vq_simd_sum(sc[g]);
      const VQ_GLOBAL uint8_t* vr = value_codes + (size_t)(kvh * stride + t) * VBYTES;
#define VQ_CVQ_CODED_VALUE(i, e) \\
  static_cast<float>( \\
      value_book[(vbook * VK + (int)vq_cvq_code(vr, (lane + 32 * (i)) * VB, VB)) * VD + (e)])
      VQ_CVQ_SOFTMAX_STEP(VQ_CVQ_CODED_VALUE)
#undef VQ_CVQ_CODED_VALUE
    }
  } else {
    const int n_exact = n_sink + n_win + n_new;
    for (int t = warp; t < n_exact; t += NW) {
      float sc[GQ];
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = 0.0f;
      VQ_UNROLL
      for (int i = 0; i < SPL; ++i) {
        if (M % 32 == 0 || lane + 32 * i < M) {
          VQ_UNROLL
          for (int e = 0; e < VD; ++e) {
            const int c = (lane + 32 * i) * VD + e;
            const float kc = VQ_EXACT_AT(sink_k, win_k, new_k, t, c);
            VQ_UNROLL
            for (int g = 0; g < GQ; ++g) sc[g] += s_q[g * D + c] * kc;
          }
        }
      }
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = vq_simd_sum(sc[g]);
#define VQ_CVQ_EXACT_VALUE(i, e) \\
  VQ_EXACT_AT(sink_v, win_v, new_v, t, (lane + 32 * (i)) * VD + (e))
      VQ_CVQ_SOFTMAX_STEP(VQ_CVQ_EXACT_VALUE)
#undef VQ_CVQ_EXACT_VALUE
    }
  }

  // merge the SIMD groups: the largest max per query head, each group's output scaled into
  // s_o in group order
  if (lane == 0) {
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g) {
      s_ml[warp * GQ + g] = m[g];
      s_ml[(NW + warp) * GQ + g] = l[g];
    }
  }
  VQ_BARRIER();
  float f[GQ];
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g) {
    float big = s_ml[g];
    for (int w = 1; w < NW; ++w) big = VQ_FMAX(big, s_ml[w * GQ + g]);
    f[g] = vq_exp2(m[g] - big);
  }
  for (int w = 0; w < NW; ++w) {
    if (warp == w) {
      VQ_UNROLL
      for (int i = 0; i < SPL; ++i) {
        if (M % 32 == 0 || lane + 32 * i < M) {
          VQ_UNROLL
          for (int e = 0; e < VD; ++e) {
            const int c = (lane + 32 * i) * VD + e;
            VQ_UNROLL
            for (int g = 0; g < GQ; ++g)
              s_o[g * D + c] = (w == 0 ? 0.0f : s_o[g * D + c]) + o[g][i][e] * f[g];
          }
        }
      }
    }
    VQ_BARRIER();
  }
  const int n_part = n_splits + 1;
  for (int i = tid; i < GQ * D; i += TILE) {
    const int row = kvh * GQ + i / D;
    part_o[(row * n_part + split) * D + i % D] = s_o[i];
  }
  if (tid < GQ) {
    float big = s_ml[tid];
    for (int w = 1; w < NW; ++w) big = VQ_FMAX(big, s_ml[w * GQ + tid]);
    float sum = 0.0f;
    for (int w = 0; w < NW; ++w)
      sum += s_ml[(NW + w) * GQ + tid] * vq_exp2(s_ml[w * GQ + tid] - big);
    const int row = kvh * GQ + tid;
    part_m[row * n_part + split] = big;
    part_l[row * n_part + split] = sum;
  }
"""
)

# How the atoms sit in threadgroup memory: float32 pairs (one 8-byte read an atom), or float16
# halves (exact for int8 and fp16 atoms; half the bytes, a conversion per read).
_ATOM_PIECES = {
    4: {
        "ATOM_DECL": "  VQ_SHARED float2 s_atom[64 * P];",
        "ATOM_STORE": "      s_atom[i] = VQ_F2(ax, ay);",
        "ATOM_LOAD": (
            "          const float2 ta = s_atom[a * P + j];\n"
            "          const float2 tb = s_atom[b * P + j];"
        ),
    },
    2: {
        "ATOM_DECL": "  VQ_SHARED ATOM_T s_atom[2 * 64 * P];",
        "ATOM_STORE": (
            "      s_atom[2 * i] = static_cast<ATOM_T>(ax);\n"
            "      s_atom[2 * i + 1] = static_cast<ATOM_T>(ay);"
        ),
        "ATOM_LOAD": (
            "          const float2 ta = VQ_F2(static_cast<float>(s_atom[2 * (a * P + j)]),\n"
            "                                  static_cast<float>(s_atom[2 * (a * P + j) + 1]));\n"
            "          const float2 tb = VQ_F2(static_cast<float>(s_atom[2 * (b * P + j)]),\n"
            "                                  static_cast<float>(s_atom[2 * (b * P + j) + 1]));"
        ),
    },
}


def _partial_body(atom_size: int) -> str:
    body = _PARTIAL_BODY
    for name, text in _ATOM_PIECES[atom_size].items():
        body = body.replace(f"@@{name}@@", text)
    assert "@@" not in body
    return body


PARTIAL_INPUTS = (
    "queries",
    "atoms",
    "pair_scale",
    "gains",
    "key_mean",
    "value_book",
    "key_codes",
    "key_scales",
    "value_codes",
    "sink_k",
    "sink_v",
    "win_k",
    "win_v",
    "new_k",
    "new_v",
    "iparams",
    "fparams",
)


def partial_kernel_source(lay: Layout, atom_size: int) -> KernelSource:
    """The partial kernel for `lay`, its atoms held as float32 (atom_size 4) or float16 (2) in
    threadgroup memory (CODE_WORDS read at call time, so a benchmark can switch it)."""
    return _partial_kernel_source(lay, atom_size, CODE_WORDS)


@functools.lru_cache(maxsize=64)
def _partial_kernel_source(lay: Layout, atom_size: int, code_words: bool) -> KernelSource:
    constants = {
        "TILE": TILE,
        "NEG": NEG,
        "D": lay.head_dim,
        "R": lay.stages,
        "GQ": lay.queries_per_kv,
        "KB": lay.key_bytes,
        "VB": lay.value_bits,
        "VD": lay.value_sub_dim,
        "VK": 1 << lay.value_bits,
        "VBYTES": lay.value_bytes,
        "TRAD": lay.traditional,
        "CENTER": lay.center,
        "ATOM_HEADS": lay.atom_heads,
        "GAIN_HEADS": lay.gain_heads,
        "VALUE_HEADS": lay.value_heads,
        "ATOM_T": mx.float32 if atom_size == 4 else mx.float16,
        "CODE_WORDS": code_words,
    }
    return KernelSource(
        name="vq_commvq_attn_partial",
        inputs=PARTIAL_INPUTS,
        outputs=("part_m", "part_l", "part_o"),
        body=_partial_body(atom_size),
        constants=constants,
        threads=TILE,
        helpers=_HELPERS,
    )


def combine_kernel_source(head_dim: int, queries_per_kv: int, out_dtype: mx.Dtype) -> KernelSource:
    return split_combine_source("vq_commvq_attn_combine", head_dim, queries_per_kv, out_dtype)


# ---------------------------------------------------------------------------------------------
# Launching them


def split_tokens(n_coded: int, n_heads: int, threadgroup_bytes: int = 0) -> int:
    """Coded tokens per split: enough splits for about TARGET_GROUPS threadgroups over the
    launch's KV heads (read at call time, so a benchmark can sweep it; None: as many as the
    GPU holds at once, `split_target`), and no more splits than MIN_SPLIT tokens each would
    make (the tokens are then spread evenly over them, so a split may hold fewer)."""
    if n_coded == 0:
        return 1
    target = split_target(TARGET_GROUPS, GROUPS_PER_MULTIPROCESSOR, 1056, threadgroup_bytes)
    splits = max(1, min(-(-n_coded // MIN_SPLIT), -(-target // n_heads)))
    return -(-n_coded // splits)


def _at_least_8(x: mx.array) -> mx.array:
    """Launch inputs hold >= 8 elements (`veloxquant.kernels.launch`): a smaller one padded
    with zeros, which the kernel never reads."""
    if x.size >= 8:
        return x
    flat = x.reshape(-1)
    return mx.concatenate([flat, mx.zeros((8 - flat.size,), x.dtype)])


@functools.lru_cache(maxsize=16)
def _dummy(dtype: mx.Dtype) -> mx.array:
    return mx.zeros((8,), dtype)


@functools.lru_cache(maxsize=64)
def _float_params(scale: float, rope_scale: float, log2_base: float) -> mx.array:
    # read by every launch, so on CUDA copied out of the managed memory a host-made array lives
    # in (veloxquant.kernels.DEVICE_LAUNCH_PARAMS)
    values = [scale * LOG2E, rope_scale, log2_base] + [0.0] * 5
    return device_resident(mx.array(values, mx.float32))


def rope_log2_base(base: float) -> float:
    """log2 of the RoPE base in float32, as mx.fast.rope hands it to its GPU kernel (which forms
    each pair's frequency from it as exp2(-(j / (D/2)) * log2(base)))."""
    return float(np.float32(math.log2(np.float32(base))))


def codebook_inputs(cache: Any) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """(atoms [S, 64, P, 2] fp16, per-pair atom scales [S, P] f32, gains [H, R, P, 2] f32,
    key mean [H, D] f32 (or a dummy), value codebook) as the partial kernel reads them, made
    once per cache: the atoms transposed so that a SIMD group's lanes read consecutive pairs."""
    memo = _memo(cache)
    if "codebook" not in memo:
        theta = cache.theta  # [S, 1, P, 64, 2], int8 (exact in fp16) or fp16
        s, _, p, k, _ = theta.shape
        atoms = theta[:, 0].transpose(0, 2, 1, 3).astype(mx.float16)
        if cache.theta_scale is None:
            scale = mx.ones((s, p), mx.float32)
        else:
            scale = cache.theta_scale.reshape(s, p).astype(mx.float32)
        gains = cache.key_gain.astype(mx.float32)
        mean = _dummy(mx.float32) if cache.key_mean is None else cache.key_mean
        arrays = (atoms, scale, gains, mean, cache.value_codebook)
        memo["codebook"] = tuple(device_resident(_at_least_8(x)) for x in arrays)
    return memo["codebook"]


def _head_table(cache: Any) -> mx.array:
    """The combine's head table: (KV head, 0, 0, 0) per KV head, padded to 8 ints."""
    memo = _memo(cache)
    if "heads" not in memo:
        rows = [v for h in range(cache.n_heads) for v in (h, 0, 0, 0)]
        rows += [0] * max(0, 8 - len(rows))
        memo["heads"] = device_resident(mx.array(rows, mx.int32))
    return memo["heads"]


def attention_inputs(
    cache: Any, queries: mx.array, scale: float, pending: dict, n_splits: int, per_split: int
) -> list[mx.array]:
    """The partial kernel's inputs (B = 1, one query per head)."""
    n_q = queries.shape[1]
    n_coded = int(pending["n_coded"])
    sinks = pending["sinks"] or (cache.sink_keys, cache.sink_values)
    win = pending["win"]
    new_k, new_v = pending["new"]
    n_sink = 0 if sinks[0] is None else int(sinks[0].shape[2])
    n_win = 0 if win is None else int(win[0].shape[2])
    n_new = int(new_k.shape[2])
    exact = []
    for pair, n in ((sinks, n_sink), (win, n_win), ((new_k, new_v), n_new)):
        exact += (
            [_dummy(mx.float16)] * 2 if n == 0 else [_at_least_8(pair[0]), _at_least_8(pair[1])]
        )
    if n_coded:
        key_codes, key_scales, value_codes = pending["codes"]
        store = [_at_least_8(key_codes), _at_least_8(key_scales), _at_least_8(value_codes)]
        stride = int(key_codes.shape[2])
    else:
        store = [_dummy(mx.uint8), _dummy(mx.float16), _dummy(mx.uint8)]
        stride = 0
    iparams = (n_coded, per_split, n_splits, n_sink, n_win, n_new, stride, cache.sinks)
    fparams = _float_params(float(scale), float(cache.rope_scale), rope_log2_base(cache.rope_base))
    return [
        _at_least_8(queries.reshape(n_q, -1)),
        *codebook_inputs(cache),
        *store,
        *exact,
        launch_params(iparams + (0,) * (PARAMS - len(iparams))),
        fparams,
    ]


def decode_attention(cache: Any, queries: mx.array, scale: float, pending: dict) -> mx.array:
    """Attention of one query per head [1, H_q, 1, D] over the cache at `pending` (the state a
    fused update left), in the kernels: the partial launch, then the combine."""
    h, d = cache.n_heads, cache.head_dim
    n_q = queries.shape[1]
    lay = layout(cache, n_q)
    size = ATOM_BYTES or atom_bytes(lay, backend() or "cuda")
    n_coded = int(pending["n_coded"])
    per = split_tokens(n_coded, h, threadgroup_bytes(lay, size))
    n_splits = -(-n_coded // per)
    inputs = attention_inputs(cache, queries, scale, pending, n_splits, per)
    rows = n_q
    m, sums, o = launch(
        partial_kernel_source(lay, size),
        inputs,
        (n_splits + 1, h, 1),
        [(rows, n_splits + 1), (rows, n_splits + 1), (rows, n_splits + 1, d)],
        [mx.float32] * 3,
    )
    if m.size < 8:  # launch inputs hold >= 8 elements; the combine reads rows < n_q only
        pad = -(-8 // m.shape[1]) - m.shape[0]
        m, sums = (mx.concatenate([x, mx.zeros((pad, x.shape[1]), x.dtype)]) for x in (m, sums))
        o = mx.concatenate([o, mx.zeros((pad, *o.shape[1:]), o.dtype)])
    (out,) = launch(
        combine_kernel_source(d, lay.queries_per_kv, queries.dtype),
        [m, sums, o, _head_table(cache), inputs[PARTIAL_INPUTS.index("iparams")]],
        (n_q, 1, 1),
        [(n_q, d)],
        [queries.dtype],
    )
    return out.reshape(1, n_q, 1, d)


# ---------------------------------------------------------------------------------------------
# The pure-MLX twin


def reference_attention(
    cache: Any, queries: mx.array, scale: float, mask: Any, pending: dict
) -> mx.array:
    """Attention of queries [B, H_q, N, D] over the cache at `pending` (the state a fused
    update left), in the queries' dtype; float32 math."""
    b, n_q, n, d = queries.shape
    h = cache.n_heads
    n_coded = int(pending["n_coded"])
    fk, fv, n_sink = attention.exact_tokens(cache, pending)
    total = n_coded + int(fk.shape[2])
    q = (queries.astype(mx.float32) * scale).reshape(b, h, n_q // h * n, d)
    run = attention.OnlineSoftmax(q, n)
    key_codes, key_scales, value_codes = pending["codes"]
    theta = cache.stage_theta() if n_coded else None
    piece = max(1, min(PIECE_TOKENS, PIECE_ELEMENTS // max(1, b * n_q * n)))
    for a in range(0, n_coded, piece):
        e = min(n_coded, a + piece)
        keys = cache.decode_keys(
            key_codes[:, :, a:e], key_scales[:, :, a:e], cache.sinks + a, theta
        )
        values = cache.decode_values(value_codes[:, :, a:e])
        run.add(keys, values, attention.mask_columns(mask, n, total, n_sink + a, e - a))
        if n > 1:  # prefill: keep one piece's intermediates alive at a time
            mx.eval(run.m, run.l, run.o)
    run.add_exact(fk, fv, n_sink, n_coded, mask)
    return run.result(queries.dtype)


# ---------------------------------------------------------------------------------------------
# The CPU kernel


def cpu_kernel_here() -> bool:
    """Whether fused attention runs the CPU kernel here: CPU_KERNEL on, MLX on the CPU, and the
    extension built (veloxquant.cpu_kernels.available, which says once in the log why not)."""
    return CPU_KERNEL and mx.default_device() == mx.cpu and cpu_kernels.available()


def cpu_kernel_takes(cache: Any, mask: Any = None) -> bool:
    """Whether `cpu_kernel_attention` takes this call: `cpu_kernel_here()`, the shared-atom form
    (`unsupported`'s first two reasons), and a mask under which every query sees every coded
    token (none, or "causal": the coded past precedes every query); a mask array (a sliding
    window, left padding) takes the twin."""
    return (
        (mask is None or (isinstance(mask, str) and mask == "causal"))
        and cache.key_gain is not None
        and _uneven_sets(cache) is None
        and cpu_kernel_here()
    )


def cpu_kernel_attention(
    cache: Any, queries: mx.array, scale: float, mask: Any, pending: dict
) -> mx.array:
    """`reference_attention` with the coded past attended in one pass of the CPU extension's
    `commvq_coded_attention` (veloxquant.cpu_kernels), straight from the packed codes: no piece
    of keys or values is decoded into an array. Takes what `cpu_kernel_takes` accepts."""
    b, n_q, n, d = queries.shape
    h = cache.n_heads
    g = n_q // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, g * n, d)
    run = attention.OnlineSoftmax(q, n)
    n_coded = int(pending["n_coded"])
    fk, fv, n_sink = attention.exact_tokens(cache, pending)
    if n_coded:
        key_codes, key_scales, value_codes = pending["codes"]
        f32 = mx.float32
        rope = RopeSpec(d, cache.rope_traditional, cache.rope_base, cache.rope_scale)
        m, l_code, o_code = cpu_kernels.commvq_coded_attention(
            q,
            cache.theta.astype(f32),
            None if cache.theta_scale is None else cache.theta_scale.astype(f32),
            cache.key_gain.astype(f32),
            cache.key_mean,
            key_codes,
            key_scales.astype(f32),
            value_codes,
            cache.value_codebook.astype(f32),
            phase_table(rope, cache.sinks, n_coded),
            n_coded,
            cache.value_bits,
            cache.rope_traditional,
        )
        run.m = m.reshape(*run.m.shape)
        run.l = l_code.reshape(*run.l.shape)
        run.o = o_code.reshape(*run.o.shape)
    run.add_exact(fk, fv, n_sink, n_coded, mask)
    return run.result(queries.dtype)
