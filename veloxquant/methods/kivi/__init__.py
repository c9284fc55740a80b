"""KIVI: a packed, per-head mixed-precision asymmetric KV cache (the RateQuant runtime).

Paper: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
arXiv 2402.02750. DESIGN.md sections 7 and 8 (RateQuant runtime).

Quantizer (`quantize_keys`, `quantize_values`; float32 math, fp16 scale and zero):
- keys per channel, in groups of G consecutive tokens: each (channel, block of G tokens) gets
  its own min/max, because key outliers live in fixed channels;
- values per token, in groups of G channels: values have no channel outliers, and a token's
  error then stays in that token;
- asymmetric min/max: scale = (max - min) / (2^b - 1) and zero = min, both rounded to fp16
  first, then code = clip(round((x - zero) / scale), 0, 2^b - 1). Dequantized: code·scale + zero.
- Bit widths 1-8 (`SUPPORTED_BITS`), anything else is refused. Codes are packed as one
  little-endian bit stream per row in uint32 words (`pack_codes`; the layout `mx.quantize`
  writes), rows padded to a whole word only when D·b is not a multiple of 32, so b costs
  exactly b bits per element for the usual head dims. Value rows are a token's D channels;
  key rows are a block's D·G codes channel-major, so every group is G consecutive codes.
- Dequantization (`dequantize_rows`) is one fused `mx.dequantize` call per bucket when it
  applies (G in 32/64/128, widths other than 1 and 7; float32 scales so the arithmetic is the
  same),
  else a pure-MLX unpack (`unpack_codes`), which is the reference it is tested against;
  `USE_MX_DEQUANTIZE = False` forces the pure path. Neither uses `mx.quantized_matmul`.

Runtime (`KIVICache`, method "kivi"; one cache per layer):
- bits per (KV head, stream) from `head_bits` [H_kv, 2] (column 0 keys, column 1 values).
  Heads are bucketed by bit width per stream; each bucket stores its own packed codes and
  scales/zeros, so one layer can mix 1-, 2- and 4-bit heads.
- the first `sinks` tokens (default 4) stay fp16 for good: the attention-sink token's key is
  atypical and would widen the min/max of every channel of its block.
- an fp16 residual window: new tokens join it, and when it holds at least `window` + G tokens
  its oldest tokens are flushed to the quantized store in whole blocks of G (keys need G
  tokens per group; values are flushed with them so both streams share the window). So after
  every call the window holds between `window` and `window` + G - 1 tokens (fewer only while
  the sequence is shorter). Default window 32 = one G.
- `update_and_fetch` dequantizes the stored past transiently (float32) and returns fp keys and
  values to attention, followed by the window and the call's own tokens in full precision (so
  a chunk's attention over itself is full precision, as in any prefill; tokens of earlier calls
  are seen quantized once flushed). Nothing dequantized is kept. It never calls
  `mx.quantized_matmul`, so it does not inherit that op's CUDA shape gap (which breaks
  `QuantizedKVCache` prefill there). Run on MLX 0.32.4's CUDA backend (H200,
  `benchmarks/bench_ratequant.py check` and `decode`): fused and pure paths agree there once
  1-bit buckets take the pure path; `USE_MX_DEQUANTIZE = False` leaves only elementwise ops
  and reductions (10x slower on that GPU).
- fused attention (`fused`, set by make_caches through `veloxquant.attention.enable_for`:
  by VELOXQUANT_FUSED, whose default `auto` turns it on where MLX runs on a GPU while
  `KERNELS_DEFAULT` is True): `update_and_fetch` only
  updates the cache (the same bits stored as on the transient path) and returns its inputs;
  mlx-lm's attention call is routed to `fused_attention`, which attends straight from the
  packed codes: the kernels of `kernels.py` for one decode query, their pure-MLX twin (the
  store dequantized a piece at a time) otherwise. `attention_path` / `last_attention` say
  which.
- `nbytes`: packed codes, fp16 scales and zeros, the fp16 window and sinks; nothing else.
  Per stored token and head: D·b/8 bytes of codes plus 4·D/G bytes of scale + zero, i.e.
  b + 32/G bits per element (G = 32: b + 1); `resident_bytes` is the formula.
- cache contract (DESIGN section 7): `offset` absolute, nothing is evicted so size() == offset,
  no `bits` attribute (it would route mlx-lm attention to quantized_matmul; the allocation is
  `head_bits`), not a KVCache subclass; batching and `to_quantized` as every CompressedCache, not
  trimmable, state/meta_state by name (`pack_state`), registered in mlx_lm.models.cache.

Knobs: KVCacheConfig.bits (integer 1-8, uniform over heads and streams: KIVI-2 is bits=2),
group_size (G; 32 when None, as in the paper), window (default 32), sinks (default 4);
options {"key_bits": b, "value_bits": b} override bits per stream (e.g. K4V2). Non-integer
average bits and per-head allocations are RateQuant's job (veloxquant/methods/ratequant).
"""

from __future__ import annotations

import numbers
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np
from mlx_lm.models.cache import create_attention_mask

from veloxquant import attention
from veloxquant.methods.base import (
    CompressedCache,
    take_sinks,
    Method,
    ModelDims,
    pack_state,
    unpack_state,
)

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
# mx.dequantize (affine) reads these widths; 1 and 7 bits, or odd group sizes, take the pure-MLX
# path. 1 bit is outside MLX's documented widths, and MLX 0.32.4's CUDA backend decodes it
# wrongly (errors of the order of the scale; benchmarks/results/mlx-cuda-dequantize-widths.txt)
# while every other width matches the pure path exactly.
MX_DEQUANTIZE_BITS = (2, 3, 4, 5, 6, 8)
# Set False to force the pure-MLX unpacking everywhere (the reference the fused path is tested
# against; also the way out on a backend without mx.dequantize).
USE_MX_DEQUANTIZE = True
DEFAULT_GROUP_SIZE = 32
DEFAULT_WINDOW = 32
DEFAULT_SINKS = 4
# fp16 scale + fp16 zero per group of G elements.
SCALE_ZERO_BITS = 32
STREAMS = ("key", "value")
# Whether VELOXQUANT_FUSED=auto (the default) fuses KIVI / RateQuant caches on a GPU. True
# since the kernels were checked against the twin and timed on an H200
# (benchmarks/results/kivi-fused-h200.md): faster than the transient path at every context
# measured. Apple GPUs take the same generated source, not yet run on one (README).
KERNELS_DEFAULT = True
OPTION_KEYS = ("key_bits", "value_bits")


def check_bits(bits: Any, where: str = "kivi") -> int:
    """An integer bit width this quantizer supports, or a clear error."""
    if (
        isinstance(bits, bool)
        or not isinstance(bits, numbers.Real)
        or bits != int(bits)
        or int(bits) not in SUPPORTED_BITS
    ):
        raise ValueError(
            f"{where}: bit width {bits!r} is not supported; the KIVI quantizer packs integer "
            f"widths {list(SUPPORTED_BITS)}"
        )
    return int(bits)


def check_group_size(group_size: Any, head_dim: int | None = None) -> int:
    """G >= 2; values are grouped along head_dim, so G must divide it."""
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, numbers.Integral)
        or group_size < 2
    ):
        raise ValueError(f"kivi: group_size must be an integer >= 2, got {group_size!r}")
    if head_dim is not None and head_dim % group_size:
        raise ValueError(
            f"kivi: group_size {group_size} must divide head_dim {head_dim} (values are "
            "quantized per token in groups of G channels)"
        )
    return int(group_size)


def overhead_bits(group_size: int) -> float:
    """Scale + zero bits per element: fp16 scale and zero per group of G elements."""
    return SCALE_ZERO_BITS / group_size


# ---------------------------------------------------------------------------------------------
# Quantizer


def _minmax_codes(x: mx.array, lo: mx.array, hi: mx.array, bits: int):
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(mx.float16)
    zero = lo.astype(mx.float16)
    s32, z32 = scale.astype(mx.float32), zero.astype(mx.float32)
    # A constant group (or one whose range underflows fp16) gets scale 0 and code 0.
    safe = mx.where(s32 > 0, s32, 1.0)
    codes = mx.clip(mx.round((x - z32) / safe), 0, levels)
    codes = mx.where(s32 > 0, codes, 0).astype(mx.uint32)
    return codes, scale, zero


def quantize_keys(x: mx.array, bits: int, group_size: int):
    """Per-channel quantization of keys x [..., T, D] in blocks of G consecutive tokens
    (T a multiple of G) → (codes uint32 [..., T, D], scale, zero fp16 [..., T/G, D])."""
    *lead, t, d = x.shape
    if t % group_size:
        raise ValueError(
            f"quantize_keys: {t} tokens is not a whole number of blocks of {group_size}"
        )
    xb = x.astype(mx.float32).reshape(*lead, t // group_size, group_size, d)
    lo, hi = xb.min(axis=-2, keepdims=True), xb.max(axis=-2, keepdims=True)
    codes, scale, zero = _minmax_codes(xb, lo, hi, bits)
    return codes.reshape(*lead, t, d), scale.squeeze(-2), zero.squeeze(-2)


def dequantize_keys(codes: mx.array, scale: mx.array, zero: mx.array, group_size: int):
    """Inverse of `quantize_keys` → float32 [..., T, D]."""
    *lead, t, d = codes.shape
    c = codes.astype(mx.float32).reshape(*lead, t // group_size, group_size, d)
    x = c * scale.astype(mx.float32)[..., None, :] + zero.astype(mx.float32)[..., None, :]
    return x.reshape(*lead, t, d)


def quantize_values(x: mx.array, bits: int, group_size: int):
    """Per-token quantization of values x [..., D] in groups of G channels
    → (codes uint32 [..., D], scale, zero fp16 [..., D/G])."""
    *lead, d = x.shape
    xg = x.astype(mx.float32).reshape(*lead, d // group_size, group_size)
    lo, hi = xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True)
    codes, scale, zero = _minmax_codes(xg, lo, hi, bits)
    return codes.reshape(*lead, d), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_values(codes: mx.array, scale: mx.array, zero: mx.array, group_size: int):
    """Inverse of `quantize_values` → float32 [..., D]."""
    *lead, d = codes.shape
    c = codes.astype(mx.float32).reshape(*lead, d // group_size, group_size)
    x = c * scale.astype(mx.float32)[..., None] + zero.astype(mx.float32)[..., None]
    return x.reshape(*lead, d)


def fake_quantize(x: mx.array, bits: int, group_size: int, stream: str) -> mx.array:
    """Quantize and dequantize x with the runtime quantizer of `stream` ("key" or "value");
    keys [..., T, D] (T a multiple of G), values [..., D]. Used to measure distortion."""
    if stream == "key":
        return dequantize_keys(*quantize_keys(x, bits, group_size), group_size)
    if stream == "value":
        return dequantize_values(*quantize_values(x, bits, group_size), group_size)
    raise ValueError(f"stream must be 'key' or 'value', got {stream!r}")


# ---------------------------------------------------------------------------------------------
# Bit-plane packing


def packed_width(n_codes: int, bits: int) -> int:
    """uint32 words holding n_codes codes of `bits` bits (a row padded to a whole word)."""
    return -(-n_codes * bits // 32)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes [..., n] (< 2^bits) → uint32 [..., packed_width(n, bits)]: one little-endian bit
    stream per row, code i in bits [i·b, (i+1)·b). This is the layout `mx.quantize` writes, so
    `mx.dequantize` reads it."""
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    planes = (codes.astype(mx.uint32)[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    stream = planes.reshape(*lead, n * bits)
    width = packed_width(n, bits)
    if width * 32 != n * bits:
        pad = mx.zeros((*lead, width * 32 - n * bits), dtype=mx.uint32)
        stream = mx.concatenate([stream, pad], axis=-1)
    stream = stream.reshape(*lead, width, 32)
    # distinct bits, so the sum is an OR and never carries
    return (stream << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def unpack_codes(words: mx.array, bits: int, n_codes: int) -> mx.array:
    """Inverse of `pack_codes` → uint32 [..., n_codes] (pure MLX: the reference path)."""
    lead = words.shape[:-1]
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape(*lead, words.shape[-1] * 32)[..., : n_codes * bits]
    planes = stream.reshape(*lead, n_codes, bits)
    return (planes << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def fused_dequantize_ok(n_codes: int, bits: int, group_size: int) -> bool:
    """Whether `mx.dequantize` (one fused op) can read rows of n_codes codes: its affine mode
    takes group sizes 32/64/128 and widths 2-6 and 8 (see MX_DEQUANTIZE_BITS), with no row
    padding."""
    return (
        USE_MX_DEQUANTIZE
        and group_size in (32, 64, 128)
        and bits in MX_DEQUANTIZE_BITS
        and n_codes % group_size == 0
        and (n_codes * bits) % 32 == 0
    )


def dequantize_rows(
    words: mx.array, scale: mx.array, zero: mx.array, bits: int, group_size: int, n_codes: int
) -> mx.array:
    """code·scale + zero over rows of n_codes packed codes, groups of G along the row
    (scale, zero [..., n_codes / G]) → float32 [..., n_codes]. Fused `mx.dequantize` when it
    applies (float32 scales, so the arithmetic is the reference's), else pure MLX."""
    s32, z32 = scale.astype(mx.float32), zero.astype(mx.float32)
    if fused_dequantize_ok(n_codes, bits, group_size):
        return mx.dequantize(words, s32, z32, group_size=group_size, bits=bits)
    codes = unpack_codes(words, bits, n_codes).astype(mx.float32)
    lead = codes.shape[:-1]
    codes = codes.reshape(*lead, n_codes // group_size, group_size)
    return (codes * s32[..., None] + z32[..., None]).reshape(*lead, n_codes)


def pack_key_block_codes(codes: mx.array, group_size: int) -> tuple[mx.array, int]:
    """Key codes [..., n·G, D] → channel-major rows [..., n, D·G] (a channel's G tokens
    contiguous, so each quantization group is G consecutive codes of a row)."""
    *lead, t, d = codes.shape
    rows = codes.reshape(*lead, t // group_size, group_size, d).swapaxes(-1, -2)
    return rows.reshape(*lead, t // group_size, d * group_size), d * group_size


def resident_bytes(
    n_quantized: int,
    n_fp: int,
    head_bits: np.ndarray,
    head_dim: int,
    group_size: int,
    batch: int = 1,
) -> int:
    """Exact `KIVICache.nbytes` for n_quantized stored tokens and n_fp fp16 tokens (window +
    sinks), from the formula: key codes ceil(D·G·b/32) uint32 words per block of G tokens and
    head, value codes ceil(D·b/32) words per token and head (both D·b/8 bytes per token when
    32 divides D), and fp16 scale + zero per group (keys: D groups per block; values: D/G
    groups per token)."""
    head_bits = np.asarray(head_bits)
    n_blocks = n_quantized // group_size
    codes = 0
    for b in head_bits[:, 0]:
        codes += n_blocks * packed_width(head_dim * group_size, int(b)) * 4
    for b in head_bits[:, 1]:
        codes += n_quantized * packed_width(head_dim, int(b)) * 4
    n_streams = head_bits.size  # H · 2
    groups = n_quantized * head_dim // group_size  # same count for keys and values
    return batch * (codes + n_streams * groups * 4 + n_streams * n_fp * head_dim * 2)


# ---------------------------------------------------------------------------------------------
# Runtime cache


def _check_head_bits(head_bits: Any) -> np.ndarray:
    hb = np.asarray(head_bits)
    if hb.ndim != 2 or hb.shape[1] != 2 or hb.shape[0] < 1:
        raise ValueError(
            f"kivi: head_bits must be [H_kv, 2] (keys, values), got shape {list(hb.shape)}"
        )
    for b in np.unique(hb):
        check_bits(b.item() if hasattr(b, "item") else b, "kivi head_bits")
    return hb.astype(np.int64)


class KIVICache(CompressedCache):
    """Packed KIVI cache for one layer with per-(KV head, stream) bit widths; see the module
    docstring. No `bits` attribute (the allocation is `head_bits`)."""

    def __init__(
        self,
        head_bits: Any,
        *,
        group_size: int = DEFAULT_GROUP_SIZE,
        window: int = DEFAULT_WINDOW,
        sinks: int = DEFAULT_SINKS,
    ):
        for name, v in (("window", window), ("sinks", sinks)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"kivi: {name} must be an integer >= 0, got {v!r}")
        self._setup(
            _check_head_bits(head_bits), check_group_size(group_size), int(window), int(sinks)
        )
        self.offset = 0
        self.n_quantized = 0
        self.head_dim = None
        self.fused = False  # set by make_caches (veloxquant.attention.enable_for)
        self._route_probe: str | None = None  # set for a loaded state (attention.route_proven)
        self._pending: dict | None = None
        self.last_attention: str | None = None
        self._n_q_heads: int | None = None  # seen by the latest fused attention
        self.sink_keys = self.sink_values = None
        self.window_keys = self.window_values = None
        # store[stream][bits] = {"codes", "scale", "zero"}, one entry per bit-width bucket
        self.store: dict[str, dict[int, dict[str, mx.array]]] = {"key": {}, "value": {}}

    def _setup(self, head_bits: np.ndarray, group_size: int, window: int, sinks: int) -> None:
        self.head_bits, self.group_size, self.window, self.sinks = (
            head_bits,
            group_size,
            window,
            sinks,
        )
        # buckets[stream] = [(bits, head indices)], and the head order that undoes the bucketing
        self.buckets, self._inverse = {}, {}
        self._kernel_memo: dict = {}  # what the layout decides for the kernels (kernels.py)
        for s, stream in enumerate(STREAMS):
            widths = sorted({int(b) for b in head_bits[:, s]})
            self.buckets[stream] = [(b, np.flatnonzero(head_bits[:, s] == b)) for b in widths]
            order = np.concatenate([idx for _, idx in self.buckets[stream]])
            identity = np.array_equal(order, np.arange(len(order)))
            self._inverse[stream] = (
                None if identity else mx.array(np.argsort(order).astype(np.int32))
            )

    def __copy__(self) -> KIVICache:
        # A flush rebinds the store's entries in its dicts: a shallow copy (BatchedCache.merge
        # and extract, mlx-lm's prompt cache) gets dicts of its own, so that neither copy's
        # flushes reach the other. The arrays themselves are never written in place.
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.store = {stream: dict(buckets) for stream, buckets in self.store.items()}
        return new

    # -- quantized store

    def _flush(self, keys: mx.array, values: mx.array) -> None:
        """Quantize keys/values [B, H, n·G, D] (float32) into the buckets' stores."""
        g = self.group_size
        for stream, x in (("key", keys), ("value", values)):
            for b, idx in self.buckets[stream]:
                xs = x if len(idx) == x.shape[1] else mx.take(x, mx.array(idx), axis=1)
                if stream == "key":
                    codes, scale, zero = quantize_keys(xs, b, g)
                    codes, _ = pack_key_block_codes(codes, g)
                else:
                    codes, scale, zero = quantize_values(xs, b, g)
                new = {"codes": pack_codes(codes, b), "scale": scale, "zero": zero}
                old = self.store[stream].get(b)
                if old is not None:
                    new = {k: mx.concatenate([old[k], new[k]], axis=2) for k in new}
                self.store[stream][b] = new
        self.n_quantized += keys.shape[2]

    def _dequantize(
        self, stream: str, store: dict | None = None, first: int = 0, last: int | None = None
    ) -> mx.array:
        """Blocks first .. last-1 (G tokens each; default all) of the quantized store, or of
        a snapshot of it, as float32 [B, H, n·G, D] in head order."""
        parts = []
        g, d = self.group_size, self.head_dim
        store = self.store if store is None else store
        last = self.n_quantized // g if last is None else last
        for b, _ in self.buckets[stream]:
            st = store[stream][b]
            if stream == "key":  # rows [B, h, n, D·G] → [B, h, n·G, D]
                sl = slice(first, last)
                x = dequantize_rows(
                    st["codes"][:, :, sl], st["scale"][:, :, sl], st["zero"][:, :, sl], b, g, d * g
                )
                bsz, h, n, _ = x.shape
                x = x.reshape(bsz, h, n, d, g).swapaxes(-1, -2).reshape(bsz, h, n * g, d)
            else:
                sl = slice(first * g, last * g)
                x = dequantize_rows(
                    st["codes"][:, :, sl], st["scale"][:, :, sl], st["zero"][:, :, sl], b, g, d
                )
            parts.append(x)
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        inv = self._inverse[stream]
        return x if inv is None else mx.take(x, inv, axis=1)

    def dequantized(self) -> tuple[mx.array | None, mx.array | None]:
        """The quantized store as float32 [B, H, n_quantized, D] keys and values (or None)."""
        if self.n_quantized == 0:
            return None, None
        return self._dequantize("key"), self._dequantize("value")

    # -- mlx-lm cache protocol

    def _set_head_dim(self, keys: mx.array) -> None:
        if self.head_dim is None:
            h, d = keys.shape[1], keys.shape[3]
            if h != self.head_bits.shape[0]:
                raise ValueError(
                    f"kivi: head_bits covers {self.head_bits.shape[0]} KV heads "
                    f"but the layer has {h}"
                )
            check_group_size(self.group_size, d)
            self.head_dim = d

    def _keep_recent(self, recent_k: mx.array, recent_v: mx.array) -> None:
        """The window's tokens followed by the call's (float32): flush whole blocks of G
        while the window would keep at least `window` tokens; the rest is the new window."""
        g = self.group_size
        n_flush = max(recent_k.shape[2] - self.window, 0) // g * g
        if n_flush:
            self._flush(recent_k[:, :, :n_flush], recent_v[:, :, :n_flush])
            recent_k, recent_v = recent_k[:, :, n_flush:], recent_v[:, :, n_flush:]
        if recent_k.shape[2]:
            self.window_keys = recent_k.astype(mx.float16)
            self.window_values = recent_v.astype(mx.float16)
        else:
            self.window_keys = self.window_values = None

    def _with_window(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.window_keys is None:
            return keys, values
        return (
            mx.concatenate([self.window_keys.astype(mx.float32), keys], axis=2),
            mx.concatenate([self.window_values.astype(mx.float32), values], axis=2),
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.fused and attention.route_proven(self):
            return self._fused_update(keys, values)
        self._check_no_pending()
        dtype = keys.dtype
        self._set_head_dim(keys)
        recent_k, recent_v = keys.astype(mx.float32), values.astype(mx.float32)
        recent_k, recent_v, out_sk, out_sv = take_sinks(self, recent_k, recent_v)
        recent_k, recent_v = self._with_window(recent_k, recent_v)
        # Transient dequantization of the quantized past; attention sees it, nothing keeps it.
        out_k, out_v = [recent_k], [recent_v]
        if self.n_quantized:
            dk, dv = self.dequantized()
            out_k.insert(0, dk)
            out_v.insert(0, dv)
        if out_sk is not None:
            out_k.insert(0, out_sk)
            out_v.insert(0, out_sv)
        out_k = out_k[0] if len(out_k) == 1 else mx.concatenate(out_k, axis=2)
        out_v = out_v[0] if len(out_v) == 1 else mx.concatenate(out_v, axis=2)
        self._keep_recent(recent_k, recent_v)
        self.offset += keys.shape[2]
        return out_k.astype(dtype), out_v.astype(dtype)

    # -- fused attention: update_and_fetch only updates the cache and returns its inputs
    # unchanged; veloxquant.attention routes the model's attention call to `fused_attention`,
    # which attends straight from the packed codes (GPU kernels, or the same algebra in MLX
    # ops, a piece of the store at a time).

    @property
    def attention_path(self) -> str:
        """How decode attention runs: "kernel" (the fused GPU kernels), "reference" (their
        algebra in MLX ops: the CPU, or a layout the kernels do not take, see
        `kernels.unsupported`) or "transient" (the store dequantized whole, then mlx-lm's
        attention). `last_attention` says what the latest call used (prefill chunks always
        take "reference" when fused)."""
        if not self.fused:
            return "transient"
        from veloxquant.methods.kivi import kernels

        n_q = self._n_q_heads or self.head_bits.shape[0]
        return "kernel" if kernels.kernels_take(self, n_q) else "reference"

    def _fused_update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._check_no_pending()
        self._set_head_dim(keys)
        # what this call's attention reads: the store before this call's flush (its arrays are
        # replaced, never written, by a flush), the sinks, the window before the call and the
        # call's own tokens
        pending = {
            "n_quantized": self.n_quantized,
            "store": {s: dict(self.store[s]) for s in STREAMS},
            "win": None if self.window_keys is None else (self.window_keys, self.window_values),
        }
        own_sinks = self.offset < self.sinks
        new_k, new_v, out_sk, out_sv = take_sinks(self, keys, values)
        pending["sinks"] = (out_sk, out_sv) if own_sinks else None
        pending["new"] = (new_k, new_v)
        n_win = self.window_size
        n_flush = max(n_win + new_k.shape[2] - self.window, 0) // self.group_size * self.group_size
        if n_flush > n_win:
            # the call's own tokens are flushed (prefill): quantized from float32, as on the
            # transient path
            recent = self._with_window(new_k.astype(mx.float32), new_v.astype(mx.float32))
            self._keep_recent(*recent)
        elif new_k.shape[2]:
            # decode: the window stays fp16 (what it stores anyway), so a step appends the new
            # token in two ops per stream, and a flush takes only window rows (fp16 values,
            # the same float32 numbers as on the transient path)
            wk, wv = new_k.astype(mx.float16), new_v.astype(mx.float16)
            if n_win:
                wk = mx.concatenate([self.window_keys, wk], axis=2)
                wv = mx.concatenate([self.window_values, wv], axis=2)
            if n_flush:
                f32 = mx.float32
                self._flush(wk[:, :, :n_flush].astype(f32), wv[:, :, :n_flush].astype(f32))
                wk, wv = wk[:, :, n_flush:], wv[:, :, n_flush:]
            self.window_keys, self.window_values = wk, wv
        self.offset += keys.shape[2]
        self._pending = pending
        # Not attention inputs: veloxquant.attention sends this layer's attention to
        # fused_attention, which reads `pending`.
        return keys, values

    def fused_attention(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of `queries` over everything the cache held for the latest update, in
        the model's dtype, without dequantizing the store whole: the GPU kernels for a single
        decode query, the pure-MLX twin (the same sums, a piece of the store at a time)
        otherwise."""
        from veloxquant.methods.kivi import kernels

        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("KIVICache.fused_attention: no update to attend over")
        b, n_q, n, _ = queries.shape
        self._n_q_heads = n_q
        if b == 1 and n == 1 and mask is None and kernels.kernels_take(self, n_q):
            self.last_attention = "kernel"
            return kernels.decode_attention(self, queries, scale, pending)
        self.last_attention = "reference"
        return kernels.reference_attention(self, queries, scale, mask, pending)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def window_size(self) -> int:
        """fp16 tokens in the residual window now."""
        return 0 if self.window_keys is None else self.window_keys.shape[2]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # nothing is evicted, so the stored length is always the absolute offset
        return create_attention_mask(N, self.offset, return_array, window_size)

    def resident_arrays(self) -> list[mx.array]:
        """Every array the cache keeps between calls (what `nbytes` counts)."""
        arrays = [
            a
            for a in (self.sink_keys, self.sink_values, self.window_keys, self.window_values)
            if a is not None
        ]
        for stream in STREAMS:
            for st in self.store[stream].values():
                arrays += [st["codes"], st["scale"], st["zero"]]
        return arrays

    @property
    def compressed_tokens(self) -> int:
        return self.n_quantized

    @property
    def nbytes(self) -> int:
        # Packed codes, fp16 scales/zeros, fp16 window and sinks. The float32 keys/values
        # dequantized in update_and_fetch are transient and not counted.
        return int(sum(a.nbytes for a in self.resident_arrays()))

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "n_quantized": self.n_quantized,
            "head_dim": -1 if self.head_dim is None else self.head_dim,
            "group_size": self.group_size,
            "window": self.window,
            "sinks": self.sinks,
        }

    @property
    def state(self) -> dict[str, Any]:
        arrays: dict[str, Any] = {
            "head_bits": mx.array(self.head_bits.astype(np.int32)),
            "sink_keys": self.sink_keys,
            "sink_values": self.sink_values,
            "window_keys": self.window_keys,
            "window_values": self.window_values,
        }
        for stream in STREAMS:
            for b, st in self.store[stream].items():
                for name, a in st.items():
                    arrays[f"{stream}{b}_{name}"] = a
        return pack_state(arrays, self.meta_state)

    @state.setter
    def state(self, v: Any) -> None:
        # from_state skips __init__: restore everything here
        arrays, meta = unpack_state(type(self).__name__, v)
        self._setup(
            _check_head_bits(np.array(arrays["head_bits"])),
            check_group_size(int(meta["group_size"])),
            int(meta["window"]),
            int(meta["sinks"]),
        )
        self.offset, self.n_quantized = int(meta["offset"]), int(meta["n_quantized"])
        self.head_dim = None if int(meta["head_dim"]) < 0 else int(meta["head_dim"])
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            setattr(self, name, arrays.get(name))
        # a loaded cache attends the way a fresh one would in this process, once its first
        # update has shown the model's attention routed (attention.route_proven)
        self.fused = attention.wanted_for(KERNELS_DEFAULT)
        self._route_probe = "loaded" if self.fused else None  # attention.route_proven
        if self.fused:
            attention.install()
        self._pending, self.last_attention, self._n_q_heads = None, None, None
        self.store = {"key": {}, "value": {}}
        if self.n_quantized:
            for stream in STREAMS:
                for b, _ in self.buckets[stream]:
                    self.store[stream][b] = {
                        n: arrays[f"{stream}{b}_{n}"] for n in ("codes", "scale", "zero")
                    }


# load_prompt_cache resolves class names in mlx_lm.models.cache.
mlx_cache.KIVICache = KIVICache


# ---------------------------------------------------------------------------------------------
# make_caches


def resolve_layout(config: Any, dims: ModelDims) -> tuple[int, int, int]:
    """(group_size, window, sinks) from a KVCacheConfig, with this module's defaults."""
    group_size = DEFAULT_GROUP_SIZE if config.group_size is None else config.group_size
    window = DEFAULT_WINDOW if config.window is None else config.window
    sinks = DEFAULT_SINKS if config.sinks is None else config.sinks
    for name, v in (("window", window), ("sinks", sinks)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"kivi: {name} must be an integer >= 0, got {v!r}")
    group_size = check_group_size(group_size, dims.D)
    return group_size, int(window), int(sinks)


def build_caches(allocation: Any, group_size: int, window: int, sinks: int) -> list[KIVICache]:
    """One KIVICache per layer from an allocation [L, H_kv, 2] of bit widths."""
    alloc = np.asarray(allocation)
    if alloc.ndim != 3 or alloc.shape[2] != 2:
        raise ValueError(f"kivi: an allocation is [L, H_kv, 2], got shape {list(alloc.shape)}")
    return [
        KIVICache(alloc[i], group_size=group_size, window=window, sinks=sinks)
        for i in range(alloc.shape[0])
    ]


def uniform_bits(config: Any) -> tuple[int, int]:
    """(key bits, value bits) of a uniform KIVI config."""
    options = dict(config.options or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"kivi: unknown options {unknown}; known: {list(OPTION_KEYS)}")
    if config.bits is None and len(options) < 2:
        raise ValueError(
            "kivi needs bits: KVCacheConfig(method='kivi', bits=2) is KIVI-2 "
            f"(integer widths {list(SUPPORTED_BITS)})"
        )
    bits = config.bits
    if bits is not None and (isinstance(bits, bool) or bits != int(bits)):
        raise ValueError(
            f"kivi: bits={config.bits!r} is not an integer; a non-integer average is an "
            "allocation: use method='ratequant' (uncalibrated=True for a uniform split)"
        )
    kb = check_bits(options.get("key_bits", config.bits), "kivi key_bits")
    vb = check_bits(options.get("value_bits", config.bits), "kivi value_bits")
    return kb, vb


def make_caches(model: Any, config: Any, artifact: Any = None) -> list[KIVICache]:
    dims = ModelDims.of(model)
    if config.uncalibrated:
        raise ValueError("kivi has no calibration, so no uncalibrated variant")
    kb, vb = uniform_bits(config)
    group_size, window, sinks = resolve_layout(config, dims)
    alloc = np.empty((dims.L, dims.H_kv, 2), dtype=np.int64)
    alloc[..., 0], alloc[..., 1] = kb, vb
    caches = build_caches(alloc, group_size, window, sinks)
    # fused attention where VELOXQUANT_FUSED asks for it (auto: on a GPU; KERNELS_DEFAULT)
    attention.enable_for(model, caches, "kivi", auto=KERNELS_DEFAULT)
    return caches


METHOD = Method(
    name="kivi",
    summary="KIVI: packed per-channel-key / per-token-value asymmetric quantization, fp16 window",
    make_caches=make_caches,
    fields=("bits", "group_size", "window", "sinks"),
    options={"key_bits": None, "value_bits": None},
    cache_classes=(KIVICache,),
    calibrated=False,
)
