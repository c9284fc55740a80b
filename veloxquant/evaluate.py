"""Evaluation harness: quality and resident memory of KV caches against the fp16 reference.

DESIGN.md sections 7 and 9 ("honest numbers only"). For every held-out window and every row:
- the text is fed the way generation feeds it: the first `prefill` tokens in one call, then the
  rest in `chunk`-token calls through the cache, so a compressing cache is exercised on the
  tokens it compressed, not on a single full-precision forward;
- the reference is a plain mlx-lm `KVCache` (`KVCacheConfig(method="fp16")`) fed identically, so
  an fp16 row matches it bit for bit; its log-probs are computed once per chunk and shared by all
  rows (rows advance in lockstep, so only one chunk of logits per row is ever alive);
- quality: perplexity after prefill (`ppl`, the compressed-cache regime) and over every predicted
  position (`ppl_all`), KL(ref || row) and top-1 agreement with the reference after prefill,
  all in float32 and accumulated as sums over windows;
- memory: resident bytes = sum of the caches' `nbytes` at the end of the window (for mlx-lm
  caches, their allocated arrays, including step padding), and
  bits per element = 8 * bytes / (2 * layers * H_kv * head_dim * tokens fed), where the element
  count is read from the reference cache, i.e. what an uncompressed cache would hold.

Rows are plain dicts `{"name": ..., **KVCacheConfig fields}`; a row may instead carry
`"make": callable(model) -> list of caches` (any mlx-lm-compatible caches).

Outputs (`write_outputs`, what the DVC evaluate stage writes), all deterministic so a re-run
with the same inputs gives the same bytes:
- `metrics/<row>.json`: the DVC metrics, one small file per row (ROW_METRIC_KEYS), so
  `dvc metrics show` prints one line per cache configuration;
- `metrics.json`: every row's METRIC_KEYS in one file, for programs;
- `eval.csv`: every result field, one row per configuration, plus its plot `series`;
- `eval_budget.csv`: the rows with a fractional eviction budget (series, budget, kl, ...);
- `eval.png`: the matplotlib quality-vs-bits figure.
dvc.yaml declares the two CSVs as plots (ppl ratio vs bits, KL vs budget, one colour per
series, template .dvc/plots/veloxquant_series.json).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from veloxquant import cpu_kernels
from veloxquant._platform import cpu_lanes
from veloxquant.config import KVCacheConfig, make_cache
from veloxquant.io import atomic_path, write_bytes_atomic, write_json_atomic

CONFIG_FIELDS = tuple(f.name for f in dataclass_fields(KVCacheConfig))
REFERENCE = KVCacheConfig(method="fp16")
REFERENCE_ROW = REFERENCE.to_dict()
# Numeric result keys written to the DVC metrics JSON.
METRIC_KEYS = (
    "ppl",
    "ppl_all",
    "ppl_ratio",
    "ppl_ref",
    "kl",
    "kl_all",
    "top1",
    "kv_bytes",
    "kv_bits_per_element",
)
# The per-row DVC metrics files: what a reader compares across rows and experiments.
ROW_METRIC_KEYS = ("ppl", "ppl_ratio", "kl", "top1", "kv_bits_per_element", "kv_bytes")
_ROW_FILE = re.compile(r"[A-Za-z0-9_.%+=-]+")


def _row_builder(row: dict) -> tuple[str, dict, Callable[[Any], list]]:
    if "name" not in row or not isinstance(row["name"], str) or not row["name"]:
        raise ValueError(f"Every eval row needs a non-empty 'name'; got {row!r}.")
    name = row["name"]
    fields = {k: v for k, v in row.items() if k not in ("name", "make")}
    if "make" in row:
        make = row["make"]
        if not callable(make):
            raise ValueError(f"Row {name!r}: 'make' must be a callable(model) -> caches.")
        return name, fields, make
    unknown = sorted(set(fields) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(
            f"Row {name!r} has unknown keys {unknown}. Rows are "
            f"{{'name': ..., **KVCacheConfig fields}}; valid fields: {list(CONFIG_FIELDS)}."
        )
    config = KVCacheConfig(**fields)
    return name, config.to_dict(), lambda model: make_cache(model, config)


def _segments(seq_len: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    spans = [(0, prefill)]
    spans += [(s, min(s + chunk, seq_len)) for s in range(prefill, seq_len, chunk)]
    return spans


def _nbytes(caches: list) -> int:
    return int(sum(c.nbytes for c in caches))


def _prefill_from_reference(caches: list, ref_caches: list, n_rows: int, n: int) -> bool:
    """Feed each layer's cache the reference prefill's keys/values (what the model would feed
    it, as long as every earlier layer returned the reference's unchanged) instead of running
    the model; True when every layer returned them unchanged, so the row's prefill is the
    reference's. Caches that attend to something else already in their first call (mlx-lm's
    QuantizedKVCache, say) return False and must be run through the model on fresh caches."""
    for cache, ref in zip(caches, ref_caches, strict=True):
        k_in = mx.concatenate([ref.keys[:, :, :n]] * n_rows, axis=0)
        v_in = mx.concatenate([ref.values[:, :, :n]] * n_rows, axis=0)
        k_out, v_out = cache.update_and_fetch(k_in, v_in)
        same = mx.array_equal(k_out, k_in) & mx.array_equal(v_out, v_in)
        mx.eval(same, [c.state for c in getattr(cache, "caches", [cache])])
        if not same.item():
            return False
    return True


def _kv_elements(reference_caches: list) -> int:
    # What an uncompressed cache represents: 2 (K and V) * H_kv * head_dim * tokens, per layer.
    total = 0
    for c in reference_caches:
        _, n_kv, _, k_dim = c.keys.shape
        v_dim = c.values.shape[-1]
        total += n_kv * (k_dim + v_dim) * c.offset
    return total


class _Sums:
    """Running sums for one row over all windows."""

    def __init__(self) -> None:
        self.nll_all = self.nll_after = self.kl_all = self.kl_after = self.top1 = 0.0
        self.n_all = self.n_after = 0
        self.kv_bytes: list[int] = []
        self.kv_elements: list[int] = []


def evaluate_rows(
    model: Any,
    windows: np.ndarray,
    rows: list[dict],
    prefill: int,
    chunk: int,
    progress: bool = True,
    batch_tokens: int = 6144,
    share_prefill: bool = True,
    lanes: int = 2,
) -> list[dict]:
    """Evaluate every row on every window against the fp16 `KVCache` reference.

    windows: int [N, S] token ids; rows: `{"name": ..., **KVCacheConfig fields}` (or with
    `"make"`). Returns one result dict per row (config fields + metrics), in row order.

    All windows go through the model as one batch, and veloxquant's caches of several rows
    too (each (row, window) keeps its own single-sequence cache inside a
    `veloxquant.batch.BatchedCache`, so every cache sees exactly the tokens it would alone):
    the projections and MLP then run as a few large GEMMs instead of many small ones. At most
    `batch_tokens` sequence positions go through one forward (bounding the logits in memory).
    With `share_prefill`, a row whose caches hand the prefill's keys and values back unchanged
    (every veloxquant cache: the call's own tokens are attended at full precision) reuses the
    reference's prefill instead of running the model again (checked per layer, see
    `_prefill_from_reference`).
    A row configured as the reference itself (`method="fp16"` and nothing else) takes the
    reference's numbers without running again. On the CPU, `lanes` units run side by side on
    that many streams (`veloxquant._platform.cpu_lanes`), with the same metrics bit for bit.
    Other caches (mlx-lm's) take the windows as their own batch dimension. Metrics equal those
    of feeding one window and one row at a time up to float rounding (tests/test_evaluate.py).
    """
    from tqdm.auto import tqdm

    from veloxquant.batch import BatchedCache
    from veloxquant.methods.base import CompressedCache

    windows = np.asarray(windows)
    if windows.ndim != 2 or not np.issubdtype(windows.dtype, np.integer):
        raise ValueError(
            f"windows must be an integer array [N, S]; got {windows.dtype} {windows.shape}."
        )
    n_windows, seq_len = windows.shape
    if n_windows < 1:
        raise ValueError("windows is empty: nothing to evaluate.")
    if not 1 <= prefill <= seq_len - 2:
        raise ValueError(
            f"prefill must be in [1, seq_len - 2] = [1, {seq_len - 2}] so that some positions are "
            f"predicted after prefill; got prefill={prefill} for windows of {seq_len} tokens."
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}.")
    if not rows:
        raise ValueError("rows is empty: give at least one {'name': ..., 'method': ...} row.")
    built = [_row_builder(r) for r in rows]
    names = [b[0] for b in built]
    if len(set(names)) != len(names):
        raise ValueError(f"Row names must be unique; got {names}.")

    # A row configured exactly as the reference (a plain fp16 KVCache) would run the same
    # forward passes on the same inputs, so it takes the reference's numbers instead.
    twins = {r for r, row in enumerate(rows) if "make" not in row and built[r][1] == REFERENCE_ROW}
    # Caches: per row, one list of per-layer caches per window (ours), or one list with the
    # windows as its batch (mlx-lm's). Units are what one forward runs: a group of our rows,
    # or one other row.
    per_row: list[list[list]] = []
    for r, (_, _, make) in enumerate(built):
        if r in twins:
            per_row.append([])
            continue
        first = make(model)
        if all(isinstance(c, CompressedCache) for c in first):
            per_row.append([first] + [make(model) for _ in range(n_windows - 1)])
        else:
            per_row.append([first])
    group = max(1, batch_tokens // (n_windows * max(prefill, chunk)))
    ours = [r for r, c in enumerate(per_row) if c and isinstance(c[0][0], CompressedCache)]

    def batched(members: list[int]) -> list:
        return [
            BatchedCache([per_row[r][w][i] for r in members for w in range(n_windows)])
            for i in range(len(model.layers))
        ]

    units = [
        (ours[g : g + group], batched(ours[g : g + group])) for g in range(0, len(ours), group)
    ]
    units += [([r], per_row[r][0]) for r in range(len(built)) if r not in ours and r not in twins]
    units.sort(key=lambda u: u[0][0])

    lanes = cpu_lanes(lanes)  # rows side by side on the CPU's cores
    tokens = mx.array(windows.astype(np.int32))
    # The last token is fed too (its logits predict nothing) so the caches end holding the
    # whole window, as after generating it.
    targets = tokens[:, 1:]
    ref_caches = make_cache(model, REFERENCE)
    segments = _segments(seq_len, prefill, chunk)
    sums = [_Sums() for _ in built]
    ref = _Sums()
    bar = tqdm(
        total=len(units) * len(segments), desc="evaluate", unit="chunk", disable=not progress
    )

    def flush(pending: list[tuple], n: int, after_prefill: bool) -> None:
        """Evaluate the units built on the lanes together, then add up their metrics."""
        mx.eval([p[1:4] for p in pending], [c.state for p in pending for c in p[4]])
        for members, nll, kl, agree, _ in pending:
            for k, r in enumerate(members):
                _add(
                    sums[r],
                    float(nll[k].item()),
                    float(kl[k].item()),
                    float(agree[k].item()),
                    n,
                    after_prefill,
                )
            bar.update(1)
        pending.clear()

    # The attention's softmax and the MLP's swiglu run vectorized (veloxquant.cpu_kernels:
    # MLX's bits).
    with cpu_kernels.vectorized():
        for start, end in segments:
            n_pred = min(end, seq_len - 1) - start
            after_prefill = start >= prefill
            x = tokens[:, start:end]
            tgt = targets[:, start : start + n_pred]
            ref_logp = cpu_kernels.log_softmax(
                model(x, cache=ref_caches)[:, :n_pred].astype(mx.float32)
            )  # [W, n, V]
            ref_top = mx.argmax(ref_logp, axis=-1)
            ref_p = mx.exp(ref_logp)
            ref_nll = -mx.take_along_axis(ref_logp, tgt[..., None], axis=-1).sum()
            mx.eval(ref_logp, ref_top, ref_p, ref_nll, [c.state for c in ref_caches])
            ref_total = float(ref_nll.item())
            _add(ref, ref_total, 0.0, 0.0, n_pred * n_windows, after_prefill)
            for r in twins:
                _add_reference(sums[r], ref_total, n_pred * n_windows, after_prefill)
            pending: list[tuple] = []  # units built on a lane, evaluated together
            for u, (members, caches) in enumerate(units):
                bar.set_postfix_str(names[members[0]], refresh=False)
                if share_prefill and start == 0 and members[0] in ours:
                    if _prefill_from_reference(caches, ref_caches, len(members), end):
                        # The row's caches returned the reference's keys and values unchanged in
                        # every layer, so its prefill logits are the reference's, bit for bit.
                        for r in members:
                            _add_reference(sums[r], ref_total, n_pred * n_windows, after_prefill)
                        bar.update(1)
                        continue
                    for r in members:  # start over with fresh caches and run the model
                        per_row[r] = [built[r][2](model) for _ in range(n_windows)]
                    caches = batched(members)
                    units[u] = (members, caches)
                # Each unit keeps its lane, so a cache's state stays on one stream.
                with mx.stream(lanes[u % len(lanes)]):
                    xb = mx.concatenate([x] * len(members), axis=0)
                    logp = cpu_kernels.log_softmax(
                        model(xb, cache=caches)[:, :n_pred].astype(mx.float32)
                    )
                    logp = logp.reshape(len(members), n_windows, *logp.shape[1:])
                    nll = -mx.take_along_axis(logp, tgt[None, ..., None], axis=-1)
                    nll = nll.sum(axis=(1, 2, 3))
                    kl = (ref_p[None] * (ref_logp[None] - logp)).sum(axis=(1, 2, 3))
                    agree = (mx.argmax(logp, axis=-1) == ref_top[None]).sum(axis=(1, 2))
                pending.append((members, nll, kl, agree, caches))
                if len(pending) == len(lanes):
                    flush(pending, n_pred * n_windows, after_prefill)
            flush(pending, n_pred * n_windows, after_prefill)
    bar.close()
    elements = _kv_elements(ref_caches)  # what one uncompressed window holds
    for r, caches in enumerate(per_row):
        if r in twins:
            caches = [ref_caches]
        if r in ours:
            per_window = [_nbytes(c) for c in caches]
        else:  # one batched cache: every window holds the same arrays
            per_window = [_nbytes(caches[0]) // n_windows] * n_windows
        sums[r].kv_bytes += per_window
        sums[r].kv_elements += [elements] * n_windows

    ppl_ref = math.exp(ref.nll_after / ref.n_after)
    ppl_ref_all = math.exp(ref.nll_all / ref.n_all)
    results = []
    for (name, config, _), acc in zip(built, sums, strict=True):
        kv_bytes = sum(acc.kv_bytes) / n_windows
        ppl = math.exp(acc.nll_after / acc.n_after)
        results.append(
            {
                "name": name,
                **config,
                "calibrated": is_calibrated(config),
                "prefill_chunked": True,
                "prefill": prefill,
                "chunk": chunk,
                "seq_len": seq_len,
                "n_windows": n_windows,
                "n_predictions": acc.n_after,
                "n_predictions_all": acc.n_all,
                "ppl": ppl,
                "ppl_all": math.exp(acc.nll_all / acc.n_all),
                "ppl_ref": ppl_ref,
                "ppl_ref_all": ppl_ref_all,
                "ppl_ratio": ppl / ppl_ref,
                "kl": acc.kl_after / acc.n_after,
                "kl_all": acc.kl_all / acc.n_all,
                "top1": acc.top1 / acc.n_after,
                "kv_bytes": kv_bytes,
                "kv_bits_per_element": 8.0 * sum(acc.kv_bytes) / sum(acc.kv_elements),
            }
        )
    return results


def is_calibrated(config: dict) -> bool | None:
    """Whether the row uses calibration artifacts (None for a ready-made `make` row, whose
    caches the harness cannot see into)."""
    from veloxquant.methods import METHODS

    method = METHODS.get(config.get("method"))
    if method is None:
        return None
    return method.calibrated and not config.get("uncalibrated", False)


def _add(acc: _Sums, nll: float, kl: float, agree: float, n: int, after_prefill: bool) -> None:
    acc.nll_all += nll
    acc.kl_all += kl
    acc.n_all += n
    if after_prefill:
        acc.nll_after += nll
        acc.kl_after += kl
        acc.top1 += agree
        acc.n_after += n


def _add_reference(acc: _Sums, nll: float, n: int, after_prefill: bool) -> None:
    """Add the reference's own numbers for n predictions: its nll, no KL, every top-1 agreed."""
    _add(acc, nll, 0.0, float(n), n, after_prefill)


# --------------------------------------------------------------------------- outputs


def write_outputs(results: list[dict], out_dir: str | Path) -> None:
    """Everything the evaluate stage writes (see the module docstring) into `out_dir`."""
    out = Path(out_dir)
    write_row_metrics(results, out / "metrics")
    write_metrics(results, out / "metrics.json")
    write_csv(results, out / "eval.csv")
    write_budget_csv(results, out / "eval_budget.csv")
    plot_quality_vs_bits(results, out / "eval.png")


def write_metrics(results: list[dict], path_json: str | Path) -> dict:
    """Metrics JSON `{row_name: {ppl, kl, top1, kv_bytes, kv_bits_per_element, ...}}`."""
    metrics = {r["name"]: {k: r[k] for k in METRIC_KEYS if k in r} for r in results}
    write_json_atomic(path_json, metrics)
    return metrics


def write_row_metrics(results: list[dict], metrics_dir: str | Path) -> None:
    """One `<row>.json` of ROW_METRIC_KEYS per row, each written atomically; files of rows no
    longer evaluated are removed afterwards. `dvc metrics show` then prints a line per row
    instead of one line of every row's keys."""
    for r in results:
        if not _ROW_FILE.fullmatch(r["name"]):
            raise ValueError(
                f"Row name {r['name']!r} is also a metrics file name: use letters, digits and "
                "._%+=- only."
            )

    metrics_dir = Path(metrics_dir)
    keep = set()
    for r in results:
        keep.add(f"{r['name']}.json")
        write_json_atomic(metrics_dir / f"{r['name']}.json", {k: r[k] for k in ROW_METRIC_KEYS})
    for stale in metrics_dir.glob("*.json"):
        if stale.name not in keep:
            stale.unlink()


def _csv_bytes(rows: list[dict]) -> bytes:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(
            {
                k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
                for k, v in r.items()
            }
        )
    return buf.getvalue().encode()


def write_csv(results: list[dict], path_csv: str | Path) -> None:
    """Every result field, one row per configuration (dicts such as `options` as JSON), and the
    row's plot series (`dvc plots` colours by it)."""
    write_bytes_atomic(path_csv, _csv_bytes([{**r, "series": _plot_series(r)} for r in results]))


def write_budget_csv(results: list[dict], path_csv: str | Path) -> None:
    """The rows with a fractional eviction budget, for `dvc plots` (KL vs budget)."""
    keys = ("name", "series", "budget", "kl", "ppl_ratio", "top1", "kv_bits_per_element")
    rows = [
        {k: _plot_series(r) if k == "series" else r[k] for k in keys}
        for r in results
        if isinstance(r.get("budget"), float) and 0 < r["budget"] < 1
    ]
    write_bytes_atomic(path_csv, _csv_bytes(rows) if rows else (",".join(keys) + "\n").encode())


def read_csv(path_csv: str | Path) -> list[dict]:
    """Results back from an `eval.csv` (`write_csv`), typed as `evaluate_rows` returns them, so
    the outputs can be re-rendered without re-evaluating."""
    with open(path_csv, newline="") as f:
        table = list(csv.DictReader(f))
    return [{k: _typed(k, v) for k, v in row.items() if k != "series"} for row in table]


def _typed(key: str, text: str) -> Any:
    if text == "":
        return None
    if key in ("name", "method", "artifact_dir"):
        return text
    if text in ("True", "False"):
        return text == "True"
    if text.startswith(("{", "[")):
        return json.loads(text)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _plot_series(result: dict) -> str:
    """Rows that differ only in budget or bit width form one curve: `qfilters-25%` and
    `qfilters-50%` are both `qfilters`, `mlx-q4` and `mlx-q8` are both `mlx-q`."""
    name = re.sub(r"-[0-9.]+%", "", result["name"])
    return "mlx-q" if result.get("method") == "quantized" else name


def plot_quality_vs_bits(results: list[dict], path_png: str | Path) -> None:
    """Two panels against KV bits per element: perplexity ratio vs fp16, and KL(fp16 || row).
    One colour and marker per series (see `_plot_series`), joined by bits, and one legend."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for r in results:
        series.setdefault(_plot_series(r), []).append(r)
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>pPX*h"
    bits = [r["kv_bits_per_element"] for r in results]
    fig, (ax_ppl, ax_kl) = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, title in (
        (ax_ppl, "ppl_ratio", "perplexity / fp16 perplexity (after prefill)"),
        (ax_kl, "kl", "KL(fp16 || row), nats/token (after prefill)"),
    ):
        for i, (label, rows) in enumerate(series.items()):
            rows = sorted(rows, key=lambda r: r["kv_bits_per_element"])
            ax.plot(
                [r["kv_bits_per_element"] for r in rows],
                [r[key] for r in rows],
                marker=markers[i % len(markers)],
                color=colors[i % len(colors)],
                lw=1,
                ms=6,
                label=label,
                zorder=3,
            )
        # Bits span 1-32: a log2 axis spreads the compressed rows instead of crowding them left.
        ax.set_xscale("log", base=2)
        ax.set_xticks([b for b in (1, 2, 4, 8, 16, 32) if min(bits) / 1.5 <= b <= max(bits) * 1.5])
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlim(min(bits) / 1.4, max(bits) * 1.4)
        ax.set_xlabel("resident KV bits per element")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    ax_ppl.axhline(1.0, color="gray", lw=0.8)
    # Broken rows (uncalibrated VQ, 2-bit scalar) sit at 50-100x: a log axis keeps the rest apart.
    ax_ppl.set_yscale("log")
    ax_ppl.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    # KL spans 0 (fp16) to ~5: symlog keeps 0 on the axis and separates the small values.
    ax_kl.set_yscale("symlog", linthresh=1e-3)
    ax_kl.set_ylim(bottom=0, top=max(1e-2, max(r["kl"] for r in results)) * 4)
    handles, labels = ax_kl.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    first = results[0]
    fig.suptitle(
        f"{first['n_windows']} held-out windows x {first['seq_len']} tokens, prefill "
        f"{first['prefill']}, chunk {first['chunk']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    with atomic_path(path_png) as tmp:
        # Fixed metadata so equal results give equal bytes.
        fig.savefig(tmp, format="png", dpi=120, metadata={"Software": None})
    plt.close(fig)
