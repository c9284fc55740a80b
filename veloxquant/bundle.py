"""Calibration bundles: versioned safetensors files plus a manifest.

A bundle is a directory:

    manifest.json            format + version, model fingerprint, per-method entries (below)
    <method>.safetensors     one file per calibrated method, tensors listed in TENSOR_SPECS

Shipping a bundle with a model: `export_bundle(bundle_dir, model_dir)` copies it to
`<model_dir>/veloxquant/` (BUNDLE_SUBDIR). `make_cache` looks there when
`KVCacheConfig.artifact_dir` is not set and the model was loaded with
`veloxquant.model_import.load_model` (which records the dir on the model via
`attach_model_dir`; mlx-lm model objects do not know their own path).

Manifest (json, sorted keys; everything is deterministic except the `created_at` fields):

    format, format_version     "veloxquant-bundle", 1
    created_at                 time of the last write (UTC, ISO 8601)
    model                      fingerprint_model_dir(): architecture fields, config/weights/tokenizer
                               sha256 and the model's path
    methods.<name>             file, sha256, size, capture_point, hyperparameters, diagnostics
                               (a json summary), data (the calibration-data fingerprint:
                               source, split, seq_len, n_tokens, sha256 ...), tensors
                               (name -> shape, dtype), versions (veloxquant, mlx, mlx-lm,
                               safetensors), created_at

Model fingerprint:
- architecture: model_type, num_layers, num_heads, num_kv_heads, head_dim, rope_theta,
  rope_traditional, rope_scaling, read from mlx-lm's ModelArgs (the same object a live model
  carries as `model.args`, so a bundle can be checked against a live model);
- config_sha256: sha256 of the canonical json of ModelArgs, i.e. exactly the config.json content
  mlx-lm uses to build the network (dtype and quantization keys are not part of it);
- weights_sha256: sha256 over the sorted `name:sha256(file)` lines of every *.safetensors in the
  model dir. The files are hashed in full (about 0.7 s for the 540 MB float32 default) and the
  result is memoised per process by (path, size, mtime), so repeated make_cache calls are free;
- tokenizer_sha256: sha256 of tokenizer.json (tokenizer.model when there is no json);
- path: the model dir the bundle was calibrated on.

Loading checks, in this order, each with its own error: format and version; per method the file
path (must stay inside the bundle dir), a pickle/zip signature, size, sha256, the safetensors
header (parsed here, never unpickled) and every tensor's presence, shape and dtype against
TENSOR_SPECS; then the model fingerprint against a live model. An architecture mismatch is a
`BundleError` naming the field and both values; a different config, weights or tokenizer digest
(e.g. a 4-bit copy of the same model) is a `BundleWarning`, or a `BundleError` under strict.
A live model whose dir is unknown has only its architecture and config digest checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import re
import shutil
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from veloxquant.io import save_safetensors_atomic, sha256_bytes, sha256_file, write_json_atomic

FORMAT_NAME = "veloxquant-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUNDLE_SUBDIR = "veloxquant"  # <model_dir>/veloxquant/ holds a bundle shipped with the model
MODEL_DIR_ATTR = "_veloxquant_model_dir"  # leading underscore: not a parameter of the model

# Every tensor a bundle may hold: method -> name -> (symbolic shape, dtype, required).
# Symbols: L layers, H_q query heads, H_kv KV heads, D head_dim, P = D/2 RoPE pairs; any other
# name is a hyperparameter of that method; "2**x" is 2 to the power of hyperparameter x;
# H_share is H_kv when hyperparameter share == "head" and 1 when share == "layer".
TENSOR_SPECS: dict[str, dict[str, tuple[tuple[str, ...], str, bool]]] = {
    "qfilters": {
        # unit-norm filter per KV head, positive convention: score = +<k_post, f>, keep highest
        "filters": (("L", "H_kv", "D"), "float32", True),
        "sigma1": (("L", "H_q"), "float32", True),  # top singular value of each head's q_post
        "kappa": (("L", "H_q"), "float32", True),  # E<q, v1> after orientation (> 0)
        "spearman": (("L",), "float32", True),  # held-out rank corr. of <k,f> vs E_q<q,k>
        "spearman_fallback": (("L",), "float32", True),  # same for the unoriented key-SVD axis
    },
    "vecinfer": {
        "smooth": (("L", "H_kv", "D"), "float32", True),
        "key_codebook": (("L", "H_share", "2**key_bits", "key_sub_dim"), "float32", True),
        "value_codebook": (("L", "H_share", "2**value_bits", "value_sub_dim"), "float32", True),
    },
    # Provisional (DESIGN.md section 8); their owners adjust these entries when they land.
    "commvq": {
        "key_theta": (("L", "H_kv", "R", "P", "64", "2"), "float32", True),
    },
    "ratequant": {
        "bits": (("L", "H_kv", "2"), "int8", True),
        "importance": (("L", "H_kv", "2"), "float32", True),
        "alpha": (("L", "H_kv", "2"), "float32", True),
        "beta": (("2",), "float32", True),
    },
}

# Who produces each method's artifact, for fail-closed error messages.
PRODUCERS: dict[str, str] = {
    m: f"`dvc repro {m}@<model>` (or `veloxquant calibrate {m}`)" for m in TENSOR_SPECS
}

ARCH_FIELDS = (
    "model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "rope_theta", "rope_traditional", "rope_scaling",
)
DIGEST_FIELDS = ("config_sha256", "weights_sha256", "tokenizer_sha256")

_METHOD_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}
_MAX_HEADER = 100 << 20


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with, or made for another model."""


class BundleWarning(UserWarning):
    """The bundle was calibrated on a different copy (weights/tokenizer/config) of the model."""


# ----------------------------------------------------------------------------------------------
# Model fingerprints


def attach_model_dir(model: Any, model_dir: str | os.PathLike) -> Any:
    """Record where `model` was loaded from, so make_cache can find `<dir>/veloxquant/`."""
    setattr(model, MODEL_DIR_ATTR, str(Path(model_dir).resolve()))
    return model


def _model_args_from_dir(model_dir: Path) -> Any:
    from mlx_lm.utils import _get_classes, load_config

    if not (model_dir / "config.json").is_file():
        raise BundleError(f"{model_dir} is not a model dir (no config.json).")
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
        "rope_scaling": _jsonable(getattr(args, "rope_scaling", None)),
        "config_sha256": sha256_bytes(_canonical_json(args_dict)),
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
        raise BundleError(
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
            raise BundleError(
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
            raise BundleError(msg + " Refusing under strict=True.")
        warnings.warn(msg, BundleWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Tensor specs


def model_dims(fingerprint: dict[str, Any]) -> dict[str, int]:
    return {
        "L": fingerprint["num_layers"],
        "H_q": fingerprint["num_heads"],
        "H_kv": fingerprint["num_kv_heads"],
        "D": fingerprint["head_dim"],
        "P": fingerprint["head_dim"] // 2,
    }


def expected_tensors(
    method: str, fingerprint: dict[str, Any], hyperparameters: dict[str, Any]
) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """TENSOR_SPECS[method] with every symbolic dim resolved for this model + hyperparameters."""
    if method not in TENSOR_SPECS:
        raise BundleError(
            f"Unknown bundle method {method!r}; add its tensors to TENSOR_SPECS in "
            f"veloxquant/bundle.py. Known: {sorted(TENSOR_SPECS)}"
        )
    env: dict[str, Any] = {**hyperparameters, **model_dims(fingerprint)}
    share = hyperparameters.get("share")
    if share is not None:
        if share not in ("head", "layer"):
            raise BundleError(f"{method}: hyperparameter share must be 'head' or 'layer', got {share!r}")
        env["H_share"] = env["H_kv"] if share == "head" else 1

    def dim(sym: str) -> int:
        if sym.isdigit():
            return int(sym)
        power = sym.startswith("2**")
        name = sym[3:] if power else sym
        if name not in env:
            raise BundleError(
                f"{method}: tensor shape needs {name!r}, which is neither a model dim nor a "
                f"hyperparameter (got hyperparameters {sorted(hyperparameters)})."
            )
        value = int(env[name])
        return 2**value if power else value

    return {
        name: (tuple(dim(s) for s in shape), dtype, required)
        for name, (shape, dtype, required) in TENSOR_SPECS[method].items()
    }


def _check_tensors(
    method: str,
    found: dict[str, tuple[tuple[int, ...], str]],
    fingerprint: dict[str, Any],
    hyperparameters: dict[str, Any],
    where: str,
) -> None:
    spec = expected_tensors(method, fingerprint, hyperparameters)
    for name, (shape, dtype, required) in spec.items():
        if name not in found:
            if required:
                raise BundleError(f"{where}: tensor {name!r} is missing (method {method!r}).")
            continue
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != shape:
            raise BundleError(
                f"{where}: tensor {name!r} has shape {list(got_shape)}, expected {list(shape)} "
                f"(spec {list(TENSOR_SPECS[method][name][0])})."
            )
        if got_dtype != dtype:
            raise BundleError(f"{where}: tensor {name!r} has dtype {got_dtype}, expected {dtype}.")
    extra = sorted(set(found) - set(spec))
    if extra:
        raise BundleError(
            f"{where}: unexpected tensors {extra} for method {method!r}; every bundle tensor "
            "must be listed in TENSOR_SPECS (veloxquant/bundle.py)."
        )


# ----------------------------------------------------------------------------------------------
# Safe safetensors reading (header parsed here; never pickle)


def _check_signature(data: bytes, where: str) -> None:
    if data[:1] == b"\x80" and len(data) > 1 and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise BundleError(
            f"{where} is a Python pickle, not safetensors. Bundles never unpickle; re-export "
            "the tensors with safetensors."
        )
    if data[:4] == b"PK\x03\x04":
        raise BundleError(
            f"{where} is a zip archive (e.g. a torch.save checkpoint), not safetensors. "
            "Bundles never unpickle; re-export the tensors with safetensors."
        )


def parse_safetensors_header(data: bytes, where: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Validate a safetensors blob's header and layout; return name -> (shape, dtype)."""
    _check_signature(data, where)
    if len(data) < 8:
        raise BundleError(f"{where}: {len(data)} bytes is too short for a safetensors file.")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > len(data):
        raise BundleError(
            f"{where}: not a safetensors file or truncated (header length {n}, file "
            f"{len(data)} bytes)."
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{where}: safetensors header is not valid json ({e}).") from e
    if not isinstance(header, dict):
        raise BundleError(f"{where}: safetensors header is not a json object.")
    header.pop("__metadata__", None)
    body = len(data) - 8 - n
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    spans = []
    for name, info in header.items():
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{where}: malformed header entry for {name!r}.") from e
        itemsize = 1 if dtype == "bool" else np.dtype(dtype if dtype != "bfloat16" else "uint16").itemsize
        if not 0 <= start <= end <= body or end - start != math.prod(shape) * itemsize:
            raise BundleError(f"{where}: tensor {name!r} has inconsistent data offsets (truncated?).")
        spans.append((start, end))
        out[name] = (shape, dtype)
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise BundleError(f"{where}: tensor data overlaps or has gaps; file is corrupt.")
        pos = end
    if pos != body:
        raise BundleError(f"{where}: {body - pos} trailing bytes after the tensor data.")
    return out


# ----------------------------------------------------------------------------------------------
# Paths and manifest


def _safe_member(bundle_dir: Path, rel: Any, where: str) -> Path:
    """Resolve a manifest file name inside bundle_dir; refuse anything that escapes it."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise BundleError(f"{where}: file name {rel!r} is not a valid relative path.")
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel):
        raise BundleError(f"{where}: file {rel!r} is an absolute path; bundle files must be relative.")
    if ".." in p.parts or "\\" in rel:
        raise BundleError(f"{where}: file {rel!r} escapes the bundle dir ('..' is not allowed).")
    root = bundle_dir.resolve()
    full = (bundle_dir / p).resolve()
    if root not in full.parents:
        raise BundleError(f"{where}: file {rel!r} resolves to {full}, outside the bundle dir {root}.")
    return bundle_dir / p


def _read_manifest(bundle_dir: Path) -> dict[str, Any]:
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a veloxquant bundle (no {MANIFEST}).")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: manifest is not valid json ({e}).") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise BundleError(f"{path}: not a {FORMAT_NAME} manifest (format={manifest.get('format')!r}).")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{path}: unknown bundle format_version {version!r}; this veloxquant reads version "
            f"{FORMAT_VERSION}. Upgrade veloxquant or re-create the bundle."
        )
    if not isinstance(manifest.get("methods"), dict) or not isinstance(manifest.get("model"), dict):
        raise BundleError(f"{path}: manifest lacks the 'model' or 'methods' table.")
    return manifest


def _resolve_bundle_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not (path / MANIFEST).is_file() and (path / BUNDLE_SUBDIR / MANIFEST).is_file():
        return path / BUNDLE_SUBDIR  # a model dir with a shipped bundle
    return path


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    import veloxquant

    out = {"veloxquant": veloxquant.__version__}
    for dist in ("mlx", "mlx-lm", "safetensors"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _jsonable(x: Any) -> Any:
    """Plain json types, so manifests are deterministic and free of NaN (stored as null)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, os.PathLike):
        return str(x)
    if hasattr(x, "tolist"):  # numpy / mlx arrays (small diagnostics only)
        return _jsonable(np.asarray(x).tolist())
    raise TypeError(f"{type(x).__name__} is not json-serialisable for a bundle manifest: {x!r}")


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(_jsonable(obj), sort_keys=True, separators=(",", ":")).encode()


@contextlib.contextmanager
def _locked(bundle_dir: Path) -> Iterator[None]:
    """Serialise manifest read-modify-write between processes writing one bundle."""
    import fcntl

    bundle_dir.mkdir(parents=True, exist_ok=True)
    with open(bundle_dir / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------
# Writing


def write_method(
    bundle_dir: str | os.PathLike,
    method: str,
    tensors: dict[str, Any],
    *,
    model_dir: str | os.PathLike | dict[str, Any],
    data_fingerprint: dict[str, Any],
    capture_point: str,
    hyperparameters: dict[str, Any],
    diagnostics: dict[str, Any],
) -> Path:
    """Write `<method>.safetensors` atomically, then update manifest.json (last).

    Other methods' files are not touched. `model_dir` is the calibrated model's dir (or a
    fingerprint dict from `fingerprint_model_dir`). Returns the method file's path.
    """
    bundle_dir = Path(bundle_dir)
    if not _METHOD_NAME.match(method):
        raise BundleError(f"Method name {method!r} must match {_METHOD_NAME.pattern}.")
    fingerprint = dict(model_dir) if isinstance(model_dir, dict) else fingerprint_model_dir(model_dir)
    hyperparameters = _jsonable(hyperparameters)
    arrays = {}
    for name, value in tensors.items():
        arr = _to_numpy(value)
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise BundleError(f"{method}: tensor {name!r} contains NaN or Inf; refusing to write it.")
        arrays[name] = arr
    found = {k: (v.shape, str(v.dtype)) for k, v in arrays.items()}
    _check_tensors(method, found, fingerprint, hyperparameters, where=f"write_method({method!r})")

    with _locked(bundle_dir):
        manifest = None
        if (bundle_dir / MANIFEST).exists():
            manifest = _read_manifest(bundle_dir)
            old = {k: manifest["model"].get(k) for k in ARCH_FIELDS + DIGEST_FIELDS}
            new = {k: fingerprint.get(k) for k in ARCH_FIELDS + DIGEST_FIELDS}
            if old != new:
                raise BundleError(
                    f"{bundle_dir} holds artifacts for model {manifest['model'].get('path')}; "
                    f"{method!r} was calibrated for {fingerprint.get('path')}, whose fingerprint "
                    "differs. Use a separate bundle dir per model."
                )
        manifest = manifest or {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "methods": {}}
        manifest["model"] = _jsonable(fingerprint)

        path = bundle_dir / f"{method}.safetensors"
        # one metadata key only: safetensors writes multi-key metadata in HashMap (random) order
        save_safetensors_atomic(path, arrays, metadata={"format": f"{FORMAT_NAME}/{method}"})
        now = _now()
        manifest["methods"][method] = _jsonable({
            "file": path.name,
            "sha256": sha256_file(path),
            "size": path.stat().st_size,
            "capture_point": capture_point,
            "hyperparameters": hyperparameters,
            "diagnostics": diagnostics,
            "data": data_fingerprint,
            "tensors": {k: {"shape": list(s), "dtype": d} for k, (s, d) in sorted(found.items())},
            "versions": _versions(),
            "created_at": now,
        })
        manifest["created_at"] = now
        write_json_atomic(bundle_dir / MANIFEST, manifest)
    return path


def _to_numpy(x: Any) -> np.ndarray:
    from veloxquant.io import to_numpy

    return to_numpy(x)


def merge_bundles(out_dir: str | os.PathLike, inputs: list[str | os.PathLike]) -> Path:
    """Combine single-method bundles (e.g. one per DVC stage) into one bundle dir, atomically.

    Every input is fully verified; method files are copied byte for byte; all inputs must share
    one model fingerprint and no method may appear twice.
    """
    out_dir = Path(out_dir)
    merged: dict[str, Any] | None = None
    sources: dict[str, Path] = {}
    for src in inputs:
        bundle = load_bundle(src)
        if merged is None:
            merged = {k: v for k, v in bundle.manifest.items() if k != "methods"}
            merged["methods"] = {}
        elif bundle.manifest["model"] != merged["model"]:
            raise BundleError(f"{src} was calibrated for a different model than {inputs[0]}.")
        for m in bundle.methods:
            if m in merged["methods"]:
                raise BundleError(f"Method {m!r} appears in more than one input bundle.")
            merged["methods"][m] = bundle.manifest["methods"][m]
            sources[m] = bundle.path / bundle.manifest["methods"][m]["file"]
    if merged is None:
        raise BundleError("merge_bundles needs at least one input bundle.")
    merged["created_at"] = max(merged["methods"][m]["created_at"] for m in merged["methods"])

    def fill(tmp: Path) -> None:
        for m, src in sources.items():
            shutil.copyfile(src, tmp / merged["methods"][m]["file"])
        write_json_atomic(tmp / MANIFEST, merged)

    _replace_dir_atomically(out_dir, fill)
    load_bundle(out_dir)
    return out_dir


def _replace_dir_atomically(dest: Path, fill) -> None:
    """Build a dir under a temp name via fill(tmp), then swap it in for `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; bundles are shared and shipped
    old = None
    try:
        fill(tmp)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
            os.rmdir(old)
            os.replace(dest, old)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old is not None and old.exists():
            shutil.rmtree(old)


# ----------------------------------------------------------------------------------------------
# Loading


@dataclasses.dataclass
class Bundle:
    """A loaded, verified bundle. Tensors are kept as numpy and handed out as mx.arrays."""

    path: Path
    manifest: dict[str, Any]
    _arrays: dict[str, dict[str, np.ndarray]]

    @property
    def methods(self) -> list[str]:
        return sorted(self.manifest["methods"])

    def tensors(self, method: str) -> dict[str, Any]:
        import mlx.core as mx

        self._need(method)
        return {k: mx.array(v) for k, v in self._arrays[method].items()}

    def method_info(self, method: str) -> dict[str, Any]:
        self._need(method)
        entry = self.manifest["methods"][method]
        keys = ("capture_point", "hyperparameters", "diagnostics", "data", "versions", "created_at")
        return {k: entry.get(k) for k in keys} | {"model": self.manifest["model"]}

    def _need(self, method: str) -> None:
        if method not in self.manifest["methods"]:
            raise BundleError(
                f"Bundle {self.path} has no {method!r} artifact (it has {self.methods}). "
                f"Produce it with {PRODUCERS.get(method, 'its calibration stage')}."
            )


def _load_method(bundle_dir: Path, manifest: dict[str, Any], method: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load as st_load

    where = f"{bundle_dir}: method {method!r}"
    if not _METHOD_NAME.match(method):
        raise BundleError(f"{where}: invalid method name.")
    entry = manifest["methods"][method]
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: manifest entry is not an object.")
    path = _safe_member(bundle_dir, entry.get("file"), where)
    where = f"{path}"
    if not path.is_file():  # symlinks were resolved by _safe_member; inside links are fine
        raise BundleError(f"{where}: file listed in the manifest is missing.")
    data = path.read_bytes()  # read once: hash and parse the same bytes
    _check_signature(data, where)
    if len(data) != entry.get("size"):
        raise BundleError(
            f"{where}: size is {len(data)} bytes but the manifest says {entry.get('size')} "
            "(truncated or modified). Re-export the bundle."
        )
    digest = sha256_bytes(data)
    if digest != entry.get("sha256"):
        raise BundleError(
            f"{where}: sha256 mismatch (file {digest[:16]}..., manifest "
            f"{str(entry.get('sha256'))[:16]}...): the file was modified or corrupted."
        )
    found = parse_safetensors_header(data, where)
    _check_tensors(method, found, manifest["model"], entry.get("hyperparameters") or {}, where)
    arrays = st_load(data)
    for name, arr in arrays.items():
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise BundleError(f"{where}: tensor {name!r} contains NaN or Inf.")
    return arrays


def load_bundle(path: str | os.PathLike, model: Any = None, *, strict: bool = False) -> Bundle:
    """Load and verify a bundle; with `model`, also check it was made for that model."""
    bundle_dir = _resolve_bundle_dir(path)
    manifest = _read_manifest(bundle_dir)
    arrays = {m: _load_method(bundle_dir, manifest, m) for m in sorted(manifest["methods"])}
    if model is not None:
        check_model_fingerprint(
            manifest["model"], fingerprint_live_model(model), strict=strict, where=f"bundle {bundle_dir}"
        )
    return Bundle(path=bundle_dir, manifest=manifest, _arrays=arrays)


def find_bundle(model: Any, config: Any) -> Path | None:
    """config.artifact_dir, else the bundle shipped in the model's dir, else None."""
    if getattr(config, "artifact_dir", None):
        return Path(config.artifact_dir)
    model_dir = getattr(model, MODEL_DIR_ATTR, None)
    if model_dir and (Path(model_dir) / BUNDLE_SUBDIR / MANIFEST).is_file():
        return Path(model_dir) / BUNDLE_SUBDIR
    return None


def require_method(model: Any, config: Any, method: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The calibrated tensors and info of `method` for `model`, or a fail-closed error."""
    path = find_bundle(model, config)
    if path is None:
        raise BundleError(
            f"KV-cache method {method!r} is calibrated and needs a bundle, but none was given "
            f"and the model dir has no {BUNDLE_SUBDIR}/ bundle. Produce it with "
            f"{PRODUCERS.get(method, 'its calibration stage')}, then pass "
            f"KVCacheConfig(method={method!r}, artifact_dir=DIR) or ship it with "
            "`veloxquant bundle export DIR MODEL_DIR`. For the uncalibrated reference variant "
            "pass uncalibrated=True."
        )
    if not Path(path).exists():
        raise BundleError(f"artifact_dir {path} does not exist. Produce it with {PRODUCERS.get(method, 'its calibration stage')}.")
    bundle = load_bundle(path, model, strict=bool(getattr(config, "strict", False)))
    return bundle.tensors(method), bundle.method_info(method)


# ----------------------------------------------------------------------------------------------
# CLI helpers (wired by veloxquant/cli.py)


def verify_bundle(
    path: str | os.PathLike, model_dir: str | os.PathLike | None = None, strict: bool = False
) -> None:
    """Raise BundleError on any problem; with model_dir, check every fingerprint field."""
    bundle = load_bundle(path)
    if model_dir is not None:
        check_model_fingerprint(
            bundle.manifest["model"], fingerprint_model_dir(model_dir), strict=strict,
            where=f"bundle {bundle.path}",
        )


def export_bundle(bundle_dir: str | os.PathLike, model_dir: str | os.PathLike) -> Path:
    """Copy a verified bundle to `<model_dir>/veloxquant/`, replacing any previous one atomically.

    Only manifest.json and the files it lists are copied. Exporting onto a model with another
    architecture is an error; onto another copy of the same model, a warning.
    """
    bundle = load_bundle(bundle_dir)
    model_dir = Path(model_dir)
    check_model_fingerprint(
        bundle.manifest["model"], fingerprint_model_dir(model_dir), where=f"bundle {bundle.path}"
    )
    dest = model_dir / BUNDLE_SUBDIR

    def fill(tmp: Path) -> None:
        for m in bundle.methods:
            name = bundle.manifest["methods"][m]["file"]
            shutil.copyfile(bundle.path / name, tmp / name)
        shutil.copyfile(bundle.path / MANIFEST, tmp / MANIFEST)

    _replace_dir_atomically(dest, fill)
    load_bundle(dest)
    return dest


def inspect_bundle(path: str | os.PathLike) -> str:
    """A readable summary: model, methods, tensors, data, diagnostics, sizes."""
    bundle = load_bundle(path)
    m = bundle.manifest
    fp = m["model"]
    lines = [
        f"bundle {bundle.path}  ({m['format']} v{m['format_version']}, updated {m.get('created_at')})",
        f"model  {fp.get('model_type')} {fp.get('path')}",
        f"       layers={fp.get('num_layers')} heads={fp.get('num_heads')} "
        f"kv_heads={fp.get('num_kv_heads')} head_dim={fp.get('head_dim')} "
        f"rope(theta={fp.get('rope_theta')}, traditional={fp.get('rope_traditional')}, "
        f"scaling={fp.get('rope_scaling')})",
        "       " + "  ".join(f"{k}={str(fp.get(k))[:12]}" for k in DIGEST_FIELDS),
    ]
    total = 0
    for name in bundle.methods:
        e = m["methods"][name]
        total += e["size"]
        lines.append(f"method {name}: {e['file']} {_human(e['size'])} sha256={e['sha256'][:12]} "
                     f"capture={e.get('capture_point')} created {e.get('created_at')}")
        lines.append(f"  hyperparameters: {json.dumps(e.get('hyperparameters'), sort_keys=True)}")
        for t, info in e.get("tensors", {}).items():
            lines.append(f"  tensor {t:<18} {info['dtype']:<8} {info['shape']}")
        data = e.get("data") or {}
        lines.append("  data: " + ", ".join(
            f"{k}={json.dumps(v, sort_keys=True, separators=(',', ':'))[:80]}" for k, v in sorted(data.items())))
        for k, v in sorted((e.get("diagnostics") or {}).items()):
            lines.append(f"  diag {k}: {_short(v)}")
        vers = e.get("versions") or {}
        lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(vers.items())))
    lines.append(f"total {_human(total)} in {len(bundle.methods)} method file(s)")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 6:
        head = ", ".join(_short(x) for x in v[:6])
        return f"[{head}, ...] ({len(v)} values)"
    return json.dumps(v) if not isinstance(v, str) else v


__all__ = [
    "Bundle", "BundleError", "BundleWarning", "TENSOR_SPECS", "FORMAT_VERSION", "BUNDLE_SUBDIR",
    "write_method", "load_bundle", "require_method", "merge_bundles", "verify_bundle",
    "export_bundle", "inspect_bundle", "fingerprint_model_dir", "fingerprint_live_model",
    "attach_model_dir", "check_model_fingerprint", "expected_tensors", "find_bundle",
]
