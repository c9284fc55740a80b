"""The KV-cache methods, one module (or package) each, and the one table that lists them.

Everything else (make_cache, calibration, bundle tensor checks, eval, the CLI) reads `METHODS`;
see `veloxquant/methods/base.py` for what a method declares. Importing this package registers
every cache class by name in `mlx_lm.models.cache`, where `load_prompt_cache` looks them up.
"""

from __future__ import annotations

import mlx_lm.models.cache as _mlx_cache

from veloxquant.methods import baselines, commvq, eviction, kivi, qfilters, ratequant, vecinfer
from veloxquant.methods.base import Method

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        baselines.FP16,
        baselines.QUANTIZED,
        eviction.STREAMINGLLM,
        eviction.KNORM,
        kivi.METHOD,
        qfilters.METHOD,
        vecinfer.METHOD,
        commvq.METHOD,
        ratequant.METHOD,
    )
}

CALIBRATED = tuple(name for name, m in METHODS.items() if m.calibrated)

for _method in METHODS.values():
    for _cls in _method.cache_classes:
        setattr(_mlx_cache, _cls.__name__, _cls)
