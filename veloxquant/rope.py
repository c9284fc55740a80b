"""The model's RoPE, as data a cache can keep and apply at any position.

Caches that code keys relative to something position-dependent (the rotated key mean; CommVQ's
pre-RoPE codes) must apply exactly the rotation the model applies, and must still do so after
`load_prompt_cache` restored them without a model. `RopeSpec` reads the rotation off the model's
own rope module and applies it with `mx.fast.rope`, the same kernel mlx-lm's modules call.

Supported: `mlx.nn.RoPE` (plain and linear-scaled) and mlx-lm's `Llama3RoPE` (frequency table).
Other variants (YaRN and SuScaled multiply by an mscale, dynamic NTK changes with the length)
are refused with an error naming the class.

`RopeTap` wraps a model's rope modules (`tap` / `untap`) so that a fused cache can rotate the
decode step's own query and key inside its attention kernel instead (`unrotated`), and, once it
does, have them handed on unrotated without building the model's rotation at all
(`DeferredPosition`, `deferral`, `rotated`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class RopeSpec:
    dims: int
    traditional: bool
    base: float | None  # None when `freqs` gives the frequencies
    scale: float
    freqs: mx.array | None = None

    @classmethod
    def from_module(cls, rope: Any, head_dim: int) -> RopeSpec:
        if isinstance(rope, RopeTap):
            rope = rope.rope
        name = type(rope).__name__
        if isinstance(rope, nn.RoPE):
            spec = cls(int(rope.dims), bool(rope.traditional), float(rope.base), float(rope.scale))
        elif name == "Llama3RoPE":
            spec = cls(int(rope.dims), bool(rope.traditional), None, 1.0, rope._freqs)
        else:
            raise ValueError(
                f"the model's RoPE is {name}, which this cache cannot apply exactly (supported: "
                "nn.RoPE, linear scaling, Llama3RoPE). Use a method that does not re-rotate "
                "keys for this model."
            )
        if spec.dims != head_dim:
            raise ValueError(
                f"the model rotates {spec.dims} of {head_dim} head dims (partial rotary), which "
                "this cache cannot apply exactly"
            )
        return spec

    @classmethod
    def of(cls, model: Any) -> RopeSpec:
        """The rotation of `model`'s attention layers (all layers must share one)."""
        layers = getattr(model, "layers", None)
        attn = getattr(layers[0], "self_attn", None) if layers else None
        if attn is None or not hasattr(attn, "rope"):
            raise ValueError("the model has no self_attn.rope module; cannot read its RoPE")
        head_dim = int(getattr(attn, "head_dim", 0) or model.args.head_dim)
        spec = cls.from_module(attn.rope, head_dim)
        for i, layer in enumerate(layers):
            other = cls.from_module(layer.self_attn.rope, head_dim)
            if other.meta() != spec.meta():
                raise ValueError(f"layer {i} uses another RoPE than layer 0; unsupported")
        return spec

    def apply(self, x: mx.array, offset: int) -> mx.array:
        """RoPE of x [..., T, D] at positions offset, offset + 1, ... (float32)."""
        # contiguous: MLX 0.32.4's CUDA rope misreads stride-0 (broadcast) inputs such as the
        # rotated key mean's, which the CPU and Metal kernels read correctly
        return mx.fast.rope(
            mx.contiguous(x.astype(mx.float32)),
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )

    def meta(self) -> dict[str, Any]:
        """Scalars for a cache's meta_state (the frequency table travels as an array)."""
        return {
            "rope_dims": self.dims,
            "rope_traditional": self.traditional,
            "rope_base": None if self.base is None else repr(self.base),
            "rope_scale": repr(self.scale),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], freqs: mx.array | None) -> RopeSpec:
        base = meta["rope_base"]
        return cls(
            int(meta["rope_dims"]),
            bool(meta["rope_traditional"]),
            None if base is None else float(base),
            float(meta["rope_scale"]),
            freqs,
        )


# Requests shorter than this rotate the mean directly: a table would cost as much and push a
# long one out of the memo.
TABLE_MIN_LENGTH = 16
# A step asks for two spans per layer (the coded past; the tokens it encodes). Rotation tables
# above TABLE_KEPT_ELEMENTS (each of cos and sin) are not kept, so they hold at most 64 MiB
# after a long prompt. Phase tables are kept whatever their length: the CPU kernel reads one
# every layer of every step, a table is what one layer's call holds anyway, and each step's is
# the previous step's grown by its new rows (`phase_table`).
TABLES_KEPT = 2
TABLE_KEPT_ELEMENTS = 1 << 22


def _tables() -> OrderedDict:
    # (spec, offset, length) -> (freqs, cos, sin), newest last. Per thread: a table may still be
    # unevaluated, and MLX evaluates an array only in the thread whose stream built it.
    if not hasattr(_local, "tables"):
        _local.tables = OrderedDict()
    return _local.tables


def rotation_table(rope: RopeSpec, offset: int, length: int) -> tuple[mx.array, mx.array]:
    """(cos, sin), each [length, D], for positions offset .. offset + length - 1, such that
    RoPE_m(x) = x ⊙ cos[m] + swap(x) ⊙ sin[m], where swap exchanges the two elements of every
    rotated pair (`rotate_by_table`). Both come from `mx.fast.rope` turning a unit vector of each
    pair, so the angles and their cos / sin are the model's own, bit for bit.

    The rotated key mean of every layer at a step spans the same positions, and computing
    cos / sin is what costs on the CPU (a scalar call per element; the numbers are in
    benchmarks/results/bench_vecinfer-default-layout-cpu.txt). So the last few tables asked for
    are kept, per thread, and shared by all layers; a spec's `freqs` must not be written in
    place (the memo keys it by identity)."""

    def build() -> tuple[mx.array, mx.array]:
        c, s = _pair_angles(rope, offset, length)
        d = rope.dims
        if rope.traditional:
            cos = mx.stack([c, c], axis=-1).reshape(length, d)
            sin = mx.stack([-s, s], axis=-1).reshape(length, d)
        else:
            cos = mx.concatenate([c, c], axis=-1)
            sin = mx.concatenate([-s, s], axis=-1)
        return cos, sin

    return _kept(("rotation", offset, length), rope, length, build)


def phase_table(rope: RopeSpec, offset: int, length: int) -> mx.array:
    """[cos θ_j | sin θ_j] [length, D] of every rotated pair j's angle at positions offset ..
    offset + length - 1 (the model's own values, as `rotation_table`'s): with
    `phase_coefficients`, q·RoPE_m(μ) is one dot product of D terms. Kept per thread like the
    rotation tables, and built from the longest kept table of the same offset plus the rows it
    lacks: a decode step's table is the previous step's and one row (computing cos / sin is
    what costs on the CPU; each row is the same whichever call computed it)."""

    def build() -> tuple[mx.array, None]:
        same_start = _key(rope, ("phase", offset))
        shorter = [
            (key[-1], hit[1])
            for key, hit in _tables().items()
            if key[:-1] == same_start and key[-1] < length and hit[0] is rope.freqs
        ]
        done, parts = 0, []
        if shorter:
            done, kept = max(shorter, key=lambda x: x[0])
            parts.append(kept)
        parts.append(mx.concatenate(_pair_angles(rope, offset + done, length - done), axis=-1))
        return (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)), None

    return _kept(("phase", offset, length), rope, length, build, keep_any_length=True)[0]


def phase_coefficients(q: mx.array, mean: mx.array, rope: RopeSpec) -> mx.array:
    """[a | b] [..., D] of rows q [..., D] against a vector μ (broadcast to q) such that
    q·RoPE_m(μ) = [a | b]·phase_table[m]: for each rotated pair j of elements (x, y),
    a_j = q_x μ_x + q_y μ_y and b_j = q_y μ_x - q_x μ_y."""
    d = q.shape[-1]
    if rope.traditional:
        qx, qy, mx_, my = q[..., 0::2], q[..., 1::2], mean[..., 0::2], mean[..., 1::2]
    else:
        h = d // 2
        qx, qy, mx_, my = q[..., :h], q[..., h:], mean[..., :h], mean[..., h:]
    return mx.concatenate([qx * mx_ + qy * my, qy * mx_ - qx * my], axis=-1)


def _pair_angles(rope: RopeSpec, offset: int, length: int) -> tuple[mx.array, mx.array]:
    # (cos, sin) [length, D / 2] of every pair's angle, from mx.fast.rope turning a unit vector
    # of each pair: cos lands at the pair's first slot, sin at its second
    d, half = rope.dims, rope.dims // 2
    first = mx.arange(d) % 2 == 0 if rope.traditional else mx.arange(d) < half
    unit = mx.broadcast_to(first.astype(mx.float32), (1, 1, length, d))
    turned = rope.apply(unit, offset)[0, 0]
    if rope.traditional:
        return turned[:, 0::2], turned[:, 1::2]
    return turned[:, :half], turned[:, half:]


def _key(rope: RopeSpec, what: tuple) -> tuple:
    return (rope.dims, rope.traditional, rope.base, rope.scale, id(rope.freqs), *what)


def _kept(
    what: tuple, rope: RopeSpec, length: int, build: Callable, keep_any_length: bool = False
) -> tuple:
    """build()'s tables for `what` (a kind, the offset, the length) under `rope`, from the
    per-thread memo when it has them; kept there when no bigger than TABLE_KEPT_ELEMENTS (or
    whatever their size, keep_any_length)."""
    key = _key(rope, what)
    tables = _tables()
    hit = tables.get(key)
    if hit is not None and hit[0] is rope.freqs:  # the kept reference pins freqs' id
        tables.move_to_end(key)
        return hit[1:]
    built = build()
    if keep_any_length or length * rope.dims <= TABLE_KEPT_ELEMENTS:
        tables[key] = (rope.freqs, *built)
        while len(tables) > TABLES_KEPT:
            tables.popitem(last=False)
    return built


def swap_pairs(x: mx.array, rope: RopeSpec) -> mx.array:
    """x [..., D] with the two elements of every rotated pair exchanged (`rotation_table`)."""
    d = x.shape[-1]
    if rope.traditional:
        return mx.stack([x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    return mx.concatenate([x[..., d // 2 :], x[..., : d // 2]], axis=-1)


def rotate_by_table(x: mx.array, rope: RopeSpec, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE of rows x [H, D] at the positions of a `rotation_table` [L, D] -> [1, H, L, D]."""
    swapped = swap_pairs(x, rope)
    return x[None, :, None, :] * cos[None, None] + swapped[None, :, None, :] * sin[None, None]


def rotated_mean(mean: mx.array, rope: RopeSpec, offset: int, length: int) -> mx.array:
    """RoPE_m(μ) for m = offset .. offset + length - 1: mean [H, D] -> [1, H, length, D]."""
    h, d = mean.shape
    if length < TABLE_MIN_LENGTH:
        return rope.apply(mx.broadcast_to(mean[None, :, None, :], (1, h, length, d)), offset)
    return rotate_by_table(mean, rope, *rotation_table(rope, offset, length))


class RopeTap(nn.Module):
    """A model's rope module, wrapped so that a cache can find the unrotated rows behind a
    rotation it is handed (`unrotated`). mlx-lm's attention rotates the decode step's query and
    key (`self.rope(x, offset=cache.offset)`) before the cache sees them; a fused cache that
    rotates them inside its own attention kernel instead takes the unrotated rows from here.
    MLX computes lazily, so a rotation that nothing reads then never runs: two small launches
    fewer per layer and step. The tap returns the module's own output, so every other cache
    and path sees exactly what it saw before. Only one-token rows at an int offset (decode
    steps) are remembered, the last few per thread.

    A cache whose steps do rotate inside the kernel says so with its offset, a
    `DeferredPosition`: for it the tap hands the one-token row on unrotated, without building
    the rotation at all (host time: each rope op costs the graph build ~10 us). The cache then
    rotates the row itself: in its kernel, or, on any other path, with this module
    (`rotated`)."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        one_token = x.ndim == 4 and x.shape[2] == 1
        if isinstance(offset, DeferredPosition):
            if one_token:
                _recent().append((x, x, int(offset), self.rope))
                return x
            offset = int(offset)
        y = self.rope(x, offset=offset)
        if one_token and isinstance(offset, int):
            _recent().append((y, x, offset, None))
        return y


# Whether a cache whose kernel rotated a step's rows defers the next step's (DeferredPosition);
# benchmarks compare the two.
DEFER = True


class DeferredPosition(int):
    """A cache's offset asking its model's tapped rope modules (`RopeTap`) to hand one-token
    rows on unrotated: the cache rotates them itself (`rotated`)."""


_local = threading.local()
_tapped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tapped model


def _recent() -> deque:
    # a layer's query and key: the last four rotations suffice, and hold one token each
    if not hasattr(_local, "recent"):
        _local.recent = deque(maxlen=4)
    return _local.recent


def _find(y: mx.array) -> tuple | None:
    # newest first: a row handed on unrotated is its own output, and may be tapped again
    for entry in reversed(_recent()):
        if entry[0] is y:
            return entry
    return None


def unrotated(y: mx.array) -> tuple[mx.array, int] | None:
    """(x, offset) when `y` is the very array a `RopeTap` returned for x at that offset on this
    thread (recently): x's rotation, or x itself handed on unrotated (a DeferredPosition);
    else None."""
    entry = _find(y)
    return None if entry is None else (entry[1], entry[2])


def deferral(y: mx.array) -> Callable[[], mx.array] | None:
    """Where a `RopeTap` handed `y` on unrotated (its offset a DeferredPosition), a function
    that builds the model's rotation of it (the tap's module at y's offset); else None. Kept
    by a cache that rotates later than the tap remembers."""
    entry = _find(y)
    if entry is None or entry[3] is None:
        return None
    rope, x, offset = entry[3], entry[1], entry[2]
    return lambda: rope(x, offset=offset)


def rotated(y: mx.array) -> mx.array:
    """`y` as the model's rope module rotates it: y itself, unless a `RopeTap` handed it on
    unrotated, then that module's rotation of it at its offset."""
    rotate = deferral(y)
    return y if rotate is None else rotate()


def tap(model: Any) -> bool:
    """Wrap each attention layer's rope module of `model` in a `RopeTap` (idempotent). Returns
    False, tapping nothing, where `RopeSpec.of` refuses the layers' rotation (the caches then
    take the model's own)."""
    try:
        RopeSpec.of(model)
    except (ValueError, AttributeError):
        return False
    for layer in model.layers:
        if not isinstance(layer.self_attn.rope, RopeTap):
            layer.self_attn.rope = RopeTap(layer.self_attn.rope)
    _tapped[id(model)] = model
    return True


def untapped(rope: Any) -> Any:
    """The model's own rope module behind a `RopeTap` (the module itself when not tapped): what
    code that reads a rope module's class or parameters must look at, since a fused VecInfer
    cache of the model may have tapped it."""
    return rope.rope if isinstance(rope, RopeTap) else rope


def untap(model: Any) -> None:
    """Put `model`'s own rope modules back where `tap` wrapped them."""
    for layer in getattr(model, "layers", None) or []:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and isinstance(getattr(attn, "rope", None), RopeTap):
            attn.rope = attn.rope.rope
    _tapped.pop(id(model), None)


def untap_all() -> None:
    """`untap` every model tapped in this process (and still alive)."""
    for model in list(_tapped.values()):
        untap(model)
