"""Helpers the benchmark scripts share (run them as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx


def fmt(xs: list[float], scale: float = 1.0, unit: str = "") -> str:
    """median [min, max] of repeated timings, scaled."""
    xs = [x * scale for x in xs]
    return f"{statistics.median(xs):.4g}{unit} [{min(xs):.4g}, {max(xs):.4g}]"


def gemm_gflops(repeats: int, n: int = 2048) -> list[float]:
    """This machine's float32 GEMM rate: `repeats` timings of a square n x n matmul, GFLOP/s."""
    import time

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        out.append(2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return out


def random_weights_model(config_json: str | Path, dtype: mx.Dtype, seed: int = 0):
    """The architecture of `config_json` with mlx's default random init from `seed`, cast to
    `dtype` (timings and memory do not depend on the weight values; greedy-token checks do, and
    MLX seeds its own generator from the clock)."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)

    config = json.loads(Path(config_json).read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def model_dtype(model) -> mx.Dtype:
    return model.model.embed_tokens.weight.dtype
