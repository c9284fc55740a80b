"""Eval harness on the real model: one 256-token window, prefill 128, chunks of 32."""

from __future__ import annotations

import csv
import json
import math

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest

from tests import test_contract as contract
from veloxquant.evaluate import evaluate_rows, plot_quality_vs_bits, write_csv, write_metrics

tiny = contract.tiny  # the tiny llama and its bundle with every calibrated method

SEQ_LEN, PREFILL, CHUNK = 256, 128, 32
ROWS = [
    {"name": "fp16", "method": "fp16"},
    {"name": "q8", "method": "quantized", "bits": 8, "group_size": 64},
    {"name": "q4", "method": "quantized", "bits": 4, "group_size": 64},
    {"name": "q2", "method": "quantized", "bits": 2, "group_size": 64},
]


def _rotating(model):
    from mlx_lm.models.cache import RotatingKVCache

    return [RotatingKVCache(max_size=64, keep=4) for _ in model.layers]


@pytest.fixture(scope="module")
def window(smollm2, eval_text) -> np.ndarray:
    _, tokenizer = smollm2
    ids = tokenizer.encode(eval_text)
    assert len(ids) >= SEQ_LEN
    return np.array(ids[:SEQ_LEN], dtype=np.int32)[None]


@pytest.fixture(scope="module")
def results(smollm2, window) -> dict[str, dict]:
    model, _ = smollm2
    # A ready-made list of plain mlx-lm caches works as a row too (sliding window + 4 sinks).
    rows = ROWS + [{"name": "rotating64", "make": _rotating, "window": 64, "sinks": 4}]
    out = evaluate_rows(model, window, rows, prefill=PREFILL, chunk=CHUNK, progress=False)
    assert [r["name"] for r in out] == [r["name"] for r in rows]
    return {r["name"]: r for r in out}


def test_fp16_row_takes_the_reference_numbers_exactly(smollm2, window, results):
    """The fp16 row is not run again: it takes the reference's sums. The same cache run as a
    row of its own (a `make` row is never treated as the reference) gives the same numbers
    bit for bit, and the same resident bytes."""
    from veloxquant.config import KVCacheConfig, make_cache

    model, _ = smollm2
    plain = lambda m: make_cache(m, KVCacheConfig(method="fp16"))  # noqa: E731
    (ran,) = evaluate_rows(
        model, window, [{"name": "fp16-run", "make": plain}], PREFILL, CHUNK, progress=False
    )
    for key in ("ppl", "ppl_all", "kl", "kl_all", "top1", "kv_bytes", "kv_bits_per_element"):
        assert ran[key] == results["fp16"][key], key
    assert ran["kl"] == 0.0 and ran["top1"] == 1.0


def test_fp16_row_matches_reference_and_full_forward(smollm2, window, results):
    model, _ = smollm2
    fp16 = results["fp16"]
    assert fp16["kl"] < 1e-6 and fp16["kl_all"] < 1e-6
    assert fp16["top1"] == 1.0
    assert fp16["n_predictions"] == SEQ_LEN - 1 - PREFILL
    assert fp16["n_predictions_all"] == SEQ_LEN - 1

    # One plain forward over the whole window, no cache: chunked feeding must agree with it.
    logits = model(mx.array(window))[0, :-1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, mx.array(window[0, 1:])[:, None], axis=-1)[:, 0]
    nll = np.array(nll)
    assert fp16["ppl_all"] == pytest.approx(math.exp(nll.mean()), rel=1e-4)
    assert fp16["ppl"] == pytest.approx(math.exp(nll[PREFILL:].mean()), rel=1e-4)
    assert fp16["ppl_ref"] == pytest.approx(fp16["ppl"], rel=1e-12)
    assert 5 < fp16["ppl"] < 60  # real prose, not noise


def test_quantized_quality_ordering(results):
    q8, q4, q2 = results["q8"], results["q4"], results["q2"]
    assert 0 < q8["kl"] < 0.01 and q8["top1"] > 0.9
    assert q8["ppl_ratio"] == pytest.approx(1.0, abs=0.03)
    assert q8["kl"] < q4["kl"] < q2["kl"]
    assert q8["top1"] > q2["top1"]
    assert q2["ppl"] > q4["ppl"] > q8["ppl"] * 0.99
    assert q2["ppl"] > 2 * results["fp16"]["ppl"]


def test_kv_bits_per_element_from_resident_arrays(smollm2, results):
    model, _ = smollm2
    n_layers = len(model.layers)
    n_kv, head_dim = model.args.num_key_value_heads, model.args.head_dim
    elements = 2 * n_layers * n_kv * head_dim * SEQ_LEN

    fp16 = results["fp16"]  # float32 model on CPU: the "fp16" cache holds float32
    assert fp16["kv_bytes"] == elements * 4
    assert fp16["kv_bits_per_element"] == 32.0

    # 4-bit, groups of 64: what mx.quantize itself allocates for one layer's keys.
    packed, scales, biases = mx.quantize(
        mx.zeros((1, n_kv, SEQ_LEN, head_dim)), group_size=64, bits=4
    )
    per_layer = 2 * (packed.nbytes + scales.nbytes + biases.nbytes)
    assert results["q4"]["kv_bytes"] == n_layers * per_layer
    q4_bits = 8 * n_layers * per_layer / elements
    assert results["q4"]["kv_bits_per_element"] == pytest.approx(q4_bits)
    assert 4 < results["q4"]["kv_bits_per_element"] < 6
    assert (
        results["q2"]["kv_bits_per_element"]
        < results["q4"]["kv_bits_per_element"]
        < (results["q8"]["kv_bits_per_element"])
    )

    # The sliding-window cache keeps ~64 of 256 tokens: far fewer resident bytes than fp16.
    rotating = results["rotating64"]
    assert rotating["kv_bits_per_element"] < 16 and rotating["kl"] > 1e-3


def test_results_say_what_each_configuration_is(results):
    q4 = results["q4"]
    assert q4["method"] == "quantized" and q4["bits"] == 4 and q4["group_size"] == 64
    assert q4["calibrated"] is False and q4["uncalibrated"] is False
    assert q4["prefill_chunked"] is True and q4["prefill"] == PREFILL and q4["chunk"] == CHUNK
    assert q4["seq_len"] == SEQ_LEN and q4["n_windows"] == 1
    assert results["rotating64"]["window"] == 64 and results["rotating64"]["calibrated"] is None


def test_outputs_written(results, tmp_path):
    rows = list(results.values())
    metrics = write_metrics(rows, tmp_path / "metrics.json")
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk == metrics and set(on_disk) == set(results)
    assert on_disk["q4"]["kl"] == results["q4"]["kl"]
    assert on_disk["fp16"]["kv_bits_per_element"] == 32.0

    write_csv(rows, tmp_path / "results.csv")
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["name"] for r in table] == list(results)
    assert table[2]["bits"] == "4" and float(table[2]["ppl"]) == pytest.approx(results["q4"]["ppl"])

    plot_quality_vs_bits(rows, tmp_path / "quality.png")
    png = (tmp_path / "quality.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_bad_arguments_are_named(smollm2, window):
    model, _ = smollm2
    with pytest.raises(ValueError, match=r"prefill must be in .* = \[1, 254\]"):
        evaluate_rows(model, window, ROWS[:1], prefill=255, chunk=CHUNK, progress=False)
    with pytest.raises(ValueError, match=r"unknown keys \['bitz'\].*valid fields"):
        evaluate_rows(
            model,
            window,
            [{"name": "x", "method": "quantized", "bitz": 4}],
            prefill=PREFILL,
            chunk=CHUNK,
            progress=False,
        )
    with pytest.raises(ValueError, match="unique"):
        evaluate_rows(
            model, window, [ROWS[0], ROWS[0]], prefill=PREFILL, chunk=CHUNK, progress=False
        )


def test_batched_evaluation_equals_one_window_and_one_row_at_a_time(tiny):
    """Batching windows and rows (veloxquant.batch.BatchedCache) changes no metric beyond float
    rounding, for every method of the table (on the tiny llama and its bundle)."""
    from tests.test_contract import VOCAB, knobs
    from veloxquant.methods import METHODS

    rows = []
    for name, method in METHODS.items():
        row = {"name": name, "method": name, **knobs(name)}
        if method.calibrated:
            row["artifact_dir"] = str(tiny["bundle"])
        rows.append(row)
    windows = np.random.default_rng(5).integers(0, VOCAB, (3, 80)).astype(np.int32)
    model = tiny["model"]
    batched = evaluate_rows(
        model, windows, rows, prefill=40, chunk=16, progress=False, batch_tokens=400
    )
    for row, got in zip(rows, batched, strict=True):
        nll = n = kl = agree = kv_bytes = 0.0
        for w in range(len(windows)):
            (one,) = evaluate_rows(
                model, windows[w : w + 1], [row], prefill=40, chunk=16, progress=False
            )
            nll += math.log(one["ppl"]) * one["n_predictions"]
            kl += one["kl"] * one["n_predictions"]
            agree += one["top1"] * one["n_predictions"]
            n += one["n_predictions"]
            kv_bytes += one["kv_bytes"]
        assert got["n_predictions"] == n, row["name"]
        # Float rounding of the batched GEMMs moves logits by ~1e-7; an eviction choice between
        # two keys that close can flip, which is what the looser bound allows (seen: knorm).
        assert got["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-3), row["name"]
        assert got["kl"] == pytest.approx(kl / n, rel=1e-2, abs=2e-4), row["name"]
        assert got["top1"] == pytest.approx(agree / n, abs=1.5 / n), row["name"]
        assert got["kv_bytes"] == pytest.approx(kv_bytes / len(windows)), row["name"]
    # Reusing the reference's prefill (rows whose caches return it unchanged) is exact but for
    # the rounding of a differently batched GEMM (the same near-tie eviction flips as above).
    ran = evaluate_rows(
        model,
        windows,
        rows,
        prefill=40,
        chunk=16,
        progress=False,
        batch_tokens=400,
        share_prefill=False,
    )
    for a, b in zip(batched, ran, strict=True):
        for key in ("ppl", "ppl_all", "kl", "kl_all", "top1", "kv_bytes"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=2e-4), (a["name"], key)
    # Running the units side by side on the CPU's lanes (two streams) is bit for bit the same
    # as one after the other: each unit's arithmetic does not depend on the stream it runs on.
    one_lane = evaluate_rows(
        model, windows, rows, prefill=40, chunk=16, progress=False, batch_tokens=400, lanes=1
    )
    for a, b in zip(batched, one_lane, strict=True):
        for key in ("ppl", "ppl_all", "kl", "kl_all", "top1", "kv_bytes"):
            assert a[key] == b[key], (a["name"], key)
