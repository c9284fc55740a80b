"""Files: atomic and deterministic writes, checksums, canonical json, directory swaps, writer
locks, and a safetensors header reader that never unpickles.

Every artifact goes to a temporary name in the destination directory and is then renamed, so an
interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import numpy as np
from safetensors.numpy import save as _st_save_bytes


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are shared and shipped
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_safetensors_atomic(
    path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """Save numpy/mlx arrays as safetensors, atomically and byte-deterministically.

    Keys are sorted and metadata is plain strings, so equal inputs give equal bytes.
    At most one metadata key: safetensors writes several in hash-map (random) order.
    """
    if metadata is not None and len(metadata) > 1:
        raise ValueError(
            "save_safetensors_atomic takes at most one metadata key (byte determinism)"
        )
    arrays = {k: to_numpy(v) for k, v in sorted(tensors.items())}
    write_bytes_atomic(path, _st_save_bytes(arrays, metadata=metadata))


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    import mlx.core as mx

    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            raise TypeError("bfloat16 arrays cannot be saved via numpy; cast first")
        return np.ascontiguousarray(np.array(x, copy=False))
    return np.ascontiguousarray(np.asarray(x))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------------------------
# Canonical json


def jsonable(x: Any) -> Any:
    """Plain json types, so manifests are deterministic and free of NaN (stored as null)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
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
        return jsonable(np.asarray(x).tolist())
    raise TypeError(f"{type(x).__name__} is not json-serialisable for a bundle manifest: {x!r}")


def canonical_json(obj: Any) -> bytes:
    return json.dumps(jsonable(obj), sort_keys=True, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------------------------
# Directories


def replace_dir_atomically(dest: Path, fill: Callable[[Path], None]) -> None:
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


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on `<directory>/.lock`: serialises writers of one directory."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------
# Safetensors headers, parsed here: a file is checked before any tensor is read, never unpickled


class SafetensorsError(ValueError):
    """A file is not well-formed safetensors (truncated, corrupt, or another format)."""


_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}
_MAX_HEADER = 100 << 20


def check_not_pickle(data: bytes, where: str) -> None:
    if data[:1] == b"\x80" and len(data) > 1 and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise SafetensorsError(
            f"{where} is a Python pickle, not safetensors. veloxquant never unpickles; re-export "
            "the tensors with safetensors."
        )
    if data[:4] == b"PK\x03\x04":
        raise SafetensorsError(
            f"{where} is a zip archive (e.g. a torch.save checkpoint), not safetensors. "
            "veloxquant never unpickles; re-export the tensors with safetensors."
        )


def parse_safetensors_header(data: bytes, where: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Validate a safetensors blob's header and layout; return name -> (shape, dtype)."""
    check_not_pickle(data, where)
    if len(data) < 8:
        raise SafetensorsError(f"{where}: {len(data)} bytes is too short for a safetensors file.")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > len(data):
        raise SafetensorsError(
            f"{where}: not a safetensors file or truncated (header length {n}, file "
            f"{len(data)} bytes)."
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{where}: safetensors header is not valid json ({e}).") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: safetensors header is not a json object.")
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
            raise SafetensorsError(f"{where}: malformed header entry for {name!r}.") from e
        itemsize = (
            1 if dtype == "bool" else np.dtype(dtype if dtype != "bfloat16" else "uint16").itemsize
        )
        if not 0 <= start <= end <= body or end - start != math.prod(shape) * itemsize:
            raise SafetensorsError(
                f"{where}: tensor {name!r} has inconsistent data offsets (truncated?)."
            )
        spans.append((start, end))
        out[name] = (shape, dtype)
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise SafetensorsError(f"{where}: tensor data overlaps or has gaps; file is corrupt.")
        pos = end
    if pos != body:
        raise SafetensorsError(f"{where}: {body - pos} trailing bytes after the tensor data.")
    return out
