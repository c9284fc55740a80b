"""Which widths this backend's `mx.dequantize` (affine) decodes like the pure-MLX
unpacking KIVI uses as its reference (`kivi.unpack_codes`), on random codes packed by
`kivi.pack_codes`, for G = 32 / 64 / 128. KIVI's fused path (`kivi.MX_DEQUANTIZE_BITS`) may only
use widths that pass on every backend it runs on.

    python benchmarks/check_dequantize.py

Results: benchmarks/results/mlx-cuda-dequantize-widths.txt (MLX 0.32.4, H200: 1 bit fails).
"""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant.methods import kivi


def main() -> None:
    rng = np.random.default_rng(0)
    backend = "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "other"
    print(f"mlx {mx.__version__}, backend {backend if backend == 'cuda' else mx.default_device()}")
    print("G bits n_codes max|fused - pure|")
    for g in (32, 64, 128):
        for b in (1, 2, 3, 4, 5, 6, 8):
            for n in (1024, 4096):
                codes = mx.array(rng.integers(0, 1 << b, size=(2, 3, 5, n)).astype(np.uint32))
                words = kivi.pack_codes(codes, b)
                # fp16 values in float32, as KIVI stores and hands them to mx.dequantize
                scale = mx.array(rng.normal(size=(2, 3, 5, n // g)).astype(np.float16))
                zero = mx.array(rng.normal(size=(2, 3, 5, n // g)).astype(np.float16))
                scale, zero = scale.astype(mx.float32), zero.astype(mx.float32)
                fused = mx.dequantize(words, scale, zero, group_size=g, bits=b)
                c = kivi.unpack_codes(words, b, n).astype(mx.float32).reshape(2, 3, 5, n // g, g)
                pure = (c * scale[..., None] + zero[..., None]).reshape(2, 3, 5, n)
                err = float(mx.abs(fused - pure).max().item())
                # float rounding (an FMA) may differ by an ulp; a wrong decode is O(scale)
                bad = err > 1e-5 * float(mx.abs(pure).max().item())
                print(f"{g} {b} {n} {err:.3g}{'  MISMATCH' if bad else ''}", flush=True)


if __name__ == "__main__":
    main()
