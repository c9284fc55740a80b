"""What real keys and values look like, for every calibrated method that codes them.

DESIGN.md section 11. Two facts drive this module:

- The key mean dominates. The per-(layer, KV head) mean μ of the pre-RoPE keys carries most of
  their energy (`mean_energy_share`). A codebook trained on raw keys spends its resolution on
  μ. RoPE is linear, so k_post = RoPE_m(μ) + RoPE_m(k_pre − μ): coding the residual
  k_post − RoPE_m(μ) and adding RoPE_m(μ) back at the token's position m is exact. For
  values the attention weights sum to 1, so the value mean comes out of the sum exactly too.
- MSE hides what matters. A key error e changes the logit by q·e, so its cost is e^T Σ_q e
  over the KV head's queries, not ‖e‖². `logit_error` reports E[(q·(k − k̂))²] relative to
  the spread of the true logits Var_k[q·k]; `output_error` reports the attention-weighted
  value error relative to the token-specific part of the attention output.

Both diagnostics use captured post-RoPE queries of the KV head's query group (repeat_kv order:
KV head g owns query heads gG .. gG + G − 1) and keys at their captured positions.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant.rope import RopeSpec


def mean_energy_share(mean: mx.array, sq_mean: mx.array) -> mx.array:
    """‖E x‖² / E‖x‖² per (layer, head) from exact capture stats [L, H, D] -> [L, H]."""
    return (mean * mean).sum(-1) / mx.maximum(sq_mean.sum(-1), 1e-30)


def rotate_at_positions(mean: mx.array, rope: RopeSpec, positions: mx.array) -> mx.array:
    """RoPE_m(μ) at each token's own position: mean [H, D], positions [n] -> [n, H, D]."""
    h, d = mean.shape
    x = mx.broadcast_to(mean[None, :, None, :], (positions.shape[0], h, 1, d))
    return rope.apply(x, positions.astype(mx.int32))[:, :, 0, :]


def logit_error(q: mx.array, k: mx.array, k_hat: mx.array) -> float:
    """E[(q·(k − k̂))²] / E_q Var_k[q·k] over every (query, key) pair of each KV head.

    q [n_q, H_q, D] post-RoPE queries; k, k_hat [n, H_kv, D] post-RoPE keys and their
    reconstruction. Summed over KV heads before the ratio.
    """
    h_kv, d = k.shape[1], k.shape[2]
    g = q.shape[1] // h_kv
    qg = q.reshape(q.shape[0], h_kv, g, d).transpose(1, 0, 2, 3).reshape(h_kv, -1, d)
    kh = k.transpose(1, 0, 2)
    err = mx.matmul(qg, (kh - k_hat.transpose(1, 0, 2)).transpose(0, 2, 1))
    logits = mx.matmul(qg, kh.transpose(0, 2, 1))
    spread = mx.var(logits, axis=-1)
    return float((mx.mean(err * err) / mx.maximum(mx.mean(spread), 1e-30)).item())


def output_error(q: mx.array, k: mx.array, v: mx.array, v_hat: mx.array) -> float:
    """E_q‖p_q (V − V̂)‖² / E_q‖p_q (V − v̄)‖² with real softmax weights p_q = softmax(q·K/√D)
    over the held-out keys of each KV head: how much of the token-specific part of the
    attention output the value reconstruction loses."""
    h_kv, d = k.shape[1], k.shape[2]
    g = q.shape[1] // h_kv
    qg = q.reshape(q.shape[0], h_kv, g, d).transpose(1, 0, 2, 3).reshape(h_kv, -1, d)
    p = mx.softmax(mx.matmul(qg, k.transpose(1, 2, 0)) * d**-0.5, axis=-1)
    vh = v.transpose(1, 0, 2)
    err = mx.matmul(p, vh - v_hat.transpose(1, 0, 2))
    centred = mx.matmul(p, vh - vh.mean(axis=1, keepdims=True))
    num, den = (err * err).sum(-1).mean(), (centred * centred).sum(-1).mean()
    return float((num / mx.maximum(den, 1e-30)).item())
