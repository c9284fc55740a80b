"""Runtime configuration: `KVCacheConfig` and `make_cache`.

`make_cache(model, KVCacheConfig(method=...))` returns one mlx-lm cache per layer, ready for
`mlx_lm.generate(..., prompt_cache=caches)`. The methods and their knobs are listed in
`veloxquant.methods.METHODS`; `veloxquant --help` prints them.

Runtime data flows one way: the config names a method; for a calibrated method `make_cache`
resolves and loads the bundle (veloxquant.bundle), which verifies files, tensors and the model
fingerprint; the method then builds its caches from the verified artifact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from veloxquant.methods import METHODS
from veloxquant.methods.base import KNOB_FIELDS


@dataclass(frozen=True)
class KVCacheConfig:
    """What cache to build.

    method:        one of `veloxquant.methods.METHODS`.
    artifact_dir:  calibration bundle dir (calibrated methods); see `veloxquant.load_bundle`.
    uncalibrated:  build the method's uncalibrated reference variant (ablations only).
    strict:        treat weight/tokenizer digest mismatches with the bundle as errors.
    bits, group_size: quantizer settings (methods that quantize scalars).
    budget:        eviction methods: a token count (int >= 1) or a fraction of tokens seen (< 1).
    sinks, window: protected first tokens / recent fp window (method defaults when None).
    options:       method-specific knobs, documented at the top of each method's module.
    """

    method: str = "fp16"
    artifact_dir: str | None = None
    uncalibrated: bool = False
    strict: bool = False
    bits: float | None = None
    group_size: int = 64
    budget: float | None = None
    sinks: int | None = None
    window: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        return self.method + ("-uncalibrated" if self.uncalibrated else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELD_DEFAULTS = {f.name: f.default for f in fields(KVCacheConfig) if f.name in KNOB_FIELDS}


def make_cache(model: Any, config: KVCacheConfig | None = None) -> list:
    """Build one cache per layer of `model` for `config` (default: plain fp KVCache)."""
    from veloxquant.bundle import load_artifact

    config = config or KVCacheConfig()
    if config.method not in METHODS:
        raise ValueError(f"Unknown KV-cache method {config.method!r}. Known: {sorted(METHODS)}")
    method = METHODS[config.method]
    for name, default in _FIELD_DEFAULTS.items():
        value = getattr(config, name)
        if name not in method.fields and value != default:
            raise ValueError(
                f"KVCacheConfig({name}={value!r}) does not apply to method {method.name!r}, "
                f"which reads {list(method.fields) or 'no knobs'}; drop it."
            )
    unknown = sorted(set(config.options) - set(method.options))
    if unknown:
        raise ValueError(
            f"{method.name}: unknown options {unknown}; known: {sorted(method.options) or 'none'}"
        )
    if config.uncalibrated and config.artifact_dir:
        raise ValueError(
            f"KVCacheConfig(uncalibrated=True, artifact_dir={config.artifact_dir!r}) is "
            "contradictory: the uncalibrated variant uses no bundle. Drop one of them."
        )
    artifact = None
    if method.calibrated and not config.uncalibrated:
        artifact = load_artifact(model, method.name, config.artifact_dir, strict=config.strict)
    elif config.uncalibrated and not method.calibrated:
        raise ValueError(f"{method.name} has no calibration, so no uncalibrated variant.")
    return method.make_caches(model, config, artifact)
