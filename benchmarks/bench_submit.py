"""What MLX's CUDA backend charges the host per custom-kernel call, by what the call carries:
32 calls per evaluation on the partial decode kernel's own inputs (8B layer shape, default
layout, 16K context). Per call: the graph build (the Python call into `mx.fast.cuda_kernel`'s
function), the submission (`mx.async_eval`: MLX encodes each kernel on the calling thread) and
the wait. Variants: a trivial kernel with 2 inputs and one small output; with the partial's 3
outputs; over its full grid; with all 18 of its inputs; the same padded with 20 KB of comment
lines (MLX rebuilds and keeps a kernel's whole source with every call); the real partial
kernel called directly, with its source as generated and with the source's comments,
indentation and blank lines stripped; the real partial kernel through
`veloxquant.kernels.launch`. Interleaved repeats, median [min, max].

    python benchmarks/bench_submit.py      # MLX on CUDA only
"""

from __future__ import annotations

import argparse
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

import veloxquant.kernels as vk
from _common import fmt
from bench_kernels import decode_inputs
from veloxquant.methods.vecinfer import kernels as K

TRIVIAL = """
  unsigned int i = threadIdx.x + blockIdx.x * blockDim.x;
  if (i < 8) part_m[i] = (float)iparams[i];
"""
PADDING = "\n".join(f"  // padding line {i:04d} " + "." * 56 for i in range(300))


def stripped(source: str) -> str:
    """`source` without comments, indentation or blank lines (preprocessor lines kept whole)."""
    lines = []
    for line in source.splitlines():
        if not line.lstrip().startswith("#"):
            line = line.split("//")[0]
        if line.strip():
            lines.append(line.strip())
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    calls = 32
    (cache,), qs, (pending,) = decode_inputs(16384, 1, calls, 8, 4, 128)
    a = K.attention_inputs(cache, qs[0], 0.1, pending, one_launch=False)
    inputs, partial = a["partial"], a["sources"][0]
    ns, n_q, d = a["n_splits"] + 1, 32, 128
    outs = [(ns * n_q + 8,), (ns * n_q + 8,), (ns * n_q * d,)]
    grid = (ns * 128, a["groups"][1], 1)

    def kernel(name, names, source, n_out=3, header=""):
        return mx.fast.cuda_kernel(
            name=name,
            input_names=names,
            output_names=["part_m", "part_l", "part_o"][:n_out],
            source=source,
            header=header,
        )

    two = ["q", "iparams"]
    k_small = kernel("vq_probe_2_1", two, TRIVIAL, 1)
    k_two = kernel("vq_probe_2", two, TRIVIAL)
    k_all = kernel("vq_probe_18", list(partial.inputs), TRIVIAL)
    k_padded = kernel("vq_probe_18_padded", list(partial.inputs), TRIVIAL + PADDING)
    body, header = partial.cuda_body(), partial.header("cuda")
    k_real = kernel("vq_probe_real", list(partial.inputs), body, header=header)
    k_stripped = kernel(
        "vq_probe_stripped", list(partial.inputs), stripped(body), header=stripped(header)
    )
    print(
        f"partial kernel source + header: {len(body) + len(header)} B as generated, "
        f"{len(stripped(body)) + len(stripped(header))} B stripped"
    )

    def call(k, ins, shapes, g):
        dtypes = [mx.float32] * len(shapes)
        kw = dict(grid=g, threadgroup=(128, 1, 1), output_shapes=shapes, output_dtypes=dtypes)
        return k(inputs=ins, **kw)[0]

    variants = {
        "trivial, 2 inputs, 1 small output": lambda q: call(
            k_small, [q, inputs[1]], [(8,)], (128, 1, 1)
        ),
        "... 3 outputs": lambda q: call(k_two, [q, inputs[1]], outs, (128, 1, 1)),
        "... the partial's grid": lambda q: call(k_two, [q, inputs[1]], outs, grid),
        "... 18 inputs": lambda q: call(k_all, [q, *inputs[1:]], outs, grid),
        "... + 20 KB of source": lambda q: call(k_padded, [q, *inputs[1:]], outs, grid),
        "the partial kernel, direct": lambda q: call(k_real, [q, *inputs[1:]], outs, grid),
        "... its source stripped": lambda q: call(k_stripped, [q, *inputs[1:]], outs, grid),
        "the partial kernel (launch)": lambda q: vk.launch(
            partial, [q, *inputs[1:]], a["groups"], outs, [mx.float32] * 3
        )[0],
    }
    result = {name: ([], [], []) for name in variants}
    names = list(variants)
    for r in range(args.repeats + 2):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            ys = [variants[name](q) for q in qs]
            t1 = time.perf_counter()
            mx.async_eval(ys)
            t2 = time.perf_counter()
            mx.eval(ys)
            t3 = time.perf_counter()
            if r >= 2:  # warm-up: compile
                for times, t in zip(result[name], (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times.append(t / calls)
    print(f"mlx {mx.__version__}, {calls} calls per eval, {args.repeats} repeats, per call:")
    for name, (build, submit, wait) in result.items():
        print(
            f"  {name:<35} build {fmt(build, 1e6, ' us')}  submit {fmt(submit, 1e6, ' us')}"
            f"  wait {fmt(wait, 1e6, ' us')}"
        )


if __name__ == "__main__":
    main()
