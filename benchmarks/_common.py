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


def random_weights_model(config_json: str | Path, dtype: mx.Dtype):
    """The architecture of `config_json` with mlx's default random init, cast to `dtype`
    (timings and memory do not depend on the weight values)."""
    from mlx_lm.utils import _get_classes

    config = json.loads(Path(config_json).read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def model_dtype(model) -> mx.Dtype:
    return model.model.embed_tokens.weight.dtype
