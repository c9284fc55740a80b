"""Capture attention activations (q_post, k_pre, k_post, v) without forking mlx-lm.

mlx-lm 0.32 llama/qwen3 attention runs: project q/k/v (+ q_norm/k_norm) -> rope(queries)
-> rope(keys) -> cache.update_and_fetch(keys, values) -> SDPA (DESIGN.md section 6).
`record_attention` swaps each `self_attn.rope` for a `RecordingRoPE` that remembers every
(input, output); a `RecordingKVCache` then pairs the calls by identity in `update_and_fetch`:
the call whose output *is* `keys` gave k_pre -> k_post, the other one gave q_post.
Nothing in the forward pass changes, so logits stay bit-identical.

Output dir of `capture_activations`:
  layer_{i:02d}.safetensors  float16 q_post [n, H_q, D], k_pre/k_post/v [n, H_kv, D],
                             int32 positions [n]; the same n sampled tokens in every layer.
  stats.safetensors          float32 exact per-channel {name}.absmax/.mean/.sq_mean [L, H, D]
                             over every token seen.
  capture.json               written last: its presence marks a complete capture.

Knobs: token_budget (n = min(token_budget, N*S) tokens sampled uniformly without replacement,
chosen up front from numpy's default_rng(seed)), seed.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from veloxquant import cpu_kernels
from veloxquant._platform import cpu_lanes
from veloxquant.rope import untapped
from veloxquant.io import (
    SafetensorsError,
    parse_safetensors_header,
    safetensors_views,
    save_safetensors_atomic,
    sha256_bytes,
    sha256_file,
    write_json_atomic,
)

NAMES = ("q_post", "k_pre", "k_post", "v")
STATS = ("absmax", "mean", "sq_mean")
FORMAT = "veloxquant-capture-v1"
_FP16_MAX = float(np.finfo(np.float16).max)


class RecordingRoPE(nn.Module):
    """Stands in for `self_attn.rope` and remembers (input, output) of every call."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._inner = inner  # leading underscore: not part of the parameter tree
        self.calls = collections.deque()  # a deque, not a list, so nn.Module ignores it

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        y = self._inner(x, *args, **kwargs)
        self.calls.append((x, y))
        return y


class RecordingKVCache(KVCache):
    """A plain `KVCache` that also records what attention fed it, one dict per call."""

    def __init__(self, rope: RecordingRoPE, layer: int):
        super().__init__()
        self.rope, self.layer, self.records = rope, layer, []

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        calls = list(self.rope.calls)
        self.rope.calls.clear()
        k_calls = [c for c in calls if c[1] is keys]
        q_calls = [c for c in calls if c[1] is not keys]
        if len(k_calls) != 1 or len(q_calls) != 1:
            raise RuntimeError(
                f"layer {self.layer}: expected one rope call for queries and one for keys before "
                f"update_and_fetch, saw {len(calls)} ({len(k_calls)} matching keys). This "
                "attention implementation is not the mlx-lm llama/qwen3 layout capture supports."
            )
        self.records.append(
            {
                "offset": self.offset,
                "q_post": q_calls[0][1],
                "k_pre": k_calls[0][0],
                "k_post": keys,
                "v": values,
            }
        )
        return super().update_and_fetch(keys, values)


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[list[RecordingRoPE]]:
    """Swap every layer's `self_attn.rope` for a `RecordingRoPE`; always restore on exit."""
    originals = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(attn, "rope", None), nn.Module):
            raise ValueError(
                f"layer {i} has no self_attn.rope module: capture supports mlx-lm "
                "llama/qwen2/qwen3-style attention only."
            )
        originals.append(attn.rope)
    try:
        for layer, rope in zip(model.layers, originals, strict=True):
            layer.self_attn.rope = RecordingRoPE(rope)
        yield [layer.self_attn.rope for layer in model.layers]
    finally:
        for layer, rope in zip(model.layers, originals, strict=True):
            layer.self_attn.rope = rope


def recording_caches(ropes: Sequence[RecordingRoPE]) -> list[RecordingKVCache]:
    """Fresh per-layer caches for one forward pass inside `record_attention`."""
    return [RecordingKVCache(rope, i) for i, rope in enumerate(ropes)]


def sample_token_indices(num_tokens: int, token_budget: int, seed: int) -> np.ndarray:
    """Sorted flat indices into the [N*S] token grid, chosen before any model call."""
    n = min(token_budget, num_tokens)
    if n == num_tokens:
        return np.arange(num_tokens, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(num_tokens, size=n, replace=False))


def _check_inputs(model: nn.Module, tokens: Any, token_budget: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(
            f"tokens must be a 2-D [N, S] array of token ids, got shape {tokens.shape}"
            "; use tokens.reshape(1, -1) for a single sequence."
        )
    if tokens.size == 0:
        raise ValueError(
            f"tokens is empty (shape {tokens.shape}): nothing to capture. Check that "
            "prepare_data produced calibration sequences."
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must hold integer token ids, got dtype {tokens.dtype}.")
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if tokens.min() < 0 or (vocab is not None and tokens.max() >= vocab):
        raise ValueError(
            f"token ids must lie in [0, {vocab}); got [{tokens.min()}, "
            f"{tokens.max()}]. Were the tokens made with this model's tokenizer?"
        )
    if (
        isinstance(token_budget, bool)
        or not isinstance(token_budget, (int, np.integer))
        or token_budget < 1
    ):
        raise ValueError(f"token_budget must be an integer >= 1, got {token_budget!r}.")
    return tokens.astype(np.int32)


def _model_summary(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "rope_traditional",
        "rope_scaling",
        "vocab_size",
    )
    summary = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    rope = untapped(model.layers[0].self_attn.rope)
    summary["rope"] = {
        "class": type(rope).__name__,
        **{
            k: getattr(rope, k)
            for k in ("dims", "traditional", "base", "scale")
            if isinstance(getattr(rope, k, None), (int, float, bool))
        },
    }
    return summary


def _reduce(x: mx.array, local: mx.array | None) -> tuple:
    """Per-channel sum, sum of squares and absmax over the tokens of x [H, S, D] (float32),
    and the sampled tokens as float16 [n, H, D] (None when this sequence has none)."""
    x32 = x.astype(mx.float32)
    sample = None if local is None else mx.take(x, local, axis=1).swapaxes(0, 1)
    return (
        x32.sum(axis=1),
        mx.square(x32).sum(axis=1),
        mx.abs(x32).max(axis=1),
        None if sample is None else sample.astype(mx.float16),
    )


def capture_activations(
    model: nn.Module,
    tokens: np.ndarray,
    out_dir: str | Path,
    token_budget: int,
    seed: int = 0,
    progress: bool = True,
    *,
    data_sha256: str | None = None,
    lanes: int | None = None,
) -> dict:
    """Run `model` over `tokens` [N, S] sequence by sequence and write the capture dir.

    Exact per-channel stats cover every token; activations are kept only for the
    n = min(token_budget, N*S) tokens sampled up front, in preallocated float16 buffers.
    Returns the summary that is also written to capture.json. On the CPU, `lanes` sequences
    run side by side on that many streams (`veloxquant._platform.cpu_lanes`), with the same
    bytes written. By default one with the CPU kernels built (they took over the single-threaded
    work a second stream overlapped, and OpenBLAS spreads the GEMMs over the cores; one lane is
    the faster there, benchmarks/results/pipeline-time-cpu.md), two without.
    """
    from tqdm import tqdm

    tokens = _check_inputs(model, tokens, token_budget)
    if lanes is None:
        lanes = 1 if cpu_kernels.available() else 2
    lanes = cpu_lanes(lanes)
    num_seqs, seq_len = tokens.shape
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "capture.json").unlink(missing_ok=True)  # the old capture is incomplete from now on

    chosen = sample_token_indices(num_seqs * seq_len, token_budget, seed)
    bounds = np.searchsorted(chosen, np.arange(num_seqs + 1) * seq_len)
    positions = np.empty(len(chosen), np.int32)
    num_layers = len(model.layers)
    buffers: list[dict[str, np.ndarray]] = [{} for _ in range(num_layers)]
    sums: dict[str, np.ndarray] = {}  # {name}.{sum|sq_sum|absmax} -> float64 [L, H, D]

    def forward(s: int, ropes: list[RecordingRoPE]) -> list[dict]:
        """Sequence s's forward pass, lazily: what each layer's attention was fed."""
        caches = recording_caches(ropes)
        # Only the captured tensors are evaluated; the unused logits graph is dropped.
        model(mx.array(tokens[s : s + 1]), cache=caches)
        if any(len(c.records) != 1 for c in caches):
            raise RuntimeError(
                "expected one attention call per layer per forward pass; "
                "this model's layout is not supported by capture."
            )
        return [c.records[0] for c in caches]

    def accumulate(s: int, records: list[dict]) -> None:
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        local = mx.array((chosen[lo:hi] - s * seq_len).astype(np.int32))
        outputs = [
            {name: _reduce(rec[name][0], local if hi > lo else None) for name in NAMES}
            for rec in records
        ]
        mx.eval([[t for v in o.values() for t in v if t is not None] for o in outputs])
        positions[lo:hi] = np.array(local) + records[0]["offset"]
        for i, layer_out in enumerate(outputs):
            for name, (x_sum, x_sq, x_max, sample) in layer_out.items():
                x_sum, x_sq, x_max = (np.array(a, np.float64) for a in (x_sum, x_sq, x_max))
                # Non-finite values poison sum and absmax, so checking those is enough.
                if not (np.isfinite(x_sum).all() and np.isfinite(x_max).all()):
                    raise FloatingPointError(
                        f"NaN/Inf in layer {i} {name} (sequence {s}); nothing was written. "
                        "Check the model weights/dtype (float16 overflow?)."
                    )
                if x_max.max() > _FP16_MAX:
                    raise OverflowError(
                        f"layer {i} {name} reaches |x| = {x_max.max():.4g} (sequence {s}), "
                        "beyond float16 storage; capture cannot store it losslessly."
                    )
                if s == 0:  # shapes are known once the first sequence has run
                    for key in ("sum", "sq_sum", "absmax"):
                        sums.setdefault(f"{name}.{key}", np.zeros((num_layers,) + x_sum.shape))
                    buffers[i][name] = np.empty((len(chosen),) + x_sum.shape, np.float16)
                sums[f"{name}.sum"][i] += x_sum
                sums[f"{name}.sq_sum"][i] += x_sq
                np.maximum(sums[f"{name}.absmax"][i], x_max, out=sums[f"{name}.absmax"][i])
                if sample is not None:
                    buffers[i][name][lo:hi] = np.array(sample)

    # The forward passes of `lanes` sequences run side by side on the CPU's cores; the
    # reductions then run on the default stream, one sequence after the other in order (MLX's
    # CPU reductions on two streams at once ran slower than one after the other), so the
    # capture is the same bytes for any number of lanes. The attention's softmax and the MLP's
    # swiglu run vectorized (veloxquant.cpu_kernels: the same bits as MLX's).
    with record_attention(model) as ropes, cpu_kernels.vectorized():
        bar = tqdm(total=num_seqs, desc="capture", unit="seq", disable=not progress)
        for first in range(0, num_seqs, len(lanes)):
            batch = {}
            for k, s in enumerate(range(first, min(first + len(lanes), num_seqs))):
                with mx.stream(lanes[k]):
                    batch[s] = forward(s, ropes)
            mx.eval([[rec[name] for rec in recs for name in NAMES] for recs in batch.values()])
            for s, records in batch.items():
                accumulate(s, records)
                bar.update(1)
            del batch
        bar.close()

    seen = num_seqs * seq_len
    meta = {"format": FORMAT}
    files = {}
    for i in range(num_layers):
        path = out_dir / f"layer_{i:02d}.safetensors"
        save_safetensors_atomic(path, {**buffers[i], "positions": positions}, metadata=meta)
        files[path.name] = sha256_file(path)
    stats = {}
    for name in NAMES:
        stats[f"{name}.absmax"] = sums[f"{name}.absmax"].astype(np.float32)
        stats[f"{name}.mean"] = (sums[f"{name}.sum"] / seen).astype(np.float32)
        stats[f"{name}.sq_mean"] = (sums[f"{name}.sq_sum"] / seen).astype(np.float32)
    save_safetensors_atomic(out_dir / "stats.safetensors", stats, metadata=meta)
    files["stats.safetensors"] = sha256_file(out_dir / "stats.safetensors")
    for stale in out_dir.glob("layer_*.safetensors"):  # from an earlier, deeper model
        if stale.name not in files:
            stale.unlink()

    summary = {
        "format": FORMAT,
        "tokens_seen": seen,
        "num_sequences": num_seqs,
        "seq_len": seq_len,
        "n_sampled": len(chosen),
        "token_budget": int(token_budget),
        "seed": int(seed),
        "num_layers": num_layers,
        "shapes": {name: list(buffers[0][name].shape[1:]) for name in NAMES},
        "model": _model_summary(model),
        "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        "data_sha256": data_sha256,
        "files": files,
    }
    write_json_atomic(out_dir / "capture.json", summary)
    return summary


class CaptureError(ValueError):
    """A capture dir is incomplete, modified or corrupt; the fix is to re-run the capture."""


_RECAPTURE = "Re-run the capture (`dvc repro capture@<model>` or `veloxquant capture`)."


def load_capture_info(capture_dir: str | Path) -> dict:
    """capture.json of a complete capture dir, its fields checked (clear error if the capture
    never finished or the file was edited)."""
    import json

    path = Path(capture_dir) / "capture.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{capture_dir} holds no complete capture (no capture.json). "
            "Run the capture stage first (`dvc repro capture` or "
            "`veloxquant capture`)."
        )
    try:
        info = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureError(f"{path} is not valid json ({e}). {_RECAPTURE}") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise CaptureError(f"{path} has format {found!r}; expected {FORMAT!r}. {_RECAPTURE}")
    for key in ("num_layers", "n_sampled", "tokens_seen"):
        value = info.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CaptureError(
                f"{path}: field {key!r} must be an integer >= 0, got {value!r}. {_RECAPTURE}"
            )
    files = info.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, str) and len(v) == 64 for v in files.values()
    ):
        raise CaptureError(f"{path}: field 'files' must map each shard to its sha256. {_RECAPTURE}")
    return info


def _read_verified(
    capture_dir: str | Path, name: str, info: dict, tensors: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """Tensors (default: all) of one capture file as read-only numpy views, after checking the
    file against capture.json: listed, present, well-formed safetensors (so a truncated file is
    named as such), holding the tensors asked for, and its sha256 (over the bytes returned)."""
    path = Path(capture_dir) / name
    if name not in info["files"]:
        raise CaptureError(f"{path} is not listed in capture.json's 'files'. {_RECAPTURE}")
    try:
        data = path.read_bytes()  # hash and parse the same bytes
    except FileNotFoundError:
        raise CaptureError(f"{path} is listed in capture.json but missing. {_RECAPTURE}") from None
    try:
        header = parse_safetensors_header(data, str(path))
    except SafetensorsError as e:
        raise CaptureError(f"{e} {_RECAPTURE}") from e
    digest = sha256_bytes(data)
    if digest != info["files"][name]:
        raise CaptureError(
            f"{path}: sha256 {digest[:16]}... does not match capture.json's "
            f"{info['files'][name][:16]}...: the file was modified or corrupted. {_RECAPTURE}"
        )
    missing = [t for t in tensors or () if t not in header]
    if missing:
        raise CaptureError(f"{path} has no tensors {missing}. {_RECAPTURE}")
    return safetensors_views(data, None if tensors is None else list(tensors))


def _as_float32(x: np.ndarray, what: str, path: Path) -> mx.array:
    """x as an mx float32 array, or an error naming where its first NaN/Inf is."""
    if not np.isfinite(x).all():
        index = [int(i) for i in np.argwhere(~np.isfinite(x))[0]]
        raise CaptureError(
            f"{path}: {what} contains NaN or Inf (first at index {index} of shape "
            f"{list(x.shape)}); every calibration would learn from it. {_RECAPTURE}"
        )
    return mx.array(x).astype(mx.float32)


def load_activations(
    capture_dir: str | Path, layer: int, names: Sequence[str] | None = None
) -> dict[str, mx.array]:
    """Sampled activations of one layer as float32 (positions stay int32).

    The shard is checked against capture.json's sha256 and every returned tensor for NaN/Inf,
    here once for every method, each error naming the file, the layer and the tensor.
    """
    info = load_capture_info(capture_dir)
    if not 0 <= layer < info["num_layers"]:
        raise IndexError(
            f"layer {layer} out of range: the capture has {info['num_layers']} layers."
        )
    names = list(NAMES + ("positions",) if names is None else names)
    unknown = set(names) - set(NAMES) - {"positions"}
    if unknown:
        raise KeyError(
            f"unknown activation names {sorted(unknown)}; known: {list(NAMES) + ['positions']}"
        )
    name = f"layer_{layer:02d}.safetensors"
    path = Path(capture_dir) / name
    data = _read_verified(capture_dir, name, info, names)
    return {
        n: mx.array(x) if n == "positions" else _as_float32(x, f"layer {layer} tensor {n!r}", path)
        for n, x in data.items()
    }


def load_stats(capture_dir: str | Path) -> dict[str, mx.array]:
    """Exact per-channel stats {name}.{absmax|mean|sq_mean}, float32 [L, H, D], checked like
    the shards (sha256, finiteness: an error names the layer and the tensor)."""
    info = load_capture_info(capture_dir)
    path = Path(capture_dir) / "stats.safetensors"
    out = {}
    for key, x in _read_verified(capture_dir, path.name, info).items():
        bad = np.argwhere(~np.isfinite(x))  # stats are small, [L, H, D]: axis 0 is the layer
        what = f"layer {int(bad[0][0])} stats tensor {key!r}" if len(bad) else key
        out[key] = _as_float32(x, what, path)
    return out
