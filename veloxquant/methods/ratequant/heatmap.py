"""Heatmap PNG of RateQuant importance and bits: layers × (KV heads of K | KV heads of V)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def write_heatmap(path: str | Path, importance: Any, bits: Any, title: str = "") -> Path:
    """Two panels over layers (rows) × KV heads of K then of V (columns): log10 importance
    and allocated bits. importance, bits [L, H_kv, 2]. Deterministic bytes for equal inputs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from veloxquant.io import atomic_path

    imp = np.asarray(importance, np.float64)
    b = np.asarray(bits)
    if imp.ndim != 3 or imp.shape[2] != 2 or b.shape != imp.shape:
        raise ValueError(
            f"write_heatmap needs importance and bits [L, H_kv, 2] of one shape, "
            f"got {list(imp.shape)} and {list(b.shape)}"
        )
    n_layers, n_heads, _ = imp.shape

    def grid(x: np.ndarray) -> np.ndarray:  # [L, H, 2] -> [L, 2H]: K heads, then V heads
        return np.concatenate([x[..., 0], x[..., 1]], axis=1)

    tiny = imp[imp > 0].min() if np.any(imp > 0) else 1.0
    panels = (
        (np.log10(np.maximum(grid(imp), tiny)), "log10 importance", "viridis"),
        (grid(b).astype(float), "bits per element (codes)", "magma"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(2.2 + 0.5 * n_heads * 2 * 2, 1.5 + 0.18 * n_layers))
    labels = [f"K{h}" for h in range(n_heads)] + [f"V{h}" for h in range(n_heads)]
    for ax, (data, name, cmap) in zip(axes, panels, strict=True):
        im = ax.imshow(data, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_xticks(range(2 * n_heads), labels, fontsize=7)
        ax.set_ylabel("layer")
        ax.axvline(n_heads - 0.5, color="white", lw=1.5)
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.08)
        if name.startswith("bits"):
            for (i, j), v in np.ndenumerate(data):
                ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=5, color="gray")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path
