"""Decode throughput as mlx-lm's generator sees it: tokens/s of `generate_step` (which overlaps
building step n+1's graph with the GPU running step n) on a pre-filled cache, fp16 `KVCache`
against our caches, plus where a step's time goes.

For each context and arm:
- tok/s over `--tokens` generated tokens after the first, interleaved over `--repeats` (median
  [min, max]), and the ratio to fp16 per repeat;
- host graph-build time of one step (`model(token, cache)` without evaluation) against the whole
  synchronous step: when the build time approaches the step time, decode is bound by Python and
  op dispatch, not by the GPU;
- peak memory of the filled cache and the step.

With `--profile`, cProfile of the host graph build of a few fused steps (top functions by own
time).

    python benchmarks/bench_generate.py --random-weights benchmarks/configs/llama3-8b.json \
        --dtype bfloat16 --contexts 4096 16384 65536 131072
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step

from veloxquant import KVCacheConfig
from _common import fmt, random_weights_model
from bench_vecinfer import filled_caches

ARMS = {
    "fp16": None,
    "vecinfer": KVCacheConfig(method="vecinfer", uncalibrated=True),
}


def tokens_per_second(model, caches, n_tokens: int) -> float:
    gen = generate_step(mx.array([42]), model, prompt_cache=caches, max_tokens=n_tokens + 1)
    next(gen)  # the prompt token's step: prefill path, not decode
    t0 = time.perf_counter()
    n = sum(1 for _ in gen)
    return n / (time.perf_counter() - t0)


def build_and_step(model, caches, token) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = model(token, cache=caches)
    t1 = time.perf_counter()
    mx.eval(out)
    return t1 - t0, time.perf_counter() - t0


def fp16_and_fused_caches(model, n_tokens: int) -> tuple[list, list]:
    """fp16 `KVCache`s and fused uncalibrated VecInfer caches (the default shape; timing does
    not depend on codebook values), both pre-filled with `n_tokens` random tokens."""
    fp = filled_caches(model, None, n_tokens)
    vq = filled_caches(model, ARMS["vecinfer"], n_tokens)
    for c in vq:
        c.fused = True
    return fp, vq


def interleaved_decode(model, arms: dict, token, repeats: int, tokens: int) -> dict:
    """Arms {name: (caches, select)}, where `select()` runs before each of the arm's turns (to set
    a module constant, say): one warm-up step each, then `repeats` rounds in rotating order.
    Returns {name: (tok/s, synchronous step s, host build s)}, one value per round."""
    for caches, select in arms.values():  # warm-up: compile, allocate
        select()
        build_and_step(model, caches, token)
    names = list(arms)
    out = {n: ([], [], []) for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            caches, select = arms[name]
            select()
            out[name][0].append(tokens_per_second(model, caches, tokens))
            b, s = build_and_step(model, caches, token)
            out[name][1].append(s)
            out[name][2].append(b)
    return out


def print_decode(result: dict, baseline: str = "fp16") -> None:
    """interleaved_decode's result, one line per arm, then each arm's tok/s over the baseline's."""
    width = max(len(n) for n in result)
    for name, (rates, steps, builds) in result.items():
        print(
            f"  {name:<{width}} {fmt(rates, unit=' tok/s')}"
            f"  step {fmt(steps, 1e3, ' ms')}  host build {fmt(builds, 1e3, ' ms')}"
        )
    for name, (rates, _, _) in result.items():
        if name != baseline:
            ratio = [a / b for a, b in zip(rates, result[baseline][0], strict=True)]
            print(f"  tok/s {name} / {baseline}: {fmt(ratio, unit='x')}")


def decode_arguments(doc: str, contexts: list[int], repeats: int) -> argparse.ArgumentParser:
    """The arguments every decode-throughput benchmark takes (this one and
    bench_encode_in_combine.py): a random-weight model, its dtype, contexts, tokens, repeats."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--random-weights", metavar="CONFIG_JSON", required=True)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--contexts", type=int, nargs="+", default=contexts)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=repeats)
    return p


def main() -> None:
    p = decode_arguments(__doc__, contexts=[4096, 16384], repeats=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()

    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    for ctx in args.contexts:
        arms = {}
        for name, config in ARMS.items():
            mx.reset_peak_memory()
            arms[name] = filled_caches(model, config, ctx)
            if config is not None:
                for c in arms[name]:
                    c.fused = True
            build_and_step(model, arms[name], token)  # warm-up: compile, allocate
            arms[name + ":peak"] = mx.get_peak_memory()
        names = list(ARMS)
        rates = {n: [] for n in names}
        split = {n: ([], []) for n in names}
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rates[name].append(tokens_per_second(model, arms[name], args.tokens))
                b, s = build_and_step(model, arms[name], token)
                split[name][0].append(b)
                split[name][1].append(s)
        print(f"context {ctx}: {args.tokens} generated tokens, {args.repeats} interleaved repeats")
        for name in names:
            paths = {getattr(c, "last_attention", None) for c in arms[name]}
            print(
                f"  {name:<9} {fmt(rates[name], unit=' tok/s')}"
                f"  step {fmt(split[name][1], 1e3, ' ms')}"
                f"  host build {fmt(split[name][0], 1e3, ' ms')}"
                f"  peak {arms[name + ':peak'] / 2**30:.2f} GiB  attention {paths}"
            )
        for name in names[1:]:
            ratio = [a / b for a, b in zip(rates[name], rates["fp16"], strict=True)]
            print(f"  tok/s {name} / fp16: {fmt(ratio, unit='x')}")
        if args.profile:
            prof = cProfile.Profile()
            for _ in range(5):  # the host graph build only; evaluation outside the profile
                prof.enable()
                out = model(token, cache=arms["vecinfer"])
                prof.disable()
                mx.eval(out)
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        del arms


if __name__ == "__main__":
    main()
