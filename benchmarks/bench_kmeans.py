"""How close k-means and CommVQ's EM run to this machine's float32 GEMM rate, in one run.

Runs the real calibrations on a capture dir and times, inside them, every call of
`veloxquant.kmeans.kmeans` (VecInfer's codebooks, CommVQ's value codebooks: init, Lloyd
iterations, reseeding and the final assignment) and every E-step of CommVQ's key EM
(`train.e_step` + `m_step`). Each call's work is counted as the FLOPs of the brute-force
distance GEMM it stands for, the one a plain GEMM k-means would run:

- k-means: 2·(d+1) FLOP per (vector, centroid) pair per assignment pass (iters + 1 passes);
- EM: 2·(2P+1) FLOP per (token, codeword) pair per iteration, 4096 codewords of 2P = D dims.

Effective GFLOP/s = those FLOPs / wall time; the GEMM rate is a square 2048 float32 matmul
measured before and after in the same process (median of both). The ratio is the number the
issue's goal (>= 0.3) is about. Nothing else runs meanwhile.

    python benchmarks/bench_kmeans.py --artifacts artifacts/smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import yaml

from veloxquant import cpu_kernels
from veloxquant import kmeans as km
from veloxquant.methods.commvq import codebook as cb
from veloxquant.methods.commvq import train as tr
from _common import fmt, gemm_gflops


class Tally:
    """Wall seconds and brute-force GEMM FLOPs of the calls a wrapper saw."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.flops = 0.0
        self.calls = 0


def timed_kmeans(tally: Tally):
    inner = km.kmeans

    def wrapper(x, n_centroids, *args, **kwargs):
        mx.eval(x)  # the caller's transforms and subsample are not k-means
        t0 = time.perf_counter()
        result = inner(x, n_centroids, *args, **kwargs)
        mx.eval(result.centroids, result.counts, result.mse)
        tally.seconds += time.perf_counter() - t0
        g, n, d = x.shape
        passes = len(result.history) + 1  # the Lloyd passes run, and the final assignment
        tally.flops += 2.0 * (d + 1) * n_centroids * n * g * passes
        tally.calls += 1
        return result

    return wrapper


def timed_em(tally: Tally):
    e_step, m_step = tr.e_step, tr.m_step

    def e_wrapper(x_flat, theta, inv_t, **kwargs):
        mx.eval(x_flat, theta)
        t0 = time.perf_counter()
        stats = e_step(x_flat, theta, inv_t, **kwargs)
        mx.eval(*stats)
        tally.seconds += time.perf_counter() - t0
        g, n, p2 = x_flat.shape
        tally.flops += 2.0 * (p2 + 1) * cb.CODEWORDS * n * g
        tally.calls += 1
        return stats

    def m_wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = m_step(*args, **kwargs)
        mx.eval(out)
        tally.seconds += time.perf_counter() - t0
        return out

    return e_wrapper, m_wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--artifacts", default="artifacts/smollm2-135m")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--repeats", type=int, default=5, help="GEMM timings before and after")
    args = parser.parse_args()

    from veloxquant.calibrate import calibrate

    art = Path(args.artifacts)
    params = yaml.safe_load(Path(args.params).read_text())["method"]
    rates = gemm_gflops(args.repeats)
    kmeans_tally, em_tally, walls = Tally(), Tally(), {}
    km.kmeans = timed_kmeans(kmeans_tally)
    import veloxquant.methods.vecinfer.calibrate as vc

    vc.kmeans = km.kmeans
    tr.e_step, tr.m_step = timed_em(em_tally)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for method in ("vecinfer", "commvq"):
            hp = {k: v for k, v in params[method].items() if k != "variants"}
            t0 = time.perf_counter()
            calibrate(
                method,
                art / "activations",
                art / "model",
                Path(tmp) / method,
                data_json=art / "data" / "data.json",
                progress=False,
                **hp,
            )
            walls[method] = time.perf_counter() - t0
    rates += gemm_gflops(args.repeats)
    peak = statistics.median(rates)
    print(
        f"calibrations of {art} (params: {args.params}), CPU kernels "
        f"{'built' if cpu_kernels.available() else 'not built'}"
    )
    print(f"  float32 GEMM (2048^2, same run): {fmt(rates, unit=' GFLOP/s')}")
    for name, tally in (("k-means", kmeans_tally), ("CommVQ EM (E + M steps)", em_tally)):
        eff = tally.flops / tally.seconds / 1e9
        print(
            f"  {name}: {tally.calls} calls, {tally.seconds:.2f} s, {tally.flops / 1e9:.1f} "
            f"GFLOP of brute-force distance GEMM -> {eff:.1f} GFLOP/s = {eff / peak:.2f} of the "
            "GEMM rate"
        )
    for method, seconds in walls.items():
        print(f"  whole {method} calibration (loading, transforms, diagnostics): {seconds:.1f} s")


if __name__ == "__main__":
    main()
