"""Uncompressed and mlx-lm-quantized baselines.

- `fp16`: mlx-lm `KVCache` in the model's dtype (float32 on the CPU backend, so its resident
  bits per element read 32 there).
- `quantized`: mlx-lm `QuantizedKVCache(group_size, bits)`; attention runs on the quantized
  keys/values through `quantized_matmul`.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant.methods.base import Artifact, Method

QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)


def make_fp16_caches(model: Any, config: Any, artifact: Artifact | None) -> list:
    return [KVCache() for _ in model.layers]


def make_quantized_caches(model: Any, config: Any, artifact: Artifact | None) -> list:
    if config.bits not in QUANTIZED_BITS or int(config.bits) != config.bits:
        raise ValueError(
            f"quantized cache needs bits in {','.join(map(str, QUANTIZED_BITS))}; got {config.bits}"
        )
    bits = int(config.bits)
    group_size = 64 if config.group_size is None else int(config.group_size)
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]


FP16 = Method(
    name="fp16",
    summary="uncompressed mlx-lm KVCache in the model dtype (the reference)",
    make_caches=make_fp16_caches,
)

QUANTIZED = Method(
    name="quantized",
    summary="mlx-lm QuantizedKVCache: bits=2/3/4/5/6/8 per element, group_size=32/64/128",
    make_caches=make_quantized_caches,
    fields=("bits", "group_size"),
)
