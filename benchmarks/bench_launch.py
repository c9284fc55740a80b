"""What one decode step's small GPU operations cost, per call, with `--calls` calls per
evaluation (so a sync is amortised as it is over a model's layers): a trivial custom kernel on
prebuilt inputs, the same with a parameter array made from a Python list per call, and with one
derived on the device from a resident array; a slice update into a large code buffer; the
VecInfer encode of one token (prebuilt inputs and as the cache calls it); bf16 SDPA at 4K.
Interleaved repeats, median [min, max] per call.

    python benchmarks/bench_launch.py      # MLX on CUDA only (the probe kernel is CUDA source)
"""

from __future__ import annotations

import argparse
import time

import veloxquant  # noqa: F401
import mlx.core as mx

from _common import fmt
from bench_kernels import rope_for, synthetic_cache
from veloxquant.methods.vecinfer import kernels as K

SOURCE = """
  unsigned int i = threadIdx.x + blockIdx.x * blockDim.x;
  if (i < 8) out[i] = x[i] + (float)p[i];
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    n = args.calls
    kern = mx.fast.cuda_kernel(
        name="vq_trivial", input_names=["x", "p"], output_names=["out"], source=SOURCE
    )
    xs = [mx.random.normal((8,)) for _ in range(n)]
    p0 = mx.zeros((8,), mx.int32)
    step = mx.ones((8,), mx.int32)
    mx.eval(xs, p0, step)

    def run(x, p):
        return kern(
            inputs=[x, p],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(8,)],
            output_dtypes=[mx.float32],
        )[0]

    def prebuilt():
        mx.eval([run(xs[i], p0) for i in range(n)])

    def from_list():
        mx.eval([run(xs[i], mx.array([i] * 8, mx.int32)) for i in range(n)])

    def on_device():
        mx.eval([run(xs[i], p0 + step * i) for i in range(n)])

    buf = mx.zeros((1, 8, 65536, 48), mx.uint8)
    row = mx.ones((1, 8, 1, 48), mx.uint8)
    mx.eval(buf, row)
    state = {"buf": buf}

    def slice_update():
        b = state["buf"]
        for i in range(n):
            b[:, :, 1000 + i : 1001 + i] = row
        mx.eval(b)
        state["buf"] = b

    cache = synthetic_cache(8, 128, 1024, rope=rope_for(128))
    one = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    mx.eval(one)
    built = K.encode_inputs(cache, one, one, 0, 1, 5000)
    mx.eval(built)
    lay = K.layout_of(cache, 8)
    src = K.encode_kernel_source(lay)

    def encode_prebuilt():
        from veloxquant.kernels import launch

        mx.eval(
            [
                launch(
                    src,
                    built,
                    (1, 8, 1),
                    [(1, 8, 1, lay.key_bytes), (1, 8, 1, lay.value_bytes)],
                    [mx.uint8, mx.uint8],
                )
                for _ in range(n)
            ]
        )

    def encode_cache():
        mx.eval([K.encode(cache, one, one, 0, 1, 5000 + i) for i in range(n)])

    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    kv = [mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16) for _ in range(2)]
    mx.eval(q, kv)

    def sdpa():
        mx.eval(
            [mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=0.08) for _ in range(n)]
        )

    arms = {
        "trivial kernel, prebuilt": prebuilt,
        "trivial kernel, mx.array(list)": from_list,
        "trivial kernel, device-derived": on_device,
        "slice update into 64K buffer": slice_update,
        "encode 1 token, prebuilt": encode_prebuilt,
        "encode 1 token, as cached": encode_cache,
        "sdpa bf16 4K": sdpa,
    }
    for f in arms.values():
        f()
        f()
    times = {k: [] for k in arms}
    names = list(arms)
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            arms[k]()
            times[k].append((time.perf_counter() - t0) / n)
    print(
        f"mlx {mx.__version__}, {n} calls per eval, {args.repeats} interleaved repeats, per call:"
    )
    for k in names:
        print(f"  {k:<34} {fmt(times[k], 1e6, ' us')}")


if __name__ == "__main__":
    main()
