"""Files: atomic and deterministic writes, checksums, canonical json, writer locks, and a
safetensors header reader that never unpickles.

Every artifact goes to a temporary name in the destination directory, is fsynced, renamed onto
its name, and the directory is fsynced: an interrupted run never leaves a half-written file
under a real name, and a completed rename survives a power cut.

Fault injection (tests/test_faults.py): every fsync, rename and unlink a crash-safe write relies
on goes through `fsync_file`, `fsync_dir`, `rename` and `unlink` below, each one a numbered
durability point. With VELOXQUANT_FAULT_AT=N the process dies with os._exit(FAULT_EXIT_CODE)
just before its Nth point, where a SIGKILL or a power cut could land (no `finally` runs, no
buffers are flushed); VELOXQUANT_FAULT_LOG=FILE appends one "N kind path" line per point, so a
test can enumerate them first. Unset, each point costs two environment lookups.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np
from safetensors.numpy import save as _st_save_bytes


_UMASK = os.umask(0)
os.umask(_UMASK)

FAULT_AT_ENV = "VELOXQUANT_FAULT_AT"
FAULT_LOG_ENV = "VELOXQUANT_FAULT_LOG"
FAULT_EXIT_CODE = 137  # what a shell reports for a SIGKILLed process
_durability_points = 0


def _durability_point(kind: str, path: str | os.PathLike) -> None:
    global _durability_points
    at, log = os.environ.get(FAULT_AT_ENV), os.environ.get(FAULT_LOG_ENV)
    if at is None and log is None:
        return
    _durability_points += 1
    if log:
        with open(log, "a") as f:
            f.write(f"{_durability_points} {kind} {path}\n")
    if at is not None and _durability_points == int(at):
        os._exit(FAULT_EXIT_CODE)


def fsync_file(path: str | os.PathLike) -> None:
    _durability_point("fsync", path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames and unlinks in `path` durable (a rename lives in the directory's data)."""
    _durability_point("fsync", path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """os.replace: atomic on POSIX within one filesystem, also over an existing file."""
    _durability_point("rename", dst)
    os.replace(src, dst)


def unlink(path: str | os.PathLike) -> None:
    _durability_point("unlink", path)
    Path(path).unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to `path`; make it `path` only if the block succeeds.

    The temp file is fsynced before the rename and the directory after it, so once this
    returns, `path` holds the complete new bytes even after a crash; before, the old ones.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are shared and shipped
    try:
        yield tmp
        fsync_file(tmp)
        rename(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def json_bytes(obj: Any) -> bytes:
    """The one json layout of every artifact: indented, sorted keys, trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_bytes_atomic(path, json_bytes(obj))


def safetensors_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """numpy/mlx arrays as safetensors bytes, byte-deterministically.

    Keys are sorted and metadata is plain strings, so equal inputs give equal bytes.
    At most one metadata key: safetensors writes several in hash-map (random) order.
    """
    if metadata is not None and len(metadata) > 1:
        raise ValueError("safetensors_bytes takes at most one metadata key (byte determinism)")
    arrays = {k: to_numpy(v) for k, v in sorted(tensors.items())}
    return _st_save_bytes(arrays, metadata=metadata)


def save_safetensors_atomic(
    path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """Save numpy/mlx arrays as safetensors, atomically and byte-deterministically."""
    write_bytes_atomic(path, safetensors_bytes(tensors, metadata))


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    import mlx.core as mx

    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            raise TypeError("bfloat16 arrays cannot be saved via numpy; cast first")
        return np.ascontiguousarray(np.array(x, copy=False))
    return np.ascontiguousarray(np.asarray(x))


def recorded_path(path: str | os.PathLike) -> str:
    """How an artifact records a path: relative to the working directory when it lies inside it,
    else absolute. DVC runs every stage from the project root, so what a stage records does not
    depend on where the project is checked out (two clones build the same bytes)."""
    p = Path(os.path.abspath(path))
    try:
        return p.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(p)


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


def safetensors_views(data: bytes, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Read-only numpy views (no copy) of the named tensors (default: all) of a safetensors blob
    that `parse_safetensors_header` has validated."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name in header if names is None else names:
        info = header[name]
        if info["dtype"] == "BF16":
            raise SafetensorsError(f"tensor {name!r} is bfloat16, which numpy cannot view.")
        dtype = np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<")
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        view = np.frombuffer(data, dtype=dtype, count=count, offset=8 + n + start)
        out[name] = view.reshape(info["shape"])
    return out
