"""VecInfer's CPU attention kernel (`cpu_kernels.vecinfer_coded_attention`) on its own, on the CPU.

1. The op alone: ns per coded token and KV head, with and without the key mean (SmolLM2-135M's
   layer: 3 KV heads, 3 query heads each, head_dim 64, d2b6 keys, d4b8 values), median of
   interleaved repeats.
2. The per-step RoPE phase table (`rope.phase_table`): built whole against grown from the
   previous step's by one row (what a decode step asks for), at 16K tokens x 64 and 64K x 128.
3. Peak MLX memory of one prefill chunk (512 queries, Llama-3-8B's 8 KV heads x 4 query heads x
   128) over 64K coded tokens: the CPU kernel against the pure-MLX twin.

    python benchmarks/bench_vecinfer_cpu_kernel.py
"""

from __future__ import annotations

import statistics
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from veloxquant import cpu_kernels
from veloxquant import rope as rope_mod
from veloxquant.methods.vecinfer import kernels as K
from veloxquant.rope import RopeSpec, phase_coefficients, phase_table
from bench_kernels import synthetic_cache


def timed(fn, repeats: int) -> list[float]:
    mx.eval(fn())  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t0)
    return out


def op_alone(repeats: int = 20) -> None:
    print("1. the op alone (3 KV heads x 3 query heads x 64, d2b6 keys, d4b8 values)")
    spec = RopeSpec(64, False, 10000.0, 1.0)
    for n_coded in (4096, 16384):
        c = synthetic_cache(3, 64, n_coded, rope=spec, value=(8, 4), shared_value_books=True)
        qt, q = mx.random.normal((1, 3, 3, 64)), mx.random.normal((1, 3, 3, 64))
        mean = c.key_mean.astype(mx.float32)[None, :, None, :]
        ab, phases = phase_coefficients(q, mean, spec), phase_table(spec, c.sinks, n_coded)
        kb, vb = c.key_codebook.astype(mx.float32), c.value_codebook.astype(mx.float32)
        mx.eval(qt, ab, phases, kb, vb)
        arms = {
            "with the key mean": (qt, ab, c._kbuf, kb, c._vbuf, vb, phases),
            "without": (qt, None, c._kbuf, kb, c._vbuf, vb, None),
        }
        times = {name: [] for name in arms}
        for _ in range(repeats):  # interleaved
            for name, args in arms.items():
                times[name] += timed(
                    lambda a=args, n=n_coded: cpu_kernels.vecinfer_coded_attention(*a, n, 6, 8), 1
                )
        for name, ts in times.items():
            ns = [t / (3 * n_coded) * 1e9 for t in ts]
            print(
                f"  {n_coded} tokens, {name:<17}: {statistics.median(ns):6.1f} ns a token and KV "
                f"head [{min(ns):.1f}, {max(ns):.1f}]"
            )


def tables(repeats: int = 5) -> None:
    print("2. the phase table of a decode step: whole against grown by one row")
    for dims, n in ((64, 16384), (128, 65536)):
        spec = RopeSpec(dims, False, 5e5, 1.0)
        whole, grown = [], []
        for r in range(repeats):
            rope_mod._tables().clear()
            t0 = time.perf_counter()
            mx.eval(phase_table(spec, 4, n + r))
            whole.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mx.eval(phase_table(spec, 4, n + r + 1))
            grown.append(time.perf_counter() - t0)
        print(
            f"  {n} tokens x {dims}: whole {statistics.median(whole) * 1e3:.1f} ms, grown "
            f"{statistics.median(grown) * 1e3:.2f} ms (medians of {repeats})"
        )


def prefill_memory() -> None:
    print("3. peak MLX memory of one 512-query chunk over 64K coded tokens (8 x 4 x 128)")
    h, g, d, n_coded, n_new = 8, 4, 128, 65536, 512
    spec = RopeSpec(d, False, 5e5, 1.0)
    c = synthetic_cache(h, d, n_coded, rope=spec, value=(8, 4), shared_value_books=True)
    q = mx.random.normal((1, h * g, n_new, d))
    new = (mx.random.normal((1, h, n_new, d)), mx.random.normal((1, h, n_new, d)))
    pending = {"n_coded": n_coded, "win": (c._wk, c._wv), "new": new}
    mx.eval(q, *new)
    for name, fn in (("CPU kernel", K.cpu_kernel_attention), ("twin", K.reference_attention)):
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        t0 = time.perf_counter()
        mx.eval(fn(c, q, 0.125, "causal", pending))
        peak = (mx.get_peak_memory() - start) / 2**20
        took = time.perf_counter() - t0
        print(f"  {name:<10}: {peak:7.1f} MiB over what it started with, {took:.1f} s")


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("the CPU extension is not built here: `veloxquant build-cpu-kernels`")
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    op_alone()
    tables()
    prefill_memory()


if __name__ == "__main__":
    main()
