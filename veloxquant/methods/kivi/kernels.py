"""KIVI's fused decode attention: one query per head attends straight from the packed codes.

The sums (per KV head h, query q of its G_q query heads, scores in log2 units):
- keys are per channel c in blocks of G tokens: k[t, c] = code[t, c]·s[blk, c] + z[blk, c], so
  a token's score is Σ_c (q_c·s[blk, c])·code[t, c] + Σ_c q_c·z[blk, c]: the query scaled once
  per block (`qs`), one multiply-add per code, one bias per block;
- values are per token in groups of G channels: Σ_t p_t·v[t, c] is accumulated from each code
  as p_t·(code·s[t, c/G] + z[t, c/G]), nothing dequantized is stored.

Two launches per layer and decode step (`decode_attention`), flash-decoding style:
1. `partial` (one launch per (key bits, value bits) pair of the layer's heads; uniform KIVI is
   one): threadgroup (split, head). Splits 0 .. S-1 each walk their range of the quantized
   store in tiles of TILE tokens (one token per thread for the scores, one channel per thread
   for the values); split S attends the exact tokens: the fp16 sinks, the fp16 window and the
   call's own token(s). Each writes its running max m (log2 units), its sum l and its
   unnormalised output o.
   On CUDA the coded tiles of 2-bit layouts go to the tensor cores (`MMA`, `MMA_BITS`; the
   kernel also reads 4-bit codes, `mma_takes`): the codes become exact f16 operands and q·s and
   p·s are each split into two f16 parts, so the sums keep float32's precision. The CUDA
   cores' kernel serves the other layouts, and Metal.
2. `combine`: one threadgroup per query head merges the S + 1 partials (o = Σ 2^(m_s - M)·o_s
   / Σ 2^(m_s - M)·l_s) and writes the head's output in the model's dtype.

`reference_attention` is the pure-MLX twin: the same attention over the same tokens (the
snapshot of the store a fused update leaves in `pending`), the store dequantized a piece at a
time under an online softmax, so prefill never holds the dequantized past whole. It serves
the CPU, prefill chunks, batches and any layout the kernels do not take (`unsupported` says
which and why), and it is the oracle the emulated kernels are tested against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from veloxquant import attention
from veloxquant.kernels import (
    TENSOR_CORE_HELPERS,
    KernelSource,
    backend,
    device_resident,
    launch,
    launch_params,
    EXACT_AT,
    split_combine_source,
    split_target,
)

TILE = 128  # tokens per tile, and threads per threadgroup
NEG = -1.0e30  # finite "minus infinity" (no inf arithmetic in kernels)
MAX_QUERIES_PER_KV = 8
MAX_ZERO_SUMS = 32  # registers a thread keeps for Σ p·z (query heads x value groups)
THREADGROUP_LIMIT = {"metal": 32768, "cuda": 49152}
# threadgroups to aim for per partial launch: None is GROUPS_PER_MULTIPROCESSOR on each CUDA
# multiprocessor, 1056 on Metal; an int overrides it. A threadgroup's tile is a chain of
# dependent loads that takes about as long with 2 as with 6 threadgroups on a multiprocessor
# (benchmarks/results/kivi-splits-h100.txt), so one wave of as many as fit is fastest: 6 at
# the partial kernel's 80 registers (tests/test_cuda_compile.py keeps them there). A mixed
# allocation's launches each take only their own heads, so the splits are sized for the
# largest of them.
TARGET_GROUPS: int | None = None
GROUPS_PER_MULTIPROCESSOR = 6
PARAMS = 16  # int32 slots of iparams
# channels of a thread's key-score loop unrolled at once, so that their code loads are in flight
# together (benchmarks/results/kivi-key-unroll-h100.txt; tests/test_cuda_compile.py keeps the
# registers it costs within 6 threadgroups per multiprocessor)
KEY_UNROLL = 64
# tokens of a whole tile's values loop unrolled at once, likewise (kivi-splits-h100.txt: 32 and
# 64 alike, both faster than the 16 a bounded loop got)
VALUE_UNROLL = 32
# The coded tiles on the tensor cores (`_MMA_PARTIAL_BODY`, CUDA only, the layouts `mma_takes`);
# False keeps them on the CUDA cores, as Metal always does.
MMA = True
# Code widths whose layouts take the tensor cores by default. The kernel reads 2 and 4 bits
# (`mma_takes`), but on an H100 a launch with a 4-bit side is slower than on the CUDA cores: a
# mixed 2/4 layer's launches 78-79 against 73-74 us at 64K with the padded threadgroup rows
# (90 before them: 4-way bank conflicts), while 2/2 is faster, 84 against 116 us
# (benchmarks/results/kivi-padding-h100.txt, kivi-mma-h100.txt).
MMA_BITS = (2,)
# the tensor-core kernel's registers (102 under NVRTC for sm_90a, 125 for sm_80, KIVI-2) allow 4
# threadgroups per multiprocessor; the splits of a cache with any tensor-core launch are sized
# for them
MMA_GROUPS_PER_MULTIPROCESSOR = 4
# splits each SIMD group of the combine merges per trip, their row loads in flight together
COMBINE_UNROLL = 4
# Scores alive at once in one piece of the twin (float32 elements): bounds prefill's peak.
PIECE_ELEMENTS = 1 << 25
PIECE_TOKENS = 16384


@dataclass(frozen=True)
class Layout:
    """What one partial kernel is compiled for."""

    head_dim: int
    group_size: int
    key_bits: int
    value_bits: int
    queries_per_kv: int

    @property
    def key_words(self) -> int:
        """uint32 words of a block's key codes (D·G codes, channel-major)."""
        return -(-self.head_dim * self.group_size * self.key_bits // 32)

    @property
    def value_words(self) -> int:
        """uint32 words of a token's value codes (D codes)."""
        return -(-self.head_dim * self.value_bits // 32)


def threadgroup_bytes(lay: Layout, mma: bool = False) -> int:
    """Threadgroup memory of the partial kernel: the scaled queries, the per-block query
    scales and biases, the tile's scores, its tokens' value-scale weights and the softmax
    state; on the tensor cores the last two as padded f16 pairs, and `mma_stages` tiles' code
    rows, scales and zero points."""
    if mma:
        return _mma_fixed_bytes(lay) + mma_stages(lay) * _mma_stage_bytes(lay)
    d, gq, blocks = lay.head_dim, lay.queries_per_kv, TILE // lay.group_size
    groups = d // lay.group_size
    floats = gq * d + blocks * gq * d + blocks * gq + gq * TILE + TILE * groups * gq + 3 * gq
    return 4 * floats


def _mma_fixed_bytes(lay: Layout) -> int:
    """The tensor-core kernel's arrays but its staged tiles: the scaled queries, the block
    biases, the scores and softmax state, q·s and p·s as padded rows of f16 pairs."""
    d, gq, blocks = lay.head_dim, lay.queries_per_kv, TILE // lay.group_size
    groups = d // lay.group_size
    floats = gq * d + blocks * gq + gq * TILE + 3 * gq
    return 4 * floats + 16 * blocks * gq * (d // 4 + 4) + 8 * groups * gq * (TILE // 2 + 4)


def _mma_stage_bytes(lay: Layout) -> int:
    """A tile's code rows as the tensor-core kernel lays them out (16 bytes more every 4 key
    channels and every 2 value rows), and their f16 scales and zero points."""
    d, blocks, groups = lay.head_dim, TILE // lay.group_size, lay.head_dim // lay.group_size
    words = blocks * (lay.key_words + d) + TILE // 2 * (2 * lay.value_words + 4)
    return 4 * words + 2 * 2 * (blocks * d + TILE * groups)


def mma_stages(lay: Layout) -> int:
    """Tiles of code rows the tensor-core kernel holds: 2 (the next tile's copied in during
    this one) where CUDA's 48 KB of threadgroup memory takes them, else 1."""
    two = _mma_fixed_bytes(lay) + 2 * _mma_stage_bytes(lay)
    return 2 if two <= THREADGROUP_LIMIT["cuda"] else 1


def unsupported(lay: Layout, which: str = "cuda") -> str | None:
    """Why the kernels do not take a layout (None when they do)."""
    d, g = lay.head_dim, lay.group_size
    if TILE % g:
        return f"group_size {g} does not divide the tile of {TILE} tokens"
    if (d <= TILE and TILE % d) or (d > TILE and d % TILE):
        return f"head_dim {d}: the kernels take divisors or multiples of {TILE}"
    if lay.queries_per_kv > MAX_QUERIES_PER_KV:
        return f"{lay.queries_per_kv} query heads per KV head (at most {MAX_QUERIES_PER_KV})"
    if lay.queries_per_kv * d // g > MAX_ZERO_SUMS:
        return (
            f"{lay.queries_per_kv} query heads x {d // g} value groups: more than "
            f"{MAX_ZERO_SUMS} zero-point sums per thread"
        )
    if threadgroup_bytes(lay) > THREADGROUP_LIMIT[which]:
        limit = THREADGROUP_LIMIT[which]
        return f"{threadgroup_bytes(lay)} bytes of threadgroup memory (at most {limit})"
    return None


def _memo(cache: Any) -> dict:
    """The cache's own memo of what its layout decides (reset when the layout is set): a
    decode step asks for it once per layer, and rebuilding it was host time on every step."""
    return cache.__dict__.setdefault("_kernel_memo", {})


def layouts(cache: Any, n_q_heads: int) -> list[Layout]:
    """One layout per (key bits, value bits) pair among the cache's heads."""
    key = ("layouts", n_q_heads, cache.head_dim)
    memo = _memo(cache)
    if key not in memo:
        gq = n_q_heads // cache.head_bits.shape[0]
        pairs = sorted({(int(k), int(v)) for k, v in cache.head_bits})
        memo[key] = [Layout(cache.head_dim, cache.group_size, kb, vb, gq) for kb, vb in pairs]
    return memo[key]


def kernels_take(cache: Any, n_q_heads: int) -> bool:
    """Whether decode attention of this cache runs in the GPU kernels: a GPU backend, a known
    head_dim and every layout of the cache supported."""
    which = backend()
    if which is None or cache.head_dim is None or n_q_heads % cache.head_bits.shape[0]:
        return False
    key = ("takes", which, n_q_heads, cache.head_dim)
    memo = _memo(cache)
    if key not in memo:
        memo[key] = all(unsupported(lay, which) is None for lay in layouts(cache, n_q_heads))
    return memo[key]


# ---------------------------------------------------------------------------------------------
# The kernels (veloxquant.kernels dialect)

_HELPERS = r"""
#ifndef VQ_KIVI_HELPERS
#define VQ_KIVI_HELPERS
// The `bits`-bit code at bit offset `off` of a little-endian bit stream of 32-bit words
// (`bits` a compile-time constant at every call: widths dividing 32 never cross a word, and
// the test folds away).
VQ_FN uint vq_kivi_bits(const VQ_GLOBAL uint32_t* w, uint sh, uint bits) {
  uint x = w[0] >> sh;
  if (32u % bits != 0u && sh + bits > 32u) x |= w[1] << (32u - sh);
  return x & ((1u << bits) - 1u);
}
VQ_FN uint vq_kivi_code(const VQ_GLOBAL uint32_t* w, uint off, uint bits) {
  return vq_kivi_bits(w + (off >> 5), off & 31u, bits);
}
#endif
"""

# A coded token's share of the values loop: each of the thread's channels, its code times the
# token's p·s of the channel's group, per query.
_VALUE_TOKEN = """
#define VQ_KIVI_VALUE_TOKEN(tt) \\
  { \\
    VQ_UNROLL \\
    for (int j = 0; j < CPT; ++j) { \\
      const int c = vc0 + j * TILE; /* the same bits of every token's row */ \\
      const float code = (float)vq_kivi_code(w + (tt) * VW, (uint)(c * VB), VB); \\
      VQ_UNROLL \\
      for (int g = 0; g < GQ; ++g) acc[g][j] += s_pw[((tt) * NG + c / G) * GQ + g] * code; \\
    } \\
  }
"""

# The partial kernel, written once for two ways of attending the coded tiles (the exact
# split's tokens take the CUDA cores either way): `_PARTIAL_BODY` on the CUDA cores, one token
# (scores) or one channel (values) per thread; `_MMA_PARTIAL_BODY` on the tensor cores (CUDA
# only, `mma_takes`). The @@NAME@@ lines are where they differ.
_PARTIAL_TEMPLATE = (
    EXACT_AT
    + """
  const int n_splits = iparams[2];
  const int split = (int)vq_gx;
  const int ci = (int)vq_gy;
  const int kvh = heads[4 * ci], krow = heads[4 * ci + 1], vrow = heads[4 * ci + 2];
  const int n_blocks = iparams[0], tiles_per_split = iparams[1];
  const int n_sink = iparams[3], n_win = iparams[4], n_new = iparams[5];
  const int kstride = iparams[6], vstride = iparams[7];
  const bool exact = split == n_splits;
  const int tid = (int)vq_tid;
  constexpr int NW = TILE / 32;
  constexpr int BPT = TILE / G;  // key blocks per tile
  constexpr int TL = D < TILE ? TILE / D : 1;  // token lanes of the value phase
  constexpr int CPT = D > TILE ? D / TILE : 1;  // channels per thread of the value phase
  constexpr int NG = D / G;  // value groups per token
  VQ_SHARED float s_q[GQ * D];
  VQ_SHARED float s_bias[BPT * GQ];
  VQ_SHARED float s_p[GQ * TILE];
  VQ_SHARED float s_m[GQ];
  VQ_SHARED float s_l[GQ];
  VQ_SHARED float s_corr[GQ];
@@CODED_ARRAYS@@

  for (int i = tid; i < GQ * D; i += TILE)
    s_q[i] = static_cast<float>(queries[kvh * GQ * D + i]) * fparams[0];
  if (tid < GQ) {
    s_m[tid] = NEG;
    s_l[tid] = 0.0f;
  }
  float acc[GQ][CPT];
  float zacc[GQ][NG];  // Σ p·z of this thread's token lane (coded tiles)
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g) {
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) acc[g][j] = 0.0f;
    VQ_UNROLL
    for (int grp = 0; grp < NG; ++grp) zacc[g][grp] = 0.0f;
  }
@@CODED_ACC@@
  const int vc0 = D < TILE ? tid % D : tid;  // this thread's first value channel
  const int vtl = D < TILE ? tid / D : 0;  // its token lane
  const int n_exact = n_sink + n_win + n_new;
  const int n_tiles_all = (n_blocks * G + TILE - 1) / TILE;
  const int t_begin = exact ? 0 : split * tiles_per_split;
  const int t_end =
      exact ? (n_exact + TILE - 1) / TILE : min(t_begin + tiles_per_split, n_tiles_all);
@@CODED_PROLOGUE@@
  VQ_BARRIER();

  for (int tile = t_begin; tile < t_end; ++tile) {
@@CODED_TILE_TOP@@
@@VALUE_SCALES@@
    // 1. scores of the tile's tokens into s_p
    if (!exact) {
@@CODED_SCORES@@
    } else {
      const int t = tile * TILE + tid;
      const bool valid = t < n_exact;
      float sc[GQ];
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = valid ? 0.0f : NEG;
      if (valid) {
        for (int c = 0; c < D; ++c) {
          const float k = VQ_EXACT_AT(sink_k, win_k, new_k, t, c);
          VQ_UNROLL
          for (int g = 0; g < GQ; ++g) sc[g] += s_q[g * D + c] * k;
        }
      }
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) s_p[g * TILE + tid] = sc[g];
    }
    VQ_BARRIER();

    // 2. online softmax, one SIMD group per query
    for (int g = (int)vq_warp; g < GQ; g += NW) {
      float mt = NEG;
      for (int i = (int)vq_lane; i < TILE; i += 32) mt = VQ_FMAX(mt, s_p[g * TILE + i]);
      mt = vq_simd_max(mt);
      const float m_old = s_m[g];
      const float m_new = VQ_FMAX(m_old, mt);
      float sum = 0.0f;
      for (int i = (int)vq_lane; i < TILE; i += 32) {
        const float s = s_p[g * TILE + i];
        const float p = s > 0.5f * NEG ? vq_exp2(s - m_new) : 0.0f;
        s_p[g * TILE + i] = p;
        sum += p;
      }
      sum = vq_simd_sum(sum);
      if (vq_lane == 0) {
        const float corr = vq_exp2(m_old - m_new);
        s_l[g] = s_l[g] * corr + sum;
        s_m[g] = m_new;
        s_corr[g] = corr;
      }
    }
    VQ_BARRIER();

    // 3. values. A coded token's value is code·s + z per group of G channels, so the sum
    // is Σ (p·s)·code + Σ p·z: one thread per token weighs its group scales by p and keeps
    // the zero-point sums of its token lane (zacc, merged once at the end), and the codes
    // meet only the weights p·s.
    if (!exact) {
@@CODED_WEIGHTS@@
      VQ_BARRIER();
    }
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g)
      VQ_UNROLL
      for (int j = 0; j < CPT; ++j) acc[g][j] *= s_corr[g];
    if (exact) {
      for (int tt = vtl; tt < TILE; tt += TL) {
        const int t = tile * TILE + tt;
        if (t >= n_exact) break;
        VQ_UNROLL
        for (int j = 0; j < CPT; ++j) {
          const float v = VQ_EXACT_AT(sink_v, win_v, new_v, t, vc0 + j * TILE);
          VQ_UNROLL
          for (int g = 0; g < GQ; ++g) acc[g][j] += s_p[g * TILE + tt] * v;
        }
      }
    } else {
@@CODED_VALUES@@
    }
    VQ_BARRIER();
  }
@@CODED_EPILOGUE@@

  // the zero-point sums of every token lane, per (query, group), into the channels' sums
  // (s_p is free now)
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g)
    VQ_UNROLL
    for (int grp = 0; grp < NG; ++grp) {
      const float z = vq_simd_sum(zacc[g][grp]);
      if (vq_lane == 0) s_p[(int)vq_warp * GQ * NG + g * NG + grp] = z;
    }
  VQ_BARRIER();
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g)
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) {
      const int grp = (vc0 + j * TILE) / G;
      float z = 0.0f;
      for (int w = 0; w < NW; ++w) z += s_p[w * GQ * NG + g * NG + grp];
      // the token lanes each add their share below: only lane 0 adds the zero points
      if (vtl == 0) acc[g][j] += z;
    }

  // the token lanes' sums (s_p again: TL·GQ·D = GQ·TILE floats)
  const int n_part = n_splits + 1;
  if (TL > 1) {
    VQ_BARRIER();
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g) s_p[(vtl * GQ + g) * D + vc0] = acc[g][0];
    VQ_BARRIER();
    if (vtl == 0) {
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g)
        for (int k = 1; k < TL; ++k) acc[g][0] += s_p[(k * GQ + g) * D + vc0];
    }
  }
  if (vtl == 0) {
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g) {
      const int part = (ci * GQ + g) * n_part + split;
      VQ_UNROLL
      for (int j = 0; j < CPT; ++j) part_o[part * D + vc0 + j * TILE] = acc[g][j];
      if (tid == 0) {
        part_m[part] = s_m[g];
        part_l[part] = s_l[g];
      }
    }
  }
"""
)

# The CUDA cores: a thread scores a token (one multiply-add per code and query, the query
# scaled per key block) and sums a channel's values (one per code and query).
_SCALAR_PIECES = {
    "CODED_ARRAYS": """
  VQ_SHARED float s_qs[BPT * GQ * D];
  VQ_SHARED float s_pw[TILE * NG * GQ];""",
    "CODED_ACC": "",
    "CODED_SCORES": """
      for (int i = tid; i < BPT * GQ * D; i += TILE) {
        const int blk = tile * BPT + i / (GQ * D), c = i % D;
        const int at = (krow * kstride + blk) * D + c;
        const float s = blk < n_blocks ? static_cast<float>(key_scale[at]) : 0.0f;
        s_qs[i] = s_q[(i / D) % GQ * D + c] * s;
      }
@@KEY_BIAS@@
      VQ_BARRIER();
      const int b = tid / G, u = tid % G, blk = tile * BPT + b;
      const bool valid = blk < n_blocks;
      float sc[GQ];
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = valid ? s_bias[b * GQ + g] : NEG;
      if (valid) {
        // channel c's codes are G·KB bits from the block row's bit c·G·KB on: when that is
        // whole words, this token's code of every channel sits at the same shift, one word
        // stride apart
        const VQ_GLOBAL uint32_t* w = key_codes + (krow * kstride + blk) * KW;
        if ((G * KB) % 32 == 0) {
          const VQ_GLOBAL uint32_t* wu = w + (u * KB >> 5);
          const uint sh = (uint)(u * KB) & 31u;
          VQ_UNROLL_BY(KUN)
          for (int c = 0; c < D; ++c) {
            const float code = (float)vq_kivi_bits(wu + c * (G * KB / 32), sh, KB);
            VQ_UNROLL
            for (int g = 0; g < GQ; ++g) sc[g] += s_qs[(b * GQ + g) * D + c] * code;
          }
        } else {
          VQ_UNROLL_BY(KUN)
          for (int c = 0; c < D; ++c) {
            const float code = (float)vq_kivi_code(w, (uint)((c * G + u) * KB), KB);
            VQ_UNROLL
            for (int g = 0; g < GQ; ++g) sc[g] += s_qs[(b * GQ + g) * D + c] * code;
          }
        }
      }
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) s_p[g * TILE + tid] = sc[g];""",
    "CODED_WEIGHTS": """
      VQ_UNROLL
      for (int grp = 0; grp < NG; ++grp) {
        VQ_UNROLL
        for (int g = 0; g < GQ; ++g) {
          const float p = s_p[g * TILE + tid];
          s_pw[(tid * NG + grp) * GQ + g] = p * vscale[grp];
          zacc[g][grp] = zacc[g][grp] * s_corr[g] + p * vzero[grp];
        }
      }""",
    "CODED_VALUES": """
      const int n_tile = min(TILE, n_blocks * G - tile * TILE);
      const VQ_GLOBAL uint32_t* w = value_codes + (vrow * vstride + tile * TILE) * VW;
      if (n_tile == TILE) {
        // a whole tile: a constant trip count, VUN tokens' code loads in flight at once
        VQ_UNROLL_BY(VUN)
        for (int k = 0; k < TILE / TL; ++k) VQ_KIVI_VALUE_TOKEN(vtl + k * TL)
      } else {
        for (int tt = vtl; tt < n_tile; tt += TL) VQ_KIVI_VALUE_TOKEN(tt)
      }""",
    "CODED_EPILOGUE": "",
    "CODED_PROLOGUE": "",
    "CODED_TILE_TOP": "",
    "VALUE_SCALES": """
    // this thread's token's value scales and zero points, asked for first so that they
    // arrive during the key scores (they wait for nothing)
    float vscale[NG], vzero[NG];
    if (!exact) {
      const int tok = tile * TILE + tid;
      const bool live = tok < n_blocks * G;
      const int row = vrow * vstride + (live ? tok : 0);
      VQ_UNROLL
      for (int grp = 0; grp < NG; ++grp) {
        vscale[grp] = live ? static_cast<float>(value_scale[row * NG + grp]) : 0.0f;
        vzero[grp] = live ? static_cast<float>(value_zero[row * NG + grp]) : 0.0f;
      }
    }""",
}

# The bias of each (key block, query) of the tile: Σ_c q_c·z[blk, c], one SIMD group per pair;
# VQ_KIVI_KEY_ZERO(b, c) is the zero point of channel c of the tile's block b, read from the
# store (CUDA cores) or from the tile's copy in threadgroup memory (tensor cores).
_KEY_BIAS = """
      for (int pair = (int)vq_warp; pair < BPT * GQ; pair += NW) {
        const int b = pair / GQ, g = pair % GQ;
        float z = 0.0f;
        if (tile * BPT + b < n_blocks)
          for (int c = (int)vq_lane; c < D; c += 32)
            z += s_q[g * D + c] * static_cast<float>(VQ_KIVI_KEY_ZERO(b, c));
        z = vq_simd_sum(z);
        if (vq_lane == 0) s_bias[pair] = z;
      }"""
_SCALAR_KEY_ZERO = """
#define VQ_KIVI_KEY_ZERO(b, c) key_zero[(krow * kstride + tile * BPT + (b)) * D + (c)]
"""
_MMA_KEY_ZERO = """
#define VQ_KIVI_KEY_ZERO(b, c) VQ_STAGED(st, 1, key_zero, (b) * D + (c))
"""

# The tensor cores (mma m16n8k16, f16 operands, f32 sums). SIMD group w takes the tile's
# tokens 32w .. 32w + 31, which lie in one key block (G >= 32):
# - scores S[token][query] = Σ_c code[token][c]·qs[c][query]: A = the codes (rows: two M-tiles
#   of 16 tokens; columns: 16 channels a step, lane L's four the channels 4 (L % 4) + {0..3}
#   of the step, as A's columns 2 (L % 4) + {0, 1, 8, 9}: any order works when B's agrees),
#   B = the per-block qs (rows: those channels, columns: queries);
# - values O[c][query] += Σ_t code[t][c]·pw[t][query] per value group: A = the codes
#   transposed (rows: 16 channels, columns: 16 tokens a step), B = p·s.
# A code is exact in f16 (the 0x6400 trick: 1024 + code, then 1024 off), and B is split into
# its f16 high and low parts, two MMAs per A, so the sums are float32's to ~2^-22 of each
# operand, as on the CUDA cores.
# Lane L = 4 r + q4 holds A's rows r and r + 8: with KB = 2 one word of a channel's codes holds
# 16 consecutive tokens, token r at bit 2r and r + 8 at 2r + 16, so one shift serves both
# rows (PRMT 0x5410 takes the low halves, 0x7632 the high); with 4 bits, r + 8 is in the next
# word at the same shift. Values' rows are channels, laid out likewise along a token's row.
_MMA_PIECES = {
    "CODED_ARRAYS": """
  // qs of the tile's key blocks, [block][query][4 channels]: f16 high parts (x, y), low (z, w)
  // (rows of D / 4 + 4: a SIMD group's queries read at once fall in different banks; so too
  // the code rows below, 16 bytes longer every 4 key channels and every 2 value rows)
  constexpr int QHR = D / 4 + 4, PWR = TILE / 2 + 4;  // row lengths of s_qh, s_pwh
  VQ_SHARED uint4 s_qh[BPT * GQ * QHR];
  // p·s, [value group][query][2 tokens]: f16 high parts (x), low parts (y)
  VQ_SHARED uint2 s_pwh[NG * GQ * PWR];
  const int mr = (int)vq_lane >> 2, mq = (int)vq_lane & 3;  // A's rows mr, mr + 8; B's column mr
  const int mn = mr < GQ ? mr : GQ - 1;  // B's column's query (columns >= GQ are never read)
  const int mt0 = 32 * (int)vq_warp;  // the SIMD group's first token of a tile
  // the code rows of STAGES tiles (a tile's BPT key blocks, its TILE value rows), copied in
  // (cp.async) a tile ahead when STAGES is 2, so that the MMAs wait on no load from memory
  constexpr int CW = G * KB / 32;  // words of a key channel's codes in a block
  constexpr int KWP = KW + D, VWP = 2 * VW + 4;  // words of a key block, of two value rows
  constexpr int KC4 = BPT * KWP / 4, VC4 = TILE / 2 * VWP / 4;  // uint4s of a tile's codes
  VQ_SHARED uint4 s_kc[STAGES * KC4];
  VQ_SHARED uint4 s_vc[STAGES * VC4];
  // and their scales and zero points: the key blocks' (BPT * D each), the value rows' (TILE *
  // NG each), in the store's own dtype (2 bytes)
  static_assert(sizeof(key_scale[0]) == 2 && sizeof(value_scale[0]) == 2, "f16 scales");
  constexpr int KS4 = BPT * D / 8, VS4 = TILE * NG / 8;  // uint4s of each
  static_assert(KS4 <= TILE && VS4 <= TILE, "one copy of each part a thread");
  VQ_SHARED uint4 s_sz[STAGES * 2 * (KS4 + VS4)];
  // element i of part 0..3 (key scale, key zero, value scale, value zero) of stage st, typed as
  // the store's
#define VQ_STAGED(st, part, arr, i) \
  reinterpret_cast<decltype(arr)>(&s_sz[(st) * 2 * (KS4 + VS4) + (part) * KS4 + \
                                        ((part) > 2 ? VS4 - KS4 : 0)])[i]
  // tile t's rows into stage st, 16 bytes a copy; a store's last tile may end early, and its
  // rows past the end are neither copied nor read
  auto stage_codes = [&](int t, int st) {
    const int nb = min(BPT, n_blocks - t * BPT);
    const VQ_GLOBAL uint4* kg =
        reinterpret_cast<const VQ_GLOBAL uint4*>(key_codes + (krow * kstride + t * BPT) * KW);
    for (int i = tid; i < nb * KW / 4; i += TILE) {
      const int b = 4 * i / KW, at = 4 * i % KW;  // a copy never straddles 4 channels
      vq_cp_async16(&s_kc[st * KC4 + (b * KWP + at + at / (4 * CW) * 4) / 4], kg + i);
    }
    const VQ_GLOBAL uint4* vg =
        reinterpret_cast<const VQ_GLOBAL uint4*>(value_codes + (vrow * vstride + t * TILE) * VW);
    for (int i = tid; i < nb * G * VW / 4; i += TILE) {
      const int t = 4 * i / VW, at = 4 * i % VW;
      vq_cp_async16(&s_vc[st * VC4 + (t / 2 * VWP + t % 2 * VW + at) / 4], vg + i);
    }
    VQ_TG uint4* sz = &s_sz[st * 2 * (KS4 + VS4)];
    const int kat = (krow * kstride + t * BPT) * D, vat = (vrow * vstride + t * TILE) * NG;
    if (tid < nb * D / 8) {  // KS4 <= TILE: one copy of each a thread
      vq_cp_async16(&sz[tid], reinterpret_cast<const VQ_GLOBAL uint4*>(key_scale + kat) + tid);
      vq_cp_async16(&sz[KS4 + tid], reinterpret_cast<const VQ_GLOBAL uint4*>(key_zero + kat) + tid);
    }
    if (tid < nb * G * NG / 8) {  // VS4 <= TILE likewise
      VQ_TG uint4* v = &sz[2 * KS4];
      const VQ_GLOBAL uint4* vs = reinterpret_cast<const VQ_GLOBAL uint4*>(value_scale + vat);
      const VQ_GLOBAL uint4* vz = reinterpret_cast<const VQ_GLOBAL uint4*>(value_zero + vat);
      vq_cp_async16(&v[tid], vs + tid);
      vq_cp_async16(&v[VS4 + tid], vz + tid);
    }
    vq_cp_async_commit();
  };""",
    "VALUE_SCALES": "",
    "CODED_PROLOGUE": """
  if (!exact && STAGES == 2 && t_begin < t_end) stage_codes(t_begin, 0);""",
    "CODED_TILE_TOP": """
    const int st = STAGES == 2 ? (tile - t_begin) & 1 : 0;  // this tile's stage
    if (!exact) {  // the copies this tile waits for go out first (stage st ^ 1 was read last tile)
      if (STAGES == 1) stage_codes(tile, 0);
      else if (tile + 1 < t_end) stage_codes(tile + 1, st ^ 1);
    }""",
    "CODED_ACC": """
  float cf[D / 16][4];  // O's C fragments: rows channels 16m + mr (+8), columns queries 2mq (+1)
  VQ_UNROLL
  for (int m = 0; m < D / 16; ++m)
    VQ_UNROLL
    for (int e = 0; e < 4; ++e) cf[m][e] = 0.0f;""",
    "CODED_SCORES": """
      // this tile's stage: each thread waits for its own copies, the barrier shows them to all
      if (STAGES == 2 && tile + 1 < t_end)
        vq_cp_async_wait<1>();
      else
        vq_cp_async_wait<0>();
      VQ_BARRIER();
      for (int i = tid; i < BPT * GQ * D / 4; i += TILE) {
        const int blk = tile * BPT + i / (GQ * D / 4), g = (i / (D / 4)) % GQ;
        const int c = 4 * (i % (D / 4));
        const int at = (blk - tile * BPT) * D + c;
        float x[4];
        VQ_UNROLL
        for (int k = 0; k < 4; ++k)
          x[k] = blk < n_blocks
                     ? s_q[g * D + c + k] * static_cast<float>(VQ_STAGED(st, 0, key_scale, at + k))
                     : 0.0f;
        uint4 h;
        h.x = vq_pack_half2(x[0], x[1]);
        h.y = vq_pack_half2(x[2], x[3]);
        h.z = vq_pack_half2(x[0] - vq_round_half(x[0]), x[1] - vq_round_half(x[1]));
        h.w = vq_pack_half2(x[2] - vq_round_half(x[2]), x[3] - vq_round_half(x[3]));
        s_qh[i / (D / 4) * QHR + i % (D / 4)] = h;
      }
@@KEY_BIAS@@
      VQ_BARRIER();
      const int b = mt0 / G, blk = tile * BPT + b;
      float sc[2][4];
      VQ_UNROLL
      for (int mt = 0; mt < 2; ++mt)
        VQ_UNROLL
        for (int e = 0; e < 4; ++e) sc[mt][e] = 0.0f;
      if (blk < n_blocks) {  // the same for the whole SIMD group
        // channel c's codes: G·KB / 32 words; the SIMD group's 32 tokens are KB of them
        const uint32_t* w =
            reinterpret_cast<const uint32_t*>(&s_kc[st * KC4]) + b * KWP + (mt0 % G) * KB / 32;
        VQ_UNROLL
        for (int ks = 0; ks < D / 16; ++ks) {
          const uint4 bq = s_qh[(b * GQ + mn) * QHR + 4 * ks + mq];
          const uint32_t bh[2] = {bq.x, bq.y}, bl[2] = {bq.z, bq.w};
          // each channel's words: with 2 bits both M-tiles' at once, with 4 one M-tile's at a
          // time (fewer registers)
          uint32_t cw[4][2];
          const uint32_t* wk = w + 16 * ks * CW + 4 * mq * CW + 4 * (4 * ks + mq);
          VQ_UNROLL
          for (int k = 0; k < 4; ++k)
            if (KB == 2) vq_kivi_words(cw[k], wk + k * CW);
          VQ_UNROLL
          for (int mt = 0; mt < 2; ++mt) {
            uint32_t lo[4], hi[4], a[4];  // channel k's words of tokens mr, mr + 8
            VQ_UNROLL
            for (int k = 0; k < 4; ++k) {
              if (KB == 4) vq_kivi_words(cw[k], wk + k * CW + 2 * mt);
              lo[k] = cw[k][KB == 2 ? mt : 0];
              hi[k] = cw[k][1];
            }
            vq_kivi_a<KB>(a, lo, hi, mr);
            vq_mma_16816(sc[mt], a, bh);
            vq_mma_16816(sc[mt], a, bl);
          }
        }
      }
      VQ_UNROLL
      for (int mt = 0; mt < 2; ++mt)
        VQ_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int t = mt0 + 16 * mt + mr + 8 * (e >> 1), g = 2 * mq + (e & 1);
          if (g < GQ) s_p[g * TILE + t] = blk < n_blocks ? s_bias[b * GQ + g] + sc[mt][e] : NEG;
        }""",
    "CODED_WEIGHTS": """
      const bool live = tile * TILE + tid < n_blocks * G;
      VQ_UNROLL
      for (int grp = 0; grp < NG; ++grp) {
        const int at = tid * NG + grp;
        const float vscale = live ? static_cast<float>(VQ_STAGED(st, 2, value_scale, at)) : 0.0f;
        const float vzero = live ? static_cast<float>(VQ_STAGED(st, 3, value_zero, at)) : 0.0f;
        VQ_UNROLL
        for (int g = 0; g < GQ; ++g) {
          const float p = s_p[g * TILE + tid];
          const float x = p * vscale;
          const float y = vq_shfl_xor(x, 1);  // the next token's (this one is even)
          if ((tid & 1) == 0) {
            uint2 h;
            h.x = vq_pack_half2(x, y);
            h.y = vq_pack_half2(x - vq_round_half(x), y - vq_round_half(y));
            s_pwh[(grp * GQ + g) * PWR + tid / 2] = h;
          }
          zacc[g][grp] = zacc[g][grp] * s_corr[g] + p * vzero;
        }
      }""",
    "CODED_VALUES": """
      VQ_UNROLL
      for (int m = 0; m < D / 16; ++m)
        VQ_UNROLL
        for (int e = 0; e < 4; ++e) cf[m][e] *= s_corr[min(2 * mq + (e & 1), GQ - 1)];
      if (tile * BPT + mt0 / G < n_blocks) {  // the same for the whole SIMD group
        VQ_UNROLL
        for (int ks = 0; ks < 2; ++ks) {
          // A's columns 2 mq + {0, 1} are tokens tk + {0, 1}, columns 2 mq + {8, 9} tk + {8, 9}
          const int tk = mt0 + 16 * ks + 2 * mq;
          // rows tk + {0, 1, 8, 9}: uint4 j * VW / 4 from pair tk / 2, then 4 pairs on
          const int row0 = st * VC4 + tk / 2 * (VWP / 4);
          VQ_UNROLL
          for (int ch = 0; ch < VW / 4; ++ch) {  // 128 bits of each row: 8 / VB M-tiles
            uint32_t v[4][4];
            VQ_UNROLL
            for (int j = 0; j < 4; ++j) {
              const uint4 x = s_vc[row0 + (j >> 1) * VWP + (j & 1) * (VW / 4) + ch];
              v[j][0] = x.x;
              v[j][1] = x.y;
              v[j][2] = x.z;
              v[j][3] = x.w;
            }
            VQ_UNROLL
            for (int mm = 0; mm < 8 / VB; ++mm) {
              const int m = ch * (8 / VB) + mm, grp = 16 * m / G;
              const uint2 p0 = s_pwh[(grp * GQ + mn) * PWR + tk / 2];
              const uint2 p1 = s_pwh[(grp * GQ + mn) * PWR + tk / 2 + 4];
              const uint32_t bh[2] = {p0.x, p1.x}, bl[2] = {p0.y, p1.y};
              uint32_t lo[4], hi[4], a[4];  // row j's words of channels 16m + mr, + 8
              VQ_UNROLL
              for (int j = 0; j < 4; ++j) {
                lo[j] = v[j][VB == 2 ? mm : (2 * mm) % 4];
                hi[j] = v[j][(2 * mm + 1) % 4];
              }
              vq_kivi_a<VB>(a, lo, hi, mr);
              vq_mma_16816(cf[m], a, bh);
              vq_mma_16816(cf[m], a, bl);
            }
          }
        }
      }""",
    "CODED_EPILOGUE": """
  if (!exact) {
    // the SIMD groups' fragments summed in order into s_q (free now), then each thread takes
    // its channel's sums as the CUDA cores would hold them
    for (int w = 0; w < NW; ++w) {
      if ((int)vq_warp == w) {
        VQ_UNROLL
        for (int m = 0; m < D / 16; ++m)
          VQ_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int c = 16 * m + mr + 8 * (e >> 1), g = 2 * mq + (e & 1);
            if (g < GQ) s_q[g * D + c] = (w > 0 ? s_q[g * D + c] : 0.0f) + cf[m][e];
          }
      }
      VQ_BARRIER();
    }
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g) acc[g][0] = vtl == 0 ? s_q[g * D + vc0] : 0.0f;
  }""",
}

_MMA_HELPERS = r"""
#ifndef VQ_KIVI_MMA_HELPERS
#define VQ_KIVI_MMA_HELPERS
// mma's A fragment (lane L: rows r = L / 4 and r + 8, columns 2 (L % 4) + {0, 1} and + 8, the
// registers' halves two adjacent columns) from B-bit codes: lo[k] / hi[k] the words holding
// column pair half k's codes of row r / r + 8, k = 0..3 for columns 2 (L % 4), + 1, + 8, + 9.
// With 2 bits one word holds a 16-code run, row r at bit 2r and r + 8 at 2r + 16 (hi unused);
// with 4 bits row r + 8 is the next word's, at the same bit 4r.
template <int B>
VQ_FN void vq_kivi_a(uint32_t (&a)[4], const uint32_t (&lo)[4], const uint32_t (&hi)[4], int r) {
  constexpr uint32_t MASK = ((1u << B) - 1u) * 0x00010001u;
  uint32_t x[4], y[4];
  for (int k = 0; k < 4; ++k) {
    x[k] = lo[k] >> (B * r);
    y[k] = hi[k] >> (B * r);
  }
  if (B == 2) {
    a[0] = vq_codes_half2(x[0], x[1], 0x5410u, MASK);
    a[1] = vq_codes_half2(x[0], x[1], 0x7632u, MASK);
    a[2] = vq_codes_half2(x[2], x[3], 0x5410u, MASK);
    a[3] = vq_codes_half2(x[2], x[3], 0x7632u, MASK);
  } else {
    a[0] = vq_codes_half2(x[0], x[1], 0x5410u, MASK);
    a[1] = vq_codes_half2(y[0], y[1], 0x5410u, MASK);
    a[2] = vq_codes_half2(x[2], x[3], 0x5410u, MASK);
    a[3] = vq_codes_half2(y[2], y[3], 0x5410u, MASK);
  }
}
// two consecutive words of codes in threadgroup memory (8 bytes, aligned)
VQ_FN void vq_kivi_words(uint32_t (&out)[2], const uint32_t* p) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  out[0] = x.x;
  out[1] = x.y;
}
#endif
"""


def _partial_body(pieces: dict[str, str]) -> str:
    body = _PARTIAL_TEMPLATE
    for name, text in pieces.items():
        text = text.lstrip("\n").replace("@@KEY_BIAS@@", _KEY_BIAS.lstrip("\n"))
        body = body.replace(f"@@{name}@@", text)
    assert "@@" not in body
    return body


_PARTIAL_BODY = _VALUE_TOKEN + _SCALAR_KEY_ZERO + _partial_body(_SCALAR_PIECES)
_MMA_PARTIAL_BODY = _MMA_KEY_ZERO + _partial_body(_MMA_PIECES)

PARTIAL_INPUTS = (
    "queries",
    "heads",
    "key_codes",
    "key_scale",
    "key_zero",
    "value_codes",
    "value_scale",
    "value_zero",
    "sink_k",
    "sink_v",
    "win_k",
    "win_v",
    "new_k",
    "new_v",
    "iparams",
    "fparams",
)


@functools.lru_cache(maxsize=64)  # a decode step asks once per layer and layout
def mma_takes(lay: Layout) -> str | None:
    """Why the tensor-core partial kernel does not take a layout (None when it does): it
    reads 2- and 4-bit codes only (a word's tokens or channels then line up with mma's
    fragment rows), 32 tokens of a key block per SIMD group, and channels in M-tiles of 16."""
    if lay.key_bits not in (2, 4) or lay.value_bits not in (2, 4):
        return f"{lay.key_bits}/{lay.value_bits} bits (the tensor cores take 2 and 4)"
    if lay.group_size < 32:
        return f"group_size {lay.group_size} (the tensor cores take 32 or more)"
    if lay.head_dim not in (64, 128):
        return f"head_dim {lay.head_dim} (the tensor cores take 64 and 128)"
    if threadgroup_bytes(lay, mma=True) > THREADGROUP_LIMIT["cuda"]:
        need, limit = threadgroup_bytes(lay, mma=True), THREADGROUP_LIMIT["cuda"]
        return f"{need} bytes of threadgroup memory on the tensor cores (at most {limit})"
    return None


def use_mma(lay: Layout) -> bool:
    """Whether this process's partial launch for `lay` takes the tensor cores."""
    bits = {lay.key_bits, lay.value_bits}
    return MMA and backend() == "cuda" and mma_takes(lay) is None and bits <= set(MMA_BITS)


def partial_kernel_source(lay: Layout, mma: bool = False) -> KernelSource:
    return _partial_kernel_source(lay, KEY_UNROLL, VALUE_UNROLL, mma)


@functools.lru_cache(maxsize=64)
def _partial_kernel_source(
    lay: Layout, key_unroll: int, value_unroll: int, mma: bool = False
) -> KernelSource:
    if mma:
        assert mma_takes(lay) is None, mma_takes(lay)
    constants = {
        "TILE": TILE,
        "NEG": NEG,
        "D": lay.head_dim,
        "G": lay.group_size,
        "GQ": lay.queries_per_kv,
        "KB": lay.key_bits,
        "VB": lay.value_bits,
        "KW": lay.key_words,
        "VW": lay.value_words,
        "KUN": key_unroll,
        "VUN": value_unroll,
    }
    source = KernelSource(
        name="vq_kivi_attn_partial",
        inputs=PARTIAL_INPUTS,
        outputs=("part_m", "part_l", "part_o"),
        body=_PARTIAL_BODY,
        constants=constants,
        threads=TILE,
        helpers=_HELPERS,
    )
    if not mma:
        return source
    return replace(
        source,
        name="vq_kivi_attn_partial_mma",
        body=_MMA_PARTIAL_BODY,
        constants={**constants, "STAGES": mma_stages(lay)},
        helpers=TENSOR_CORE_HELPERS + _HELPERS + _MMA_HELPERS,
        backends=("cuda",),
    )


@functools.lru_cache(maxsize=64)
def combine_kernel_source(head_dim: int, queries_per_kv: int, out_dtype: mx.Dtype) -> KernelSource:
    return split_combine_source(
        "vq_kivi_attn_combine", head_dim, queries_per_kv, out_dtype, TILE, COMBINE_UNROLL
    )


# ---------------------------------------------------------------------------------------------
# Launching them


def split_tiles(
    n_blocks: int,
    group_size: int,
    n_heads: int,
    target: int | None = None,
    per_multiprocessor: int | None = None,
    threadgroup_bytes: int = 0,
) -> int:
    """Tiles of the store per split: enough splits for about `target` threadgroups over a
    launch of `n_heads` KV heads (default TARGET_GROUPS, read at call time so a benchmark can
    sweep it; where None, `per_multiprocessor` (default GROUPS_PER_MULTIPROCESSOR) per CUDA
    multiprocessor, or as many threadgroups of `threadgroup_bytes` as one holds where the
    card's shared memory holds fewer; 1056 on Metal)."""
    if target is None:
        per = per_multiprocessor or GROUPS_PER_MULTIPROCESSOR
        target = split_target(TARGET_GROUPS, per, 1056, threadgroup_bytes)
    n_tiles = -(-n_blocks * group_size // TILE)
    if n_tiles == 0:
        return 1
    splits = max(1, min(n_tiles, -(-target // n_heads)))
    return -(-n_tiles // splits)


def _int_params(values: tuple[int, ...]) -> mx.array:
    return launch_params(tuple(values) + (0,) * (PARAMS - len(values)))


@functools.lru_cache(maxsize=16)
def _float_params(value: float) -> mx.array:
    # read by every launch, so on CUDA copied out of the managed memory a host-made array
    # lives in (veloxquant.kernels.DEVICE_LAUNCH_PARAMS)
    return device_resident(mx.array([value] + [0.0] * 7, mx.float32))


@functools.lru_cache(maxsize=16)
def _dummy(dtype: mx.Dtype) -> mx.array:
    return mx.zeros((8,), dtype)


def head_table(cache: Any, lay: Layout) -> tuple[mx.array, int]:
    """(int32 [max(4·n, 8)], n): for each of the n KV heads with this layout's bits, (the head,
    its row in the key store's bucket, its row in the value store's bucket, 0)."""
    key = ("heads", lay.key_bits, lay.value_bits)
    memo = _memo(cache)
    if key not in memo:
        rows = []
        key_heads = dict(cache.buckets["key"])[lay.key_bits].tolist()
        value_heads = dict(cache.buckets["value"])[lay.value_bits].tolist()
        for h, (kb, vb) in enumerate(cache.head_bits.tolist()):
            if (kb, vb) == (lay.key_bits, lay.value_bits):
                rows += [h, key_heads.index(h), value_heads.index(h), 0]
        n = len(rows) // 4
        rows += [0] * max(0, 8 - len(rows))
        memo[key] = (device_resident(mx.array(rows, mx.int32)), n)  # as _float_params
    return memo[key]


def combined_head_table(cache: Any, n_q_heads: int) -> mx.array:
    """Every layout's head table rows, layout after layout: the combine's for the partial rows
    of a mixed allocation's launches, made once per cache (it was a concatenation per step)."""
    key = ("combined_heads", n_q_heads, cache.head_dim)
    memo = _memo(cache)
    if key not in memo:
        tables = [head_table(cache, lay) for lay in layouts(cache, n_q_heads)]
        rows = mx.concatenate([t[: 4 * n] for t, n in tables])
        memo[key] = device_resident(rows)  # as head_table's
    return memo[key]


def launch_heads(cache: Any, n_q_heads: int) -> int:
    """KV heads of the cache's largest partial launch (one launch per layout)."""
    key = ("launch_heads", n_q_heads, cache.head_dim)
    memo = _memo(cache)
    if key not in memo:
        memo[key] = max(head_table(cache, lay)[1] for lay in layouts(cache, n_q_heads))
    return memo[key]


def attention_inputs(
    cache: Any,
    queries: mx.array,
    scale: float,
    pending: dict,
    lay: Layout,
    n_splits: int,
    tiles_per_split: int,
) -> list[mx.array]:
    """The partial kernel's inputs for one layout (B = 1, one query per head)."""
    n_q = queries.shape[1]
    n_blocks = pending["n_quantized"] // cache.group_size
    keys = pending["store"]["key"].get(lay.key_bits) if n_blocks else None
    values = pending["store"]["value"].get(lay.value_bits) if n_blocks else None
    sinks = pending["sinks"] or (cache.sink_keys, cache.sink_values)
    win = pending["win"]
    new_k, new_v = pending["new"]
    n_sink = 0 if sinks[0] is None else int(sinks[0].shape[2])
    n_win = 0 if win is None else int(win[0].shape[2])
    n_new = int(new_k.shape[2])
    exact = []
    for pair, n in ((sinks, n_sink), (win, n_win), ((new_k, new_v), n_new)):
        if n == 0:
            exact += [_dummy(mx.float16), _dummy(mx.float16)]
        else:
            exact += [pair[0], pair[1]]
    if keys is None:
        store = [_dummy(mx.uint32), _dummy(mx.float16), _dummy(mx.float16)] * 2
        kstride = vstride = 0
    else:
        store = [keys["codes"], keys["scale"], keys["zero"]]
        store += [values["codes"], values["scale"], values["zero"]]
        kstride, vstride = int(keys["codes"].shape[2]), int(values["codes"].shape[2])
    iparams = (n_blocks, tiles_per_split, n_splits, n_sink, n_win, n_new, kstride, vstride)
    return [
        queries.reshape(n_q, -1),
        head_table(cache, lay)[0],
        *store,
        *exact,
        _int_params(iparams),
        _float_params(scale * math.log2(math.e)),
    ]


def decode_attention(cache: Any, queries: mx.array, scale: float, pending: dict) -> mx.array:
    """Attention of one query per head [1, H_q, 1, D] over the cache at `pending` (the state a
    fused update left), in the kernels: a partial launch per layout, then the combine."""
    n_kv, d = cache.head_bits.shape[0], cache.head_dim
    n_q = queries.shape[1]
    gq = n_q // n_kv
    n_blocks = pending["n_quantized"] // cache.group_size
    lays = layouts(cache, n_q)
    tensor = [use_mma(lay) for lay in lays]
    # every launch takes the same splits (the combine reads one count)
    fit = MMA_GROUPS_PER_MULTIPROCESSOR if any(tensor) else GROUPS_PER_MULTIPROCESSOR
    nbytes = max(threadgroup_bytes(lay, mma) for lay, mma in zip(lays, tensor, strict=True))
    heads = launch_heads(cache, n_q)
    per = split_tiles(n_blocks, cache.group_size, heads, None, fit, nbytes)
    n_tiles = -(-n_blocks * cache.group_size // TILE)
    n_splits = -(-n_tiles // per)
    parts = []
    for lay, mma in zip(lays, tensor, strict=True):
        inputs = attention_inputs(cache, queries, scale, pending, lay, n_splits, per)
        n_heads = head_table(cache, lay)[1]
        rows = n_heads * gq
        parts.append(
            launch(
                partial_kernel_source(lay, mma),
                inputs,
                (n_splits + 1, n_heads, 1),
                [(rows, n_splits + 1), (rows, n_splits + 1), (rows, n_splits + 1, d)],
                [mx.float32] * 3,
            )
        )
        # slot 2 of the launch parameters, n_splits, the combine reads, is every layout's
        iparams = inputs[PARTIAL_INPUTS.index("iparams")]
    if len(parts) == 1:
        (m, sums, o), heads = parts[0], inputs[PARTIAL_INPUTS.index("heads")]
    else:
        m, sums, o = (mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        heads = combined_head_table(cache, n_q)
    if m.size < 8:  # launch inputs hold >= 8 elements; the combine reads rows < n_q only
        pad = -(-8 // m.shape[1]) - m.shape[0]
        m, sums = (mx.concatenate([x, mx.zeros((pad, x.shape[1]), x.dtype)]) for x in (m, sums))
        o = mx.concatenate([o, mx.zeros((pad, *o.shape[1:]), o.dtype)])
    (out,) = launch(
        combine_kernel_source(d, gq, queries.dtype),
        [m, sums, o, heads, iparams],
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
    """Attention of queries [B, H_q, N, D] over the sinks, the store's first n_quantized tokens
    (the snapshot in `pending`) and the pending exact tokens, under an online softmax over
    pieces of the store, so no more than a piece is ever dequantized. Float32 math."""
    b, n_q, n, d = queries.shape
    h = cache.head_bits.shape[0]
    g = n_q // h
    f32 = mx.float32
    n_quant = int(pending["n_quantized"])
    fk, fv, n_sink = attention.exact_tokens(cache, pending)
    total = n_quant + int(fk.shape[2])
    q = (queries.astype(f32) * scale).reshape(b, h, g * n, d)
    run = attention.OnlineSoftmax(q, n)
    gs = cache.group_size
    piece = max(gs, min(PIECE_TOKENS, PIECE_ELEMENTS // max(1, b * n_q * n)) // gs * gs)
    store = pending["store"]
    for a in range(0, n_quant, piece):
        e = min(n_quant, a + piece)
        keys = cache._dequantize("key", store, a // gs, e // gs)
        values = cache._dequantize("value", store, a // gs, e // gs)
        run.add(keys, values, attention.mask_columns(mask, n, total, n_sink + a, e - a))
        if n > 1:  # prefill: keep one piece's intermediates alive at a time
            mx.eval(run.m, run.l, run.o)

    run.add_exact(fk, fv, n_sink, n_quant, mask)
    return run.result(queries.dtype)
