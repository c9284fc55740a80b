"""VecInfer's runtime cache: packed product-VQ codes plus an fp16 recent window and sinks.

- resident: packed codes (d4b8: one uint8 per 4 elements; 12-bit codes two per 3 bytes; see
  `veloxquant.codes.code_bytes`), an fp16 window of the most recent `window` tokens (bfloat16
  for a bfloat16 model: `window_dtype`), the first
  `sinks` tokens in fp16 (the attention-sink token's key is small and atypical, and coding it
  costs far more KL than its bytes), the layer's codebooks in fp16 and λ in f32. `nbytes`
  counts exactly these.
- `update_and_fetch`: the tokens of the call join the fp16 window; what falls out of it is
  encoded (smooth + Hadamard, argmin by GEMM distances) and appended to the codes. Attention gets
  keys/values dequantized transiently (codes → codewords → inverse transform), then the window
  and the call's own tokens in full precision, like any prefill; the dequantized copy is dropped
  after the call. (A fused LUT path that never materialises keys is the kernels' job.)
- d8b12's per-head codebooks (4096 × 8 fp16 per head, K and V) are counted too; they dominate
  the bytes at short contexts and amortise over long ones.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

import veloxquant.methods.vecinfer.kernels  # noqa: F401  (read from the package per call, below)
from veloxquant import attention
from veloxquant import rope as rope_tap
from veloxquant.codes import code_bytes, pq_decode, pq_encode
from veloxquant.kmeans import check_finite
from veloxquant.methods.base import (
    Artifact,
    CompressedCache,
    ModelDims,
    pack_state,
    take_sinks,
    unpack_state,
)
from veloxquant.rope import RopeSpec, rotated_mean
from veloxquant.methods.vecinfer.calibrate import (
    DEFAULTS,
    check_hyperparameters,
    gaussian_codebook,
    n_books,
    sharing,
)
from veloxquant.methods.vecinfer.transform import (
    check_hadamard_dim,
    inverse_smooth_transform,
    smooth_transform,
)


def window_dtype(model_dtype: mx.Dtype) -> mx.Dtype:
    """The 16-bit float the fp16 window is kept in: the model's own when it is one (bfloat16
    keys stay exact, and the decode step casts nothing), else float16."""
    return model_dtype if model_dtype in (mx.float16, mx.bfloat16) else mx.float16


# 26 fp16 recent tokens (with the 4 sinks) fill the 3-bit budget at 1024 tokens beside the
# default codes (2.5 bits) and codebooks; measured, a wider window buys less than value bits.
DEFAULT_WINDOW = 26
DEFAULT_SINKS = 4


class VecInferCache(CompressedCache):
    """Product-VQ KV cache for one layer. See the module docstring for what is resident.

    No `bits` attribute (it would route mlx-lm attention to quantized_matmul); not a KVCache
    subclass, and `to_quantized` raises (mlx-lm's kv_bits= would otherwise skip it without a
    word); `merge` batches it as one row of a `veloxquant.batch.BatchedCache`.
    """

    def __init__(
        self,
        smooth: mx.array,
        key_codebook: mx.array,
        value_codebook: mx.array,
        *,
        key_bits: int,
        key_sub_dim: int,
        value_bits: int,
        value_sub_dim: int,
        hadamard: bool,
        window: int = DEFAULT_WINDOW,
        sinks: int = DEFAULT_SINKS,
        key_mean: mx.array | None = None,
        value_mean: mx.array | None = None,
        rope: RopeSpec | None = None,
        value_smooth: mx.array | None = None,
    ):
        h, d = smooth.shape
        for name, mean in (("key_mean", key_mean), ("value_mean", value_mean)):
            if mean is not None and tuple(mean.shape) != (h, d):
                raise ValueError(f"vecinfer: {name} has shape {list(mean.shape)}, need [{h}, {d}]")
        if key_mean is not None and rope is None:
            raise ValueError("vecinfer: a key mean needs the model's RoPE to rotate it")
        for side, book, bits, sub in (
            ("key", key_codebook, key_bits, key_sub_dim),
            ("value", value_codebook, value_bits, value_sub_dim),
        ):
            want = (2**bits, sub)
            if book.ndim != 3 or tuple(book.shape[1:]) != want or book.shape[0] not in (1, h):
                raise ValueError(
                    f"vecinfer: {side} codebook has shape {list(book.shape)} but the configured "
                    f"d{sub}b{bits} needs [{h} or 1, {2**bits}, {sub}] (2^{side}_bits centroids of "
                    f"{side}_sub_dim dims); the artifact was made with other hyperparameters"
                )
            if d % sub:
                raise ValueError(f"vecinfer: {side}_sub_dim {sub} must divide head_dim {d}")
            check_finite(book, f"vecinfer {side} codebook")
        check_finite(smooth, "vecinfer smooth scales")
        if not bool(mx.all(smooth > 0).item()):
            raise ValueError("vecinfer: smooth scales must be > 0")
        if hadamard:
            check_hadamard_dim(d)
        if window < 0 or sinks < 0:
            raise ValueError(f"vecinfer: window and sinks must be >= 0, got {window}, {sinks}")
        self.smooth = smooth.astype(mx.float16)  # calibration used these fp16 values
        # Means are resident in fp16, and calibration coded exactly these fp16 values.
        self.key_mean = None if key_mean is None else key_mean.astype(mx.float16)
        self.value_mean = None if value_mean is None else value_mean.astype(mx.float16)
        self.rope = rope
        self.rope_freqs = None if rope is None else rope.freqs
        # values are scaled and rotated like keys only when calibrated with value_smooth
        self.value_smooth = None if value_smooth is None else value_smooth.astype(mx.float16)
        self.key_codebook = key_codebook.astype(mx.float16)
        self.value_codebook = value_codebook.astype(mx.float16)
        self.key_bits, self.key_sub_dim = int(key_bits), int(key_sub_dim)
        self.value_bits, self.value_sub_dim = int(value_bits), int(value_sub_dim)
        self.hadamard = bool(hadamard)
        self.window, self.sinks = int(window), int(sinks)
        self.sink_keys = self.sink_values = None
        self.key_codes = self.value_codes = None
        self.window_keys = self.window_values = None
        self.offset = 0
        # Fused attention (veloxquant.attention): off until the model's attention is routed.
        self.fused = False
        self._route_probe: str | None = None  # set for a loaded state (attention.route_proven)
        self._pending: dict | None = None
        self._last_write: mx.array | None = None
        # the output of the cache's latest kernel launch, which the next one takes as an input
        # (`after`) so that MLX orders them: the one-launch kernel counts its threadgroups in a
        # buffer of the cache's, and two launches of one cache running at once in a graph would
        # mix their counts
        self._last_launch: mx.array | None = None
        self.last_attention: str | None = None
        # who rotated the latest kernel step's query and key: "kernel" (the attention launch,
        # the model's rope tapped) or "model" (mlx-lm's own rope launches)
        self.last_rope: str | None = None

    # -- storage. Codes live in buffers that grow in CODE_STEP-token steps, so the fused path
    # appends a token without copying the past; `key_codes` / `value_codes` are the filled
    # part. The fused path keeps the full window as a ring (the new token takes the leaving
    # token's slot); `window_keys` / `window_values` are in order. On a GPU a decode step's
    # kernels write both in place (kernels.WRITE_IN_PLACE), which MLX does not track: every
    # read of the buffers outside those kernels goes through `_sync` first, and copies of the
    # cache get copies of the buffers.

    CODE_STEP = 256

    @property
    def key_codes(self) -> mx.array | None:
        return self._filled(self._kbuf)

    @key_codes.setter
    def key_codes(self, v: mx.array | None) -> None:
        self._kbuf = v
        self._n_coded = 0 if v is None else int(v.shape[2])

    @property
    def value_codes(self) -> mx.array | None:
        return self._filled(self._vbuf)

    @value_codes.setter
    def value_codes(self, v: mx.array | None) -> None:
        self._vbuf = v

    def _sync(self) -> None:
        """Wait for the latest in-place write into the buffers (a decode step's kernels), so
        that reading them with MLX operations sees it: MLX knows nothing of that write and
        would otherwise order such a read only by the stream, or not at all within one
        evaluation."""
        if self._last_write is not None:
            mx.eval(self._last_write)
            self._last_write = None

    def _filled(self, buf: mx.array | None) -> mx.array | None:
        self._sync()
        if buf is None or buf.shape[2] == self._n_coded:
            return buf
        return buf[:, :, : self._n_coded]

    @property
    def window_keys(self) -> mx.array | None:
        return self._in_order(self._wk)

    @window_keys.setter
    def window_keys(self, v: mx.array | None) -> None:
        self._wk, self._ring = (None if v is None else mx.contiguous(v)), 0

    @property
    def window_values(self) -> mx.array | None:
        return self._in_order(self._wv)

    @window_values.setter
    def window_values(self, v: mx.array | None) -> None:
        self._wv = None if v is None else mx.contiguous(v)

    def _in_order(self, ring: mx.array | None) -> mx.array | None:
        self._sync()
        if ring is None or self._ring == 0:
            return ring
        return mx.concatenate([ring[:, :, self._ring :], ring[:, :, : self._ring]], axis=2)

    def _normalize_window(self) -> None:
        if self._ring:
            wk, wv = self.window_keys, self.window_values
            self.window_keys, self.window_values = wk, wv

    # -- encode / decode (float32)

    def _lam(self) -> mx.array:
        return self.smooth.astype(mx.float32)[:, None, :]  # [H, 1, D] against [B, H, T, D]

    def _lam_v(self) -> mx.array:
        return self.value_smooth.astype(mx.float32)[:, None, :]

    def _key_shift(self, start: int, length: int) -> mx.array | float:
        """RoPE_m(μ) for positions start .. start + length - 1 (0 without a key mean)."""
        if self.key_mean is None:
            return 0.0
        return rotated_mean(self.key_mean.astype(mx.float32), self.rope, start, length)

    def _value_shift(self) -> mx.array | float:
        return 0.0 if self.value_mean is None else self.value_mean.astype(mx.float32)[:, None]

    def encode_keys(self, keys: mx.array, start: int) -> mx.array:
        """keys [B, H, T, D] at positions start.. → packed codes of the residual k − RoPE_m(μ)
        (smooth, rotate, nearest codeword)."""
        res = keys.astype(mx.float32) - self._key_shift(start, keys.shape[2])
        kt = smooth_transform(res, self._lam(), self.hadamard)
        return pq_encode(kt, self.key_codebook, self.key_sub_dim, self.key_bits)

    def decode_keys(self, packed: mx.array, start: int) -> mx.array:
        kt = pq_decode(
            packed, self.key_codebook, self.key_sub_dim, self.key_bits, self.smooth.shape[-1]
        )
        res = inverse_smooth_transform(kt, self._lam(), self.hadamard)
        return res + self._key_shift(start, packed.shape[2])

    def encode_values(self, values: mx.array) -> mx.array:
        res = values.astype(mx.float32) - self._value_shift()
        if self.value_smooth is not None:
            res = smooth_transform(res, self._lam_v(), self.hadamard)
        return pq_encode(res, self.value_codebook, self.value_sub_dim, self.value_bits)

    def decode_values(self, packed: mx.array) -> mx.array:
        res = pq_decode(
            packed, self.value_codebook, self.value_sub_dim, self.value_bits, self.smooth.shape[-1]
        )
        if self.value_smooth is not None:
            res = inverse_smooth_transform(res, self._lam_v(), self.hadamard)
        return res + self._value_shift()

    # -- mlx-lm cache protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.fused and attention.route_proven(self):
            return self._fused_update(keys, values)
        keys = rope_tap.rotated(keys)  # the tap handed it on unrotated for a fused step
        self._check_no_pending()
        self._normalize_window()
        self.last_attention = "transient"
        dtype = keys.dtype
        recent_k, recent_v = keys.astype(mx.float32), values.astype(mx.float32)
        recent_k, recent_v, out_sk, out_sv = take_sinks(self, recent_k, recent_v)
        if self.window_keys is not None:
            recent_k = mx.concatenate([self.window_keys.astype(mx.float32), recent_k], axis=2)
            recent_v = mx.concatenate([self.window_values.astype(mx.float32), recent_v], axis=2)
        # Transient dequantization of the coded past; attention sees it, nothing keeps it.
        if self.key_codes is not None:
            # coded tokens are contiguous from position `sinks` on
            past_k = self.decode_keys(self.key_codes, self.sinks)
            out_k = mx.concatenate([past_k, recent_k], axis=2)
            out_v = mx.concatenate([self.decode_values(self.value_codes), recent_v], axis=2)
        else:
            out_k, out_v = recent_k, recent_v
        if out_sk is not None:
            out_k = mx.concatenate([out_sk, out_k], axis=2)
            out_v = mx.concatenate([out_sv, out_v], axis=2)
        n_old = recent_k.shape[2] - self.window
        if n_old > 0:
            n_coded = 0 if self.key_codes is None else self.key_codes.shape[2]
            new_kc = self.encode_keys(recent_k[:, :, :n_old], self.sinks + n_coded)
            new_vc = self.encode_values(recent_v[:, :, :n_old])
            if self.key_codes is None:
                self.key_codes, self.value_codes = new_kc, new_vc
            else:
                self.key_codes = mx.concatenate([self.key_codes, new_kc], axis=2)
                self.value_codes = mx.concatenate([self.value_codes, new_vc], axis=2)
            recent_k, recent_v = recent_k[:, :, n_old:], recent_v[:, :, n_old:]
        self.window_keys = recent_k.astype(window_dtype(dtype))
        self.window_values = recent_v.astype(window_dtype(dtype))
        self.offset += keys.shape[2]
        return out_k.astype(dtype), out_v.astype(dtype)

    def __copy__(self) -> VecInferCache:
        # The fused path writes the code buffers and the window ring in place (and, off the
        # kernels, rebinds them with slice assignment): a shallow copy (BatchedCache.merge,
        # mlx-lm's prompt cache) gets buffers of its own, so that neither copy's writes reach
        # the other.
        self._sync()
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        # and kernel memos of its own: they hold the one-launch kernel's count buffer
        new._kernel_memo = {}
        buffers = [
            name for name in ("_kbuf", "_vbuf", "_wk", "_wv") if getattr(self, name) is not None
        ]
        for name in buffers:
            setattr(new, name, mx.array(getattr(self, name)))
        # copied now: a lazy copy would read the buffers after later in-place writes
        mx.eval([getattr(new, name) for name in buffers])
        return new

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # nothing is evicted, so the stored length is always the absolute offset
        return create_attention_mask(N, self.offset, return_array, window_size)

    @property
    def compressed_tokens(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.shape[2]

    @property
    def nbytes(self) -> int:
        # Everything resident and nothing else: packed codes (their whole buffers, unfilled
        # capacity included), the fp16 window and sinks, this layer's fp16 codebooks, means and
        # smooth scales (so once per layer), f32 RoPE frequencies, and the copies of those the
        # CUDA decode kernel reads (its layer_pack, once it exists). The dequantized
        # keys/values built in update_and_fetch are transient and not counted.
        from veloxquant.methods.vecinfer import kernels

        stored = {"key_codes": "_kbuf", "value_codes": "_vbuf"}
        stored.update(window_keys="_wk", window_values="_wv")
        arrays = (getattr(self, stored.get(name, name)) for name in self._ARRAYS)
        own = sum(a.nbytes for a in arrays if a is not None)
        return int(own + kernels.kernel_bytes(self))

    # -- fused attention: update_and_fetch only updates the cache and returns its inputs
    # unchanged; veloxquant.attention routes the model's attention call to `fused_attention`,
    # which attends straight from the codes (GPU kernels, or the same algebra in pure MLX).

    @property
    def attention_path(self) -> str:
        """How decode attention runs: "kernel" (fused GPU kernels), "cpu-kernel" (MLX on the
        CPU: the coded past attended by the CPU extension's one-pass kernel), "reference" (the
        fused algebra in MLX ops: the CPU without the extension, or a layout the kernels do not
        take) or "transient" (the coded past dequantized, then mlx-lm's attention: the
        fallback). `last_attention` says what the latest call used (on a GPU, prefill chunks
        take "reference" when fused; on the CPU, calls with a mask array do)."""
        if not self.fused:
            return "transient"
        from veloxquant.methods.vecinfer import kernels

        if kernels.kernels_take(self, self.smooth.shape[0]):
            return "kernel"
        if kernels.cpu_kernel_here():
            return "cpu-kernel"
        return "reference"

    def _check_no_pending(self) -> None:
        if self._pending is not None:
            # the leaving token's codes exist only once its attention runs: write them now, so
            # the cache still holds every token it has seen when the caller switches paths
            pending, self._pending = self._pending, None
            pending = self._rotated_new(pending)
            self._encode_leaving(pending)
            self._write_ring(pending)
            raise attention.unattended_update(self)

    def _rotated_new(self, pending: dict) -> dict:
        """`pending` with its new key as the model rotates it, where the model's tapped rope
        handed it on unrotated for the kernel to rotate (`veloxquant.rope.DeferredPosition`)
        and something else reads it instead."""
        rotate = pending.get("deferral")
        if rotate is None:
            return pending
        return {**pending, "new": (rotate(), pending["new"][1]), "deferral": None}

    def _encode_leaving(self, pending: dict) -> dict:
        """Encode and append the token a full window dropped in the update behind `pending`
        (if any); returns `pending` without it."""
        encode = pending.get("encode")
        if encode is None:
            return pending
        self._sync()
        wk, wv = pending["win"]
        self._append_codes(*self._encode_rows(wk, wv, encode[0], 1, encode[1]))
        return {**pending, "encode": None}

    def _encode_rows(self, k_src: mx.array, v_src: mx.array, first: int, n: int, pos: int):
        """Codes of rows first .. first+n-1 of k_src / v_src [B, H, R, D] at positions pos..:
        the encode kernel on a GPU, the oracle's encode_keys / encode_values elsewhere."""
        from veloxquant.methods.vecinfer import kernels

        if k_src.shape[0] == 1 and kernels.kernels_take(self, self.smooth.shape[0]):
            return kernels.encode(self, k_src, v_src, first, n, pos)
        k = k_src[:, :, first : first + n].astype(mx.float32)
        v = v_src[:, :, first : first + n].astype(mx.float32)
        return self.encode_keys(k, pos), self.encode_values(v)

    def _reserve_codes(self, n: int, batch: int = 1) -> None:
        """Room in the code buffers for n more tokens, in whole CODE_STEP-token steps (buffers
        set whole, e.g. from a saved state, are regrown to them: the GPU kernels read whole
        16-token blocks of rows)."""
        n0 = self._n_coded
        if self._kbuf is not None and n0 + n <= self._kbuf.shape[2]:
            if self._kbuf.shape[2] % self.CODE_STEP == 0:
                return
        self._sync()
        cap = -(-(n0 + n) // self.CODE_STEP) * self.CODE_STEP
        h, d = self.smooth.shape
        batch = batch if self._kbuf is None else self._kbuf.shape[0]
        grown = []
        for buf, bits, sub in (
            (self._kbuf, self.key_bits, self.key_sub_dim),
            (self._vbuf, self.value_bits, self.value_sub_dim),
        ):
            pad = mx.zeros((batch, h, cap - n0, code_bytes(bits, d // sub)), mx.uint8)
            grown.append(pad if buf is None else mx.concatenate([buf[:, :, :n0], pad], 2))
        self._kbuf, self._vbuf = grown

    def _append_codes(self, kc: mx.array, vc: mx.array) -> None:
        n0, n = self._n_coded, kc.shape[2]
        self._reserve_codes(n, kc.shape[0])
        self._kbuf[:, :, n0 : n0 + n] = kc
        self._vbuf[:, :, n0 : n0 + n] = vc
        self._n_coded = n0 + n

    def _write_ring(self, pending: dict) -> None:
        """The new token of a decode step over the ring slot of the token leaving the window,
        by slice assignment (what the kernels do in place). The pending attention keeps the
        ring as it was: setitem rebinds the array object it is called on, so it writes
        copies of the objects."""
        slot = pending.get("ring")
        if slot is None:
            return
        self._sync()
        wdt = self._wk.dtype
        new_k, new_v = pending["new"]
        ring_k, ring_v = copy.copy(self._wk), copy.copy(self._wv)
        ring_k[:, :, slot : slot + 1] = new_k.astype(wdt)
        ring_v[:, :, slot : slot + 1] = new_v.astype(wdt)
        self._wk, self._wv = ring_k, ring_v

    def _fused_update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._check_no_pending()
        # a key handed on unrotated (this cache's offset deferred it) is rotated in the
        # attention launch of a decode step whose window is full, and here for anything else
        deferral = rope_tap.deferral(keys)
        n_win = 0 if self._wk is None else self._wk.shape[2]
        ring_step = keys.shape[2] == 1 and self.offset >= self.sinks and 0 < self.window == n_win
        if deferral is not None and not ring_step:
            keys, deferral = deferral(), None
        wdt = window_dtype(keys.dtype)
        # a call's own sink tokens are attended exactly, as on the transient path
        own_sinks = self.offset < self.sinks
        if own_sinks:
            new_k, new_v, out_sk, out_sv = take_sinks(self, keys, values)
        else:  # (take_sinks would build float32 copies of the stored sinks, unread here)
            new_k, new_v = keys, values
        n_new, n_before, w = new_k.shape[2], self._n_coded, self.window
        if n_new == 1 and w > 0 and n_win == w:
            # Decode once the window is full: the oldest token (ring slot `_ring`) leaves, is
            # encoded, and the new token takes its slot; this call's attention still sees it
            # exact, as the transient path. The encode and the ring write happen with the
            # attention (fused_attention): on a GPU, inside its own launch.
            slot = self._ring
            self._pending = {
                "n_coded": n_before,
                "win": (self._wk, self._wv),
                "encode": (slot, self.sinks + n_before),
                "ring": slot,
                # the model's unrotated key, where its rope is tapped (veloxquant.rope.tap),
                # and the model's rotation of it where the tap handed it on unrotated
                "unrotated_key": rope_tap.unrotated(keys),
                "deferral": deferral,
                "position": int(self.offset),
            }
            self._ring = (slot + 1) % w
        elif n_new:
            # Anything else (prefill chunks, the window filling up): window + new tokens in
            # order; what falls out of the window is encoded.
            self._sync()
            self._normalize_window()
            recent_k, recent_v = new_k.astype(mx.float32), new_v.astype(mx.float32)
            if self._wk is not None:
                recent_k = mx.concatenate([self._wk.astype(mx.float32), recent_k], axis=2)
                recent_v = mx.concatenate([self._wv.astype(mx.float32), recent_v], axis=2)
            n_old = recent_k.shape[2] - w
            if n_old > 0:
                kc, vc = self._encode_rows(recent_k, recent_v, 0, n_old, self.sinks + n_before)
                self._append_codes(kc, vc)
            self._pending = {"n_coded": n_before, "win": None}
            new_k, new_v = recent_k, recent_v
            keep = max(n_old, 0)
            # row-contiguous buffers of the ring's own (a strided view, e.g. of the model's
            # transposed values, would reach the kernels as MLX's contiguous copy, and their
            # in-place writes would be lost)
            self._wk = mx.contiguous(recent_k[:, :, keep:].astype(wdt))
            self._wv = mx.contiguous(recent_v[:, :, keep:].astype(wdt))
        else:
            self._pending = {"n_coded": n_before, "win": None}
            new_k, new_v = keys[:, :, :0], values[:, :, :0]
        self._pending["new"] = (new_k, new_v)
        self._pending["sinks"] = (out_sk, out_sv) if own_sinks else None
        self.offset += keys.shape[2]
        # Not attention inputs: veloxquant.attention sends this layer's attention to
        # fused_attention, which reads the cache.
        return keys, values

    def fused_attention(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of `queries` over everything the cache holds after the latest update, in
        the model's dtype, without dequantizing the coded past: the GPU kernels for a single
        decode query, the pure-MLX twin (same algebra, in pieces) otherwise."""
        kernels = veloxquant.methods.vecinfer.kernels  # the package's: benchmarks swap it

        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("VecInferCache.fused_attention: no update to attend over")
        if pending.get("deferral") is not None and rope_tap.unrotated(queries) is None:
            # the tap handed this step's query on unrotated, and what arrived is not that
            # array: something changed it on the way, rotated or not; keep the cache whole
            pending = self._rotated_new(pending)
            self._encode_leaving(pending)
            self._write_ring(pending)
            raise RuntimeError(
                "VecInferCache: the model's attention changed the query between its rope and "
                "the attention call, so the cache cannot tell whether it is rotated. Set "
                "veloxquant.methods.vecinfer.kernels.ROPE_IN_KERNEL = False (or "
                "veloxquant.rope.untap(model)) for this model."
            )
        b, n_q, n, _ = queries.shape
        if b == 1 and n == 1 and mask is None and kernels.kernels_take(self, n_q):
            self.last_attention = "kernel"
            in_place = pending.get("encode") is not None and kernels.WRITE_IN_PLACE
            if in_place:  # the step's own rows before the model's RoPE, for the launch to rotate
                pending = {**pending, "rotate": _unrotated(pending, queries)}
                self._reserve_codes(1)
            else:
                pending, queries = self._rotated_new(pending), rope_tap.rotated(queries)
                if self._kbuf is not None:
                    self._reserve_codes(0)
                self._write_ring(pending)
            try:
                a = kernels.attention_inputs(self, queries, scale, pending)
                rotates = a.get("rope_in", False)
                if not rotates:  # the launch takes the rows as the model rotates them
                    new_pending, new_queries = self._rotated_new(pending), rope_tap.rotated(queries)
                    if new_pending is not pending or new_queries is not queries:
                        pending, queries = {**new_pending, "rotate": None}, new_queries
                        a = kernels.attention_inputs(self, queries, scale, pending)
                out, codes = kernels.launch_attention(a, queries)
            except BaseException:
                pending = self._rotated_new(pending)
                if in_place:
                    self._write_ring(pending)
                self._encode_leaving(pending)  # keep the cache whole, then fail
                raise
            self._last_launch = out
            self.last_rope = "kernel" if rotates else "model"
            if rotates and rope_tap.DEFER:  # the next step's tapped rope hands its rows on
                # unrotated
                self.offset = rope_tap.DeferredPosition(self.offset)
            if in_place:  # the launch wrote the codes and the ring
                self._n_coded += 1
                self._last_write = out
            elif codes is not None:
                self._append_codes(*codes)
            return out
        pending, queries = self._rotated_new(pending), rope_tap.rotated(queries)
        self._sync()  # the twin and the CPU kernel read the code buffers
        self._write_ring(pending)
        pending = self._encode_leaving(pending)
        if kernels.cpu_kernel_takes(self, queries, mask):
            self.last_attention = "cpu-kernel"
            return kernels.cpu_kernel_attention(self, queries, scale, mask, pending)
        self.last_attention = "reference"
        return kernels.reference_attention(self, queries, scale, mask, pending)

    # -- prompt-cache state: arrays by name, scalars in meta_state (methods/base.py)

    _ARRAYS = (
        "key_codes",
        "value_codes",
        "window_keys",
        "window_values",
        "sink_keys",
        "sink_values",
        "smooth",
        "key_codebook",
        "value_codebook",
        "key_mean",
        "value_mean",
        "rope_freqs",
        "value_smooth",
    )

    @property
    def meta_state(self) -> dict:
        return {
            "offset": int(self.offset),
            "key_bits": self.key_bits,
            "key_sub_dim": self.key_sub_dim,
            "value_bits": self.value_bits,
            "value_sub_dim": self.value_sub_dim,
            "hadamard": self.hadamard,
            "window": self.window,
            "sinks": self.sinks,
            **(self.rope.meta() if self.rope is not None else {"rope_dims": None}),
        }

    @property
    def state(self) -> dict:
        arrays = {name: getattr(self, name) for name in self._ARRAYS}
        for name in ("window_keys", "window_values"):  # the ring is written in place later
            if arrays[name] is not None:
                arrays[name] = mx.array(arrays[name])
                mx.eval(arrays[name])  # so copied now, not when the caller evaluates it
        return pack_state(arrays, self.meta_state)

    @state.setter
    def state(self, v: dict) -> None:
        arrays, meta = unpack_state(type(self).__name__, v)
        self._last_write = self._last_launch = None  # from_state skips __init__
        for name in self._ARRAYS:
            setattr(self, name, arrays[name])
        # a loaded cache attends the way a fresh one would in this process, once its first
        # update has shown the model's attention routed (attention.route_proven)
        kernels = veloxquant.methods.vecinfer.kernels
        self.fused = attention.wanted(cpu_kernel=kernels.cpu_kernel_here())
        self._route_probe = "loaded" if self.fused else None  # attention.route_proven
        if self.fused:
            attention.install()
        self._pending, self.last_attention, self._kernel_memo = None, None, {}
        self.offset, self.window, self.sinks = (int(meta[k]) for k in ("offset", "window", "sinks"))
        self.key_bits, self.key_sub_dim = int(meta["key_bits"]), int(meta["key_sub_dim"])
        self.value_bits, self.value_sub_dim = int(meta["value_bits"]), int(meta["value_sub_dim"])
        self.hadamard = bool(meta["hadamard"])
        no_rope = meta["rope_dims"] is None
        self.rope = None if no_rope else RopeSpec.from_meta(meta, self.rope_freqs)


def _unrotated(pending: dict, queries: mx.array) -> tuple | None:
    """(query, key, position) before the model's RoPE, when its tapped rope modules rotated
    both of this decode step's rows at the cache's own position, else None."""
    key, query = pending.get("unrotated_key"), rope_tap.unrotated(queries)
    position = pending.get("position")
    if key is None or query is None or not key[1] == query[1] == position:
        return None
    return query[0], key[0], position


def _check_options(options: dict, hp: dict) -> None:
    for key, want in options.items():
        have = hp.get(key)
        if key == "value_share":  # None means "as share", in the options and in old artifacts
            want = want or hp["share"]
            have = sharing(hp, "value")
        if have != want:
            raise ValueError(
                f"vecinfer: options ask for {key}={want!r} but the artifact was calibrated "
                f"with {key}={hp.get(key)!r}; point artifact_dir at a bundle calibrated with "
                "those hyperparameters (or drop the option)"
            )


def make_caches(model: Any, config: Any, artifact: Artifact | None) -> list[VecInferCache]:
    dims = ModelDims.of(model)
    window = DEFAULT_WINDOW if config.window is None else int(config.window)
    sinks = DEFAULT_SINKS if config.sinks is None else int(config.sinks)
    if artifact is None:  # uncalibrated: Gaussian codebooks, no smoothing (what upstream ships)
        hp = {**DEFAULTS, **config.options}
        check_hyperparameters(hp)
        books = {}
        for side in ("key", "value"):
            cb = gaussian_codebook(hp[f"{side}_sub_dim"], hp[f"{side}_bits"], hp["seed"])
            shape = (dims.L, n_books(hp, side, dims.H_kv), *cb.shape)
            books[side] = mx.broadcast_to(cb[None, None], shape)
        smooth = mx.ones((dims.L, dims.H_kv, dims.D), dtype=mx.float32)
        means = value_smooth = None
    else:
        hp = artifact.hyperparameters
        _check_options(config.options, hp)
        smooth = artifact.tensors["smooth"]
        books = {
            "key": artifact.tensors["key_codebook"],
            "value": artifact.tensors["value_codebook"],
        }
        value_smooth = None
        if hp.get("value_smooth", "none") != "none":
            value_smooth = artifact.tensors["value_smooth"]
        means = None
        if hp.get("center", False):
            means = (artifact.tensors["key_mean"], artifact.tensors["value_mean"])
    rope = RopeSpec.of(model) if means is not None else None
    caches = [
        VecInferCache(
            smooth[i],
            books["key"][i],
            books["value"][i],
            key_bits=hp["key_bits"],
            key_sub_dim=hp["key_sub_dim"],
            value_bits=hp["value_bits"],
            value_sub_dim=hp["value_sub_dim"],
            hadamard=hp["hadamard"],
            window=window,
            sinks=sinks,
            key_mean=None if means is None else means[0][i],
            value_mean=None if means is None else means[1][i],
            rope=rope,
            value_smooth=None if value_smooth is None else value_smooth[i],
        )
        for i in range(dims.L)
    ]
    # fused attention whenever the model's attention can be routed (veloxquant.attention), on a
    # GPU and, with the CPU extension built, on the CPU; with the key mean, whose RoPE the kernel
    # knows, the decode step's own query and key are rotated inside the attention launch (the
    # model's rope modules tapped)
    cpu_kernel = veloxquant.methods.vecinfer.kernels.cpu_kernel_here()
    if attention.enable_for(model, caches, "vecinfer", cpu_kernel=cpu_kernel) and rope is not None:
        rope_tap.tap(model)
    return caches
