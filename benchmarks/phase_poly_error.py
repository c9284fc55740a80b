"""The tensor-core kernel's output error with and without the phase polynomial, on the CPU.

    python benchmarks/phase_poly_error.py

Runs the one-launch kernel's generated CUDA source in the kernel emulator
(`tests/kernel_emulator.py`, as `tests/test_kernels.py` does) on a random 8B-shape cache
(6-bit key pairs, 8-bit value fours, key mean, 2 KV heads, 4 query heads each, 1500 coded
tokens in splits of two 256-token tiles), with the slow RoPE pairs summed as one polynomial
(`Layout.poly_pairs`) and with every pair from the phase table, at RoPE bases 1e4 and 5e5
(Llama-3's). Prints the largest output error against the pure-MLX reference, relative to the
reference's largest entry: f16 operands put both near 1e-3.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests package

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from tests import test_kernels as T  # noqa: E402
from veloxquant.methods.vecinfer import kernels as K  # noqa: E402
from veloxquant.rope import RopeSpec  # noqa: E402


def relative_error(base: float, poly: bool) -> tuple[int, int, float]:
    """(slow pairs in the polynomial, splits, max |kernel - reference| / max |reference|)."""
    h, g, d, n = 2, 4, 128, 1500
    c, normal = T._random_cache((d, g, (6, 2), (8, 4)), h=h)
    c.rope = RopeSpec.from_module(nn.RoPE(d, base=base), d)
    c.update_and_fetch(normal(1, h, n, d, scale=2.0), normal(1, h, n, d))
    mx.eval(c.fused_attention(normal(1, h * g, n, d), scale=0.1))
    c.update_and_fetch(normal(1, h, 1, d, scale=2.0), normal(1, h, 1, d))
    pending, c._pending = c._pending, None
    q = normal(1, h * g, 1, d, scale=2.0)
    K.MMA, K.MIN_SPLIT = True, 512
    chosen = K.poly_pairs
    if not poly:
        K.poly_pairs = lambda rope, head_dim: 0
    try:
        K.clear_memos([c])
        c._reserve_codes(1)
        lay = K.layout_of(c, h * g)
        ref = np.array(K.reference_attention(c, q, 1 / math.sqrt(d), None, pending))
        out, _, _ = T._emulated_attention("cuda", c, q, {**pending, "encode": None}, 2, 1)
        splits = K.attention_inputs(c, q, 1.0, pending, r=2)["n_splits"]
    finally:
        K.poly_pairs = chosen
    return lay.poly_pairs, splits, float(np.abs(out - ref).max() / np.abs(ref).max())


def main() -> None:
    print("| RoPE base | phase | slow pairs | splits | max error / max output |")
    print("| --- | --- | --- | --- | --- |")
    for base in (10000.0, 500000.0):
        for poly in (False, True):
            pairs, splits, err = relative_error(base, poly)
            name = "polynomial" if poly else "table"
            print(f"| {base:g} | {name} | {pairs} | {splits} | {err:.2e} |")


if __name__ == "__main__":
    main()
