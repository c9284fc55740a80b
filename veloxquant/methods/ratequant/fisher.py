"""RateQuant importance: Fisher information of the next-token loss w.r.t. each head's K and V.

Gradients. For a calibration window, g = ∂L/∂δ where L is the summed next-token NLL and δ a
zero perturbation added to every layer's cached keys (post-RoPE) and values through a
`PerturbedKVCache` (a plain mlx-lm KVCache that adds an input perturbation array); one
`mx.value_and_grad` gives g for every layer, KV head, token and channel. Float32. Non-finite
gradients are an error naming the layer. Two ways to feed the window:
- mode "plain": the whole window in one call, δ added to the incoming K/V before they are
  stored (every query sees every earlier key perturbed, including its nearest neighbours);
- mode "runtime" (default): the window is fed in calls of `chunk` tokens, K/V are stored clean,
  and each read adds δ only where a KIVICache with the same window / sinks / G holds tokens
  quantized at that moment. So g is the sensitivity to the errors the runtime actually makes:
  never inside a call's own chunk, the fp16 window or the sinks. Heads that attend mostly to
  recent tokens look important in plain mode but are protected by the window at runtime.

Importance. To second order, independent errors e raise the expected loss by ½ Σ F e² with
the diagonal (empirical) Fisher F ≈ g². KIVI's error is not the same everywhere: its scale is
the group's range r (per channel and block of G tokens for keys, per token and group of G
channels for values), and the range is not independent of g (e.g. sink-like tokens that draw
much attention tend to have small values, hence small per-token ranges and small errors). So
    w[l, h, s] = E_windows Σ_{t, c} g[t, c]² · r[t, c]² / mean(r²)
("range-weighted", default), which makes w·d(b) the predicted loss of distortion d(b) =
E‖e‖² for this quantizer; `range_weighted=False` gives the plain E Σ g².

Validation (`noise_validation`): forward-only noise injection on a subset of (layer, head,
stream) units, fed exactly like the gradient pass, with Gaussian noise shaped like the
quantizer's error (std ∝ r, overall σ = sigma · the head's RMS): ΔKL(clean ‖ noisy) / σ²
≈ ½ w for small σ, so its rank correlation with w checks the estimator.

Stream response (`quantization_kl`, `stream_response`): forward only, the KL the runtime's
KIVI error costs when one stream (every layer and head) is quantized at width b and the other
is exact, fed like the gradient pass. The error is that of quantizing the clean K/V, added
where the runtime holds tokens quantized: the positions and codes are the runtime's, but a
layer's K/V at runtime already carry the upstream layers' errors, so this is the first-order
picture of the same thing (a test matches it to the packed cache within 10%). The
second-order importance w·d is the loss of *small* errors; KIVI at 1-2 bits is not small
(min/max codes move a key's attention logits by O(1)), and the response tells the allocation
by how much each stream's loss departs from w·d at each width (alloc.py, `stream_scale`) and
at which widths a stream breaks the model.

Proxy (`proxy_importance`): E‖x‖² per (layer, head, stream), the cheap, weaker importance
(upstream's, per layer from keys only) kept for the ablation.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from veloxquant import cpu_kernels
from veloxquant.methods import kivi

STREAM_NAMES = ("K", "V")
STREAM_KINDS = ("key", "value")  # kivi.fake_quantize's names
MODES = ("plain", "runtime")


def quantized_prefix(past: int, window: int, sinks: int, group_size: int) -> tuple[int, int]:
    """Positions [lo, hi) of the first `past` tokens that a KIVICache with this layout holds
    quantized (not sinks, not the fp16 window) once it has seen `past` tokens."""
    lo = min(sinks, past)
    return lo, lo + max(past - lo - window, 0) // group_size * group_size


class PerturbedKVCache(KVCache):
    """A plain KVCache with perturbation arrays dk / dv ([B, H, S, D] over the window's
    positions, or None) on the keys/values attention reads: a differentiable input.

    mode "plain": the perturbation is added to the incoming keys/values before the KVCache
    stores them. mode "runtime": they are stored clean and each read adds the perturbation
    only at the positions a KIVICache (window, sinks, group_size) holds quantized then.
    """

    def __init__(
        self,
        dk: mx.array | None = None,
        dv: mx.array | None = None,
        *,
        mode: str = "plain",
        window: int = 0,
        sinks: int = 0,
        group_size: int = 1,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"fisher: mode must be one of {MODES}, got {mode!r}")
        self.dk, self.dv, self.mode = dk, dv, mode
        self.layout = (window, sinks, group_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        past, n = self.offset, keys.shape[2]
        if self.mode == "plain":
            if self.dk is not None:
                keys = keys + self.dk[:, :, past : past + n]
            if self.dv is not None:
                values = values + self.dv[:, :, past : past + n]
            return super().update_and_fetch(keys, values)
        k, v = super().update_and_fetch(keys, values)
        lo, hi = quantized_prefix(past, *self.layout)
        if hi > lo:
            k, v = _add_span(k, self.dk, lo, hi), _add_span(v, self.dv, lo, hi)
        return k, v


def _add_span(x: mx.array, delta: mx.array | None, lo: int, hi: int) -> mx.array:
    if delta is None:
        return x
    # in the cache's dtype: a float32 δ would promote a bf16 model's K/V and every layer after
    span = x[:, :, lo:hi] + delta[:, :, lo:hi].astype(x.dtype)
    return mx.concatenate([x[:, :, :lo], span, x[:, :, hi:]], axis=2)


def _kv_shape(model: Any, n_tokens: int) -> tuple[int, int, int, int]:
    args = model.args
    heads = args.num_attention_heads
    n_kv = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return 1, n_kv, n_tokens, head_dim


def window_logp(
    model: Any,
    tokens: mx.array,
    perturbations: Sequence[mx.array | None],
    chunk: int | None = None,
    **cache_kwargs: Any,
):
    """(next-token log-probs, one float32 [n, V] per call; the caches) of one window tokens
    [S], fed in calls of `chunk` tokens (all at once when None), with perturbations
    [dk_0, dv_0, dk_1, ...] (each [1, H, S-1, D] or None) through
    `PerturbedKVCache(**cache_kwargs)` in every layer."""
    n_layers = len(model.layers)
    caches = [
        PerturbedKVCache(perturbations[2 * i], perturbations[2 * i + 1], **cache_kwargs)
        for i in range(n_layers)
    ]
    inputs = tokens[None, :-1]
    step = inputs.shape[1] if chunk is None else chunk
    out = []
    for start in range(0, inputs.shape[1], step):
        logits = model(inputs[:, start : start + step], cache=caches)[0].astype(mx.float32)
        out.append(cpu_kernels.log_softmax(logits))
    return out, caches


def window_nll(
    model: Any,
    tokens: mx.array,
    perturbations: Sequence[mx.array | None],
    chunk: int | None = None,
    **cache_kwargs: Any,
):
    """(summed next-token NLL of one window, the caches); see `window_logp`."""
    logps, caches = window_logp(model, tokens, perturbations, chunk, **cache_kwargs)
    targets = tokens[1:]
    total, start = mx.array(0.0, dtype=mx.float32), 0
    for logp in logps:
        tgt = targets[start : start + logp.shape[0], None]
        total = total - mx.take_along_axis(logp, tgt, axis=-1).sum()
        start += logp.shape[0]
    return total, caches


def window_gradients(
    model: Any, tokens: mx.array, chunk: int | None = None, **cache_kwargs: Any
) -> tuple[float, list[mx.array], list[mx.array]]:
    """(loss, [∂L/∂k_0, ∂L/∂v_0, ...], [k_0, v_0, ...]) for one window: gradients and the
    clean cached keys/values, each [1, H, S-1, D] float32."""
    n_layers = len(model.layers)
    n = tokens.shape[0] - 1
    zeros = [mx.zeros(_kv_shape(model, n), dtype=mx.float32) for _ in range(2 * n_layers)]

    def fn(perts):
        loss, caches = window_nll(model, tokens, perts, chunk, **cache_kwargs)
        kv = [a[:, :, :n] for c in caches for a in (c.keys, c.values)]
        return loss, kv

    (loss, kv), grads = mx.value_and_grad(fn)(zeros)
    mx.eval(loss, grads, kv)
    # (in plain mode the stored K/V include δ = 0, so they are the clean ones too)
    return float(loss.item()), grads, kv


def error_scale_sq(x: mx.array, stream: int, group_size: int, sinks: int) -> mx.array:
    """r² [H, T, D]: the squared range of the KIVI group each element of x [H, T, D] falls in
    (keys: per channel over blocks of G tokens from position `sinks`; values: per token over
    groups of G channels); 0 at the sink positions and in the last incomplete key block."""
    h, t, d = x.shape
    n_blocks = max(t - sinks, 0) // group_size
    lo, hi = sinks, sinks + n_blocks * group_size
    r2 = mx.zeros((h, t, d), dtype=mx.float32)
    if n_blocks == 0:
        return r2
    body = x[:, lo:hi].astype(mx.float32)
    if stream == 0:
        b = body.reshape(h, n_blocks, group_size, d)
        r = mx.repeat((b.max(2) - b.min(2))[:, :, None], group_size, axis=2)
    else:
        b = body.reshape(h, hi - lo, d // group_size, group_size)
        r = mx.repeat((b.max(-1) - b.min(-1))[..., None], group_size, axis=-1)
    r2[:, lo:hi] = (r * r).reshape(h, hi - lo, d)
    return r2


def _range_weight(r2: mx.array) -> mx.array:
    """r² / mean(r²) over the quantized elements (r² > 0), per head."""
    used = (r2 > 0).astype(mx.float32)
    mean = (r2 * used).sum(axis=(1, 2)) / mx.maximum(used.sum(axis=(1, 2)), 1.0)
    return r2 / mx.maximum(mean, 1e-30)[:, None, None]


def fisher_importance(
    model: Any,
    windows: np.ndarray,
    *,
    mode: str = "runtime",
    chunk: int | None = 64,
    window: int = 32,
    sinks: int = 4,
    group_size: int = 64,
    range_weighted: bool = True,
    progress: bool = False,
    time_forward: bool = True,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(w, w_sq, timing): w [L, H_kv, 2] the importance (range-weighted unless told not to),
    w_sq [L, H_kv, 2] the plain E Σ g², both float64 means over windows [N, S]; stream 0 keys,
    1 values. In mode "plain" the window is one call (chunk ignored). timing: seconds per
    window of the gradient pass and in all, and with `time_forward` those of a forward fed the
    same way and of a one-call forward (two extra forward passes, for the ratios)."""
    from tqdm.auto import tqdm

    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"fisher_importance needs token windows [N, S >= 2], got {windows.shape}")
    if mode not in MODES:
        raise ValueError(f"fisher: mode must be one of {MODES}, got {mode!r}")
    kwargs = {"mode": mode, "window": window, "sinks": sinks, "group_size": group_size}
    chunk = None if mode == "plain" else chunk
    n_layers = len(model.layers)
    w_sum = w_sq_sum = 0.0
    grad_s = []
    for wi in tqdm(range(windows.shape[0]), desc="fisher", unit="window", disable=not progress):
        tokens = mx.array(windows[wi].astype(np.int32))
        t0 = time.perf_counter()
        _, grads, kv = window_gradients(model, tokens, chunk, **kwargs)
        sq, weighted = [], []
        for i, (g, x) in enumerate(zip(grads, kv, strict=True)):
            g2 = g[0] * g[0]  # [H, T, D]
            sq.append(g2.sum(axis=(1, 2)))
            if range_weighted:
                r2 = error_scale_sq(x[0], i % 2, group_size, sinks)
                weighted.append((g2 * _range_weight(r2)).sum(axis=(1, 2)))
        sq = np.array(mx.stack(sq), np.float64).reshape(n_layers, 2, -1).transpose(0, 2, 1)
        wt = (
            np.array(mx.stack(weighted), np.float64).reshape(n_layers, 2, -1).transpose(0, 2, 1)
            if range_weighted
            else sq
        )
        grad_s.append(time.perf_counter() - t0)
        bad = ~(np.isfinite(sq) & np.isfinite(wt))
        if bad.any():
            layer, head, stream = (int(a[0]) for a in np.nonzero(bad))
            raise FloatingPointError(
                f"fisher: non-finite gradient in layer {layer} (KV head {head}, "
                f"{STREAM_NAMES[stream]}) on calibration window {wi}; check the model weights "
                "and dtype (float16 overflow?) or drop that window"
            )
        w_sum, w_sq_sum = w_sum + wt, w_sq_sum + sq
    med = float(np.median(grad_s))
    timing = {"fisher_window_s": med, "fisher_total_s": float(np.sum(grad_s))}
    if time_forward:
        tokens = mx.array(windows[0].astype(np.int32))
        none = [None] * (2 * n_layers)
        t0 = time.perf_counter()
        mx.eval(window_nll(model, tokens, none, chunk, **kwargs)[0])
        fed_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(window_nll(model, tokens, none, None)[0])
        one_call_s = time.perf_counter() - t0
        timing.update(
            forward_window_s=fed_s,
            forward_one_call_s=one_call_s,
            fisher_over_forward=med / fed_s,
            fisher_over_one_call_forward=med / one_call_s,
        )
    n = windows.shape[0]
    return w_sum / n, w_sq_sum / n, timing


def noise_validation(
    model: Any,
    tokens: np.ndarray,
    units: Sequence[tuple[int, int, int]],
    *,
    sigma: float = 0.05,
    draws: int = 2,
    seed: int = 0,
    mode: str = "runtime",
    chunk: int | None = 64,
    window: int = 32,
    sinks: int = 4,
    group_size: int = 64,
    range_weighted: bool = True,
) -> np.ndarray:
    """ΔKL / σ² per unit (layer, head, stream) on one window tokens [S], forward only: the
    KL(clean ‖ noisy) summed over positions, with Gaussian noise as the perturbation of that
    head's K or V only, fed like `fisher_importance` with the same arguments; the noise's std
    is ∝ the KIVI group range r when range_weighted (else flat), scaled so its overall RMS
    is σ = sigma · the head's RMS on this window; averaged over `draws` samples. ≈ ½ w."""
    x = mx.array(np.asarray(tokens, dtype=np.int32))
    kwargs = {"mode": mode, "window": window, "sinks": sinks, "group_size": group_size}
    chunk = None if mode == "plain" else chunk
    n_layers = len(model.layers)
    shape = _kv_shape(model, x.shape[0] - 1)
    none: list[mx.array | None] = [None] * (2 * n_layers)
    ref, caches = window_logp(model, x, none, chunk, **kwargs)
    mx.eval(ref, [c.state for c in caches])
    key = mx.random.key(seed)
    out = []
    for layer, head, stream in units:
        stored = (caches[layer].keys if stream == 0 else caches[layer].values)[
            0, head : head + 1, : shape[2]
        ]
        rms = float(mx.sqrt(mx.mean(stored.astype(mx.float32) ** 2)).item())
        s = sigma * max(rms, 1e-12)
        shape_std = (
            mx.sqrt(_range_weight(error_scale_sq(stored, stream, group_size, sinks)))[0]
            if range_weighted
            else mx.ones(shape[2:])
        )
        kls = []
        for _ in range(draws):
            key, sub = mx.random.split(key)
            pert = mx.zeros(shape, dtype=mx.float32)
            pert[:, head] = mx.random.normal(shape[2:], key=sub) * shape_std * s
            perts = list(none)
            perts[2 * layer + stream] = pert
            noisy, _ = window_logp(model, x, perts, chunk, **kwargs)
            kl = sum((mx.exp(r) * (r - n)).sum() for r, n in zip(ref, noisy, strict=True))
            kls.append(float(kl.item()))
        out.append(float(np.mean(kls)) / (s * s))
    return np.array(out)


def kivi_error(x: mx.array, stream: int, bits: int, group_size: int, sinks: int) -> mx.array:
    """The runtime quantizer's error Q_b(x) − x on x [B, H, T, D] (stream 0 keys, 1 values) at
    the positions a KIVICache quantizes: whole blocks of G from position `sinks` (it flushes
    in such blocks); zero at the sinks and after the last whole block."""
    t = x.shape[2]
    lo = min(sinks, t)
    hi = lo + (t - lo) // group_size * group_size
    if hi == lo:
        return mx.zeros_like(x)
    body = x[:, :, lo:hi].astype(mx.float32)
    err = kivi.fake_quantize(body, bits, group_size, STREAM_KINDS[stream]) - body
    pad = [(0, 0), (0, 0), (lo, t - hi), (0, 0)]
    return mx.pad(err, pad)


def check_response_window(n_tokens: int, chunk: int, window: int, sinks: int, group_size: int):
    """A clear error unless a window of n_tokens, fed in calls of `chunk`, ever has a call
    that sees a quantized token (else neither the runtime Fisher pass nor the stream response
    measures anything)."""
    starts = range(0, max(n_tokens - 1, 0), chunk)
    if not any(
        hi > lo for lo, hi in (quantized_prefix(s, window, sinks, group_size) for s in starts)
    ):
        raise ValueError(
            f"ratequant: a window of {n_tokens} tokens fed in calls of {chunk} never holds a "
            f"quantized token with window={window}, sinks={sinks}, G={group_size} (the first "
            f"block is quantized after {sinks + window + group_size} tokens); use longer "
            "calibration windows (fisher_tokens, response_tokens) or a shorter chunk"
        )


def quantization_kl(
    model: Any,
    tokens: np.ndarray,
    key_bits: int | None,
    value_bits: int | None,
    *,
    chunk: int = 64,
    window: int = 32,
    sinks: int = 4,
    group_size: int = 64,
    reference: tuple[list, list] | None = None,
) -> float:
    """Mean KL(clean ‖ quantized) per token of one window tokens [S] when every layer's keys
    (values) carry the KIVI error of their clean values at key_bits (value_bits); None leaves
    a stream exact. Fed in calls of `chunk` tokens in runtime mode, so each call sees the
    error exactly where a KIVICache with this layout holds tokens quantized (see the module
    docstring for what is approximate); the mean is over the calls that see any quantized
    token. `reference`: the clean
    (log-probs, caches) of `window_logp`, to share across calls."""
    x = mx.array(np.asarray(tokens, dtype=np.int32))
    check_response_window(x.shape[0], chunk, window, sinks, group_size)
    kwargs = {"mode": "runtime", "window": window, "sinks": sinks, "group_size": group_size}
    n_layers = len(model.layers)
    n = x.shape[0] - 1
    if reference is None:
        reference = window_logp(model, x, [None] * (2 * n_layers), chunk, **kwargs)
        mx.eval(reference[0])
    ref, caches = reference
    perts: list[mx.array | None] = []
    for c in caches:
        for stream, bits in enumerate((key_bits, value_bits)):
            stored = (c.keys if stream == 0 else c.values)[:, :, :n]
            perts.append(
                None if bits is None else kivi_error(stored, stream, bits, group_size, sinks)
            )
    noisy, _ = window_logp(model, x, perts, chunk, **kwargs)
    total, count = 0.0, 0
    for start, (r, q) in zip(range(0, n, chunk), zip(ref, noisy, strict=True), strict=True):
        lo, hi = quantized_prefix(start, window, sinks, group_size)
        if hi > lo:
            total += float((mx.exp(r) * (r - q)).sum().item())
            count += r.shape[0]
    return total / count


def stream_response(
    model: Any,
    tokens: np.ndarray,
    allowed: Sequence[int],
    *,
    chunk: int = 64,
    window: int = 32,
    sinks: int = 4,
    group_size: int = 64,
    progress: bool = False,
) -> np.ndarray:
    """KL [2, len(allowed)] (float64): `quantization_kl` with only the keys (row 0) or only the
    values (row 1) quantized, at each allowed width, on one window tokens [S]."""
    from tqdm.auto import tqdm

    x = mx.array(np.asarray(tokens, dtype=np.int32))
    kwargs = {"window": window, "sinks": sinks, "group_size": group_size}
    reference = window_logp(
        model, x, [None] * (2 * len(model.layers)), chunk, mode="runtime", **kwargs
    )
    mx.eval(reference[0])
    out = np.zeros((2, len(allowed)))
    jobs = [(s, i) for s in range(2) for i in range(len(allowed))]
    for s, i in tqdm(jobs, desc="stream response", unit="run", disable=not progress):
        bits = (allowed[i], None) if s == 0 else (None, allowed[i])
        out[s, i] = quantization_kl(
            model, tokens, *bits, chunk=chunk, reference=reference, **kwargs
        )
    return out


def proxy_importance(stats: dict[str, Any]) -> np.ndarray:
    """E‖x‖² [L, H, 2] from capture stats (exact per-channel second moments over every token):
    k_post.sq_mean and v.sq_mean summed over head_dim."""
    k = np.asarray(stats["k_post.sq_mean"], dtype=np.float64).sum(-1)
    v = np.asarray(stats["v.sq_mean"], dtype=np.float64).sum(-1)
    return np.stack([k, v], axis=-1)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):  # average tied ranks
            tie = x == v
            if tie.sum() > 1:
                r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(np.asarray(a, np.float64)), ranks(np.asarray(b, np.float64))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def stratified_units(importance: np.ndarray, n: int) -> list[tuple[int, int, int]]:
    """n (layer, head, stream) units evenly spaced in importance rank, so a rank check spans
    the whole range rather than a random cluster."""
    flat = importance.reshape(-1)
    n = min(n, flat.size)
    order = np.argsort(flat, kind="stable")
    picks = order[np.unique(np.round(np.linspace(0, flat.size - 1, n)).astype(int))]
    return [tuple(int(i) for i in np.unravel_index(p, importance.shape)) for p in picks]
