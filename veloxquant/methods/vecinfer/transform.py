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
