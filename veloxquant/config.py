"""Runtime configuration: `KVCacheConfig` and `make_cache`.

`make_cache(model, KVCacheConfig(method=...))` returns one mlx-lm cache per layer, ready for
`mlx_lm.generate(..., prompt_cache=caches)`. Each method lives in its own module under
`veloxquant/methods/` and exposes `make_caches(model, config) -> list`.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any

# method name -> module under veloxquant.methods
METHODS: dict[str, str] = {
    "fp16": "baselines",
    "quantized": "baselines",
    "qfilters": "qfilters",
    "streamingllm": "eviction",
    "knorm": "eviction",
    "vecinfer": "vecinfer",
}


@dataclass(frozen=True)
class KVCacheConfig:
    """What cache to build.

    method:        one of `METHODS`.
    artifact_dir:  calibration bundle dir (calibrated methods); see `veloxquant.load_bundle`.
    uncalibrated:  build the method's uncalibrated reference variant (ablations only).
    strict:        treat weight/tokenizer digest mismatches with the bundle as errors.
    bits, group_size: mlx-lm `QuantizedKVCache` baseline.
    budget:        eviction methods: a token count (int >= 1) or a fraction of tokens seen (< 1).
    sinks, window: protected first tokens / recent fp window (method defaults when None).
    options:       method-specific knobs, documented at the top of each method's module.
    """

    method: str = "fp16"
    artifact_dir: str | None = None
    uncalibrated: bool = False
    strict: bool = False
    bits: int | None = None
    group_size: int = 64
    budget: float | None = None
    sinks: int | None = None
    window: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        return self.method + ("-uncalibrated" if self.uncalibrated else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_cache(model: Any, config: KVCacheConfig | None = None) -> list:
    """Build one cache per layer of `model` for `config` (default: plain fp KVCache)."""
    config = config or KVCacheConfig()
    if config.method not in METHODS:
        raise ValueError(f"Unknown KV-cache method {config.method!r}. Known: {sorted(METHODS)}")
    module = importlib.import_module(f"veloxquant.methods.{METHODS[config.method]}")
    return module.make_caches(model, config)


def model_dims(model_or_config: Any) -> dict[str, int]:
    """L, H_q, H_kv, D from a model, its ModelArgs, a config.json dict or a model dir."""
    import json
    from pathlib import Path

    src = model_or_config
    if isinstance(src, (str, Path)):
        path = Path(src)
        src = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    if hasattr(src, "args"):
        src = src.args
    get = src.get if isinstance(src, dict) else (lambda k, d=None: getattr(src, k, d))
    heads = int(get("num_attention_heads"))
    return {
        "L": int(get("num_hidden_layers")),
        "H_q": heads,
        "H_kv": int(get("num_key_value_heads", None) or heads),
        "D": int(get("head_dim", None) or int(get("hidden_size")) // heads),
    }
