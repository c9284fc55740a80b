"""VecInfer's outlier-suppressing key transform: smooth scales, then a Walsh-Hadamard rotation.

k̃ = H·(k ⊘ λ), with H the orthonormal Walsh-Hadamard transform (`mx.hadamard_transform`,
default scale 1/sqrt(D)). H is symmetric and orthogonal, so k = H·k̃ ⊙ λ, and the matching query
transform q̃ = H·(q ⊙ λ) keeps ⟨q̃, k̃⟩ = ⟨q, k⟩.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def check_hadamard_dim(dim: int) -> None:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(
            f"vecinfer: head_dim {dim} is not a power of two, so the Walsh-Hadamard rotation "
            "is undefined for it; calibrate with hadamard=False for this model."
        )


def smooth_scales(absmax: mx.array, clip_percentile: float = 99.9, floor: float = 1e-2) -> mx.array:
    """λ = sqrt(clipped per-channel max|k|), floored. absmax [L, H, D] → λ [L, H, D] f32."""
    a = np.asarray(absmax, dtype=np.float64)
    if a.ndim != 3:
        raise ValueError(f"smooth_scales expects absmax [L, H, D], got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("k_post.absmax contains NaN/inf; re-run the capture")
    cap = np.percentile(a.reshape(a.shape[0], -1), clip_percentile, axis=1)[:, None, None]
    lam = np.maximum(np.sqrt(np.minimum(a, cap)), floor)
    return mx.array(lam.astype(np.float32))


def smooth_transform(x: mx.array, smooth: mx.array, hadamard: bool) -> mx.array:
    """k̃ = H·(k ⊘ λ); smooth broadcasts against x [..., D]."""
    y = x / smooth
    return mx.hadamard_transform(y) if hadamard else y


def inverse_smooth_transform(y: mx.array, smooth: mx.array, hadamard: bool) -> mx.array:
    """k = (H·k̃) ⊙ λ (H is its own inverse)."""
    return (mx.hadamard_transform(y) if hadamard else y) * smooth


def query_transform(q: mx.array, smooth: mx.array, hadamard: bool) -> mx.array:
    """q̃ = H·(q ⊙ λ), so ⟨q̃, k̃⟩ = ⟨q, k⟩ (for the LUT attention path)."""
    y = q * smooth
    return mx.hadamard_transform(y) if hadamard else y


def balanced_scales(
    signal_power: mx.array, cost_power: mx.array, clip_percentile: float = 99.0
) -> mx.array:
    """λ_c = (E[x_c²] / w_c)^(1/4) per (layer, head, channel) [L, H, D].

    With x̃ = H·(x ⊘ λ) coded at a roughly uniform error per dimension of x̃, the error that
    matters costs Σ_c w_c λ_c² e_c² (w: the squared query per channel for keys, the squared
    o_proj column for values), while the coding error scales with Σ_c E[x_c²] / λ_c². Their
    product is smallest (Cauchy-Schwarz) at this λ. The ratio is clipped per layer to the
    [100 − p, p] percentile range, so a channel no query reads cannot take all the scale."""
    a = np.maximum(np.asarray(signal_power, np.float64), 1e-30)
    w = np.asarray(cost_power, np.float64)
    w = np.maximum(w, 1e-6 * w.reshape(w.shape[0], -1).mean(axis=1)[:, None, None])
    ratio = a / w
    flat = ratio.reshape(ratio.shape[0], -1)
    lo = np.percentile(flat, 100 - clip_percentile, axis=1)[:, None, None]
    hi = np.percentile(flat, clip_percentile, axis=1)[:, None, None]
    lam = np.clip(ratio, lo, hi) ** 0.25
    lam /= np.exp(np.log(lam).reshape(lam.shape[0], -1).mean(axis=1))[:, None, None]
    return mx.array(lam.astype(np.float32))
