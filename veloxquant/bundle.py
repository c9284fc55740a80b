"""Calibration bundles: content-addressed safetensors files plus one manifest, changed only by
transactions.

A bundle is a directory:

    manifest.json                       format + version, model fingerprint, per-method entries
    <method>-<sha256[:16]>.safetensors  one file per calibrated method, named by its content and
                                        never changed once written; its tensors are exactly the
                                        method's `tensor_specs` (veloxquant/methods/)
    .lock                               the writers' lock (flock); readers never take it

Shipping a bundle with a model: `export_bundle(bundle_dir, model_dir)` writes it to
`<model_dir>/veloxquant/` (BUNDLE_SUBDIR), where `make_cache` finds it for a model loaded with
`veloxquant.model_import.load_model`.

Every write (`write_method`, `merge_bundles`, `export_bundle`) is one `_commit`, under the
writer lock:
1. debris of a killed writer (`.*.tmp`) is removed;
2. each new method file is written under its content address: temp file, fsync, rename,
   directory fsync. A name, once visible, holds its complete and final bytes;
3. manifest.json is replaced by one atomic rename, then the directory is fsynced: the commit;
4. only then are method files deleted that neither the new manifest nor the one it replaced
   lists (orphans of killed writers, generations older than the previous one).
A crash anywhere leaves either the old or the new manifest, and every file it lists.

Readers take no lock. They read manifest.json once, then only the files it lists. A reader so
slow that two commits passed meanwhile may find one of its files collected; it then re-reads
the manifest and starts over (READ_ATTEMPTS in all). A load sees one manifest's bundle, never a
mix of two.

Equal content gives equal file names and equal manifest bytes (there are no timestamps), so a
rerun changes nothing on disk and DVC outputs do not churn.

Manifest (json, sorted keys), checked field by field on every load and before every write:

    format, format_version     "veloxquant-bundle", 2
    model                      the model fingerprint (veloxquant.fingerprint): architecture,
                               config/weights/tokenizer sha256, path (information only)
    methods.<name>             file, sha256, size, capture_point, hyperparameters, diagnostics
                               (a json summary), data (the calibration-data fingerprint:
                               source, split, seq_len, n_tokens, sha256), tensors
                               (name -> shape, dtype), versions (veloxquant, mlx, mlx-lm,
                               safetensors)

Loading checks, in this order, each with its own error naming the field or file: manifest.json
itself (a file of the bundle dir, json, the schema above: types, required fields, ranges, the
method's own hyperparameter checks); per method the file path (must stay inside the bundle
dir), a pickle/zip signature, size, sha256, the safetensors header (parsed here, never
unpickled), every tensor's presence, shape and dtype against the method's `tensor_specs`,
finiteness, and the method's own value checks (`check_artifact`); then, given a live model, its
fingerprint (veloxquant.fingerprint). `verify_bundle` runs exactly these checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
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
    json_bytes,
    jsonable,
    locked,
    parse_safetensors_header,
    safetensors_bytes,
    sha256_bytes,
    sha256_file,
    to_numpy,
    unlink,
    write_bytes_atomic,
)
from veloxquant.methods import CALIBRATED, METHODS
from veloxquant.methods.base import Artifact, ModelDims

FORMAT_NAME = "veloxquant-bundle"
# 2: content-addressed method files, transactional writes, no timestamps. 1 (veloxquant 0.2)
# rewrote `<method>.safetensors` in place.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
BUNDLE_SUBDIR = "veloxquant"  # <model_dir>/veloxquant/ holds a bundle shipped with the model
READ_ATTEMPTS = 10  # manifest re-reads of a reader that keeps losing races with writers

_METHOD_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_METHOD_FILE = re.compile(r"^[a-z][a-z0-9_]*-[0-9a-f]{16}\.safetensors$")
_LEGACY_FILE = re.compile(r"^[a-z][a-z0-9_]*\.safetensors$")  # format_version 1's file names
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MAX_DIM = 1 << 20  # bound on layers, heads and head_dim: rejects garbage, admits any model

BundleWarning = FingerprintWarning


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with, or made for another model."""


def producer(method: str) -> str:
    """How a user makes `method`'s artifact, for fail-closed error messages."""
    return f"`dvc repro {method}@<model>` (or `veloxquant calibrate {method}`)"


def method_file(method: str, sha256: str) -> str:
    """A method file's content address: `<method>-<sha256[:16]>.safetensors`."""
    return f"{method}-{sha256[:16]}.safetensors"


# ----------------------------------------------------------------------------------------------
# Tensor specs


def expected_tensors(
    method: str, fingerprint: dict[str, Any], hyperparameters: dict[str, Any]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The method's tensor specs resolved for this model and these hyperparameters."""
    if method not in METHODS or not METHODS[method].calibrated:
        raise BundleError(
            f"Unknown bundle method {method!r}; calibrated methods: {sorted(CALIBRATED)}."
        )
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


def _model_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first architecture or digest field in which two fingerprints differ, or None.

    Paths are information only: two copies of one model at different paths are the same model.
    """
    for field in ARCH_FIELDS + DIGEST_FIELDS:
        x, y = a.get(field), b.get(field)
        if x != y:
            if field in DIGEST_FIELDS:
                x, y = (v[:16] + "..." if isinstance(v, str) else v for v in (x, y))
            return f"{field} is {x!r} vs {y!r} (models at {a.get('path')} and {b.get('path')})"
    return None


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
    """Add or replace `method`'s artifact in a bundle, as one transaction (module docstring).

    Other methods' files and entries stay as they are. `model_dir` is the calibrated model's dir
    (or a fingerprint dict from `fingerprint_model_dir`). Returns the method file's path.
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
    # one metadata key only: safetensors writes multi-key metadata in HashMap (random) order
    data = safetensors_bytes(arrays, metadata={"format": f"{FORMAT_NAME}/{method}"})
    digest = sha256_bytes(data)
    entry = jsonable(
        {
            "file": method_file(method, digest),
            "sha256": digest,
            "size": len(data),
            "capture_point": capture_point,
            "hyperparameters": hyperparameters,
            "diagnostics": diagnostics,
            "data": data_fingerprint,
            "tensors": {k: {"shape": list(s), "dtype": d} for k, (s, d) in sorted(found.items())},
            "versions": _versions(),
        }
    )

    def update(current: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, bytes]]:
        if current is None:
            current = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "methods": {}}
        else:
            differs = _model_difference(current["model"], fingerprint)
            if differs:
                raise BundleError(
                    f"{bundle_dir} holds artifacts for another model than the one {method!r} "
                    f"was calibrated for: {differs}. Use a separate bundle dir per model."
                )
        current["model"] = jsonable(fingerprint)
        current["methods"][method] = entry
        return current, {entry["file"]: data}

    _commit(bundle_dir, update, build_on_current=True)
    return bundle_dir / entry["file"]


def merge_bundles(out_dir: str | os.PathLike, inputs: list[str | os.PathLike]) -> Path:
    """Combine single-method bundles (e.g. one per DVC stage) into one bundle, as one transaction.

    Every input is fully verified and its method files are written byte for byte, as verified.
    All inputs must be for one model (architecture and digests; paths may differ) and no method
    may appear twice. The output holds exactly the inputs' methods.
    """
    out_dir = Path(out_dir)
    if not inputs:
        raise BundleError("merge_bundles needs at least one input bundle.")
    bundles = [load_bundle(src) for src in inputs]
    model = bundles[0].manifest["model"]
    methods: dict[str, Any] = {}
    payloads: dict[str, bytes] = {}
    for src, bundle in zip(inputs, bundles, strict=True):
        differs = _model_difference(model, bundle.manifest["model"])
        if differs:
            raise BundleError(
                f"{src} was calibrated for a different model than {inputs[0]}: {differs}."
            )
        for m in bundle.methods:
            if m in methods:
                raise BundleError(f"Method {m!r} appears in more than one input bundle.")
            methods[m] = bundle.manifest["methods"][m]
            payloads[methods[m]["file"]] = bundle.file_bytes(m)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model": model,
        "methods": methods,
    }
    _commit(out_dir, lambda current: (manifest, payloads), build_on_current=False)
    load_bundle(out_dir)
    return out_dir


def export_bundle(bundle_dir: str | os.PathLike, model_dir: str | os.PathLike) -> Path:
    """Write a verified bundle to `<model_dir>/veloxquant/`, replacing any previous one, as one
    transaction in place (a reader of the model dir always finds the old or the new bundle).

    Only manifest.json and the files it lists are written. Exporting onto a model with another
    architecture is an error; onto another copy of the same model, a warning.
    """
    bundle = load_bundle(bundle_dir)
    model_dir = Path(model_dir)
    _check_fingerprint(bundle, fingerprint_model_dir(model_dir), strict=False)
    dest = model_dir / BUNDLE_SUBDIR
    payloads = {bundle.manifest["methods"][m]["file"]: bundle.file_bytes(m) for m in bundle.methods}
    _commit(dest, lambda current: (bundle.manifest, payloads), build_on_current=False)
    load_bundle(dest)
    return dest


def _commit(
    bundle_dir: Path,
    build: Callable[[dict[str, Any] | None], tuple[dict[str, Any], dict[str, bytes]]],
    *,
    build_on_current: bool,
) -> None:
    """The one way a bundle changes (steps 1-4 of the module docstring).

    build(current) -> (new manifest, {file name: bytes} of the method files it brings); with
    build_on_current, `current` is the bundle's verified manifest (None for a new bundle),
    otherwise None (the new manifest replaces the old one whatever it was).
    """
    with locked(bundle_dir):
        for p in bundle_dir.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp") and not p.is_dir():
                unlink(p)  # a killed writer's; no other writer can be running
        path = bundle_dir / MANIFEST
        current_raw = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        current = None
        if build_on_current and current_raw is not None:
            current = _parse_manifest(current_raw, bundle_dir)
        manifest, payloads = build(current)
        _validate_manifest(manifest, bundle_dir, f"{path} (about to be written)")
        for name, data in sorted(payloads.items()):
            if not _holds(bundle_dir / name, data):
                write_bytes_atomic(bundle_dir / name, data)
        new_raw = json_bytes(manifest)
        if new_raw != current_raw:
            write_bytes_atomic(path, new_raw)  # the commit point

        # Keep the previous generation for readers that read its manifest before the commit.
        # Files of an older format's manifest go now: no reader of this version can use them.
        previous, legacy = _listed_files(current_raw)
        keep = _listed_files(new_raw)[0] | previous
        for p in bundle_dir.iterdir():
            if p.name in keep or not (p.is_file() or p.is_symlink()):
                continue
            if _METHOD_FILE.match(p.name) or (p.name in legacy and _LEGACY_FILE.match(p.name)):
                unlink(p)


def _holds(path: Path, data: bytes) -> bool:
    """Whether `path` is a plain file holding exactly `data` (then it need not be rewritten)."""
    return (
        path.is_file()
        and not path.is_symlink()
        and path.stat().st_size == len(data)
        and sha256_file(path) == sha256_bytes(data)
    )


def _listed_files(raw: bytes | None) -> tuple[set[str], set[str]]:
    """(files a current-format manifest lists, files an older-format manifest lists), read
    leniently: a damaged previous manifest protects nothing."""
    try:
        manifest = json.loads(raw) if raw is not None else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return set(), set()
    if not isinstance(manifest, dict) or not isinstance(manifest.get("methods"), dict):
        return set(), set()
    files = {
        e["file"]
        for e in manifest["methods"].values()
        if isinstance(e, dict) and isinstance(e.get("file"), str)
    }
    return (files, set()) if manifest.get("format_version") == FORMAT_VERSION else (set(), files)


# ----------------------------------------------------------------------------------------------
# Loading


@dataclasses.dataclass
class Bundle:
    """A loaded, verified bundle. Tensors are kept as numpy and handed out as mx.arrays."""

    path: Path
    manifest: dict[str, Any]
    _arrays: dict[str, dict[str, np.ndarray]]
    _files: dict[str, bytes] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def methods(self) -> list[str]:
        return sorted(self.manifest["methods"])

    def tensors(self, method: str) -> dict[str, Any]:
        import mlx.core as mx

        self._need(method)
        return {k: mx.array(v) for k, v in self._arrays[method].items()}

    def file_bytes(self, method: str) -> bytes:
        """The method file's bytes exactly as verified (merge and export write these)."""
        self._need(method)
        return self._files[method]

    def method_info(self, method: str) -> dict[str, Any]:
        self._need(method)
        entry = self.manifest["methods"][method]
        keys = ("capture_point", "hyperparameters", "diagnostics", "data", "versions")
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


def _load_method(
    bundle_dir: Path, manifest: dict[str, Any], method: str
) -> tuple[dict[str, np.ndarray], bytes]:
    from safetensors.numpy import load as st_load

    entry = manifest["methods"][method]  # the schema checked the entry and its file name
    path = bundle_dir / entry["file"]
    where = f"{path}"
    try:
        data = path.read_bytes()  # read once: hash and parse the same bytes
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        raise BundleError(f"{where}: file listed in the manifest is missing.") from e
    try:
        check_not_pickle(data, where)
    except SafetensorsError as e:
        raise BundleError(str(e)) from e
    if len(data) != entry["size"]:
        raise BundleError(
            f"{where}: size is {len(data)} bytes but the manifest says {entry['size']} "
            "(truncated or modified). Re-export the bundle."
        )
    digest = sha256_bytes(data)
    if digest != entry["sha256"]:
        raise BundleError(
            f"{where}: sha256 mismatch (file {digest[:16]}..., manifest "
            f"{entry['sha256'][:16]}...): the file was modified or corrupted."
        )
    try:
        found = parse_safetensors_header(data, where)
    except SafetensorsError as e:
        raise BundleError(str(e)) from e
    _check_tensors(method, found, manifest["model"], entry["hyperparameters"], where)
    arrays = st_load(data)
    for name, arr in arrays.items():
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise BundleError(f"{where}: tensor {name!r} contains NaN or Inf.")
    return arrays, data


def load_bundle(path: str | os.PathLike, model: Any = None, *, strict: bool = False) -> Bundle:
    """Load and verify a bundle; with `model`, also check it was made for that model.

    Takes no lock: a concurrent writer's commit is seen entirely or not at all.
    """
    bundle_dir = _resolve_bundle_dir(path)
    for attempt in range(1, READ_ATTEMPTS + 1):
        raw = _read_manifest_bytes(bundle_dir)
        manifest = _parse_manifest(raw, bundle_dir)
        try:
            loaded = {m: _load_method(bundle_dir, manifest, m) for m in sorted(manifest["methods"])}
            break
        except BundleError:
            # Method files never change, so a listed file can only have gone because writers
            # committed twice since `raw` was read: start over from the newer manifest. An
            # unchanged manifest means the bundle itself is damaged.
            if attempt == READ_ATTEMPTS or _read_manifest_bytes(bundle_dir) == raw:
                raise
    bundle = Bundle(
        path=bundle_dir,
        manifest=manifest,
        _arrays={m: arrays for m, (arrays, _) in loaded.items()},
        _files={m: data for m, (_, data) in loaded.items()},
    )
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


def _read_manifest_bytes(bundle_dir: Path) -> bytes:
    path = bundle_dir / MANIFEST
    if path.is_symlink():
        target = path.resolve()
        if bundle_dir.resolve() not in target.parents:
            raise BundleError(
                f"{path} is a symlink to {target}, outside the bundle dir: a bundle's manifest "
                "must be its own file. Re-export the bundle."
            )
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise BundleError(f"{bundle_dir} is not a veloxquant bundle (no {MANIFEST}).") from None


def _parse_manifest(raw: bytes, bundle_dir: Path) -> dict[str, Any]:
    path = bundle_dir / MANIFEST
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: manifest is not valid json ({e}).") from e
    _validate_manifest(manifest, bundle_dir, str(path))
    return manifest


def _version_error(where: str, version: Any) -> BundleError:
    if isinstance(version, int) and not isinstance(version, bool) and 1 <= version < FORMAT_VERSION:
        return BundleError(
            f"{where}: bundle format_version {version} was written by an older veloxquant "
            f"(whose writes were not crash-safe); this veloxquant reads version "
            f"{FORMAT_VERSION}. Re-create the bundle with this version: rerun its calibration "
            "(`dvc repro`, or `veloxquant calibrate METHOD ACTIVATIONS MODEL NEW_DIR`), then "
            "`veloxquant bundle export NEW_DIR MODEL_DIR` where it ships with a model."
        )
    return BundleError(
        f"{where}: unknown bundle format_version {version!r}; this veloxquant reads version "
        f"{FORMAT_VERSION}. Upgrade veloxquant or re-create the bundle."
    )


def _validate_manifest(m: Any, bundle_dir: Path, where: str) -> None:
    """The manifest schema: types, required fields, ranges, each error naming its field."""
    if not isinstance(m, dict):
        raise BundleError(
            f"{where}: the manifest is a json {_json_kind(m)}; expected an object with "
            "'format', 'format_version', 'model' and 'methods'."
        )
    if m.get("format") != FORMAT_NAME:
        raise BundleError(
            f"{where}: not a {FORMAT_NAME} manifest (field 'format' is {m.get('format')!r})."
        )
    if m.get("format_version") != FORMAT_VERSION:
        raise _version_error(where, m.get("format_version"))

    model = _field(m, "model", "object", where)
    _field(model, "model_type", "string", where, "model")
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
        _field(model, key, "integer", where, "model", lo=1, hi=_MAX_DIM)
    if model["num_heads"] % model["num_kv_heads"]:
        raise BundleError(
            f"{where}: field 'model.num_heads' ({model['num_heads']}) is not a multiple of "
            f"'model.num_kv_heads' ({model['num_kv_heads']})."
        )
    if _field(model, "rope_theta", "number", where, "model") <= 0:
        raise BundleError(f"{where}: field 'model.rope_theta' must be > 0.")
    _field(model, "rope_traditional", "boolean", where, "model")
    _field(model, "rope_scaling", "object", where, "model", nullable=True)
    if "rope_dims" in model:
        hi = model["head_dim"]
        _field(model, "rope_dims", "integer", where, "model", nullable=True, lo=1, hi=hi)
    _field(model, "config_sha256", "sha256", where, "model")
    _field(model, "weights_sha256", "sha256", where, "model", nullable=True)
    _field(model, "tokenizer_sha256", "sha256", where, "model", nullable=True)
    _field(model, "path", "string", where, "model", nullable=True)

    methods = _field(m, "methods", "object", where)
    if not methods:
        raise BundleError(
            f"{where}: field 'methods' is empty; a bundle holds at least one calibrated "
            f"method's artifact ({sorted(CALIBRATED)}). Produce one with "
            "`veloxquant calibrate METHOD ...`."
        )
    for name, entry in methods.items():
        _validate_entry(name, entry, model, bundle_dir, where)


def _validate_entry(
    name: str, entry: Any, model: dict[str, Any], bundle_dir: Path, where: str
) -> None:
    f = f"methods.{name}"
    if not _METHOD_NAME.match(name) or name not in CALIBRATED:
        raise BundleError(
            f"{where}: field 'methods' lists {name!r}, which is not a calibrated method "
            f"(calibrated methods: {sorted(CALIBRATED)})."
        )
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: field {f!r} must be an object, got a {_json_kind(entry)}.")
    method = METHODS[name]
    file = _field(entry, "file", "string", where, f)
    _safe_member(bundle_dir, file, f"{where}: field '{f}.file'")
    sha = _field(entry, "sha256", "sha256", where, f)
    if file != method_file(name, sha):
        raise BundleError(
            f"{where}: field '{f}.file' is {file!r}, but method files are named by their "
            f"content: {method_file(name, sha)!r} for this sha256. Re-export the bundle."
        )
    _field(entry, "size", "integer", where, f, lo=8, hi=1 << 50)  # 8: the header length
    capture_point = _field(entry, "capture_point", "string", where, f)
    if capture_point != method.capture_point:
        raise BundleError(
            f"{where}: field '{f}.capture_point' is {capture_point!r}, but {name} is "
            f"calibrated from {method.capture_point!r}."
        )
    hp = _field(entry, "hyperparameters", "object", where, f)
    try:
        method.hyperparameters(hp)  # unknown names and the method's own range checks
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{where}: field '{f}.hyperparameters': {e}") from e
    _field(entry, "diagnostics", "object", where, f)
    data = _field(entry, "data", "object", where, f)
    _field(data, "source", "object", where, f"{f}.data")
    _field(data, "split", "string", where, f"{f}.data")
    _field(data, "seq_len", "integer", where, f"{f}.data", lo=1)
    _field(data, "n_tokens", "integer", where, f"{f}.data", lo=1)
    _field(data, "sha256", "sha256", where, f"{f}.data")
    versions = _field(entry, "versions", "object", where, f)
    for key in versions:
        _field(versions, key, "string", where, f"{f}.versions")
    tensors = _field(entry, "tensors", "object", where, f)
    listed = {}
    for t, info in tensors.items():
        info = _field(tensors, t, "object", where, f"{f}.tensors")
        shape = _field(info, "shape", "array", where, f"{f}.tensors.{t}")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise BundleError(
                f"{where}: field '{f}.tensors.{t}.shape' must list integers >= 0, got {shape}."
            )
        listed[t] = (tuple(shape), _field(info, "dtype", "string", where, f"{f}.tensors.{t}"))
    spec = expected_tensors(name, model, hp)
    if listed != spec:
        raise BundleError(
            f"{where}: field '{f}.tensors' lists {_spec_text(listed)}, but {name}'s tensor_specs "
            f"for this model and hyperparameters are {_spec_text(spec)}."
        )


_KINDS: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str) and v != "",
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ),
    "boolean": lambda v: isinstance(v, bool),
    "sha256": lambda v: isinstance(v, str) and bool(_SHA256.match(v)),
}


def _field(
    obj: dict[str, Any],
    key: str,
    kind: str,
    where: str,
    parent: str = "",
    *,
    nullable: bool = False,
    lo: int | None = None,
    hi: int | None = None,
) -> Any:
    name = f"{parent}.{key}" if parent else key
    if key not in obj:
        raise BundleError(f"{where}: required field {name!r} is missing.")
    value = obj[key]
    if value is None and nullable:
        return None
    if not _KINDS[kind](value):
        want = {"sha256": "a sha256 (64 lowercase hex digits)", "integer": "an integer"}.get(
            kind, f"a{'n' if kind[0] in 'aeiou' else ''} {kind}"
        )
        raise BundleError(
            f"{where}: field {name!r} must be {'null or ' if nullable else ''}{want}, got "
            f"{_short(value)}."
        )
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BundleError(f"{where}: field {name!r} is {value}, outside [{lo}, {hi}].")
    return value


def _json_kind(v: Any) -> str:
    for kind, test in (("object", dict), ("array", list), ("string", str), ("boolean", bool)):
        if isinstance(v, test):
            return kind
    return "null" if v is None else "number"


def _spec_text(spec: dict[str, tuple[tuple[int, ...], str]]) -> str:
    return "{" + ", ".join(f"{k}: {d}{list(s)}" for k, (s, d) in sorted(spec.items())) + "}"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


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
