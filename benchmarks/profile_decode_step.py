"""Where one decode step's GPU time goes: every kernel of a synchronous step, fp16 `KVCache`
against the fused VecInfer caches, for `ncu`.

Run it under ncu with profiling off at the start; the script turns the profiler on (CUDA driver
`cuProfilerStart`) only around the measured steps, and launches a one-thread marker kernel
(`vq_step_marker`) before each step so that the kernels can be split into steps afterwards:

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --page raw --log-file step.csv \\
        python benchmarks/profile_decode_step.py \\
            --random-weights benchmarks/configs/llama3-8b.json --context 16384
    python benchmarks/profile_decode_step.py --parse step.csv

Without ncu it prints the synchronous step's wall time per arm (interleaved repeats), which is
what the GPU time per step is set against. `--parse` prints, per arm, the GPU time of a step
(the sum of its kernels' durations), the kernel count, and the kernels grouped by name, largest
first; with `--per-layer`, also every attention launch of each step in layer order (a grouped
median hid that a step's first layer and its last four took 200-450 us where the others took
25-80: benchmarks/results/launch-params-h100.txt).

`--baseline NAME=KERNELS_PY` (repeatable) adds an arm per other revision of
veloxquant/methods/vecinfer/kernels.py, on fused caches of its own: the A/B of a kernel change
inside real decode steps (give `--parse` the same `--baseline` names).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import statistics
from collections import defaultdict

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

import veloxquant.methods.vecinfer as vecinfer
from _common import fmt, random_weights_model
from ab_kernel_revisions import load_baseline, switch
from bench_generate import build_and_step, default_layout_caches, fp16_and_fused_caches

MARKER = "vq_step_marker"
ARMS = ("fp16", "vecinfer")  # then the --baseline arms, in the order they are profiled


def _marker_kernel():
    return mx.fast.cuda_kernel(
        name=MARKER,
        input_names=["x"],
        output_names=["y"],
        source="if (threadIdx.x == 0) { y[0] = x[0]; }",
    )


def mark(kernel, tag: int) -> None:
    x = mx.full((8,), tag, mx.float32)
    (y,) = kernel(
        inputs=[x],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
        output_shapes=[(8,)],
        output_dtypes=[mx.float32],
    )
    mx.eval(y)


def profiler(start: bool) -> int:
    """cuProfilerStart / cuProfilerStop of the CUDA driver (0 on success)."""
    lib = ctypes.CDLL("libcuda.so.1")
    return int((lib.cuProfilerStart if start else lib.cuProfilerStop)())


def run(args) -> None:
    print(f"mlx {mx.__version__}, device {mx.default_device()}, context {args.context}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    fp, vq = fp16_and_fused_caches(model, args.context)
    current = vecinfer.kernels
    # name: (caches, the kernels module their steps run, None for fp16)
    arms = {"fp16": (fp, None), "vecinfer": (vq, current)}
    for name, path in baselines(args.baseline):
        arms[name] = (default_layout_caches(model, args.context), load_baseline(path))

    def step(name: str) -> float:
        caches, kernels = arms[name]
        if kernels is not None:
            switch(kernels, caches)
        return build_and_step(model, caches, token)[2]

    names = list(arms)
    for name in names:  # warm-up: compile, allocate
        for _ in range(2):
            step(name)
    walls = {name: [] for name in arms}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            walls[name].append(step(name))
    for name, w in walls.items():
        print(f"  {name:<9} synchronous step {fmt(w, 1e3, ' ms')}")
    marker = _marker_kernel()
    mark(marker, -1)  # compiled before the profiled range
    print(f"cuProfilerStart -> {profiler(True)}")
    for tag, (caches, kernels) in enumerate(arms.values()):
        if kernels is not None:
            switch(kernels, caches)
        for _ in range(args.steps):
            mark(marker, tag)
            mx.eval(model(token, cache=caches))
    mark(marker, -1)
    print(f"cuProfilerStop -> {profiler(False)}")
    switch(current, vq)
    print("arms in order:", ", ".join(arms), f"({args.steps} steps each)")


def baselines(specs: list[str]) -> list[tuple[str, str]]:
    """`--baseline NAME=KERNELS_PY` arguments as (name, path); names other than the fixed arms'."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in ARMS or name in dict(out):
            raise SystemExit(f"--baseline {spec!r}: expected NAME=KERNELS_PY with a new NAME")
        out.append((name, path))
    return out


def parse(path: str, arms: list[str], steps: int, per_layer: bool = False) -> None:
    rows = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    reader = csv.DictReader(lines)
    to_us = None
    for row in reader:
        t = row.get("gpu__time_duration.sum", "")
        if to_us is None:  # the units row comes first
            to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3}[t]
            continue
        rows.append((row["Kernel Name"], float(t.replace(",", "")) * to_us))
    # split on the markers: step i of arm a is the i-th marked segment
    segments, cur = [], None
    for name, t in rows:
        if MARKER in name:
            cur = []
            segments.append(cur)
        elif cur is not None:
            cur.append((name, t))
    segments = [s for s in segments if s]
    print(f"{len(rows)} kernels, {len(segments)} marked steps")
    for a, arm in enumerate(arms):
        mine = segments[a * steps : (a + 1) * steps]
        if not mine:
            continue
        totals = [sum(t for _, t in s) for s in mine]
        print(
            f"\n{arm}: GPU time per step {statistics.median(totals) / 1e3:.3f} ms "
            f"[{min(totals) / 1e3:.3f}, {max(totals) / 1e3:.3f}], "
            f"{statistics.median(len(s) for s in mine)} kernels per step"
        )
        by_name = defaultdict(list)
        for name, t in mine[-1]:
            by_name[name[:90]].append(t)
        for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
            med = statistics.median(ts)
            print(f"  {sum(ts) / 1e3:8.3f} ms  {len(ts):5d} x {med:8.2f} us  {name}")
        for i, step in enumerate(mine if per_layer else []):
            layers = [t for name, t in step if "attn" in name or "sdpa" in name]
            print(f"  step {i} attention per layer, us: " + " ".join(f"{t:.0f}" for t in layers))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--random-weights", metavar="CONFIG_JSON")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--parse", metavar="NCU_CSV")
    p.add_argument("--per-layer", action="store_true", help="--parse: each attention launch")
    p.add_argument("--baseline", action="append", default=[], metavar="NAME=KERNELS_PY")
    args = p.parse_args()
    if args.parse:
        names = list(ARMS) + [n for n, _ in baselines(args.baseline)]
        parse(args.parse, names, args.steps, args.per_layer)
    elif not args.random_weights:
        p.error("--random-weights CONFIG_JSON is needed to profile (or --parse NCU_CSV)")
    else:
        run(args)


if __name__ == "__main__":
    main()
