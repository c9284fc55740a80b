"""The README's two tables of the `full` experiment, from its metrics files: one Markdown table
per model, rows grouped as the README groups them (ppl / fp16, KL, top-1, resident bits per
element; several rows of a group joined by " / ").

    python benchmarks/full_tables.py benchmarks/results/full/smollm2-135m-metrics.json \
        benchmarks/results/full/smollm2-135m-kvbias-metrics.json
"""

from __future__ import annotations

import json
import sys

GROUPS = [
    ("mlx-q8 / q4 / q2", ["mlx-q8", "mlx-q4", "mlx-q2"]),
    ("vecinfer (default) / uncalibrated", ["vecinfer", "vecinfer-uncalibrated"]),
    (
        "vecinfer nocenter / novaluesmooth / nosmooth",
        ["vecinfer-nocenter", "vecinfer-novaluesmooth", "vecinfer-nosmooth"],
    ),
    (
        "vecinfer nohadamard / layershared / d4b8 / paper",
        ["vecinfer-nohadamard", "vecinfer-layershared", "vecinfer-d4b8", "vecinfer-paper"],
    ),
    (
        "vecinfer headvalues (window 20) / values1.5bit (the previous default)",
        ["vecinfer-headvalues", "vecinfer-values1.5bit"],
    ),
    (
        "commvq 2-bit / 1-bit (window 8) / 2-bit uncalibrated",
        ["commvq-2bit", "commvq-1bit", "commvq-2bit-uncalibrated"],
    ),
    ("commvq 2-bit, the paper's free θ per stage (fp16, per KV head)", ["commvq-2bit-paper"]),
    ("kivi 2 / 3 / 4", ["kivi-2", "kivi-3", "kivi-4"]),
    (
        "ratequant b̄=2: Fisher / uniform / proxy",
        ["ratequant-2", "ratequant-2-uniform", "ratequant-2-proxy"],
    ),
    ("ratequant b̄=2.5", ["ratequant-2.5", "ratequant-2.5-uniform", "ratequant-2.5-proxy"]),
    ("ratequant b̄=3", ["ratequant-3", "ratequant-3-uniform", "ratequant-3-proxy"]),
    ("ratequant b̄=4", ["ratequant-4", "ratequant-4-uniform", "ratequant-4-proxy"]),
    ("ratequant b̄=2.5 without the stream response", ["ratequant-2.5-noresponse"]),
    ("qfilters 12.5% / 25% / 50%", ["qfilters-12.5%", "qfilters-25%", "qfilters-50%"]),
    (
        "qfilters uncalibrated",
        ["qfilters-12.5%-uncalibrated", "qfilters-25%-uncalibrated", "qfilters-50%-uncalibrated"],
    ),
    ("streamingllm", ["streamingllm-12.5%", "streamingllm-25%", "streamingllm-50%"]),
    ("knorm", ["knorm-12.5%", "knorm-25%", "knorm-50%"]),
]
COLUMNS = [("ppl_ratio", "{:.3f}"), ("kl", "{:.3f}"), ("top1", "{:.3f}")]
COLUMNS.append(("kv_bits_per_element", "{:.2f}"))


def table(metrics: dict) -> str:
    lines = [
        "| row | ppl / fp16 | KL | top-1 | resident bits/elem |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, rows in GROUPS:
        cells = [" / ".join(fmt.format(metrics[r][key]) for r in rows) for key, fmt in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    for path in sys.argv[1:]:
        metrics = json.loads(open(path).read())
        print(f"{path} (fp16 ppl {metrics['fp16']['ppl']:.2f}):\n\n{table(metrics)}\n")


if __name__ == "__main__":
    main()
