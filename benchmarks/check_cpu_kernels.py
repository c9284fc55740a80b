"""Every float32 input: the extension's exp (veloxquant/cpu_kernels.cpp) against `mx.exp`, and
its swiglu against mlx-lm's (gate = every float32, up = 1.5), compared bit for bit (NaN
payloads aside). The tests sweep a sample of the same inputs; this is the whole of them.

    python benchmarks/check_cpu_kernels.py          # about 4 minutes on one x86 core
"""

from __future__ import annotations

import argparse
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu
from tqdm import tqdm

from veloxquant import cpu_kernels


def _bits(a: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunk-log2", type=int, default=24, help="inputs per chunk, log2")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("build the extension first: veloxquant build-cpu-kernels")
    native = cpu_kernels._load()
    chunk = 1 << args.chunk_log2
    bad = {"exp": 0, "swiglu": 0}
    first_bad: dict[str, float] = {}
    t0 = time.perf_counter()
    for start in tqdm(range(0, 1 << 32, chunk), desc="float32 inputs", unit="chunk"):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        xm = mx.array(x)
        got = np.frombuffer(native.exp_float32(x.tobytes()), np.float32)
        want = np.array(mx.exp(xm))
        up = mx.full(xm.shape, 1.5)
        got_s, want_s = np.array(cpu_kernels.swiglu(xm, up)), np.array(swiglu(xm, up))
        for name, g, w in (("exp", got, want), ("swiglu", got_s, want_s)):
            diff = np.flatnonzero(_bits(g) != _bits(w))
            bad[name] += diff.size
            if diff.size and name not in first_bad:
                first_bad[name] = float(x[diff[0]])
    print(f"2**32 float32 inputs in {time.perf_counter() - t0:.0f} s")
    for name, n in bad.items():
        extra = f" (first at {first_bad[name]!r})" if n else ""
        print(f"  {name}: {n} inputs whose bits differ from MLX's{extra}")
    if any(bad.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
