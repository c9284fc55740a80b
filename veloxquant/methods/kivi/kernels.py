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
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant import attention
from veloxquant.kernels import (
    KernelSource,
    backend,
    device_resident,
    launch,
    launch_params,
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


def threadgroup_bytes(lay: Layout) -> int:
    """Threadgroup memory of the partial kernel: the scaled queries, the per-block query
    scales and biases, the tile's scores, its tokens' value-scale weights and the softmax
    state."""
    d, gq, blocks = lay.head_dim, lay.queries_per_kv, TILE // lay.group_size
    groups = d // lay.group_size
    floats = gq * d + blocks * gq * d + blocks * gq + gq * TILE + TILE * groups * gq + 3 * gq
    return 4 * floats


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

# The exact tokens in position order: sinks, window, the call's own.
_EXACT_AT = """
#define VQ_EXACT_AT(sink, win, cur, t, c) \\
  ((t) < n_sink ? static_cast<float>(sink[(kvh * n_sink + (t)) * D + (c)]) \\
   : (t) < n_sink + n_win ? static_cast<float>(win[(kvh * n_win + (t) - n_sink) * D + (c)]) \\
   : static_cast<float>(cur[(kvh * n_new + (t) - n_sink - n_win) * D + (c)]))
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

_PARTIAL_BODY = (
    _EXACT_AT
    + _VALUE_TOKEN
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
  VQ_SHARED float s_qs[BPT * GQ * D];
  VQ_SHARED float s_bias[BPT * GQ];
  VQ_SHARED float s_p[GQ * TILE];
  VQ_SHARED float s_pw[TILE * NG * GQ];
  VQ_SHARED float s_m[GQ];
  VQ_SHARED float s_l[GQ];
  VQ_SHARED float s_corr[GQ];

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
  const int vc0 = D < TILE ? tid % D : tid;  // this thread's first value channel
  const int vtl = D < TILE ? tid / D : 0;  // its token lane
  const int n_exact = n_sink + n_win + n_new;
  const int n_tiles_all = (n_blocks * G + TILE - 1) / TILE;
  const int t_begin = exact ? 0 : split * tiles_per_split;
  const int t_end =
      exact ? (n_exact + TILE - 1) / TILE : min(t_begin + tiles_per_split, n_tiles_all);
  VQ_BARRIER();

  for (int tile = t_begin; tile < t_end; ++tile) {
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
    }
    // 1. scores of the tile's tokens, one per thread
    float sc[GQ];
    bool valid;
    if (!exact) {
      for (int i = tid; i < BPT * GQ * D; i += TILE) {
        const int blk = tile * BPT + i / (GQ * D), c = i % D;
        const int at = (krow * kstride + blk) * D + c;
        const float s = blk < n_blocks ? static_cast<float>(key_scale[at]) : 0.0f;
        s_qs[i] = s_q[(i / D) % GQ * D + c] * s;
      }
      for (int pair = (int)vq_warp; pair < BPT * GQ; pair += NW) {
        const int blk = tile * BPT + pair / GQ, g = pair % GQ;
        float z = 0.0f;
        if (blk < n_blocks)
          for (int c = (int)vq_lane; c < D; c += 32)
            z += s_q[g * D + c] * static_cast<float>(key_zero[(krow * kstride + blk) * D + c]);
        z = vq_simd_sum(z);
        if (vq_lane == 0) s_bias[pair] = z;
      }
      VQ_BARRIER();
      const int b = tid / G, u = tid % G, blk = tile * BPT + b;
      valid = blk < n_blocks;
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
    } else {
      const int t = tile * TILE + tid;
      valid = t < n_exact;
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g) sc[g] = valid ? 0.0f : NEG;
      if (valid) {
        for (int c = 0; c < D; ++c) {
          const float k = VQ_EXACT_AT(sink_k, win_k, new_k, t, c);
          VQ_UNROLL
          for (int g = 0; g < GQ; ++g) sc[g] += s_q[g * D + c] * k;
        }
      }
    }
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g) s_p[g * TILE + tid] = sc[g];
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
    // is Σ (p·s)·code + Σ p·z: one thread per token weighs its group scales by p (s_pw) and
    // keeps the zero-point sums of its token lane (zacc, merged once at the end), and the
    // channel loop is one multiply-add per code and query.
    if (!exact) {
      VQ_UNROLL
      for (int grp = 0; grp < NG; ++grp) {
        VQ_UNROLL
        for (int g = 0; g < GQ; ++g) {
          const float p = s_p[g * TILE + tid];
          s_pw[(tid * NG + grp) * GQ + g] = p * vscale[grp];
          zacc[g][grp] = zacc[g][grp] * s_corr[g] + p * vzero[grp];
        }
      }
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
      const int n_tile = min(TILE, n_blocks * G - tile * TILE);
      const VQ_GLOBAL uint32_t* w = value_codes + (vrow * vstride + tile * TILE) * VW;
      if (n_tile == TILE) {
        // a whole tile: a constant trip count, VUN tokens' code loads in flight at once
        VQ_UNROLL_BY(VUN)
        for (int k = 0; k < TILE / TL; ++k) VQ_KIVI_VALUE_TOKEN(vtl + k * TL)
      } else {
        for (int tt = vtl; tt < n_tile; tt += TL) VQ_KIVI_VALUE_TOKEN(tt)
      }
    }
    VQ_BARRIER();
  }

  // the zero-point sums of every token lane, per (query, group), into the channels' sums
  // (s_pw is free now)
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g)
    VQ_UNROLL
    for (int grp = 0; grp < NG; ++grp) {
      const float z = vq_simd_sum(zacc[g][grp]);
      if (vq_lane == 0) s_pw[(int)vq_warp * GQ * NG + g * NG + grp] = z;
    }
  VQ_BARRIER();
  VQ_UNROLL
  for (int g = 0; g < GQ; ++g)
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) {
      const int grp = (vc0 + j * TILE) / G;
      float z = 0.0f;
      for (int w = 0; w < NW; ++w) z += s_pw[w * GQ * NG + g * NG + grp];
      // the token lanes each add their share below: only lane 0 adds the zero points
      if (vtl == 0) acc[g][j] += z;
    }

  // the token lanes' sums (s_qs is free now: TL <= BPT since G divides D)
  const int n_part = n_splits + 1;
  if (TL > 1) {
    VQ_UNROLL
    for (int g = 0; g < GQ; ++g) s_qs[(vtl * GQ + g) * D + vc0] = acc[g][0];
    VQ_BARRIER();
    if (vtl == 0) {
      VQ_UNROLL
      for (int g = 0; g < GQ; ++g)
        for (int k = 1; k < TL; ++k) acc[g][0] += s_qs[(k * GQ + g) * D + vc0];
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

_COMBINE_BODY = """
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

COMBINE_INPUTS = ("part_m", "part_l", "part_o", "heads", "iparams")


def partial_kernel_source(lay: Layout) -> KernelSource:
    return _partial_kernel_source(lay, KEY_UNROLL, VALUE_UNROLL)


@functools.lru_cache(maxsize=64)
def _partial_kernel_source(lay: Layout, key_unroll: int, value_unroll: int) -> KernelSource:
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
    return KernelSource(
        name="vq_kivi_attn_partial",
        inputs=PARTIAL_INPUTS,
        outputs=("part_m", "part_l", "part_o"),
        body=_PARTIAL_BODY,
        constants=constants,
        threads=TILE,
        helpers=_HELPERS,
    )


@functools.lru_cache(maxsize=64)
def combine_kernel_source(head_dim: int, queries_per_kv: int, out_dtype: mx.Dtype) -> KernelSource:
    constants = {
        "TILE": TILE,
        "NEG": NEG,
        "D": head_dim,
        "GQ": queries_per_kv,
        "OUT_T": out_dtype,
        "COMBINE_UNROLL": COMBINE_UNROLL,
    }
    return KernelSource(
        name="vq_kivi_attn_combine",
        inputs=COMBINE_INPUTS,
        outputs=("out",),
        body=_COMBINE_BODY,
        constants=constants,
        threads=TILE,
    )


# ---------------------------------------------------------------------------------------------
# Launching them


def split_tiles(n_blocks: int, group_size: int, n_heads: int, target: int | None = None) -> int:
    """Tiles of the store per split: enough splits for about `target` threadgroups over a
    launch of `n_heads` KV heads (default TARGET_GROUPS, read at call time so a benchmark can
    sweep it; where None, GROUPS_PER_MULTIPROCESSOR per CUDA multiprocessor, 1056 on Metal)."""
    if target is None:
        target = split_target(TARGET_GROUPS, GROUPS_PER_MULTIPROCESSOR, 1056)
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
    per = split_tiles(n_blocks, cache.group_size, launch_heads(cache, n_q))
    n_tiles = -(-n_blocks * cache.group_size // TILE)
    n_splits = -(-n_tiles // per)
    parts = []
    for lay in layouts(cache, n_q):
        inputs = attention_inputs(cache, queries, scale, pending, lay, n_splits, per)
        n_heads = head_table(cache, lay)[1]
        rows = n_heads * gq
        parts.append(
            launch(
                partial_kernel_source(lay),
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
