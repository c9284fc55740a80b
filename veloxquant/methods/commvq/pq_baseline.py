"""The baseline CommVQ is measured against: plain product VQ on pre-RoPE keys.

What an MLX port that is "CommVQ without the commutative codebook" does: k-means product-VQ
codebooks (consecutive channels, `sub_dim` per sub-vector, one codebook per (layer, KV head))
trained on captured pre-RoPE keys, optionally after removing the key mean; the cache inverts
RoPE, stores the codes and re-applies RoPE exactly at fetch. Values, sinks and window are
CommVQCache's. A sub-vector of consecutive channels is not a union of RoPE pairs in the
half-split layout, so this codebook is not closed under RoPE; it is still exact about positions
here because it decodes to the pre-RoPE space first.

Not a method of its own: eval rows build it with `make_caches(model, key_codebook, ...)`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache

from veloxquant.codes import pq_decode, pq_encode
from veloxquant.kmeans import product_kmeans
from veloxquant.methods.base import ModelDims
from veloxquant.methods.commvq.cache import CommVQCache, _check_finite, rope_params


def train_prerope_pq(
    k_pre: mx.array,
    sub_dim: int,
    bits: int,
    *,
    center: bool,
    iters: int = 16,
    seed: int = 0,
    max_vectors: int | None = 32768,
    progress: bool = False,
) -> tuple[mx.array, mx.array | None]:
    """k_pre [G, N, D] → (codebook [G, 2^bits, sub_dim], μ [G, D] or None)."""
    mu = k_pre.mean(axis=1) if center else None
    x = k_pre if mu is None else k_pre - mu[:, None]
    res = product_kmeans(
        x,
        sub_dim,
        2**bits,
        max_vectors=max_vectors,
        iters=iters,
        seed=seed,
        progress=progress,
        desc=f"pre-RoPE PQ d{sub_dim}b{bits}",
    )
    return res.centroids, mu


class PreRopePQCache(CommVQCache):
    """CommVQCache with the keys coded by plain product VQ in the pre-RoPE space."""

    array_names = ("key_codebook",) + tuple(
        n
        for n in CommVQCache.array_names
        if n not in ("theta", "theta_scale", "key_gain", "key_scales")
    )

    def __init__(
        self,
        key_codebook: mx.array,
        value_codebook: mx.array,
        key_mean: mx.array | None = None,
        *,
        head_dim: int,
        key_bits: int,
        key_sub_dim: int,
        **kwargs: Any,
    ):
        self.key_codebook = key_codebook.astype(mx.float16)
        self.key_bits, self.key_sub_dim = int(key_bits), int(key_sub_dim)
        self._dim = int(head_dim)
        super().__init__(None, value_codebook, key_mean, **kwargs)

    def _validate_keys(self) -> None:
        want = (2**self.key_bits, self.key_sub_dim)
        if self.key_codebook.ndim != 3 or tuple(self.key_codebook.shape[1:]) != want:
            raise ValueError(
                f"pre-RoPE PQ: key codebook has shape "
                f"{list(self.key_codebook.shape)}, expected [H, {want[0]}, "
                f"{want[1]}]"
            )
        if self._dim % self.key_sub_dim:
            raise ValueError(
                f"pre-RoPE PQ: key_sub_dim {self.key_sub_dim} must divide head_dim {self._dim}"
            )
        _check_finite(self.key_codebook, "key codebook")

    @property
    def head_dim(self) -> int:
        return self._dim

    @property
    def n_heads(self) -> int:
        return int(self.key_codebook.shape[0])

    def stage_theta(self) -> None:
        return None  # plain PQ has no θ

    def encode_keys(self, keys: mx.array, offset: int, theta: None = None) -> tuple[mx.array, None]:
        x = self._rope(keys.astype(mx.float32), offset, inverse=True)
        if self.key_mean is not None:
            x = x - self.key_mean[None, :, None, :]
        return pq_encode(x, self.key_codebook, self.key_sub_dim, self.key_bits), None

    def decode_keys(
        self, packed: mx.array, scales: None, offset: int, theta: None = None
    ) -> mx.array:
        x = pq_decode(packed, self.key_codebook, self.key_sub_dim, self.key_bits, self.head_dim)
        if self.key_mean is not None:
            x = x + self.key_mean[None, :, None, :]
        return self._rope(x, offset)

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            **super().meta_state,
            "key_bits": self.key_bits,
            "key_sub_dim": self.key_sub_dim,
            "head_dim": self._dim,
        }

    def _set_meta(self, meta: dict[str, Any]) -> None:
        super()._set_meta(meta)
        self.key_bits, self.key_sub_dim = int(meta["key_bits"]), int(meta["key_sub_dim"])
        self._dim = int(meta["head_dim"])


mlx_cache.PreRopePQCache = PreRopePQCache


def make_caches(
    model: Any,
    key_codebook: mx.array,
    value_codebook: mx.array,
    key_mean: mx.array | None,
    *,
    key_bits: int,
    key_sub_dim: int,
    value_bits: int,
    value_sub_dim: int,
    window: int,
    sinks: int,
) -> list:
    """One PreRopePQCache per layer from [L, H, ...] codebooks (and μ [L, H, D])."""
    base, traditional, scale = rope_params(model)
    head_dim = ModelDims.of(model).D
    return [
        PreRopePQCache(
            key_codebook[i],
            value_codebook[i],
            None if key_mean is None else key_mean[i],
            head_dim=head_dim,
            key_bits=key_bits,
            key_sub_dim=key_sub_dim,
            rope_base=base,
            rope_traditional=traditional,
            rope_scale=scale,
            value_bits=value_bits,
            value_sub_dim=value_sub_dim,
            window=window,
            sinks=sinks,
        )
        for i in range(key_codebook.shape[0])
    ]
