"""Uncompressed and mlx-lm-quantized baselines.

- `fp16`: mlx-lm `KVCache` in the model's dtype (float32 on the CPU backend, so its resident
  bits per element read 32 there).
- `quantized`: mlx-lm `QuantizedKVCache(group_size, bits)`; attention runs on the quantized
  keys/values through `quantized_matmul`.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache


def make_caches(model: Any, config: Any) -> list:
    n = len(model.layers)
    if config.method == "fp16":
        return [KVCache() for _ in range(n)]
    if config.method == "quantized":
        if config.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"quantized cache needs bits in 2,3,4,5,6,8; got {config.bits}")
        return [QuantizedKVCache(group_size=config.group_size, bits=config.bits) for _ in range(n)]
    raise ValueError(f"baselines does not provide method {config.method!r}")
