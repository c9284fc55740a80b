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
- path: the model dir the bundle was calibrated on (information only).

An architecture mismatch is a `FingerprintError` naming the field and both values; a different
config, weights or tokenizer digest (e.g. a 4-bit copy of the same model) is a
`FingerprintWarning`, or a `FingerprintError` under strict. A live model whose dir is unknown has
only its architecture and config digest checked.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

from veloxquant.io import canonical_json, jsonable, sha256_bytes, sha256_file

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


class FingerprintError(ValueError):
    """A bundle was made for another model (or, under strict, another copy of it)."""


class FingerprintWarning(UserWarning):
    """The bundle was calibrated on a different copy (weights/tokenizer/config) of the model."""


def attach_model_dir(model: Any, model_dir: str | os.PathLike) -> Any:
    """Record where `model` was loaded from, so make_cache can find `<dir>/veloxquant/`."""
    setattr(model, MODEL_DIR_ATTR, str(Path(model_dir).resolve()))
    return model


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


def fingerprint_model_dir(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Architecture plus config/weights/tokenizer digests of an mlx-lm model dir."""
    model_dir = Path(model_dir).resolve()
    fp = _architecture(_model_args_from_dir(model_dir))
    fp["weights_sha256"] = _weights_digest(model_dir)
    fp["tokenizer_sha256"] = _tokenizer_digest(model_dir)
    fp["path"] = str(model_dir)
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
    model_dir = getattr(model, MODEL_DIR_ATTR, None)
    if model_dir and Path(model_dir).is_dir():
        fp["weights_sha256"] = _weights_digest(Path(model_dir))
        fp["tokenizer_sha256"] = _tokenizer_digest(Path(model_dir))
        fp["path"] = str(model_dir)
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
    for field in DIGEST_FIELDS:
        want, have = expected.get(field), actual.get(field)
        if want is None or have is None or want == have:
            continue
        msg = (
            f"{where}: {field} differs from the model's (bundle {want[:12]}..., model "
            f"{have[:12]}...). Same architecture, different copy of the model (e.g. another "
            f"quantization); the calibration may not transfer. Bundle model: "
            f"{expected.get('path')}, this model: {actual.get('path')}."
        )
        if strict:
            raise FingerprintError(msg + " Refusing under strict=True.")
        warnings.warn(msg, FingerprintWarning, stacklevel=3)
