"""VecInfer's quality over k-means seeds with two k-means++ draws: the Gumbel-max categorical
over log D² that kmeans.py used before (kept here for this comparison) and its inverse
cumulative D² draws now. The same distribution (point i with probability D²_i / ΣD²), other
random draws; this shows whether the codebooks' quality moved beyond the seed-to-seed spread.
Default and paper layouts, calibrated on the default pipeline's capture and evaluated as the
evaluate stage does (its windows, prefill and chunk), one JSON line per (seed, init, row).

    python benchmarks/eval_kmeans_init_seeds.py 0 1 2
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import yaml

from veloxquant import kmeans as km
from veloxquant.calibrate import calibrate
from veloxquant.data import load_tokens
from veloxquant.evaluate import evaluate_rows
from veloxquant.model_import import load_model


def gumbel_init(x, k, key, progress, desc):
    """kmeans._init_kmeans_pp before 57d7307."""
    g, n, d = x.shape
    k_sub, k_first, k_steps = mx.random.split(key, 3)
    m = min(n, max(k, km.KMEANS_PP_SAMPLE_PER_CENTROID * k))
    if m < n:
        x = km._init_sample(x, m, k_sub)
    first = mx.random.randint(0, m, shape=(g, 1), key=k_first)
    chosen = [km._gather_rows(x, first)]
    d2 = mx.square(x - chosen[0]).sum(axis=-1)
    step_keys = mx.random.split(k_steps, max(k - 1, 1))
    for i in range(1, k):
        logits = mx.log(mx.maximum(d2, 1e-30))
        idx = mx.random.categorical(logits, axis=-1, key=step_keys[i - 1])[:, None]
        c = km._gather_rows(x, idx)
        chosen.append(c)
        d2 = mx.minimum(d2, mx.square(x - c).sum(axis=-1))
        if i % 16 == 0:
            mx.eval(d2, chosen)
    return mx.concatenate(chosen, axis=1)


def main() -> None:
    new_init = km._init_kmeans_pp
    art = Path("artifacts/smollm2-135m")
    params = yaml.safe_load(Path("params.yaml").read_text())
    hp = {k: v for k, v in params["method"]["vecinfer"].items() if k != "variants"}
    paper = {**hp, **params["method"]["vecinfer"]["variants"]["paper"]}
    e = params["eval"]
    model, _ = load_model(art / "model")
    windows = load_tokens(art / "data" / "eval.safetensors")[: e["windows"]]
    out = []
    for seed in map(int, sys.argv[1:]):
        for name, init in (("gumbel", gumbel_init), ("cdf", new_init)):
            km._init_kmeans_pp = init
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                for tag, h in (("default", hp), ("paper", paper)):
                    calibrate(
                        "vecinfer",
                        art / "activations",
                        art / "model",
                        Path(tmp) / tag,
                        data_json=art / "data" / "data.json",
                        progress=False,
                        **{**h, "seed": seed},
                    )
                rows = [
                    {
                        "name": "vecinfer",
                        "method": "vecinfer",
                        "artifact_dir": str(Path(tmp) / "default"),
                    },
                    {
                        "name": "vecinfer-paper",
                        "method": "vecinfer",
                        "artifact_dir": str(Path(tmp) / "paper"),
                        "window": 48,
                    },
                ]
                res = evaluate_rows(model, windows, rows, prefill=e["prefill"], chunk=e["chunk"])
                for r in res:
                    if r["name"].startswith("vecinfer"):
                        rec = {
                            "seed": seed,
                            "init": name,
                            "row": r["name"],
                            "kl": r["kl"],
                            "ppl_ratio": r["ppl_ratio"],
                            "top1": r["top1"],
                        }
                        out.append(rec)
                        print(json.dumps(rec), f"{time.time() - t0:.0f}s", flush=True)
    for row in ("vecinfer", "vecinfer-paper"):
        for name in ("gumbel", "cdf"):
            got = [r for r in out if r["row"] == row and r["init"] == name]
            means = {k: statistics.mean(r[k] for r in got) for k in ("kl", "ppl_ratio", "top1")}
            print(
                f"{row:<15} {name:<7} mean over seeds: "
                + "  ".join(f"{k} {v:.4f}" for k, v in means.items())
            )


if __name__ == "__main__":
    main()
