"""CommVQ's fused decode attention: for now its pure-MLX twin only.

`reference_attention` attends over exactly the tokens the transient path would (the sinks, the
coded past as it was before the call, the window and the call's own tokens), with the coded
past decoded one piece at a time (`CommVQCache.decode_keys` at the piece's positions,
`decode_values`) under an online softmax, so no call holds the whole dequantized past: prefill
of a long prompt stays within a piece's memory. It is the oracle a GPU kernel will be tested
against. There is no GPU kernel, so the fused path is opt-in (VELOXQUANT_FUSED=1): a 2-bit key
at D = 128 is 21 stages of two atoms on each of 64 RoPE pairs, 28x the codebook reads per token
of VecInfer's kernel, so one would save memory (as this twin does) but not time (README,
"CommVQ: the twin first").
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant import attention

# Scores alive at once in one piece (float32 elements): bounds prefill's peak memory.
PIECE_ELEMENTS = 1 << 25
PIECE_TOKENS = 16384


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
