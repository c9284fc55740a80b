"""Calibration bundles: versioned safetensors files plus a manifest.

A bundle is a directory:

    manifest.json            format + version, model fingerprint, per-method entries (below)
    <method>.safetensors     one file per calibrated method; its tensors are exactly the
                             method's `tensor_specs` (veloxquant/methods/)

Shipping a bundle with a model: `export_bundle(bundle_dir, model_dir)` copies it to
`<model_dir>/veloxquant/` (BUNDLE_SUBDIR), where `make_cache` finds it for a model loaded with
`veloxquant.model_import.load_model`.

Manifest (json, sorted keys; everything is deterministic except the `created_at` fields):

    format, format_version     "veloxquant-bundle", 1
    created_at                 time of the last write (UTC, ISO 8601)
    model                      the model fingerprint (veloxquant.fingerprint)
    methods.<name>             file, sha256, size, capture_point, hyperparameters, diagnostics
                               (a json summary), data (the calibration-data fingerprint:
                               source, split, seq_len, n_tokens, sha256 ...), tensors
                               (name -> shape, dtype), versions (veloxquant, mlx, mlx-lm,
                               safetensors), created_at

Loading checks, in this order, each with its own error: format and version; per method the file
path (must stay inside the bundle dir), a pickle/zip signature, size, sha256, the safetensors
header (parsed here, never unpickled), every tensor's presence, shape and dtype against the
method's `tensor_specs`, finiteness, and the method's own value checks (`check_artifact`); then,
given a live model, its fingerprint (veloxquant.fingerprint).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from veloxquant._version import __version__
from veloxquant.fingerprint import (
    ARCH_FIELDS,
    DIGEST_FIELDS,
    MODEL_DIR_ATTR,
    FingerprintError,
    FingerprintWarning,
    check_model_fingerprint,
    fingerprint_live_model,
    fingerprint_model_dir,
)
from veloxquant.io import (
    SafetensorsError,
    check_not_pickle,
    jsonable,
    locked,
    parse_safetensors_header,
    replace_dir_atomically,
    save_safetensors_atomic,
    sha256_bytes,
    sha256_file,
    to_numpy,
    write_json_atomic,
)
from veloxquant.methods import METHODS
from veloxquant.methods.base import Artifact, ModelDims

FORMAT_NAME = "veloxquant-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUNDLE_SUBDIR = "veloxquant"  # <model_dir>/veloxquant/ holds a bundle shipped with the model

_METHOD_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

BundleWarning = FingerprintWarning


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with, or made for another model."""


def producer(method: str) -> str:
    """How a user makes `method`'s artifact, for fail-closed error messages."""
    return f"`dvc repro {method}@<model>` (or `veloxquant calibrate {method}`)"


# ----------------------------------------------------------------------------------------------
# Tensor specs


def expected_tensors(
    method: str, fingerprint: dict[str, Any], hyperparameters: dict[str, Any]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The method's tensor specs resolved for this model and these hyperparameters."""
    if method not in METHODS or not METHODS[method].calibrated:
        known = sorted(m for m in METHODS if METHODS[m].calibrated)
        raise BundleError(f"Unknown bundle method {method!r}; calibrated methods: {known}.")
    try:
        specs = METHODS[method].tensor_specs(
            ModelDims.from_fingerprint(fingerprint), hyperparameters
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(
            f"{method}: cannot resolve tensor shapes from the hyperparameters "
            f"{sorted(hyperparameters)}: {e}"
        ) from e
    return {name: (tuple(s.shape), s.dtype) for name, s in specs.items()}


def _check_tensors(
    method: str,
    found: dict[str, tuple[tuple[int, ...], str]],
    fingerprint: dict[str, Any],
    hyperparameters: dict[str, Any],
    where: str,
) -> None:
    spec = expected_tensors(method, fingerprint, hyperparameters)
    for name, (shape, dtype) in spec.items():
        if name not in found:
            raise BundleError(f"{where}: tensor {name!r} is missing (method {method!r}).")
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != shape:
            raise BundleError(
                f"{where}: tensor {name!r} has shape {list(got_shape)}, expected {list(shape)} "
                f"for this model and the recorded hyperparameters."
            )
        if got_dtype != dtype:
            raise BundleError(f"{where}: tensor {name!r} has dtype {got_dtype}, expected {dtype}.")
    extra = sorted(set(found) - set(spec))
    if extra:
        raise BundleError(
            f"{where}: unexpected tensors {extra} for method {method!r}; a bundle holds exactly "
            "the method's tensor_specs."
        )


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
    fingerprint = (
        dict(model_dir) if isinstance(model_dir, dict) else fingerprint_model_dir(model_dir)
    )
    hyperparameters = jsonable(hyperparameters)
    arrays = {}
    for name, value in tensors.items():
        arr = to_numpy(value)
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise BundleError(
                f"{method}: tensor {name!r} contains NaN or Inf; refusing to write it."
            )
        arrays[name] = arr
    found = {k: (v.shape, str(v.dtype)) for k, v in arrays.items()}
    _check_tensors(method, found, fingerprint, hyperparameters, where=f"write_method({method!r})")

    with locked(bundle_dir):
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
        manifest = manifest or {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "methods": {},
        }
        manifest["model"] = jsonable(fingerprint)

        path = bundle_dir / f"{method}.safetensors"
        # one metadata key only: safetensors writes multi-key metadata in HashMap (random) order
        save_safetensors_atomic(path, arrays, metadata={"format": f"{FORMAT_NAME}/{method}"})
        now = _now()
        manifest["methods"][method] = jsonable(
            {
                "file": path.name,
                "sha256": sha256_file(path),
                "size": path.stat().st_size,
                "capture_point": capture_point,
                "hyperparameters": hyperparameters,
                "diagnostics": diagnostics,
                "data": data_fingerprint,
                "tensors": {
                    k: {"shape": list(s), "dtype": d} for k, (s, d) in sorted(found.items())
                },
                "versions": _versions(),
                "created_at": now,
            }
        )
        manifest["created_at"] = now
        write_json_atomic(bundle_dir / MANIFEST, manifest)
    return path


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

    replace_dir_atomically(out_dir, fill)
    load_bundle(out_dir)
    return out_dir


def export_bundle(bundle_dir: str | os.PathLike, model_dir: str | os.PathLike) -> Path:
    """Copy a verified bundle to `<model_dir>/veloxquant/`, replacing any previous one atomically.

    Only manifest.json and the files it lists are copied. Exporting onto a model with another
    architecture is an error; onto another copy of the same model, a warning.
    """
    bundle = load_bundle(bundle_dir)
    model_dir = Path(model_dir)
    _check_fingerprint(bundle, fingerprint_model_dir(model_dir), strict=False)
    dest = model_dir / BUNDLE_SUBDIR

    def fill(tmp: Path) -> None:
        for m in bundle.methods:
            name = bundle.manifest["methods"][m]["file"]
            shutil.copyfile(bundle.path / name, tmp / name)
        shutil.copyfile(bundle.path / MANIFEST, tmp / MANIFEST)

    replace_dir_atomically(dest, fill)
    load_bundle(dest)
    return dest


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

    def artifact(self, method: str) -> Artifact:
        """What `make_cache` hands the method: its tensors and manifest entry."""
        info = self.method_info(method)
        return Artifact(
            method=method,
            tensors=self.tensors(method),
            hyperparameters=dict(info["hyperparameters"] or {}),
            diagnostics=dict(info["diagnostics"] or {}),
            info=info,
        )

    def _need(self, method: str) -> None:
        if method not in self.manifest["methods"]:
            raise BundleError(
                f"Bundle {self.path} has no {method!r} artifact (it has {self.methods}). "
                f"Produce it with {producer(method)}."
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
    try:
        check_not_pickle(data, where)
    except SafetensorsError as e:
        raise BundleError(str(e)) from e
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
    try:
        found = parse_safetensors_header(data, where)
    except SafetensorsError as e:
        raise BundleError(str(e)) from e
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
    bundle = Bundle(path=bundle_dir, manifest=manifest, _arrays=arrays)
    dims = ModelDims.from_fingerprint(manifest["model"])
    for m in bundle.methods:
        check = METHODS[m].check_artifact
        if check is not None:
            try:
                check(bundle.artifact(m), dims)
            except ValueError as e:
                raise BundleError(f"{bundle_dir}: method {m!r}: {e}") from e
    if model is not None:
        _check_fingerprint(bundle, fingerprint_live_model(model), strict=strict)
    return bundle


def _check_fingerprint(bundle: Bundle, actual: dict[str, Any], strict: bool) -> None:
    try:
        check_model_fingerprint(
            bundle.manifest["model"], actual, strict=strict, where=f"bundle {bundle.path}"
        )
    except FingerprintError as e:
        raise BundleError(str(e)) from e


def find_bundle(model: Any, artifact_dir: str | os.PathLike | None) -> Path | None:
    """`artifact_dir`, else the bundle shipped in the model's dir, else None."""
    if artifact_dir:
        return Path(artifact_dir)
    model_dir = getattr(model, MODEL_DIR_ATTR, None)
    if model_dir and (Path(model_dir) / BUNDLE_SUBDIR / MANIFEST).is_file():
        return Path(model_dir) / BUNDLE_SUBDIR
    return None


def load_artifact(
    model: Any, method: str, artifact_dir: str | os.PathLike | None, strict: bool = False
) -> Artifact:
    """`method`'s verified artifact for `model`, or a fail-closed error naming the fix."""
    path = find_bundle(model, artifact_dir)
    if path is None:
        raise BundleError(
            f"KV-cache method {method!r} is calibrated and needs a bundle, but none was given "
            f"and the model dir has no {BUNDLE_SUBDIR}/ bundle. Produce it with "
            f"{producer(method)}, then pass "
            f"KVCacheConfig(method={method!r}, artifact_dir=DIR) or ship it with "
            "`veloxquant bundle export DIR MODEL_DIR`. For the uncalibrated reference variant "
            "pass uncalibrated=True."
        )
    if not Path(path).exists():
        raise BundleError(
            f"artifact_dir {path} does not exist. Produce it with {producer(method)}."
        )
    return load_bundle(path, model, strict=strict).artifact(method)


def verify_bundle(
    path: str | os.PathLike, model_dir: str | os.PathLike | None = None, strict: bool = False
) -> Bundle:
    """Every check `make_cache` runs; with model_dir, also every fingerprint field."""
    bundle = load_bundle(path)
    if model_dir is not None:
        _check_fingerprint(bundle, fingerprint_model_dir(model_dir), strict=strict)
    return bundle


# ----------------------------------------------------------------------------------------------
# Paths and manifest


def _safe_member(bundle_dir: Path, rel: Any, where: str) -> Path:
    """Resolve a manifest file name inside bundle_dir; refuse anything that escapes it."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise BundleError(f"{where}: file name {rel!r} is not a valid relative path.")
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel):
        raise BundleError(
            f"{where}: file {rel!r} is an absolute path; bundle files must be relative."
        )
    if ".." in p.parts or "\\" in rel:
        raise BundleError(f"{where}: file {rel!r} escapes the bundle dir ('..' is not allowed).")
    root = bundle_dir.resolve()
    full = (bundle_dir / p).resolve()
    if root not in full.parents:
        raise BundleError(
            f"{where}: file {rel!r} resolves to {full}, outside the bundle dir {root}."
        )
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
        raise BundleError(
            f"{path}: not a {FORMAT_NAME} manifest (format={manifest.get('format')!r})."
        )
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

    out = {"veloxquant": __version__}
    for dist in ("mlx", "mlx-lm", "safetensors"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
