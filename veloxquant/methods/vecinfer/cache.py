"""VecInfer's runtime cache: packed product-VQ codes plus an fp16 recent window and sinks.

- resident: packed codes (d4b8: one uint8 per 4 elements; 12-bit codes two per 3 bytes; see
  `veloxquant.codes.code_bytes`), an fp16 window of the most recent `window` tokens, the first
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

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from veloxquant.codes import pq_decode, pq_encode
from veloxquant.kmeans import check_finite
from veloxquant.methods.base import Artifact, ModelDims, pack_state, unpack_state
from veloxquant.methods.vecinfer.calibrate import DEFAULTS, check_hyperparameters, gaussian_codebook
from veloxquant.methods.vecinfer.transform import (
    check_hadamard_dim,
    inverse_smooth_transform,
    smooth_transform,
)

# 48 fp16 recent tokens spend the 3-bit budget at 1024 tokens where it buys the most: keys
# carry the loss, and the newest keys get the most attention.
DEFAULT_WINDOW = 48
DEFAULT_SINKS = 4


class VecInferCache(_BaseCache):
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
    ):
        h, d = smooth.shape
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
        self.smooth = smooth.astype(mx.float32)
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

    # -- encode / decode (float32)

    def _lam(self) -> mx.array:
        return self.smooth[:, None, :]  # [H, 1, D] against [B, H, T, D]

    def encode_keys(self, keys: mx.array) -> mx.array:
        """keys [B, H, T, D] → packed key codes (smooth, rotate, nearest codeword)."""
        kt = smooth_transform(keys.astype(mx.float32), self._lam(), self.hadamard)
        return pq_encode(kt, self.key_codebook, self.key_sub_dim, self.key_bits)

    def decode_keys(self, packed: mx.array) -> mx.array:
        kt = pq_decode(
            packed, self.key_codebook, self.key_sub_dim, self.key_bits, self.smooth.shape[-1]
        )
        return inverse_smooth_transform(kt, self._lam(), self.hadamard)

    def encode_values(self, values: mx.array) -> mx.array:
        return pq_encode(
            values.astype(mx.float32), self.value_codebook, self.value_sub_dim, self.value_bits
        )

    def decode_values(self, packed: mx.array) -> mx.array:
        return pq_decode(
            packed, self.value_codebook, self.value_sub_dim, self.value_bits, self.smooth.shape[-1]
        )

    # -- mlx-lm cache protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        dtype = keys.dtype
        recent_k, recent_v = keys.astype(mx.float32), values.astype(mx.float32)
        n_sink = min(max(self.sinks - self.offset, 0), keys.shape[2])
        if n_sink:
            # The first `sinks` tokens (attention sinks) stay in fp16 for good.
            sk, sv = (
                recent_k[:, :, :n_sink].astype(mx.float16),
                recent_v[:, :, :n_sink].astype(mx.float16),
            )
            if self.sink_keys is None:
                self.sink_keys, self.sink_values = sk, sv
            else:
                self.sink_keys = mx.concatenate([self.sink_keys, sk], axis=2)
                self.sink_values = mx.concatenate([self.sink_values, sv], axis=2)
            recent_k, recent_v = recent_k[:, :, n_sink:], recent_v[:, :, n_sink:]
        if self.window_keys is not None:
            recent_k = mx.concatenate([self.window_keys.astype(mx.float32), recent_k], axis=2)
            recent_v = mx.concatenate([self.window_values.astype(mx.float32), recent_v], axis=2)
        # Transient dequantization of the coded past; attention sees it, nothing keeps it.
        if self.key_codes is not None:
            out_k = mx.concatenate([self.decode_keys(self.key_codes), recent_k], axis=2)
            out_v = mx.concatenate([self.decode_values(self.value_codes), recent_v], axis=2)
        else:
            out_k, out_v = recent_k, recent_v
        if self.sink_keys is not None:
            out_k = mx.concatenate([self.sink_keys.astype(mx.float32), out_k], axis=2)
            out_v = mx.concatenate([self.sink_values.astype(mx.float32), out_v], axis=2)
        n_old = recent_k.shape[2] - self.window
        if n_old > 0:
            new_kc = self.encode_keys(recent_k[:, :, :n_old])
            new_vc = self.encode_values(recent_v[:, :, :n_old])
            if self.key_codes is None:
                self.key_codes, self.value_codes = new_kc, new_vc
            else:
                self.key_codes = mx.concatenate([self.key_codes, new_kc], axis=2)
                self.value_codes = mx.concatenate([self.value_codes, new_vc], axis=2)
            recent_k, recent_v = recent_k[:, :, n_old:], recent_v[:, :, n_old:]
        self.window_keys = recent_k.astype(mx.float16)
        self.window_values = recent_v.astype(mx.float16)
        self.offset += keys.shape[2]
        return out_k.astype(dtype), out_v.astype(dtype)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # nothing is evicted, so the stored length is always the absolute offset
        return create_attention_mask(N, self.offset, return_array, window_size)

    def is_trimmable(self) -> bool:
        return False

    @classmethod
    def merge(cls, caches: list) -> Any:
        # Not mlx-lm's BatchKVCache, which would silently drop the compression: each sequence
        # keeps its own codes and window, row by row.
        from veloxquant.batch import BatchedCache

        return BatchedCache.merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        # mlx-lm's kv_bits= calls this once `offset` reaches quantized_kv_start; without it the
        # request would be ignored silently. veloxquant's CLI and server refuse kv_bits up front.
        raise NotImplementedError(
            "VecInferCache is already a quantized (product-VQ) cache and cannot be converted "
            "to mlx-lm's QuantizedKVCache: drop kv_bits= (mlx_lm --kv-bits)."
        )

    @property
    def nbytes(self) -> int:
        # Everything resident and nothing else: packed codes, the fp16 window and sinks, this
        # layer's fp16 codebooks (so once per layer) and f32 smooth scales. The dequantized
        # keys/values built in update_and_fetch are transient and not counted.
        arrays = (
            self.key_codes,
            self.value_codes,
            self.window_keys,
            self.window_values,
            self.sink_keys,
            self.sink_values,
            self.key_codebook,
            self.value_codebook,
            self.smooth,
        )
        return int(sum(a.nbytes for a in arrays if a is not None))

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
    )

    @property
    def meta_state(self) -> dict:
        return {
            "offset": self.offset,
            "key_bits": self.key_bits,
            "key_sub_dim": self.key_sub_dim,
            "value_bits": self.value_bits,
            "value_sub_dim": self.value_sub_dim,
            "hadamard": self.hadamard,
            "window": self.window,
            "sinks": self.sinks,
        }

    @property
    def state(self) -> dict:
        return pack_state({name: getattr(self, name) for name in self._ARRAYS}, self.meta_state)

    @state.setter
    def state(self, v: dict) -> None:
        arrays, meta = unpack_state(type(self).__name__, v)
        for name in self._ARRAYS:
            setattr(self, name, arrays[name])
        self.offset, self.window, self.sinks = (int(meta[k]) for k in ("offset", "window", "sinks"))
        self.key_bits, self.key_sub_dim = int(meta["key_bits"]), int(meta["key_sub_dim"])
        self.value_bits, self.value_sub_dim = int(meta["value_bits"]), int(meta["value_sub_dim"])
        self.hadamard = bool(meta["hadamard"])


def _check_options(options: dict, hp: dict) -> None:
    for key, want in options.items():
        if hp.get(key) != want:
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
        n_books = dims.H_kv if hp["share"] == "head" else 1
        books = {}
        for side in ("key", "value"):
            cb = gaussian_codebook(hp[f"{side}_sub_dim"], hp[f"{side}_bits"], hp["seed"])
            books[side] = mx.broadcast_to(cb[None, None], (dims.L, n_books, *cb.shape))
        smooth = mx.ones((dims.L, dims.H_kv, dims.D), dtype=mx.float32)
    else:
        hp = artifact.hyperparameters
        _check_options(config.options, hp)
        smooth = artifact.tensors["smooth"]
        books = {
            "key": artifact.tensors["key_codebook"],
            "value": artifact.tensors["value_codebook"],
        }
    return [
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
        )
        for i in range(dims.L)
    ]
