"""Baseline KV caches on held-out text: fp16 KVCache vs mlx-lm QuantizedKVCache 8/4/2 bits.

Quality (ppl after prefill and overall, KL(fp16 || row), top-1 agreement) and resident KV bits
per element, on the first `--windows` windows of the default eval split (pydoc topics, split by
topic with eval_fraction 0.1, seed 0), fed as generation feeds them: `--prefill` tokens in one
call, then `--chunk`-token calls through the cache.

    python benchmarks/eval_baselines.py --model-dir /tmp/smol
    python benchmarks/eval_baselines.py            # imports the embedded default model first

Writes metrics.json, results.csv and quality_vs_bits.png to --out and prints a table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)

from veloxquant.data import load_tokens, prepare_data
from veloxquant.evaluate import evaluate_rows, plot_quality_vs_bits, write_csv, write_metrics
from veloxquant.model_import import import_model, load_model

ROWS = [
    {"name": "fp16", "method": "fp16"},
    {"name": "quantized-8b-g64", "method": "quantized", "bits": 8, "group_size": 64},
    {"name": "quantized-4b-g64", "method": "quantized", "bits": 4, "group_size": 64},
    {"name": "quantized-2b-g64", "method": "quantized", "bits": 2, "group_size": 64},
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="imported model dir (default: import the embedded SmolLM2 into --out)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/eval_baselines"))
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = args.out / "model"
        if not (model_dir / "config.json").is_file():
            import_model("default", model_dir)
    model, tokenizer = load_model(model_dir)

    data_dir = args.out / "data"
    info = prepare_data(
        tokenizer,
        {"kind": "pydoc_topics"},
        data_dir,
        seq_len=args.seq_len,
        calib_windows=1,
        eval_windows=args.windows,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
    )
    windows = load_tokens(data_dir / "eval.safetensors")

    start = time.perf_counter()
    results = evaluate_rows(model, windows, ROWS, prefill=args.prefill, chunk=args.chunk)
    elapsed = time.perf_counter() - start

    write_metrics(results, args.out / "metrics.json")
    write_csv(results, args.out / "results.csv")
    plot_quality_vs_bits(results, args.out / "quality_vs_bits.png")

    print(
        f"model {model_dir}; eval data sha256 {info['eval']['sha256'][:16]} "
        f"({windows.shape[0]} x {windows.shape[1]} tokens, "
        f"topics {info['split']['eval_topics']})"
    )
    print(f"prefill {args.prefill} in one call, then chunks of {args.chunk}; {elapsed:.0f} s")
    header = (
        f"{'row':<18} {'ppl':>8} {'ppl_all':>8} {'ppl/fp16':>8} {'KL':>9} {'top1':>6} "
        f"{'KV MiB':>7} {'bits/el':>7}"
    )
    print(header)
    for r in results:
        print(
            f"{r['name']:<18} {r['ppl']:8.3f} {r['ppl_all']:8.3f} {r['ppl_ratio']:8.4f} "
            f"{r['kl']:9.5f} {r['top1']:6.3f} {r['kv_bytes'] / 2**20:7.2f} "
            f"{r['kv_bits_per_element']:7.2f}"
        )


if __name__ == "__main__":
    main()
