"""Causal prefill by blocks on the CPU (`veloxquant.attention.causal_blocks`): the same bits as
MLX's own attention, and taken only where it applies."""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant import attention


def _bits(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).view(np.uint32)


@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, queries, keys, dtype",
    [
        (1, 9, 3, 256, 256, mx.float32),  # SmolLM2's heads, blocks of 64
        (2, 4, 4, 200, 200, mx.float32),  # no GQA, a last block of 8 queries
        (1, 8, 2, 130, 700, mx.float32),  # a chunk after 570 cached tokens
        (1, 4, 2, 192, 192, mx.bfloat16),
        (1, 4, 1, 160, 160, mx.float16),
    ],
)
def test_blocked_attention_is_mlx_attention_bit_for_bit(
    batch, q_heads, kv_heads, queries, keys, dtype
):
    mx.random.seed(queries + keys)
    q = (mx.random.normal((batch, q_heads, queries, 64)) * 2).astype(dtype)
    k = (mx.random.normal((batch, kv_heads, keys, 64)) * 2).astype(dtype)
    v = mx.random.normal((batch, kv_heads, keys, 64)).astype(dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = attention.blocked_causal_attention(q, k, v, 0.125)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_a_prefill_under_causal_blocks_gives_the_same_logits_through_the_blocks(
    smollm2, monkeypatch
):
    model, _ = smollm2
    taken = []
    blocked = attention.blocked_causal_attention
    monkeypatch.setattr(
        attention, "blocked_causal_attention", lambda *a, **k: taken.append(1) or blocked(*a, **k)
    )
    tokens = mx.array(np.random.default_rng(0).integers(0, 40000, (1, 256)), mx.int32)

    def logits(make_cache, n=256):
        caches = [make_cache() for _ in model.layers]
        out = model(tokens[:, :n], cache=caches)
        mx.eval(out)
        return out

    want = logits(KVCache)
    assert not taken and not attention.installed()
    with attention.causal_blocks():
        got = logits(KVCache)
        assert len(taken) == len(model.layers)
        logits(KVCache, n=2 * attention.CAUSAL_BLOCK - 1)  # too short to gain: MLX's own
        logits(lambda: QuantizedKVCache(bits=8))  # mlx-lm's quantized attention
        assert len(taken) == len(model.layers)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not attention.installed() and not attention._blocks_on


def test_causal_blocks_leaves_an_installed_dispatch_installed():
    with attention.fused():
        with attention.causal_blocks():
            assert attention._blocks_on
        assert attention.installed() and not attention._blocks_on
    assert not attention.installed()
