"""Opt-in dispatch of mlx-lm's attention call to veloxquant's fused attention.

mlx-lm's attention modules call `scaled_dot_product_attention(queries, keys, values, cache=...,
scale=..., mask=...)`, a name each model module binds at import (`from .base import
scaled_dot_product_attention`). `install()` rebinds that name, in `mlx_lm.models.base` and in
every loaded model module that bound it, to `dispatch`:

- when `cache` is a veloxquant cache whose latest update was a fused one (it has a pending
  attention), the call goes to `cache.fused_attention(queries, scale, mask)`, which attends
  straight from the codes; the keys and values the cache returned are not read;
- every other call (any other cache, no cache, a veloxquant cache on its transient path) goes
  to mlx-lm's own function, unchanged.

`uninstall()` puts mlx-lm's function back everywhere it was replaced. `fused()` is the same as
a context manager.

A cache only takes the fused path when its `fused` flag is set, and `make_cache` sets it only
for a model whose attention module looks the name up here (`routes(model)`): a model whose
attention calls `mx.fast.scaled_dot_product_attention` directly keeps the transient path, and
says so once in the log. If a fused update is ever not followed by its attention, the cache
raises at its next update rather than attend wrongly twice. A cache loaded from a saved prompt
cache has no model to ask: its first update runs transient, and it fuses from the next one only
if that update's attention came through `dispatch` (`route_proven`).

`native_softmax()` also routes, for the duration of a block, CPU float32 attention with a causal
or no mask through `cpu_attention` (and mlx-lm's quantized attention through
`cpu_quantized_attention`): MLX's and mlx-lm's own CPU attention, op for op, with the softmax
from `veloxquant.cpu_kernels` (the same bits, its exp vectorized). Capture, evaluate and RateQuant's
gradient pass use it (through `cpu_kernels.vectorized()`); every other call goes to mlx-lm's
function as before.

`VELOXQUANT_FUSED` picks the path of new caches: `auto` (the default) fuses where MLX runs on a
GPU that takes the kernels (CUDA or Metal), and on the CPU for a method with a CPU kernel there
(VecInfer, with the CPU extension built: `veloxquant.cpu_kernels`); other methods keep the
transient path on the CPU. `1` fuses everywhere (the pure-MLX twins of the kernels where no
kernel runs); `0` never fuses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base

from veloxquant import cpu_kernels, rope

NAME = "scaled_dot_product_attention"
log = logging.getLogger("veloxquant")

_original = mlx_base.scaled_dot_product_attention
_patched: list[Any] = []  # modules whose NAME we replaced
_cpu_softmax_on = False  # set by `native_softmax()`


def dispatch(
    queries: Any,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> Any:
    """mlx-lm's scaled_dot_product_attention, with veloxquant's fused caches routed to their
    own attention."""
    if getattr(cache, "_route_probe", None) == "asked":
        cache._route_probe = None  # a loaded cache's attention does come here (route_proven)
    if getattr(cache, "_pending", None) is not None and hasattr(cache, "fused_attention"):
        if sinks is not None:
            raise NotImplementedError(
                "veloxquant fused attention does not take attention-sink logits (sinks=); "
                "set cache.fused = False for this model"
            )
        return cache.fused_attention(queries, scale=scale, mask=mask)
    queries = rope.rotated(queries)  # where a tapped rope handed it on unrotated
    if _cpu_softmax_on and _takes_cpu_softmax(queries, keys, cache, mask, sinks):
        if hasattr(cache, "bits"):
            return cpu_quantized_attention(
                queries, keys, values, scale, mask, cache.group_size, cache.bits
            )
        return cpu_attention(queries, keys, values, scale, mask)
    return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def mask_columns(mask: Any, n_q: int, total: int, start: int, length: int) -> mx.array | None:
    """Columns start .. start+length-1 of the attention mask of n_q queries over `total` keys
    (the queries being the last n_q of them): None (no mask), "causal", or an mlx-lm mask
    array [.., N, total]; None means every column is visible. For attention computed in
    pieces (the fused caches' pure-MLX paths), as a boolean or additive mask broadcasting
    against scores [B, H_kv, G, N, length]."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        qpos = mx.arange(total - n_q, total)[:, None]
        kpos = mx.arange(start, start + length)[None, :]
        return qpos >= kpos
    if mask.ndim == 4:  # [B, 1, N, L] against scores [B, H, G, N, L]
        mask = mask[:, :, None]
    return mask[..., start : start + length]


def apply_mask(scores: mx.array, mask: mx.array | None) -> mx.array:
    """scores with `mask_columns`'s mask applied (masked scores become -inf)."""
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf)
    return scores + mask


def route_proven(cache: Any) -> bool:
    """Whether a cache with `fused` set may take its fused update now. `make_cache` fuses only
    for a model whose attention is routed here (`enable_for`); a cache restored from a saved
    state (`_route_probe = "loaded"`) has no model to ask. Its first update therefore runs on
    the transient path, which is right under any attention, and `dispatch` marks the cache
    when that update's attention comes through it: from the next update on, the cache fuses.
    If it never came, the model's attention is not routed, and the cache stays transient
    (`fused` cleared, logged once), rather than attend only its new tokens."""
    probe = getattr(cache, "_route_probe", None)
    if probe is None:
        return True
    if probe == "loaded":
        cache._route_probe = "asked"
        return False
    cache._route_probe = None
    cache.fused = False
    name = type(cache).__name__
    if name not in _warned:
        _warned.add(name)
        log.info(
            "veloxquant: a loaded %s uses the transient path: the model's attention does not "
            "call mlx-lm's scaled_dot_product_attention by name",
            name,
        )
    return False


def unattended_update(cache: Any) -> RuntimeError:
    """The error a fused cache raises at an update when the previous one's attention never
    ran: the model's attention is not routed here."""
    return RuntimeError(
        f"{type(cache).__name__}: a fused update was never followed by its attention, so the "
        "model's attention is not routed through veloxquant.attention (it calls something "
        "other than mlx-lm's scaled_dot_product_attention). Set cache.fused = False on every "
        "layer to use the transient path."
    )


def exact_tokens(cache: Any, pending: dict) -> tuple[mx.array, mx.array, int]:
    """The tokens a fused cache attends at full precision for the update behind `pending`, in
    position order: the sinks (the call's own with the stored ones when the call reached them,
    `pending["sinks"]`, else the stored ones), the window as the call found it
    (`pending["win"]`, or None) and the call's own tokens (`pending["new"]`). Returns float32
    keys and values [B, H, n, D] and the number of sinks among them."""
    sink_k, sink_v = pending.get("sinks") or (cache.sink_keys, cache.sink_values)
    keys = [] if sink_k is None else [sink_k]
    values = [] if sink_v is None else [sink_v]
    n_sink = 0 if sink_k is None else int(sink_k.shape[2])
    if pending["win"] is not None:
        keys.append(pending["win"][0])
        values.append(pending["win"][1])
    keys.append(pending["new"][0])
    values.append(pending["new"][1])
    f32 = mx.float32
    return (
        mx.concatenate([x.astype(f32) for x in keys], axis=2),
        mx.concatenate([x.astype(f32) for x in values], axis=2),
        n_sink,
    )


class OnlineSoftmax:
    """Attention of scaled queries [B, H_kv, G·N, D] (KV head h serving query heads
    hG .. hG+G-1, N queries each) accumulated over pieces of keys and values [B, H_kv, L, D]
    with an online softmax, so that no more than a piece of a long past is held at once: the
    fused caches' pure-MLX twins. Float32."""

    def __init__(self, q: mx.array, n_queries: int):
        self.q = q
        b, h, gn, d = q.shape
        self.shape = (b, h, gn // n_queries, n_queries)
        f32 = mx.float32
        # a finite floor: a piece whose every column is masked (a sliding window) leaves it,
        # where -inf would give exp(-inf - -inf) = NaN
        self.m = mx.full((*self.shape, 1), -1.0e30, f32)
        self.l = mx.zeros((*self.shape, 1), f32)
        self.o = mx.zeros((*self.shape, d), f32)

    def add(self, keys: mx.array, values: mx.array, mask: mx.array | None) -> None:
        """One piece; `mask` from `mask_columns` for its columns (None: all visible)."""
        b, h, g, n = self.shape
        s = (self.q @ keys.swapaxes(-1, -2)).reshape(b, h, g, n, keys.shape[2])
        s = apply_mask(s, mask)
        m_new = mx.maximum(self.m, s.max(axis=-1, keepdims=True))
        alpha = mx.exp(self.m - m_new)
        p = mx.exp(s - m_new)
        pv = (p.reshape(b, h, g * n, -1) @ values).reshape(b, h, g, n, -1)
        self.o = self.o * alpha + pv
        self.l = self.l * alpha + p.sum(axis=-1, keepdims=True)
        self.m = m_new

    def add_exact(
        self, keys: mx.array, values: mx.array, n_sink: int, n_before: int, mask: Any
    ) -> None:
        """The exact tokens of `exact_tokens` (n_sink sinks, then the rest), whose columns
        are 0 .. n_sink-1 and, after the n_before compressed tokens, the last ones."""
        n = self.shape[3]
        total = n_before + keys.shape[2]
        cols = [(0, n_sink)] if n_sink else []
        cols.append((n_sink + n_before, keys.shape[2] - n_sink))
        masks = [mask_columns(mask, n, total, start, length) for start, length in cols]
        self.add(keys, values, None if masks[0] is None else mx.concatenate(masks, axis=-1))

    def result(self, dtype: mx.Dtype) -> mx.array:
        """The attention [B, H_q, N, D] in `dtype`."""
        b, h, g, n = self.shape
        return (self.o / self.l).reshape(b, h * g, n, -1).astype(dtype)


def _takes_cpu_softmax(queries: Any, keys: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    if not (
        (mask is None or (isinstance(mask, str) and mask == "causal"))
        and sinks is None
        and queries.dtype == mx.float32
        and mx.default_device() == mx.cpu
    ):
        return False
    if hasattr(cache, "bits"):  # mlx-lm's quantized attention: keys are (codes, scales, biases)
        return isinstance(keys, tuple) and keys[0].shape[-2] >= queries.shape[2]
    return isinstance(keys, mx.array) and keys.dtype == mx.float32


def _probabilities(scores: mx.array, mask: str | None) -> mx.array:
    """The softmax of scores [..., Lq, Lk], under MLX's causal mask (query i sees keys up to
    Lk - Lq + i) or none."""
    if mask != "causal":
        return cpu_kernels.softmax(scores)
    return cpu_kernels.causal_softmax(scores, max(scores.shape[-1] - scores.shape[-2], 0))


def cpu_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: str | None
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)`
    (mask "causal" or None) as MLX computes it on the CPU, bit for bit: its fallback's scaled
    queries, the scores' matmul (queries grouped by KV head), masked scores set to the dtype's
    lowest value, the softmax, and the probabilities' matmul with the values. The masked
    softmax is `veloxquant.cpu_kernels.causal_softmax`, the same bits as MLX's, computed over
    each row's visible part only. Tests compare the outputs and the gradients."""
    n_batch, n_q_heads, n_queries, _ = queries.shape
    n_kv_heads = keys.shape[1]
    repeats = n_q_heads // n_kv_heads
    queries = queries * mx.array(scale, queries.dtype)
    if repeats > 1:
        queries = queries.reshape(n_batch, n_kv_heads, repeats, n_queries, queries.shape[-1])
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    out = _probabilities(queries @ mx.swapaxes(keys, -1, -2), mask) @ values
    return out.reshape(n_batch, n_q_heads, n_queries, -1) if repeats > 1 else out


def cpu_quantized_attention(
    queries: mx.array,
    keys: tuple,
    values: tuple,
    scale: float,
    mask: str | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention` (mask "causal" or None) bit for bit:
    its scaled queries, the scores' quantized matmul (queries grouped by KV head), masked
    scores set to the lowest float, the softmax, the probabilities' quantized matmul with the
    values; with the masked softmax and the quantized matmuls of `veloxquant.cpu_kernels`."""
    n_batch, n_q_heads, n_queries, head_dim = queries.shape
    n_kv_heads = keys[0].shape[-3]
    repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(n_batch, n_kv_heads, repeats, n_queries, head_dim)
        keys = tuple(mx.expand_dims(a, -3) for a in keys)
        values = tuple(mx.expand_dims(a, -3) for a in values)
    scores = cpu_kernels.quantized_matmul(
        queries, *keys, transpose=True, group_size=group_size, bits=bits
    )
    probs = _probabilities(scores, mask)
    out = cpu_kernels.quantized_matmul(
        probs, *values, transpose=False, group_size=group_size, bits=bits
    )
    return out.reshape(n_batch, n_q_heads, n_queries, -1) if repeats > 1 else out


@contextlib.contextmanager
def native_softmax() -> Iterator[None]:
    """Route CPU float32 attention through `cpu_attention` for the duration of a block (the
    dispatch is installed for it, and uninstalled after if it was not on before). When the
    extension is not built, MLX's softmax runs inside it (the same bits; one log line says so)."""
    global _cpu_softmax_on
    was_installed, was_on = installed(), _cpu_softmax_on
    install()
    _cpu_softmax_on = True
    try:
        yield
    finally:
        _cpu_softmax_on = was_on
        if not was_installed:
            uninstall()


def installed() -> bool:
    return mlx_base.scaled_dot_product_attention is dispatch


def install() -> None:
    """Route mlx-lm's attention through `dispatch` (idempotent; model modules imported later
    bind the routed name from mlx_lm.models.base)."""
    for name, module in list(sys.modules.items()):
        if not (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models.")):
            continue
        if getattr(module, NAME, None) is _original:
            setattr(module, NAME, dispatch)
            _patched.append(module)


def uninstall() -> None:
    """Put mlx-lm's own function back wherever `install` replaced it, and in model modules
    imported meanwhile (they bound the routed name from mlx_lm.models.base); and every model's
    own rope modules back where a fused cache tapped them (`veloxquant.rope.tap`)."""
    _patched.clear()
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, NAME, None) is dispatch:
            setattr(module, NAME, _original)
    rope.untap_all()


@contextlib.contextmanager
def fused() -> Iterator[None]:
    """`install()` for the duration of a block, restored after (if it was not on before)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def routes(model: Any) -> bool:
    """Whether `model`'s attention looks up the routed function (every layer's module)."""
    layers = getattr(model, "layers", None) or []
    mods = {type(getattr(layer, "self_attn", None)).__module__ for layer in layers}
    if not mods or not installed():
        return False
    return all(getattr(sys.modules.get(m), NAME, None) is dispatch for m in mods)


MODES = {"auto": None, "1": True, "0": False}


def wanted(cpu_kernel: bool = False) -> bool:
    """Whether new caches take the fused path, by VELOXQUANT_FUSED (module docstring);
    cpu_kernel: the method has a kernel that runs on this CPU, so `auto` fuses here too."""
    value = os.environ.get("VELOXQUANT_FUSED", "auto").strip().lower()
    if value not in MODES:
        raise ValueError(
            f"VELOXQUANT_FUSED={value!r}: expected one of {sorted(MODES)} "
            "(auto: fused where a kernel runs; 1: always; 0: never)"
        )
    if MODES[value] is None:
        from veloxquant.kernels import backend

        return backend() is not None or cpu_kernel
    return MODES[value]


def wanted_for(auto: bool, cpu_kernel: bool = False) -> bool:
    """`wanted(cpu_kernel)` for a method whose fused path is the default where `auto` fuses
    (auto=True) or only when asked for with VELOXQUANT_FUSED=1 (auto=False)."""
    explicit = os.environ.get("VELOXQUANT_FUSED", "auto").strip().lower() == "1"
    return wanted(cpu_kernel) and (auto or explicit)


def enable_for(
    model: Any, caches: list, method: str, auto: bool = True, cpu_kernel: bool = False
) -> bool:
    """Install the dispatch and put `caches` on the fused path when `model`'s attention is
    routed and VELOXQUANT_FUSED asks for it (`wanted`); otherwise leave them on the transient
    path (logging once why, when the model is the reason). auto=False: a method whose fused
    path is not yet the default anywhere fuses only when VELOXQUANT_FUSED=1; cpu_kernel: the
    method's fused path runs a kernel on this CPU, so `auto` fuses here too. Returns whether
    they are fused."""
    if not wanted_for(auto, cpu_kernel):
        return False
    install()
    if not routes(model):
        key = (method, type(model).__module__)
        if key not in _warned:
            _warned.add(key)
            log.info(
                "veloxquant: %s caches use the transient path for %s: its attention does not "
                "call mlx-lm's scaled_dot_product_attention by name",
                method,
                type(model).__module__,
            )
        return False
    for c in caches:
        c.fused = True
    return True


_warned: set = set()
