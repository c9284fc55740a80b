"""In-process A/B of VecInfer's decode kernels at two revisions: this tree's
`veloxquant/methods/vecinfer/kernels.py` against a baseline copy of that file.

    git show HEAD~1:veloxquant/methods/vecinfer/kernels.py > /tmp/base_kernels.py
    python benchmarks/ab_kernel_revisions.py --baseline /tmp/base_kernels.py \
        --contexts 16384 65536 131072
    python benchmarks/ab_kernel_revisions.py --baseline /tmp/base_kernels.py \
        --random-weights benchmarks/configs/llama3-8b.json --contexts 16384 65536

Without `--random-weights`, one layer at a time on the same synthetic caches (the 8B layer
shape and default layout of bench_kernels.py): the largest difference between the two outputs,
then wall time per layer (32 calls per eval, interleaved repeats, median [min, max]). At these
sizes that wall time is mostly launch cost on MLX's CUDA backend; each kernel's own GPU time
comes from a profiler, with `--calls` so that it sees only a few launches of each:

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        -k regex:attn_partial python benchmarks/ab_kernel_revisions.py --baseline ... --calls 3

With `--steps`, each call is a whole fused decode step of a cache whose window is full
(`update_and_fetch` + `fused_attention`: on CUDA one launch, which also encodes the token
leaving the window and writes the cache in place; else the partial launch, then the combine
that does), each revision on its own cache set built from the same seeds; it prints the largest
output difference and whether the two wrote the same codes and window, after one step and
again after the timed steps, then the timings. Profile every launch with `-k regex:attn_`.

With `--random-weights`, tokens/s through mlx-lm's `generate_step`: fp16 `KVCache`, VecInfer
fused with this tree's kernels and with the baseline's, the two VecInfer arms on one cache set.
The baseline file must keep this tree's function names (it is imported as a module of its own).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

import veloxquant.methods.vecinfer as vecinfer
from veloxquant.methods.vecinfer import kernels as current
from _common import fmt
from bench_kernels import time_arms


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def switch(module, caches) -> None:
    """Make `module` the kernels of `caches`: a cache memoises its layout and launch constants
    by the revision that built them (`_kernel_memo`), and another revision's may lack a key."""
    vecinfer.kernels = module
    for c in caches:
        if c.__dict__.get("_ab_revision") is not module:
            c.__dict__.pop("_kernel_memo", None)
            c._ab_revision = module


def kernel_ab(args, baseline) -> None:
    from bench_kernels import decode_inputs

    h, g, d, layers, sets = 8, 4, 128, 32, 4
    scale = 1 / math.sqrt(d)
    revisions = {"baseline": baseline, "this tree": current}
    for n in args.contexts:
        caches, qs, pend = decode_inputs(n, sets, layers, h, g, d)
        outs = {}
        for name, K in revisions.items():
            switch(K, caches)
            outs[name] = K.decode_attention(caches[0], qs[0], scale, pend[0])[0]
            partial = K.attention_kernel_sources(K.layout_of(caches[0], h * g), mx.bfloat16)[0]
            print(f"context {n}: {name} partial kernel {partial.kernel_name}")
        a, b = (outs[k].astype(mx.float32) for k in revisions)
        print(
            f"context {n}: max |this tree - baseline| {mx.abs(a - b).max().item():.3g}"
            f" (max |output| {mx.abs(a).max().item():.3g})"
        )
        if args.twin:  # each revision against this tree's pure-MLX twin (float32)
            ref = current.reference_attention(caches[0], qs[0], scale, None, pend[0])
            for name, out in outs.items():
                err = mx.abs(out.astype(mx.float32) - ref).max().item()
                print(f"context {n}: max |{name} - twin| {err:.3g}")
        if args.calls:
            for K in revisions.values():
                switch(K, caches)
                for _ in range(args.calls):
                    mx.eval(K.decode_attention(caches[1], qs[1], scale, pend[1])[0])
            continue

        def arm(K, caches=caches, qs=qs, pend=pend):
            def run():
                switch(K, caches)
                outs = [
                    K.decode_attention(caches[i % sets], qs[i], scale, pend[i % sets])[0]
                    for i in range(layers)
                ]
                mx.eval(outs)

            return run

        times = time_arms({k: arm(K) for k, K in revisions.items()}, args.repeats)
        for k, v in times.items():
            print(f"  {k:<9} {fmt([t / layers for t in v], 1e6, ' us')} per layer")
        ratio = [a / b for a, b in zip(times["baseline"], times["this tree"], strict=True)]
        print(f"  baseline / this tree: {fmt(ratio, unit='x')}")


def step_ab(args, baseline) -> None:
    from bench_generate import DEFAULT_SINKS, DEFAULT_WINDOW
    from bench_kernels import rope_for, synthetic_cache

    h, g, d, layers, sets = 8, 4, 128, 32, 4
    scale = 1 / math.sqrt(d)
    revisions = {"baseline": baseline, "this tree": current}
    for n in args.contexts:
        caches = {}
        for name in revisions:
            caches[name] = []
            for i in range(sets):
                c = synthetic_cache(
                    h, d, n - DEFAULT_SINKS - DEFAULT_WINDOW, rope=rope_for(d), seed=i,
                    value=(8, 4), shared_value_books=True, window=DEFAULT_WINDOW,
                    sinks=DEFAULT_SINKS,
                )  # fmt: skip
                c.fused = True
                caches[name].append(c)
        mx.random.seed(1)
        qs = [(mx.random.normal((1, h * g, 1, d)) * 2).astype(mx.bfloat16) for _ in range(layers)]
        news = [mx.random.normal((2, 1, h, 1, d)).astype(mx.bfloat16) for _ in range(layers)]
        mx.eval(qs, news, [c.state for cs in caches.values() for c in cs])

        def arm(name, n_layers=layers, caches=caches, qs=qs, news=news):
            def run():
                switch(revisions[name], caches[name])
                outs = []
                for i in range(n_layers):
                    c = caches[name][i % sets]
                    c.update_and_fetch(news[i][0], news[i][1])
                    outs.append(c.fused_attention(qs[i], scale))
                mx.eval(outs)
                return outs

            return run

        def compare(when: str, arm=arm, caches=caches, n=n) -> None:
            step = {name: arm(name, sets)() for name in revisions}  # one step of each cache
            diff = max(
                mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                for a, b in zip(step["baseline"], step["this tree"], strict=True)
            )
            same = all(
                mx.array_equal(a._kbuf, b._kbuf).item()
                and mx.array_equal(a._vbuf, b._vbuf).item()
                and mx.array_equal(a._wk, b._wk).item()
                and mx.array_equal(a._wv, b._wv).item()
                for a, b in zip(caches["baseline"], caches["this tree"], strict=True)
            )
            paths = {c.last_attention for cs in caches.values() for c in cs}
            steps = caches["this tree"][0].compressed_tokens - (n - DEFAULT_SINKS - DEFAULT_WINDOW)
            print(
                f"context {n}, {when} ({steps} steps per cache): max |this tree - baseline| "
                f"{diff:.3g}, same codes and window written: {same}, attention {paths}"
            )

        compare("one step")
        if args.calls:
            for name in revisions:
                for _ in range(args.calls):
                    arm(name, 1)()
            continue
        times = time_arms({name: arm(name) for name in revisions}, args.repeats)
        # the caches took the same steps in lockstep: they must still agree
        compare("after the timed steps")
        vecinfer.kernels = current
        for k, v in times.items():
            print(f"  {k:<9} {fmt([t / layers for t in v], 1e6, ' us')} per layer step")
        ratio = [a / b for a, b in zip(times["baseline"], times["this tree"], strict=True)]
        print(f"  baseline / this tree: {fmt(ratio, unit='x')}")
    vecinfer.kernels = current


def decode_ab(args, baseline) -> None:
    from _common import random_weights_model
    from bench_generate import fp16_and_fused_caches, interleaved_decode, print_decode

    def use_kernels(module, caches):
        def select():
            switch(module, caches)

        return select

    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    for ctx in args.contexts:
        fp, vq = fp16_and_fused_caches(model, ctx)
        # the cache looks its kernels module up on the package at every call
        arms = {
            "fp16": (fp, use_kernels(current, [])),
            "this tree": (vq, use_kernels(current, vq)),
            "baseline": (vq, use_kernels(baseline, vq)),
        }
        result = interleaved_decode(model, arms, token, args.repeats, args.tokens)
        vecinfer.kernels = current
        print(f"context {ctx}: {args.tokens} tokens, {args.repeats} interleaved repeats")
        print_decode(result)
        del fp, vq, arms
        mx.clear_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline", required=True, help="a kernels.py of another revision")
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536, 131072])
    p.add_argument("--repeats", type=int, default=None, help="default: 15 (kernel), 5 (decode)")
    p.add_argument("--calls", type=int, default=0, help="kernel A/B: only this many calls each")
    p.add_argument("--twin", action="store_true", help="kernel A/B: also each one's error")
    p.add_argument("--steps", action="store_true", help="kernel A/B of whole cache steps")
    p.add_argument("--random-weights", metavar="CONFIG_JSON", help="decode A/B of this model")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    baseline = load_baseline(args.baseline)
    if args.random_weights:
        args.repeats = args.repeats or 5
        decode_ab(args, baseline)
    elif args.steps:
        args.repeats = args.repeats or 15
        step_ab(args, baseline)
    else:
        args.repeats = args.repeats or 15
        kernel_ab(args, baseline)


if __name__ == "__main__":
    main()
