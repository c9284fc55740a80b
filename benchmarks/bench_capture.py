"""Activation-capture cost: time overhead vs a plain forward pass, and peak memory vs budget.

Time: per repeat, the same N x S tokens go through (a) a plain forward pass to logits,
(b) a plain forward pass to the last hidden state (no LM head), (c) `capture_activations`
(including its file writes). Arms are interleaved, in alternating order, and the ratios
capture / plain are reported per repeat as median [min, max]. Goal: <= 1.1x. Capture never
evaluates the LM head or the last layer's tail, so (b) is the fairer denominator.

Memory: each budget runs in a fresh child process, reporting the RSS after loading the model,
the peak RSS during capture (sampled every 2 ms from /proc/self/statm; Linux only; ru_maxrss
is useless here because loading the model peaks higher), MLX's peak memory during capture, and
the bytes of the float16 sample buffers (n * L * (H_q + 3 H_kv) * D * 2). Expect
peak RSS ~ model + transient per-sequence activations + sample buffers, whatever the tokens seen.

    python benchmarks/bench_capture.py --model-dir /tmp/smol --num-seqs 2 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from veloxquant.capture import capture_activations
from veloxquant.model_import import load_model


def make_tokens(vocab: int, num_seqs: int, seq_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (num_seqs, seq_len)).astype(np.int32)


def plain_logits(model, tokens: np.ndarray) -> None:
    for row in tokens:
        mx.eval(model(mx.array(row[None]), cache=make_prompt_cache(model)))


def plain_hidden(model, tokens: np.ndarray) -> None:
    for row in tokens:
        mx.eval(model.model(mx.array(row[None]), cache=make_prompt_cache(model)))


def bench_time(args) -> None:
    model, _ = load_model(args.model_dir)
    tokens = make_tokens(model.args.vocab_size, args.num_seqs, args.seq_len, args.seed)

    def capture() -> None:
        with tempfile.TemporaryDirectory() as d:
            capture_activations(model, tokens, d, args.budget, seed=args.seed, progress=False)

    arms = {
        "logits": lambda: plain_logits(model, tokens),
        "hidden": lambda: plain_hidden(model, tokens),
        "capture": capture,
    }
    for fn in arms.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.repeats):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            t0 = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - t0)

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"

    print(
        f"time: {args.num_seqs} x {args.seq_len} tokens, budget {args.budget}, "
        f"{args.repeats} interleaved repeats; seconds median [min, max]"
    )
    for name, xs in times.items():
        print(f"  {name:8s} {fmt(xs)} s")
    for base in ("logits", "hidden"):
        ratios = [c / b for c, b in zip(times["capture"], times[base], strict=True)]
        print(f"  capture / plain-{base}: {fmt(ratios)}x  (goal <= 1.1x)")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(args) -> None:
    """One budget in this fresh process; prints a JSON line."""
    model, _ = load_model(args.model_dir)
    mx.eval(model.parameters())
    rss_model = rss_mb()
    tokens = make_tokens(model.args.vocab_size, args.num_seqs, args.seq_len, args.seed)
    peak, done = [rss_model], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    mx.reset_peak_memory()
    with tempfile.TemporaryDirectory() as d:
        info = capture_activations(
            model, tokens, d, args.memory_child, seed=args.seed, progress=False
        )
    done.set()
    sampler.join()
    rss_after = max(peak[0], rss_mb())
    n, shapes = info["n_sampled"], info["shapes"].values()
    buffer_mb = n * info["num_layers"] * sum(h * d for h, d in shapes) * 2 / 2**20
    print(
        json.dumps(
            {
                "budget": args.memory_child,
                "tokens_seen": info["tokens_seen"],
                "n_sampled": n,
                "rss_model_mb": rss_model,
                "peak_rss_capture_mb": rss_after,
                "mlx_peak_mb": mx.get_peak_memory() / 2**20,
                "buffers_mb": buffer_mb,
            }
        )
    )


def bench_memory(args) -> None:
    print(f"memory: {args.num_seqs} x {args.seq_len} = {args.num_seqs * args.seq_len} tokens seen")
    for budget in (args.budget, args.large_budget):
        cmd = [
            sys.executable,
            __file__,
            "--model-dir",
            args.model_dir,
            "--num-seqs",
            str(args.num_seqs),
            "--seq-len",
            str(args.seq_len),
            "--seed",
            str(args.seed),
            "--memory-child",
            str(budget),
        ]
        r = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        grow = r["peak_rss_capture_mb"] - r["rss_model_mb"]
        print(
            f"  budget {r['budget']:>7d} (n={r['n_sampled']}): RSS model "
            f"{r['rss_model_mb']:.0f} MB, peak during capture {r['peak_rss_capture_mb']:.0f} MB "
            f"(+{grow:.0f}); sample buffers "
            f"{r['buffers_mb']:.1f} MB; mlx peak during capture {r['mlx_peak_mb']:.0f} MB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="an imported mlx-lm model dir")
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=64, help="small token budget")
    p.add_argument("--large-budget", type=int, default=1 << 20, help="memory arm (capped at N*S)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child is not None:
        return memory_child(args)
    if not args.skip_time:
        bench_time(args)
    if not args.skip_memory:
        bench_memory(args)


if __name__ == "__main__":
    main()
