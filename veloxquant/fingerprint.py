"""Model fingerprints: what a bundle records about the model it was calibrated on, and the check
of a live model (or a model dir) against it.

- architecture: model_type, num_layers, num_heads, num_kv_heads, head_dim, rope_theta,
  rope_traditional, rope_scaling, read from mlx-lm's ModelArgs (the same object a live model
  carries as `model.args`, so a bundle can be checked against a live model);
- config_sha256: sha256 of the canonical json of ModelArgs, i.e. exactly the config.json content
  mlx-lm uses to build the network (dtype and quantization keys are not part of it);
- weights_sha256: sha256 over the sorted `name:sha256(file)` lines of every *.safetensors in the
  model dir. The files are hashed in full and the result is memoised per process by
  (path, size, mtime), so repeated make_cache calls are free;
- tokenizer_sha256: sha256 of tokenizer.json (tokenizer.model when there is no json);
- params_digest: sha256 over every parameter of the built model (name, dtype, shape and an
  evenly strided sample of up to PARAM_SAMPLE elements of its raw bytes), so it is computed
  the same way from a live model object as from a model dir (which is built lazily for it).
  It needs no path: a model loaded any way at all is checked by it, and a quantized copy
  (other dtypes and shapes) or fine-tune (other values) differs. A sample, not a hash of every
  byte: cheap enough for every make_cache call, and weights_sha256 covers every byte when the
  model's dir is known;
- weights_format: a readable summary (dtypes, quantization bits/group size) for messages;
- path: the model dir the bundle was calibrated on (information only).

Where a live model came from: `veloxquant.model_import.load_model` records its dir, and so does
`mlx_lm.load` (and everything built on it: `mlx_lm.server`, `mlx_lm.generate`) once veloxquant
is imported: this module wraps `mlx_lm.utils.load_model`, the one function they all load
through, to set `model._veloxquant_model_dir` (a plain attribute, not a parameter). That is
what lets make_cache find a bundle exported into the model dir and check the file digests.

An architecture mismatch is a `FingerprintError` naming the field and both values; a different
config, weights, params or tokenizer digest (e.g. a 4-bit copy of the same model) is a
`FingerprintWarning`, or a `FingerprintError` under strict. Under strict, a model whose weights
cannot be compared at all (no digest on either side in common) is refused too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

from veloxquant.io import canonical_json, jsonable, recorded_path, sha256_bytes, sha256_file

MODEL_DIR_ATTR = "_veloxquant_model_dir"  # leading underscore: not a parameter of the model
ARCH_FIELDS = (
    "model_type",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "rope_traditional",
    "rope_scaling",
)
DIGEST_FIELDS = ("config_sha256", "weights_sha256", "tokenizer_sha256")
# Checked like DIGEST_FIELDS, but kept out of that tuple: bundles written before it existed
# lack it, and the bundle writer compares DIGEST_FIELDS when a method joins an existing bundle.
PARAMS_FIELDS = ("params_digest",)
WEIGHT_FIELDS = ("weights_sha256", "params_digest")  # either one identifies the weights
PARAM_SAMPLE = 4096  # elements sampled per parameter for params_digest


class FingerprintError(ValueError):
    """A bundle was made for another model (or, under strict, another copy of it)."""


class FingerprintWarning(UserWarning):
    """The bundle was calibrated on a different copy (weights/tokenizer/config) of the model."""


def attach_model_dir(model: Any, model_dir: str | os.PathLike) -> Any:
    """Record where `model` was loaded from, so make_cache can find `<dir>/veloxquant/`."""
    setattr(model, MODEL_DIR_ATTR, str(Path(model_dir).resolve()))
    return model


def _record_model_dir_on_mlx_lm_load() -> None:
    """Wrap `mlx_lm.utils.load_model` so every model mlx-lm loads carries its dir.

    mlx_lm.load, sharded_load and the server call it through the module global, so wrapping
    the attribute covers them however the user imported `load`.
    """
    import mlx_lm.utils as mlx_utils

    original = mlx_utils.load_model
    if getattr(original, "_veloxquant_records_dir", False):
        return

    @functools.wraps(original)
    def load_model(model_path: Any, *args: Any, **kwargs: Any) -> Any:
        model, config = original(model_path, *args, **kwargs)
        attach_model_dir(model, model_path)
        return model, config

    load_model._veloxquant_records_dir = True
    mlx_utils.load_model = load_model


_record_model_dir_on_mlx_lm_load()


def _model_args_from_dir(model_dir: Path) -> Any:
    from mlx_lm.utils import _get_classes, load_config

    if not (model_dir / "config.json").is_file():
        raise FingerprintError(f"{model_dir} is not a model dir (no config.json).")
    config = load_config(model_dir)
    _, args_class = _get_classes(config)
    return args_class.from_dict(config)


def _architecture(args: Any) -> dict[str, Any]:
    heads = int(args.num_attention_heads)
    kv = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    args_dict = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
    return {
        "model_type": str(args.model_type),
        "num_layers": int(args.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": int(kv),
        "head_dim": int(head_dim),
        "rope_theta": float(getattr(args, "rope_theta", 10000.0)),
        "rope_traditional": bool(getattr(args, "rope_traditional", False)),
        "rope_scaling": jsonable(getattr(args, "rope_scaling", None)),
        "config_sha256": sha256_bytes(canonical_json(args_dict)),
    }


_DIGEST_MEMO: dict[tuple, str] = {}


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGEST_MEMO:
        _DIGEST_MEMO[key] = sha256_file(path)
    return _DIGEST_MEMO[key]


def _weights_digest(model_dir: Path) -> str | None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    lines = "".join(f"{f.name}:{_file_digest(f)}\n" for f in files)
    return sha256_bytes(lines.encode())


def _tokenizer_digest(model_dir: Path) -> str | None:
    for name in ("tokenizer.json", "tokenizer.model"):
        if (model_dir / name).is_file():
            return _file_digest(model_dir / name)
    return None


def weights_format(model: Any) -> str:
    """e.g. "float32" or "4-bit affine g64, float32": parameter dtypes and quantization."""
    from mlx.utils import tree_flatten

    dtypes = sorted({str(p.dtype).removeprefix("mlx.core.") for _, p in _parameters(model)})
    quant = sorted(
        {
            f"{m.bits}-bit {getattr(m, 'mode', 'affine')} g{m.group_size}"
            for _, m in tree_flatten(model.leaf_modules(), is_leaf=lambda m: hasattr(m, "bits"))
            if hasattr(m, "bits") and hasattr(m, "group_size")
        }
    )
    return ", ".join(quant + dtypes)


def _parameters(model: Any) -> list:
    from mlx.utils import tree_flatten

    return sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])


def params_digest(model: Any) -> str:
    """sha256 of every parameter's name, dtype, shape and a strided sample of its bytes."""
    import mlx.core as mx
    import numpy as np

    h = hashlib.sha256()
    samples = []
    for name, p in _parameters(model):
        h.update(f"{name}:{p.dtype}:{list(p.shape)}\n".encode())
        flat = p.reshape(-1)
        stride = max(1, flat.size // PARAM_SAMPLE)
        # raw bytes, so every dtype (bfloat16, packed uint32 codes) hashes the same way
        samples.append(flat[::stride][:PARAM_SAMPLE].view(mx.uint8))
    if samples:
        h.update(np.array(mx.concatenate(samples)).tobytes())
    return h.hexdigest()


_DIR_MODEL_MEMO: dict[tuple, tuple[str, str]] = {}


def _params_of_dir(model_dir: Path) -> tuple[str | None, str | None]:
    """(params_digest, weights_format) of the model mlx-lm builds from `model_dir`, memoised
    per process by the weight files' (name, size, mtime)."""
    from mlx_lm.utils import load_model

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None, None
    key = (str(model_dir),) + tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _DIR_MODEL_MEMO:
        model, _ = load_model(model_dir, lazy=True)
        _DIR_MODEL_MEMO[key] = (params_digest(model), weights_format(model))
    return _DIR_MODEL_MEMO[key]


def fingerprint_model_dir(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Architecture plus config/weights/params/tokenizer digests of an mlx-lm model dir."""
    given, model_dir = model_dir, Path(model_dir).resolve()
    fp = _architecture(_model_args_from_dir(model_dir))
    fp["weights_sha256"] = _weights_digest(model_dir)
    fp["tokenizer_sha256"] = _tokenizer_digest(model_dir)
    fp["params_digest"], fp["weights_format"] = _params_of_dir(model_dir)
    fp["path"] = recorded_path(given)
    return fp


def fingerprint_live_model(model: Any) -> dict[str, Any]:
    """Fingerprint of a loaded mlx-lm model: architecture and config digest from `model.args`;
    weights/tokenizer digests only when the model carries its dir (see `attach_model_dir`)."""
    args = getattr(model, "args", None)
    if args is None:
        raise FingerprintError(
            "The model has no `.args` (mlx-lm ModelArgs); cannot check the bundle against it."
        )
    fp = _architecture(args)
    fp["params_digest"] = params_digest(model)
    fp["weights_format"] = weights_format(model)
    model_dir = getattr(model, MODEL_DIR_ATTR, None)
    if model_dir and Path(model_dir).is_dir():
        fp["weights_sha256"] = _weights_digest(Path(model_dir))
        fp["tokenizer_sha256"] = _tokenizer_digest(Path(model_dir))
        fp["path"] = recorded_path(model_dir)
    else:
        fp["weights_sha256"] = fp["tokenizer_sha256"] = fp["path"] = None
    return fp


def check_model_fingerprint(
    expected: dict[str, Any], actual: dict[str, Any], *, strict: bool = False, where: str = "bundle"
) -> None:
    """Raise on an architecture mismatch; warn (or raise if strict) on a digest mismatch."""
    for field in ARCH_FIELDS:
        if expected.get(field) != actual.get(field):
            raise FingerprintError(
                f"{where} was calibrated for a different model: {field} is "
                f"{expected.get(field)!r} in the bundle but {actual.get(field)!r} in the model "
                f"(bundle model: {expected.get('path')}). Calibrate for this model instead."
            )
    for field in DIGEST_FIELDS + PARAMS_FIELDS:
        want, have = expected.get(field), actual.get(field)
        if want is None or have is None or want == have:
            continue
        msg = (
            f"{where}: {field} differs from the model's (bundle {want[:12]}..., model "
            f"{have[:12]}...). Same architecture, different copy of the model (e.g. another "
            f"quantization); the calibration may not transfer. Bundle model: "
            f"{expected.get('path')} ({expected.get('weights_format') or 'format not recorded'}), "
            f"this model: {actual.get('path')} ({actual.get('weights_format')})."
        )
        if strict:
            raise FingerprintError(msg + " Refusing under strict=True.")
        warnings.warn(msg, FingerprintWarning, stacklevel=3)
    compared = [f for f in WEIGHT_FIELDS if expected.get(f) and actual.get(f)]
    if strict and not compared:
        raise FingerprintError(
            f"{where}: strict=True, but the model's weights cannot be compared with the bundle's: "
            f"the bundle records {[f for f in WEIGHT_FIELDS if expected.get(f)] or 'no digest'}, "
            f"the model offers {[f for f in WEIGHT_FIELDS if actual.get(f)] or 'no digest'}. "
            "Load the model with mlx_lm.load or veloxquant.model_import.load_model (after "
            "importing veloxquant), or re-create the bundle with this veloxquant."
        )
