"""What one MLX CUDA custom-kernel launch costs per call, by number of inputs, source size,
threadgroup memory and threadgroups (each kernel does nothing: it copies 8 floats). 32 calls
per evaluation, interleaved repeats, median per call of the whole call and of its evaluation.
The "include" arms hand MLX a one-line source that #includes the same padded body from a file
(what `veloxquant.kernels.CUDA_SOURCE_FILES` does): MLX copies a kernel's source into every
call's primitive and hashes it at every evaluation.

    python benchmarks/bench_launch_inputs.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

# (inputs, bytes of comment padding in the source, bytes of shared memory, threadgroups, the
# source from a file, outputs)
ARMS = [
    (2, 0, 0, 1, False, 1),
    (17, 0, 0, 1, False, 1),
    (17, 16000, 0, 1, False, 1),
    (17, 0, 30000, 1, False, 1),
    (17, 0, 30000, 520, False, 1),
    (21, 0, 0, 1, False, 1),
    (21, 36000, 0, 1, False, 1),
    (21, 36000, 0, 1, True, 1),
    (21, 0, 0, 1, False, 4),
    (13, 0, 0, 1, False, 4),
    (13, 0, 0, 1, False, 1),
    (6, 0, 0, 1, False, 1),
]


def make_kernel(n_inputs: int, pad: int, shared: int, from_file: bool, n_outputs: int):
    body = ""
    if shared:
        body += f"  __shared__ float s_big[{shared // 4}];\n"
        body += "  s_big[threadIdx.x] = 1.0f;\n  __syncthreads();\n"
    body += "  unsigned int i = threadIdx.x;\n"
    body += "  if (i < 8) out0[i] = x0[i]" + (" + s_big[i]" if shared else "") + ";\n"
    body += "".join(f"  if (i < 8) out{o}[i] = x0[i];\n" for o in range(1, n_outputs))
    body += ("  // " + "x" * 96 + "\n") * (pad // 100)
    if from_file:
        path = Path(tempfile.mkdtemp(prefix="vq-launch-")) / "body.cuh"
        path.write_text(body)
        body = f'#include "{path}"\n'
    return mx.fast.cuda_kernel(
        name=f"vq_launch_{n_inputs}_{pad}_{shared}_{int(from_file)}_{n_outputs}",
        input_names=[f"x{i}" for i in range(n_inputs)],
        output_names=[f"out{o}" for o in range(n_outputs)],
        source=body,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        raise SystemExit("needs MLX's CUDA backend")
    xs = [mx.random.normal((8,)) for _ in range(max(a[0] for a in ARMS))]
    mx.eval(xs)
    arms = {}
    for n_inputs, pad, shared, groups, from_file, n_outputs in ARMS:
        kernel = make_kernel(n_inputs, pad, shared, from_file, n_outputs)

        def run(kernel=kernel, n_inputs=n_inputs, groups=groups, n_out=n_outputs) -> float:
            outs = [
                kernel(
                    inputs=xs[:n_inputs],
                    grid=(128 * groups, 1, 1),
                    threadgroup=(128, 1, 1),
                    output_shapes=[(8,)] * n_out,
                    output_dtypes=[mx.float32] * n_out,
                )[0]
                for _ in range(args.calls)
            ]
            t0 = time.perf_counter()
            mx.eval(outs)
            return time.perf_counter() - t0

        where = ", included" if from_file else ""
        name = f"{n_inputs} inputs, {pad} B source pad{where}, {shared} B shared, {groups} groups"
        name += f", {n_outputs} outputs" if n_outputs > 1 else ""
        arms[name] = run
    for run in arms.values():  # warm-up: compile
        run()
    times = {k: [] for k in arms}
    for _ in range(args.repeats):
        for name, run in arms.items():
            t0 = time.perf_counter()
            evaluation = run()
            times[name].append(((time.perf_counter() - t0) / args.calls, evaluation / args.calls))
    print(f"mlx {mx.__version__}, {args.calls} calls per eval, {args.repeats} repeats, per call:")
    for name, v in times.items():
        whole = statistics.median(a for a, _ in v) * 1e6
        evaluation = statistics.median(b for _, b in v) * 1e6
        print(f"  {name:<72} {whole:.1f} us, of which evaluation {evaluation:.1f} us")


if __name__ == "__main__":
    main()
