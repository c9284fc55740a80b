"""The method contract: everything veloxquant knows about a KV-cache method, declared once.

Each method module (or package) under `veloxquant/methods/` builds one `Method` and the table in
`veloxquant/methods/__init__.py` lists them. `make_cache`, calibration, the bundle's tensor check,
the eval's calibrated flag, the CLI's choices and help all read that table; nothing outside
`veloxquant/methods/` names a method.

Runtime data flows one way: `make_cache` resolves and loads the bundle (which checks files,
checksums, the model fingerprint, and tensor shapes against `tensor_specs`), then calls the
method's `make_caches(model, config, artifact)` with an `Artifact` (None for uncalibrated
methods and variants).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from veloxquant import attention

# The KVCacheConfig fields a method may read besides `method`, `artifact_dir`, `uncalibrated`,
# `strict` and `options`; a method lists the ones it uses in `Method.fields`, and make_cache
# refuses a config that sets any other (so a knob is never silently ignored).
KNOB_FIELDS = ("bits", "group_size", "budget", "sinks", "window")


@dataclass(frozen=True)
class ModelDims:
    """The architecture a method's tensors and caches depend on.

    L layers, H_q query heads, H_kv KV heads, D head_dim; RoPE: base theta, the pair layout
    (`rope_traditional`: interleaved pairs (2j, 2j+1); otherwise half-split (j, j + D/2)), the
    scaling dict and the number of rotated dims (D unless partial rotary).
    """

    L: int
    H_q: int
    H_kv: int
    D: int
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    rope_dims: int | None = None

    @property
    def P(self) -> int:
        return self.D // 2

    @property
    def G(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.H_q // self.H_kv

    @classmethod
    def from_args(cls, args: Any) -> ModelDims:
        """From mlx-lm ModelArgs (also what a live model carries as `model.args`) or a
        config.json dict."""
        get = args.get if isinstance(args, dict) else (lambda k, d=None: getattr(args, k, d))
        heads = int(get("num_attention_heads"))
        head_dim = int(get("head_dim", None) or int(get("hidden_size")) // heads)
        partial = get("partial_rotary_factor", None)
        scaling = get("rope_scaling", None)
        return cls(
            L=int(get("num_hidden_layers")),
            H_q=heads,
            H_kv=int(get("num_key_value_heads", None) or heads),
            D=head_dim,
            rope_theta=float(get("rope_theta", None) or 10000.0),
            rope_traditional=bool(get("rope_traditional", False)),
            rope_scaling=dict(scaling) if scaling else None,
            rope_dims=int(head_dim * float(partial)) if partial else head_dim,
        )

    @classmethod
    def of(cls, model_or_dir: Any) -> ModelDims:
        """From a live mlx-lm model, its ModelArgs, a config.json dict or a model dir."""
        if isinstance(model_or_dir, ModelDims):
            return model_or_dir
        if isinstance(model_or_dir, (str, Path)):
            path = Path(model_or_dir)
            return cls.from_args(
                json.loads((path / "config.json" if path.is_dir() else path).read_text())
            )
        return cls.from_args(getattr(model_or_dir, "args", model_or_dir))

    @classmethod
    def from_fingerprint(cls, fp: Mapping[str, Any]) -> ModelDims:
        """From a bundle manifest's model fingerprint (veloxquant.fingerprint)."""
        return cls(
            L=int(fp["num_layers"]),
            H_q=int(fp["num_heads"]),
            H_kv=int(fp["num_kv_heads"]),
            D=int(fp["head_dim"]),
            rope_theta=float(fp["rope_theta"]),
            rope_traditional=bool(fp["rope_traditional"]),
            rope_scaling=fp.get("rope_scaling"),
            rope_dims=fp.get("rope_dims") or int(fp["head_dim"]),
        )


@dataclass(frozen=True)
class TensorSpec:
    """One bundle tensor: exact shape and numpy dtype name."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Artifact:
    """What a bundle hands a calibrated method: its tensors (as mx.arrays) and manifest entry."""

    method: str
    tensors: dict[str, Any]
    hyperparameters: dict[str, Any]
    diagnostics: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)  # capture_point, data, versions, model


@dataclass(frozen=True)
class CalibrationInputs:
    """What a calibration reads. Most methods need only the capture; methods that probe the model
    itself (e.g. gradients through it) also load the model and the calibration token windows."""

    activations_dir: Path  # a capture dir: capture.json, layer_XX.safetensors, stats.safetensors
    model_dir: Path  # the model the capture was made from
    calib_tokens: Path | None = None  # int32 [N, S] windows (data/calib.safetensors)


@dataclass(frozen=True)
class Method:
    """One KV-cache method.

    name           what `KVCacheConfig(method=...)`, the CLI, bundles and DVC call it.
    summary        one line for `--help` and the README.
    make_caches    (model, config, artifact or None) -> one mlx-lm cache per layer.
    fields         the KVCacheConfig knobs (of KNOB_FIELDS) this method reads.
    options        KVCacheConfig.options keys it accepts, with their defaults.
    cache_classes  registered by name in mlx_lm.models.cache, so load_prompt_cache finds them.

    Calibrated methods also declare:
    capture_point  what calibration reads from a capture (e.g. "q_post", "k_post,v").
    defaults       every calibration hyperparameter with its default; nothing else is accepted.
    calibrate      (inputs: CalibrationInputs, dims, hyperparameters, progress) ->
                   (tensors, diagnostics): tensors are the bundle's arrays (mx or numpy),
                   diagnostics a json-able summary. Deterministic in (inputs, hyperparameters).
    tensor_specs   (dims, hyperparameters) -> {name: TensorSpec}: exactly the tensors it writes.
    check_hyperparameters  (hyperparameters) -> None; raises ValueError naming the bad one.
    check_artifact (artifact, dims) -> None; value checks beyond shape and dtype (e.g. unit
                   norms), run by `bundle verify` and `make_cache` alike.
    min_tokens     (dims, hyperparameters) -> the fewest captured tokens calibration accepts.
    plot           optional (artifact, png path) -> None: a picture of the artifact that the
                   method's stage writes and DVC shows (`dvc plots show`).
    """

    name: str
    summary: str
    make_caches: Callable[[Any, Any, Artifact | None], list]
    fields: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    cache_classes: tuple[type, ...] = ()
    calibrated: bool = False
    capture_point: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    calibrate: Callable[..., tuple[dict[str, Any], dict[str, Any]]] | None = None
    tensor_specs: Callable[[ModelDims, dict[str, Any]], dict[str, TensorSpec]] | None = None
    check_hyperparameters: Callable[[dict[str, Any]], None] | None = None
    check_artifact: Callable[[Artifact, ModelDims], None] | None = None
    min_tokens: Callable[[ModelDims, dict[str, Any]], int] | None = None
    plot: Callable[[Artifact, Path], None] | None = None

    def __post_init__(self) -> None:
        unknown = set(self.fields) - set(KNOB_FIELDS)
        if unknown:
            raise ValueError(f"method {self.name}: unknown KVCacheConfig fields {sorted(unknown)}")
        needed = (self.calibrate, self.tensor_specs, self.capture_point, self.min_tokens)
        if self.calibrated and any(x is None for x in needed):
            raise ValueError(
                f"method {self.name} is calibrated, so it must declare calibrate, tensor_specs, "
                "capture_point and min_tokens"
            )

    def hyperparameters(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`defaults` with `overrides` applied and checked; an unknown name is an error."""
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown hyperparameters {unknown}; known: {sorted(self.defaults)}"
            )
        hp = {**self.defaults, **overrides}
        if self.check_hyperparameters is not None:
            self.check_hyperparameters(hp)
        return hp


# ---------------------------------------------------------------------------------------------
# What every veloxquant cache shares


class CompressedCache(_BaseCache):
    """Base of veloxquant's caches: what mlx-lm would otherwise do silently wrong with them.

    - `merge` batches for real: each sequence keeps its own compressed cache as one row of a
      `veloxquant.batch.BatchedCache` (mlx-lm's BatchKVCache would drop the compression).
    - `to_quantized` refuses: mlx-lm's kv_bits= would replace the compressed cache with a
      QuantizedKVCache once `offset` reaches quantized_kv_start; the CLI and server refuse
      kv_bits up front.
    - not trimmable: coded or evicted tokens cannot be restored.
    No `bits` attribute: its presence routes mlx-lm attention to quantized_matmul.
    """

    @classmethod
    def merge(cls, caches: list) -> Any:
        from veloxquant.batch import BatchedCache

        return BatchedCache.merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError(
            f"{type(self).__name__} is already a compressed cache and cannot be converted to "
            "mlx-lm's QuantizedKVCache: drop kv_bits= (mlx_lm --kv-bits), or use "
            "KVCacheConfig(method='quantized', bits=...) instead."
        )

    def is_trimmable(self) -> bool:
        return False

    @property
    def compressed_tokens(self) -> int:
        """Tokens held coded or evicted rather than at full precision (for stats and tests)."""
        raise NotImplementedError

    # what a fused update leaves for the attention call that follows it (None: nothing pending)
    _pending: dict | None = None

    def _check_no_pending(self) -> None:
        """Refuse an update while the previous fused update's attention never ran.

        A fused update leaves `_pending` (what its attention must read) for the attention call
        that follows it; a second update first means the caller bypassed the dispatch. Here the
        update itself is already complete (store and window advanced), so only the marker goes;
        a cache whose update is finished by its attention overrides this."""
        if self._pending is not None:
            self._pending = None
            raise attention.unattended_update(self)


def take_sinks(
    cache: Any, keys: mx.array, values: mx.array
) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None]:
    """Split off the attention-sink tokens of one update (float32 keys/values [B, H, T, D]).

    The first `cache.sinks` tokens of the sequence are kept in fp16 for good
    (`cache.sink_keys` / `cache.sink_values`, None until the first). Returns (the call's
    remaining keys, values, then the sinks attention sees in this call: the stored fp16 ones,
    followed by this call's own sink tokens exactly, as every token of the call is)."""
    n_sink = min(max(cache.sinks - cache.offset, 0), keys.shape[2])
    out_k = None if cache.sink_keys is None else cache.sink_keys.astype(mx.float32)
    out_v = None if cache.sink_values is None else cache.sink_values.astype(mx.float32)
    if n_sink:
        new_k, new_v = keys[:, :, :n_sink], values[:, :, :n_sink]
        out_k = new_k if out_k is None else mx.concatenate([out_k, new_k], axis=2)
        out_v = new_v if out_v is None else mx.concatenate([out_v, new_v], axis=2)
        sk, sv = new_k.astype(mx.float16), new_v.astype(mx.float16)
        if cache.sink_keys is None:
            cache.sink_keys, cache.sink_values = sk, sv
        else:
            cache.sink_keys = mx.concatenate([cache.sink_keys, sk], axis=2)
            cache.sink_values = mx.concatenate([cache.sink_values, sv], axis=2)
        keys, values = keys[:, :, n_sink:], values[:, :, n_sink:]
    return keys, values, out_k, out_v


# ---------------------------------------------------------------------------------------------
# Cache state for save_prompt_cache / load_prompt_cache
#
# mlx-lm 0.32 serialises only `cache.state` (arrays, plus int/float/bool/str/None leaves it
# converts), and `from_state` skips __init__. Our caches keep their arrays by name in `state` and
# their scalars in `meta_state`, serialised as state["meta"], so a loaded cache never depends on
# positional order. Version 2 is veloxquant 0.2; 0.1 saved positional tuples.
STATE_VERSION = 2


def pack_state(arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """`state` of a veloxquant cache: named arrays (None allowed) plus its meta_state."""
    if "meta" in arrays:
        raise ValueError("'meta' is reserved for the cache's scalar state")
    return {**arrays, "meta": {"state_version": STATE_VERSION, **meta}}


def unpack_state(cls_name: str, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, meta) from a state set by load_prompt_cache, or a clear error for a prompt
    cache saved by another veloxquant version."""
    meta = state.get("meta") if isinstance(state, dict) else None
    version = meta.get("state_version") if isinstance(meta, dict) else None
    if version != STATE_VERSION:
        from veloxquant._version import __version__

        saved = "veloxquant 0.1 (positional state)" if version is None else f"state v{version}"
        raise ValueError(
            f"{cls_name}: this prompt cache was saved by {saved}; veloxquant {__version__} reads "
            f"state v{STATE_VERSION}. Re-create the prompt cache with this version."
        )
    arrays = {k: v for k, v in state.items() if k != "meta"}
    return arrays, {k: v for k, v in meta.items() if k != "state_version"}
