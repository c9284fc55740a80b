"""Atomic, deterministic file writes and checksums.

Every artifact goes to a temporary name in the destination directory and is then
renamed, so an interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

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
        raise ValueError("save_safetensors_atomic takes at most one metadata key (byte determinism)")
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
