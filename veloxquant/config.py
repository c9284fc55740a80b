"""Runtime configuration: `KVCacheConfig` and `make_cache`.

`make_cache(model, KVCacheConfig(method=...))` returns one mlx-lm cache per layer, ready for
`mlx_lm.generate(..., prompt_cache=caches)`. The methods and their knobs are listed in
`veloxquant.methods.METHODS`; `veloxquant --help` prints them.

Runtime data flows one way: the config names a method; for a calibrated method `make_cache`
resolves and loads the bundle (veloxquant.bundle), which verifies files, tensors and the model
fingerprint; the method then builds its caches from the verified artifact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from veloxquant.methods import METHODS
from veloxquant.methods.base import KNOB_FIELDS, Method


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
    group_size: int | None = None  # the method's default when None
    budget: float | None = None
    sinks: int | None = None
    window: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A knob the method does not read, or an unknown option, is an error here, at
        # construction, so nothing is ever silently ignored.
        check_config(self)

    def label(self) -> str:
        return self.method + ("-uncalibrated" if self.uncalibrated else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELD_DEFAULTS = {f.name: f.default for f in fields(KVCacheConfig) if f.name in KNOB_FIELDS}


def check_config(config: KVCacheConfig) -> Method:
    """The config's method, or a ValueError naming the field that does not apply to it."""
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
    if config.uncalibrated and not method.calibrated:
        raise ValueError(f"{method.name} has no calibration, so no uncalibrated variant.")
    return method


def make_cache(model: Any, config: KVCacheConfig | None = None) -> list:
    """Build one cache per layer of `model` for `config` (default: plain fp KVCache)."""
    return cache_factory(model, config)()


def cache_factory(model: Any, config: KVCacheConfig | None = None) -> Callable[[], list]:
    """A function that builds fresh caches for `model` on every call, with the bundle loaded
    and checked once, now (a server builds one set of caches per request)."""
    from veloxquant.bundle import load_artifact

    config = config or KVCacheConfig()
    method = check_config(config)
    artifact = None
    if method.calibrated and not config.uncalibrated:
        if not config.artifact_dir:
            _check_discoverable(model, method.name)
        artifact = load_artifact(model, method.name, config.artifact_dir, strict=config.strict)

    def build() -> list:
        return method.make_caches(model, config, artifact)

    return build


def _check_discoverable(model: Any, method: str) -> None:
    """Without artifact_dir the bundle comes from the model's dir: say why it cannot when the
    model does not know its dir (rather than claim the dir has no bundle)."""
    from veloxquant.bundle import BUNDLE_SUBDIR, BundleError, producer
    from veloxquant.fingerprint import MODEL_DIR_ATTR

    if getattr(model, MODEL_DIR_ATTR, None) is None:
        raise BundleError(
            f"KV-cache method {method!r} is calibrated and needs a bundle, but no artifact_dir "
            f"was given and the model does not record which dir it was loaded from, so a "
            f"bundle exported into it ({BUNDLE_SUBDIR}/) cannot be found. Load the model with "
            "mlx_lm.load or veloxquant.model_import.load_model after `import veloxquant`, or "
            f"pass KVCacheConfig(method={method!r}, artifact_dir=DIR). Bundles come from "
            f"{producer(method)}."
        )


def check_kv_bits(caches: list, kv_bits: int | None) -> None:
    """mlx-lm's kv_bits= swaps caches for QuantizedKVCache once quantized_kv_start is reached;
    only a plain KVCache can take that. Refuse it up front for every other cache (ours would
    raise mid-stream; mlx-lm would skip a QuantizedKVCache without a word)."""
    from mlx_lm.models.cache import KVCache

    if kv_bits is None:
        return
    others = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if others:
        raise ValueError(
            f"kv_bits={kv_bits} (--kv-bits) only applies to mlx-lm's plain KVCache, not to "
            f"{', '.join(others)}: it would replace or skip the configured cache. Drop "
            "--kv-bits, or pick the scalar quantized cache with --method quantized --bits N."
        )
