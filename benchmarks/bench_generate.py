"""Decode throughput as mlx-lm's generator sees it: tokens/s of `generate_step` (which overlaps
building step n+1's graph with the GPU running step n) on a pre-filled cache, fp16 `KVCache`
against the fused VecInfer caches of the default calibrated layout, plus where a step's time goes.

The VecInfer arm is `default_layout_caches`: the default bundle's layout (d2b6 keys per KV head
coded around a RoPE-rotated mean, d4b8 layer-shared values with scales and a mean, 4 sinks, a
26-token window in the model's dtype) holding random codes, so the partial kernel does the RoPE
phase work a real bundle makes it do. Timing does not depend on the codebook values.

For each context and arm:
- tok/s over `--tokens` generated tokens after the first, interleaved over `--repeats` (median
  [min, max]), and the ratio to fp16 per repeat;
- one synchronous step split three ways: the host graph build (`model(token, cache)`), the host
  submission (`mx.async_eval`: MLX encodes every kernel of the step on the calling thread) and
  the wait for the GPU. When build + submit approaches the step, decode is bound by the host,
  not by the GPU, and generate_step's overlap cannot help;
- peak memory of the filled cache and the step.

With `--bounds`, four more VecInfer arms on caches of their own: `two_launches`, the partial and
the combine as separate launches (`kernels.ONE_LAUNCH` off; where MLX runs on CUDA a step's
layer is otherwise one launch), `inline_source`, MLX holding each kernel's whole source rather
than an #include of it (`veloxquant.kernels.CUDA_SOURCE_FILES` off), and two whose outputs are
wrong and whose times are bounds:
`no_combine` skips the combine (two-launch inputs, the partial's output, cast, standing in for
the attention) and `no_attention` skips the attention (the query stands in for it; the model's
step without attention, which no cache can beat). On the CPU fused caches take the pure-MLX
twin, which none of the swaps touches.

With `--cuda-cores`, one more: `vecinfer_cuda_cores`, the one-launch kernel with its coded
tokens on the CUDA cores (`kernels.MMA` off; the default puts them on the tensor cores).

With `--model-rope`, one more: `vecinfer_model_rope`, the decode step's query and key rotated by
the model's own rope launches (`kernels.ROPE_IN_KERNEL` off, the model's rope modules untapped)
instead of inside the attention launch. The fp16 arm always runs on the untapped model.

With `--waits`, each arm's decode loop once more per round with timers (`pipelined_split`):
per token, the host's build and submission of the next step and its wait for the current one.

With `--profile`, cProfile of the host graph build of a few fused steps (top functions by own
time).

    python benchmarks/bench_generate.py --random-weights benchmarks/configs/llama3-8b.json \
        --dtype bfloat16 --contexts 4096 16384 65536 131072
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import veloxquant.kernels  # preloads OpenBLAS before mlx (import veloxquant)
import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

from veloxquant import attention
from veloxquant import rope as rope_tap
from veloxquant.methods.vecinfer.cache import DEFAULT_SINKS, DEFAULT_WINDOW, window_dtype
from veloxquant.rope import RopeSpec
from _common import fmt, model_dtype, random_weights_model
from bench_kernels import synthetic_cache
from bench_vecinfer import filled_caches


def tokens_per_second(model, caches, n_tokens: int) -> float:
    gen = generate_step(mx.array([42]), model, prompt_cache=caches, max_tokens=n_tokens + 1)
    next(gen)  # the prompt token's step: prefill path, not decode
    t0 = time.perf_counter()
    n = sum(1 for _ in gen)
    return n / (time.perf_counter() - t0)


def pipelined_split(model, caches, n_tokens: int) -> tuple[float, float, float]:
    """generate_step's decode loop (greedy, on its stream) with timers, per token: the host build
    of the next step's graph, its submission (`mx.async_eval`) and the wait for the current
    token (`.item()`). Medians over `n_tokens` (s). A wait well above zero says the GPU set the
    pace: the host had built and submitted step n + 1 while step n still ran. A wait near zero
    does not say the host did: the submission itself waits while too much work is in flight
    (fp16's reads several times its synchronous submission at 64K on an H100)."""

    def step(y):
        with mx.stream(generation_stream):
            logits = model(y[None], cache=caches)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)

    y, logprobs = step(mx.array([42]))
    mx.async_eval(y, logprobs)
    builds, submits, waits = [], [], []
    for _ in range(n_tokens):
        t0 = time.perf_counter()
        next_y, next_logprobs = step(y)
        t1 = time.perf_counter()
        mx.async_eval(next_y, next_logprobs)
        t2 = time.perf_counter()
        y.item()
        waits.append(time.perf_counter() - t2)
        builds.append(t1 - t0)
        submits.append(t2 - t1)
        y = next_y
    y.item()
    return statistics.median(builds), statistics.median(submits), statistics.median(waits)


def build_and_step(model, caches, token) -> tuple[float, float, float]:
    """One synchronous decode step: (host graph build s, host submission s, whole step s)."""
    t0 = time.perf_counter()
    out = model(token, cache=caches)
    t1 = time.perf_counter()
    mx.async_eval(out)
    t2 = time.perf_counter()
    mx.eval(out)
    return t1 - t0, t2 - t1, time.perf_counter() - t0


def default_layout_caches(model, n_tokens: int) -> list:
    """Fused VecInfer caches, one per layer, of the default calibrated layout holding `n_tokens`
    tokens (random codes, sinks and window), built without encoding anything: a 128K context
    costs no fill transients."""
    a = model.args
    rope, dtype = RopeSpec.of(model), window_dtype(model_dtype(model))
    n_coded = n_tokens - DEFAULT_SINKS - DEFAULT_WINDOW
    caches = []
    for i in range(len(model.layers)):
        c = synthetic_cache(
            a.num_key_value_heads,
            a.head_dim,
            n_coded,
            rope=rope,
            window=DEFAULT_WINDOW,
            sinks=DEFAULT_SINKS,
            value=(8, 4),
            shared_value_books=True,
            seed=i,
        )
        c.sink_keys, c.sink_values = c.sink_keys.astype(dtype), c.sink_values.astype(dtype)
        c.window_keys, c.window_values = c.window_keys.astype(dtype), c.window_values.astype(dtype)
        c.fused = True
        caches.append(c)
    mx.eval([c.state for c in caches])
    attention.install()
    if not attention.routes(model):
        raise RuntimeError(f"{type(model).__module__}: attention is not routed to fused caches")
    rope_tap.tap(model)  # as make_cache does for caches with the key mean
    return caches


def fp16_and_fused_caches(model, n_tokens: int) -> tuple[list, list]:
    """fp16 `KVCache`s pre-filled with `n_tokens` random tokens, and `default_layout_caches`."""
    return filled_caches(model, None, n_tokens), default_layout_caches(model, n_tokens)


def interleaved_decode(
    model, arms: dict, token, repeats: int, tokens: int, waits: bool = False
) -> dict:
    """Arms {name: (caches, select)}, where `select()` runs before each of the arm's turns (to set
    a module constant, say): one warm-up step each, then `repeats` rounds in rotating order.
    Returns {name: (tok/s, synchronous step s, host build s, host submit s)}, one value per
    round; with `waits`, a fifth list of `pipelined_split`'s (build, submit, wait) per round."""
    for caches, select in arms.values():  # warm-up: compile, allocate
        select()
        build_and_step(model, caches, token)
    names = list(arms)
    out = {n: ([], [], [], [], []) for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            caches, select = arms[name]
            select()
            out[name][0].append(tokens_per_second(model, caches, tokens))
            if waits:
                mx.synchronize()
                out[name][4].append(pipelined_split(model, caches, tokens))
            # generate_step leaves its look-ahead step in flight: without this wait the
            # submission below queued behind it and counted part of the GPU's time
            mx.synchronize()
            build, submit, step = build_and_step(model, caches, token)
            out[name][1].append(step)
            out[name][2].append(build)
            out[name][3].append(submit)
    return out


def print_decode(result: dict, baseline: str = "fp16") -> None:
    """interleaved_decode's result, one line per arm, then each arm's tok/s over the baseline's."""
    width = max(len(n) for n in result)
    for name, (rates, steps, builds, submits, split) in result.items():
        print(
            f"  {name:<{width}} {fmt(rates, unit=' tok/s')}  step {fmt(steps, 1e3, ' ms')}"
            f"  host build {fmt(builds, 1e3, ' ms')}  submit {fmt(submits, 1e3, ' ms')}"
        )
        if split:
            b, s, w = zip(*split, strict=True)
            print(
                f"  {'':<{width}} pipelined, per token: build {fmt(b, 1e3, ' ms')}  submit "
                f"{fmt(s, 1e3, ' ms')}  wait {fmt(w, 1e3, ' ms')}"
            )
    for name, (rates, *_) in result.items():
        if name != baseline:
            ratio = [a / b for a, b in zip(rates, result[baseline][0], strict=True)]
            print(f"  tok/s {name} / {baseline}: {fmt(ratio, unit='x')}")


def decode_arguments(doc: str, contexts: list[int], repeats: int) -> argparse.ArgumentParser:
    """The arguments every decode-throughput benchmark takes (this one and
    bench_in_place.py): a random-weight model, its dtype, contexts, tokens, repeats."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--random-weights", metavar="CONFIG_JSON", required=True)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--contexts", type=int, nargs="+", default=contexts)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=repeats)
    return p


def partial_only(a: dict, queries: mx.array) -> tuple[mx.array, None]:
    """`kernels.launch_attention` without its second launch: the partial's output stands in."""
    from veloxquant.methods.vecinfer.kernels import launch_partial

    n_q, d = queries.shape[1], queries.shape[3]
    part_o = launch_partial(a, queries)[2]
    return part_o[: n_q * d].reshape(1, n_q, 1, d).astype(queries.dtype), None


def use_kernels(
    model,
    fn=None,
    one_launch: bool = True,
    source_files: bool = True,
    mma: bool = True,
    rope_in: bool = True,
):
    """An arm's select: the attention launches `fn` (default the real ones) with the kernels'
    switches as given, the defaults being the default path; with rope_in, `model`'s rope
    modules tapped (make_cache's default for these caches), without, untapped."""
    from veloxquant.methods.vecinfer import kernels

    real = kernels.launch_attention if fn is None else fn

    def select():
        kernels.launch_attention = real
        kernels.ONE_LAUNCH = one_launch
        kernels.MMA = mma
        kernels.ROPE_IN_KERNEL = rope_in
        veloxquant.kernels.CUDA_SOURCE_FILES = source_files
        (rope_tap.tap if rope_in else rope_tap.untap)(model)

    return select


def bound_arms(model, ctx: int) -> dict:
    """--bounds' arms: {name: (caches, select)}, select swapping the attention launches."""
    arms = {"vecinfer": use_kernels(model), "two_launches": use_kernels(model, one_launch=False)}
    arms["inline_source"] = use_kernels(model, source_files=False)
    arms["no_combine"] = use_kernels(model, partial_only, one_launch=False)
    arms["no_attention"] = use_kernels(model, lambda a, queries: (queries, None))
    return {
        n: (default_layout_caches(model, ctx) if n != "vecinfer" else None, f)
        for n, f in arms.items()
    }


def main() -> None:
    p = decode_arguments(__doc__, contexts=[4096, 16384], repeats=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--bounds", action="store_true", help="arms without the combine / attention")
    p.add_argument("--cuda-cores", action="store_true", help="an arm with kernels.MMA off")
    p.add_argument("--model-rope", action="store_true", help="an arm with the model's RoPE")
    p.add_argument("--waits", action="store_true", help="each arm's pipelined_split too")
    args = p.parse_args()

    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    for ctx in args.contexts:
        # VecInfer first, so that its peak is its own (weights, its caches, the step); fp16's
        # peak then includes the VecInfer caches, whose bytes are printed beside it
        arms, peaks = {}, {}
        builders = (
            ("vecinfer", lambda n=ctx: default_layout_caches(model, n)),
            ("fp16", lambda n=ctx: filled_caches(model, None, n)),
        )
        for name, build in builders:
            mx.clear_cache()
            mx.reset_peak_memory()
            caches = build()
            build_and_step(model, caches, token)
            arms[name], peaks[name] = (caches, lambda: None), mx.get_peak_memory()
        arms = {name: arms[name] for name in ("fp16", "vecinfer")}  # fp16 is the baseline
        arms["fp16"] = (arms["fp16"][0], lambda: rope_tap.untap(model))
        arms["vecinfer"] = (arms["vecinfer"][0], use_kernels(model))
        if args.cuda_cores:
            cuda_cores = (default_layout_caches(model, ctx), use_kernels(model, mma=False))
            arms["vecinfer_cuda_cores"] = cuda_cores
        if args.model_rope:
            model_rope = (default_layout_caches(model, ctx), use_kernels(model, rope_in=False))
            arms["vecinfer_model_rope"] = model_rope
        if args.bounds:
            for name, (caches, select) in bound_arms(model, ctx).items():
                arms[name] = (caches or arms[name][0], select)
        result = interleaved_decode(model, arms, token, args.repeats, args.tokens, args.waits)
        print(f"context {ctx}: {args.tokens} generated tokens, {args.repeats} interleaved repeats")
        print_decode(result)
        kv = {name: sum(c.nbytes for c in caches) for name, (caches, _) in arms.items()}
        arms["vecinfer"][1]()  # the default launches again
        paths = {c.last_attention for c in arms["vecinfer"][0]}
        gib = 2**30
        print(
            f"  KV bytes (from the arrays) fp16 {kv['fp16'] / gib:.2f} GiB, vecinfer "
            f"{kv['vecinfer'] / gib:.2f} GiB ({kv['vecinfer'] / kv['fp16']:.3f}x); peak with "
            f"weights: vecinfer {peaks['vecinfer'] / gib:.2f} GiB, fp16 {peaks['fp16'] / gib:.2f}"
            f" GiB (+ the vecinfer caches); vecinfer attention {paths}"
        )
        if args.profile:
            prof = cProfile.Profile()
            for _ in range(5):  # the host graph build only; evaluation outside the profile
                prof.enable()
                out = model(token, cache=arms["vecinfer"][0])
                prof.disable()
                mx.eval(out)
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        # the last arm built (`caches`) too: kept, it counted in the next context's peaks
        del arms, caches, result
        mx.clear_cache()


if __name__ == "__main__":
    main()
