"""Host cost of one decode step's graph build, on any machine: the 8B model's attention shape
(32 layers, 32 query / 8 KV heads, head_dim 128) with small projections, fp16 `KVCache`
against fused VecInfer caches of the default layout, the GPU kernels replaced by a stub that
returns zeros of the right shapes (so the numbers are Python and MLX op construction, not
kernels). Interleaved repeats, median [min, max] per layer: the attention call (cache update
and attention) and the whole step; then the two host functions of a fused layer step alone
(`attention_inputs`, `launch_attention`; best of 5 x 2000 calls), and `veloxquant.kernels.launch`
against the same stubbed kernel called directly. `--kivi` adds fused KIVI-2 and a mixed
2/4-bit RateQuant allocation (their launches stubbed the same way). With `--baseline`, another
revision's veloxquant/methods/vecinfer/kernels.py runs beside this tree's (a third arm on the
same caches, as ab_kernel_revisions.py does). With `--model-rope`, fused caches of their own
whose steps take the model's rotation (`kernels.ROPE_IN_KERNEL` off, the model's rope modules
untapped): the default arm's tapped rope hands its rows on unrotated and builds no rope op. The
fp16 arm runs on the untapped model. With `--calls`, cProfile's count of function calls per layer
step for each arm: a count, the same however loaded the machine is, for an A/B of host work
between two checkouts (run this file in each).

    git show 68321b7:veloxquant/methods/vecinfer/kernels.py > /tmp/base_kernels.py
    python benchmarks/bench_host_build.py --repeats 30 --baseline /tmp/base_kernels.py
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm.models.llama as llama
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

import veloxquant.kernels as vk
from veloxquant import rope
from _common import fmt

CONFIG = Path(__file__).parent / "configs" / "llama3-8b.json"


# The stubbed launches' inputs, kept until the step is evaluated, as a real kernel's outputs
# keep them: otherwise the model's local was the last reference to the layer's query graph,
# and its teardown (about 10 us per layer on this CPU) counted against the fused arms.
HELD: list[list[mx.array]] = []


def stub_kernel(*, name, **_):
    def call(**kw):
        HELD.append(kw["inputs"])
        return [
            mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)
        ]

    return call


def step_calls(model, caches, token, fp16: bool, steps: int = 10) -> tuple[float, float]:
    """cProfile's count of function calls (Python's and C's) per layer of a decode step's graph
    build: all of them, and those in veloxquant's own files."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    for _ in range(steps):
        profile.enable()
        out = model(token, cache=caches)
        profile.disable()
        mx.eval(out if fp16 else [c.state for c in caches])
        HELD.clear()
    stats = pstats.Stats(profile).stats
    ours = sum(v[1] for k, v in stats.items() if "/veloxquant/" in k[0])
    total = sum(v[1] for v in stats.values())
    per = steps * len(caches)
    return total / per, ours / per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--baseline", help="a kernels.py of another revision, as a third arm")
    p.add_argument("--kivi", action="store_true", help="also fused KIVI-2 and mixed 2/4 caches")
    p.add_argument("--model-rope", action="store_true", help="an arm with the model's RoPE")
    p.add_argument("--calls", action="store_true", help="also Python function calls per layer step")
    args = p.parse_args()
    import veloxquant.methods.kivi.kernels as kivi_kernels
    import veloxquant.methods.vecinfer as vecinfer

    vk.backend = kivi_kernels.backend = lambda: "cuda"  # the fused paths' host code, stubbed
    # an H100 / H200's splits, with or without a driver
    vk.cuda_multiprocessors = lambda: vk.TIMED_CARD_MULTIPROCESSORS
    vk.cuda_shared_memory = lambda: vk.TIMED_CARD_SHARED_MEMORY
    mx.fast.cuda_kernel = stub_kernel
    from ab_kernel_revisions import load_baseline
    from bench_generate import default_layout_caches

    config = json.loads(CONFIG.read_text())
    config.update(hidden_size=1024, intermediate_size=1024, vocab_size=1000)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    fp = [KVCache() for _ in model.layers]
    for c in fp:
        x = mx.zeros((1, 8, args.context, 128), mx.bfloat16)
        c.update_and_fetch(x, x)
    vq = default_layout_caches(model, args.context)  # taps the model's rope modules
    current = vecinfer.kernels
    arms = {"fp16": (fp, current), "vecinfer": (vq, current)}
    if args.model_rope:
        arms["model_rope"] = (default_layout_caches(model, args.context), current)
    if args.baseline:  # the cache looks its kernels module up on the package at every call
        arms["baseline"] = (vq, load_baseline(args.baseline))
    if args.kivi:
        from bench_kivi_decode import CONFIGS, fused_copy
        from bench_vecinfer import filled_caches

        for name, config in CONFIGS.items():
            arms[name] = (fused_copy(filled_caches(model, config, args.context)), current)

    attention_time = [0.0]
    original = llama.Attention.__call__

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = original(self, *a, **kw)
        attention_time[0] += time.perf_counter() - t
        return out

    llama.Attention.__call__ = timed
    token = mx.array([[42]])
    result = {name: ([], []) for name in arms}
    for r in range(args.repeats + 3):
        names = list(arms)
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotating order
            caches, kernels = arms[name]
            vecinfer.kernels = kernels
            current.ROPE_IN_KERNEL = name != "model_rope"
            (rope.untap if name in ("fp16", "model_rope") else rope.tap)(model)
            attention_time[0] = 0.0
            t = time.perf_counter()
            out = model(token, cache=caches)
            step = time.perf_counter() - t
            if r >= 3:  # warm-up
                result[name][0].append(attention_time[0] / len(caches))
                result[name][1].append(step / len(caches))
            # the fused arms' outputs are stub zeros: evaluate their state, not 8B work
            mx.eval(out if name == "fp16" else [c.state for c in caches])
            HELD.clear()
    llama.Attention.__call__ = original
    print(f"mlx {mx.__version__}, {args.context}-token context, per layer:")
    for name, (att, step) in result.items():
        print(f"  {name:<8} attention {fmt(att, 1e6, ' us')}  whole step {fmt(step, 1e6, ' us')}")
    if args.calls:  # a count, not a time: the same on any machine, however loaded
        for name, (caches, kernels) in arms.items():
            vecinfer.kernels = kernels
            current.ROPE_IN_KERNEL = name != "model_rope"
            (rope.untap if name in ("fp16", "model_rope") else rope.tap)(model)
            total, ours = step_calls(model, caches, token, name == "fp16")
            print(f"  {name:<8} Python function calls per layer step: {total:.1f}, of which in "
                  f"veloxquant {ours:.1f}")  # fmt: skip
    vecinfer.kernels = current
    current.ROPE_IN_KERNEL = True

    from bench_kernels import decode_inputs

    (cache,), (q,), (pending,) = decode_inputs(args.context, 1, 1, 8, 4, 128)

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=2000, repeat=5)) / 2000

    for name, (_, kernels) in arms.items():
        if name not in ("vecinfer", "baseline"):
            continue
        inputs = kernels.attention_inputs(cache, q, 0.1, pending)
        t_in = best(lambda k=kernels: k.attention_inputs(cache, q, 0.1, pending))
        t_launch = best(lambda k=kernels, a=inputs: k.launch_attention(a, q))
        print(
            f"  {name:<8} attention_inputs {t_in * 1e6:.2f} us  launch_attention "
            f"{t_launch * 1e6:.2f} us ({len(inputs['sources'])} stubbed launches)"
        )
    # launch()'s own cost: the partial kernel through it against the same stub called directly
    a = current.attention_inputs(cache, q, 0.1, pending, one_launch=False)
    src, ins, outs = a["sources"][0], a["partial"], [(8,)] * 3
    stub = vk.compiled(src, tuple(str(x.dtype) for x in ins))
    t_wrapped = best(lambda: vk.launch(src, ins, a["groups"], outs, [mx.float32] * 3))
    t_direct = best(
        lambda: stub(
            inputs=ins, grid=(128, 1, 1), threadgroup=(128, 1, 1), output_shapes=outs,
            output_dtypes=[mx.float32] * 3,
        )
    )  # fmt: skip
    print(f"  launch() {t_wrapped * 1e6:.2f} us, the stub called directly {t_direct * 1e6:.2f} us")


if __name__ == "__main__":
    main()
