"""Per-chunk cost of eviction caches against mlx-lm's fp16 KVCache, measured side by side.

Two levels, every arm starting from the same prefilled state for every repeat, arms
interleaved within each repeat (so machine load hits all arms alike):
- cache:  the 30 caches' work alone (update_and_fetch of one chunk + eviction + eval), no model;
- model:  one model forward of a chunk (attention sees fewer keys in the evicting arms, so this
          is the end-to-end ratio a user sees, not just the bookkeeping).
Chunk 64 = chunked prefill / eval harness step; chunk 1 = one decode step. The timed chunk comes
after a prefill and one 64-token chunk (offset prefill + 64).

Reports per-arm time median/min/max and the ratio to fp16 per repeat (median/min/max).
Absolute times on a shared CPU mean little; the ratios are the result.

    python benchmarks/bench_eviction.py [--model /tmp/smol] [--bundle DIR] [--budget 128]
                                        [--prefill 512] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np


from veloxquant import KVCacheConfig, make_cache
from veloxquant.model_import import load_model


def snapshot(caches: list) -> list:
    return [(type(c), c.state) for c in caches]


def restore(snap: list) -> list:
    """Fresh caches with private copies of the snapshot's arrays.

    Sharing the snapshot's arrays would be correct too (mlx arrays are values), but then
    KVCache's in-place slice update could not reuse its buffer and would copy all of it,
    which would make the fp16 arm look slower than it is.
    """

    def own(x):
        return mx.array(np.array(x)) if isinstance(x, mx.array) else x

    caches = [cls.from_state(tuple(own(x) for x in state)) for cls, state in snap]
    mx.eval([c.state for c in caches])
    return caches


def summary(xs: list[float]) -> str:
    return f"median {statistics.median(xs):8.3f}  min {min(xs):8.3f}  max {max(xs):8.3f}"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="/tmp/smol")
    p.add_argument(
        "--bundle", default=None, help="Q-Filters bundle; without it the uncalibrated fallback runs"
    )
    p.add_argument("--budget", type=float, default=128)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    budget = int(args.budget) if args.budget >= 1 else args.budget

    from pydoc_data.topics import topics
    from tqdm import tqdm

    model, tok = load_model(args.model)
    text = "\n\n".join(topics[k] for k in sorted(topics)[-12:])
    ids = np.array(tok.encode(text)[: args.prefill + 128], np.int32)[None]
    prompt = mx.array(ids[:, : args.prefill])
    warm, chunk = (
        mx.array(ids[:, args.prefill : args.prefill + 64]),
        mx.array(ids[:, args.prefill + 64 :]),
    )

    qf = (
        KVCacheConfig(method="qfilters", artifact_dir=args.bundle, budget=budget)
        if args.bundle
        else KVCacheConfig(method="qfilters", uncalibrated=True, budget=budget)
    )
    arms = {
        "fp16": KVCacheConfig(method="fp16"),
        "qfilters" + ("" if args.bundle else "-uncal"): qf,
        "knorm": KVCacheConfig(method="knorm", budget=budget),
        "streamingllm": KVCacheConfig(method="streamingllm", budget=budget),
    }
    snaps = {}
    for name, cfg in arms.items():
        caches = make_cache(model, cfg)
        mx.eval(model(prompt, cache=caches), [c.state for c in caches])
        # one chunk more, so the fp16 KVCache has room (it grows its buffer 256 tokens at a
        # time; timing right at a regrowth would charge fp16 a copy it pays every 4th chunk)
        mx.eval(model(warm, cache=caches), [c.state for c in caches])
        snaps[name] = snapshot(caches)
        print(
            f"{name:<14} at offset {caches[0].offset}: {caches[0].size()} tokens/layer, "
            f"{sum(c.nbytes for c in caches) / 2**20:.2f} MiB resident"
        )

    rng = np.random.default_rng(0)
    H, D = snaps["fp16"][0][1][0].shape[1], snaps["fp16"][0][1][0].shape[3]

    def cache_work(caches: list, n: int) -> None:
        k = mx.array(rng.standard_normal((1, H, n, D)), mx.float32)
        mx.eval(k)
        t = time.perf_counter()
        outs = [c.update_and_fetch(k, k) for c in caches]
        mx.eval(outs, [c.state for c in caches])
        return time.perf_counter() - t

    def model_work(caches: list, n: int) -> float:
        x = chunk[:, :n]
        t = time.perf_counter()
        mx.eval(model(x, cache=caches), [c.state for c in caches])
        return time.perf_counter() - t

    for level, work in (("cache", cache_work), ("model", model_work)):
        for n in (64, 1):
            times = {name: [] for name in arms}
            for r in tqdm(range(args.repeats + 1), desc=f"{level} chunk={n}", leave=False):
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                for name in order:
                    dt = work(restore(snaps[name]), n)
                    if r > 0:  # repeat 0 warms up
                        times[name].append(dt)
            print(
                f"\n{level}-level, chunk {n}, budget {budget}, at offset {args.prefill + 64} "
                f"({args.repeats} interleaved repeats)"
            )
            for name, ts in times.items():
                ms = [1e3 * t for t in ts]
                line = f"  {name:<14} ms {summary(ms)}"
                if name != "fp16":
                    ratios = [a / b for a, b in zip(ts, times["fp16"], strict=True)]
                    line += f"   ratio vs fp16 {summary(ratios)}"
                print(line)


if __name__ == "__main__":
    main()
