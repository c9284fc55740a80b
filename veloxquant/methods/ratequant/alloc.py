"""RateQuant distortion curves and the bit allocation (reverse water-filling).

Distortion (`measure_distortion`, `distortion_from_capture`): d(b) = E_tokens ‖x − Q_b(x)‖²
(summed over head_dim) per (layer, KV head, stream) at every allowed b, with the runtime KIVI
quantizer itself (`kivi.fake_quantize`: same G, keys per channel in blocks of G tokens, values
per token in groups of G channels). The capture stores a uniform subsample of tokens in
(sequence, position) order, so a key block is G consecutive *sampled* tokens of one sequence
(a sequence ends where the position drops); the sink positions (< sinks), which the runtime
keeps in fp16, are left out. Because sampled neighbours are further apart than runtime
neighbours, key blocks span more positions than at runtime, which inflates α for keys
somewhat (the slope β is unaffected); values are per token, so exact.

Fit (`fit_distortion`): ln d = ln α − b ln β, one slope per stream (β [2]) with an intercept
α per (layer, head, stream), by least squares over the allowed bits. β is shared per stream
because it is a property of the quantizer and of the group statistics, not of a head, and a
per-head slope from a handful of points would let fit noise steer the allocation; R² is
reported per unit against that shared-slope fit.

Allocation (`allocate`): minimise Σ w·α·β^(−b) subject to mean(b) = b̄ − 32/G (b̄ counts the
fp16 scale + zero per group of G). Reverse water-filling b = clip(log_β(w·α·ln β / μ),
b_min, b_max) with bisection on μ, snap to the nearest allowed width, then greedy
rebalancing by marginal gain Δ(w·d)/Δbits on the *measured* d until the total code bits equal
the budget: while over budget, lower the unit whose next-lower width costs least per bit
saved; while under, raise the unit whose next-higher width gains most per bit spent. Moves
that fit the remaining gap go first; a unit moved one way never moves back. If no sequence of
such moves reaches the budget (widths with steps larger than the gap, e.g. every unit at a
floor of 4 with 8 above), the allocation is refused with the reachable average. Last, exchanges
at constant total: while raising one unit and lowering another by the same bits lowers the
objective, the best such pair is made (the snap of the fitted curve can misplace units
where the measured curve bends, e.g. at 1 bit). The budget is
exact whenever (b̄ − 32/G)·N is an integer for N = L·H·2 units (and reachable), otherwise the
largest total below it; target and achieved b̄ are both reported.

Stream response (`stream_scale`, `admissible_min_bits`): w·d is the second-order loss of
small errors. The calibration also measures the KL of quantizing one whole stream at each
allowed width (fisher.py, `stream_response`). κ_s(b) = measured KL / Σ_units w·d(b) says how
far the second-order model is off for stream s at width b: measured on SmolLM2, about 1.7×
more for values than for keys even at 8 bits, and 1.8-3.3× (keys) / 1.2-1.6× (values) more
at 1-2 bits than at 4. The
allocation minimises Σ w·κ_s(b)·d(b) (a width-dependent rescale of the measured curves per
stream, so the within-stream ranking stays the importance's). A width whose stream alone costs more
than `max_stream_kl` nats per token is not admissible for that stream: there the model is
broken, not perturbed, and no per-unit importance from small perturbations can rank heads
(1-bit keys: a head that ignores its quantized past at small errors attends to garbage at
large ones).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from veloxquant.methods import kivi


def check_allowed_bits(allowed: Sequence[Any]) -> tuple[int, ...]:
    """Sorted unique supported widths (at least two), or a clear error."""
    try:
        values = list(allowed)
    except TypeError as e:
        raise ValueError(
            f"ratequant: allowed_bits must be a list of widths, got {allowed!r}"
        ) from e
    widths = tuple(sorted({kivi.check_bits(b, "ratequant allowed_bits") for b in values}))
    if len(widths) < 2:
        raise ValueError(
            f"ratequant: allowed_bits needs at least two widths to mix, got {list(values)}"
        )
    return widths


def code_budget(target_bits: float, allowed: Sequence[int], group_size: int) -> float:
    """Average code bits for an average b̄ that counts scale + zero; a b̄ outside
    [min + overhead, max + overhead] is an error."""
    ovh = kivi.overhead_bits(group_size)
    lo, hi = min(allowed) + ovh, max(allowed) + ovh
    if (
        not isinstance(target_bits, (int, float, np.floating, np.integer))
        or isinstance(target_bits, bool)
        or not math.isfinite(target_bits)
    ):
        raise ValueError(f"ratequant: bits must be a number, got {target_bits!r}")
    if not lo - 1e-9 <= target_bits <= hi + 1e-9:
        raise ValueError(
            f"ratequant: bits={target_bits} (average bits per element, counting the fp16 "
            f"scale + zero of each group of G={group_size}: +{ovh:g}) is outside "
            f"[{lo:g}, {hi:g}] for allowed widths {list(allowed)}"
        )
    return float(target_bits) - ovh


# ---------------------------------------------------------------------------------------------
# Distortion


def key_block_indices(positions: np.ndarray, group_size: int, sinks: int) -> np.ndarray:
    """Indices of captured tokens that form whole key blocks: G consecutive sampled tokens of
    one sequence (a new sequence starts where the position does not increase), sinks dropped."""
    pos = np.asarray(positions).astype(np.int64)
    starts = np.flatnonzero(np.r_[True, pos[1:] <= pos[:-1]])
    ends = np.r_[starts[1:], len(pos)]
    out = []
    for a, b in zip(starts, ends, strict=True):
        idx = np.arange(a, b)[pos[a:b] >= sinks]
        n = len(idx) // group_size * group_size
        out.append(idx[:n])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def measure_distortion(
    keys: mx.array,
    values: mx.array,
    positions: np.ndarray,
    allowed: Sequence[int],
    group_size: int,
    sinks: int,
) -> np.ndarray:
    """d [H, 2, n_bits] (float64): mean over tokens of ‖x − Q_b(x)‖² of one layer's captured
    keys / values [n, H, D] at each allowed width, with the runtime quantizer."""
    pos = np.asarray(positions)
    kidx = key_block_indices(pos, group_size, sinks)
    vidx = np.flatnonzero(pos >= sinks)
    if len(kidx) == 0 or len(vidx) == 0:
        raise ValueError(
            f"ratequant: the capture has no whole key block of {group_size} "
            "sampled tokens in one sequence; capture more tokens"
        )
    k = mx.take(keys, mx.array(kidx), axis=0).transpose(1, 0, 2)  # [H, n, D], blocks along n
    v = mx.take(values, mx.array(vidx), axis=0).transpose(1, 0, 2)
    out = []
    for b in allowed:
        ek = kivi.fake_quantize(k, b, group_size, "key") - k
        ev = kivi.fake_quantize(v, b, group_size, "value") - v
        out.append(mx.stack([(ek * ek).sum(-1).mean(-1), (ev * ev).sum(-1).mean(-1)], -1))
    d = np.array(mx.stack(out, axis=-1), dtype=np.float64)  # [H, 2, n_bits]
    return d


def distortion_from_capture(
    activations_dir: str | Path,
    n_layers: int,
    allowed: Sequence[int],
    group_size: int,
    sinks: int,
    progress: bool = False,
) -> np.ndarray:
    """d [L, H, 2, n_bits] from a capture dir's k_post and v (see `measure_distortion`)."""
    from tqdm.auto import tqdm

    from veloxquant.capture import load_activations

    out = []
    for layer in tqdm(range(n_layers), desc="distortion", unit="layer", disable=not progress):
        acts = load_activations(activations_dir, layer, ["k_post", "v", "positions"])
        out.append(
            measure_distortion(
                acts["k_post"], acts["v"], np.array(acts["positions"]), allowed, group_size, sinks
            )
        )
    return np.stack(out)


def fit_distortion(
    allowed: Sequence[int], d: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fit ln d = ln α − b ln β with β shared per stream: d [..., 2, n_bits] →
    (α [..., 2], β [2], R² [..., 2] of each unit's points against its fitted line)."""
    b = np.asarray(allowed, dtype=np.float64)
    if np.any(~np.isfinite(d)) or np.any(d <= 0):
        raise ValueError(
            "ratequant: measured distortion must be finite and > 0 at every width "
            "(a constant head?)"
        )
    y = np.log(d)
    yc = y - y.mean(-1, keepdims=True)
    bc = b - b.mean()
    # Shared slope per stream: least squares of all units' centred points on centred bits.
    lead = tuple(range(y.ndim - 2))
    slope = (yc * bc).sum(axis=(*lead, -1)) / (bc @ bc * np.prod(y.shape[:-2], dtype=np.int64))
    ln_beta = -slope  # [2]
    ln_alpha = y.mean(-1) + ln_beta * b.mean()  # [..., 2]
    pred = ln_alpha[..., None] - b * ln_beta[:, None]
    ss_res = ((y - pred) ** 2).sum(-1)
    ss_tot = (yc**2).sum(-1)
    r2 = 1.0 - ss_res / np.maximum(ss_tot, 1e-300)
    return np.exp(ln_alpha), np.exp(ln_beta), r2


# ---------------------------------------------------------------------------------------------
# Allocation


def water_fill(
    w: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
    mean_bits: float,
    b_min: float | np.ndarray,
    b_max: float,
    iters: int = 200,
) -> tuple[np.ndarray, float]:
    """Continuous reverse water-filling: b = clip(log_β(w·α·ln β / μ), b_min, b_max), μ by
    bisection (in log space) so that mean(b) = mean_bits; b_min may be per unit. Returns
    (b, ln μ)."""
    ln_beta = np.log(np.broadcast_to(beta, w.shape))
    with np.errstate(divide="ignore"):
        c = np.log(np.maximum(w, 0) * alpha * ln_beta)  # -inf for w = 0: always b_min
    finite = c[np.isfinite(c)]
    b_min = np.broadcast_to(np.asarray(b_min, np.float64), w.shape)
    if finite.size == 0:
        return np.maximum(np.full(w.shape, float(mean_bits)), b_min), float("nan")

    def bits(ln_mu: float) -> np.ndarray:
        return np.clip((c - ln_mu) / ln_beta, b_min, b_max)

    lo = float(np.min(finite - b_max * ln_beta.max())) - 1.0  # every unit at b_max
    hi = float(np.max(finite - b_min.min() * ln_beta.min())) + 1.0  # every unit at b_min
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if bits(mid).mean() > mean_bits:
            lo = mid
        else:
            hi = mid
    ln_mu = 0.5 * (lo + hi)
    return bits(ln_mu), ln_mu


def _measured_d(d_table: np.ndarray, allowed: Sequence[int], b: np.ndarray) -> np.ndarray:
    pos = np.searchsorted(np.asarray(allowed), b)
    return np.take_along_axis(d_table, pos[..., None], axis=-1)[..., 0]


def stream_scale(
    stream_kl: np.ndarray, importance: np.ndarray, distortion: np.ndarray
) -> np.ndarray:
    """κ [2, n_bits]: measured KL of each stream quantized alone at each width (stream_kl
    [2, n_bits]) over the second-order prediction Σ_units w·d(b) (importance [L, H, 2],
    distortion [L, H, 2, n_bits]). A width whose measured KL is 0 (float32 cannot see its
    error) gets a tiny κ: it costs nothing measurable."""
    kl = np.asarray(stream_kl, np.float64)
    w = np.asarray(importance, np.float64)
    d = np.asarray(distortion, np.float64)
    pred = np.einsum("lhs,lhsb->sb", w, d)
    if kl.shape != pred.shape:
        raise ValueError(
            f"ratequant: stream_kl has shape {list(kl.shape)} but the distortion table has "
            f"{pred.shape[1]} widths"
        )
    if np.any(~np.isfinite(kl)) or np.any(~(pred > 0)):
        raise ValueError(
            "ratequant: the stream response needs finite measured KL and a positive predicted "
            "loss (an importance that is zero for a whole stream?); recalibrate"
        )
    return np.maximum(kl, 1e-12) / pred


def admissible_min_bits(
    stream_kl: np.ndarray, allowed: Sequence[int], max_stream_kl: float
) -> tuple[int, int]:
    """The lowest width per stream (keys, values) from which every allowed width keeps that
    stream's measured KL (stream_kl [2, n_bits]) at or below max_stream_kl."""
    kl = np.asarray(stream_kl, np.float64)
    out = []
    for s in range(2):
        ok = kl[s] <= max_stream_kl
        # admissible widths form a top range: the first width from which all above pass
        bad = np.flatnonzero(~ok)
        first = 0 if bad.size == 0 else int(bad.max()) + 1
        if first >= len(allowed):
            raise ValueError(
                f"ratequant: every allowed width costs the {('keys', 'values')[s]} alone "
                f"more than max_stream_kl={max_stream_kl} nats/token (measured "
                f"{[round(float(x), 4) for x in kl[s]]} at {list(allowed)}); allow wider "
                "widths or raise max_stream_kl"
            )
        out.append(int(allowed[first]))
    return out[0], out[1]


def allocate(
    importance: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
    distortion: np.ndarray,
    allowed: Sequence[int],
    target_bits: float,
    group_size: int,
    min_bits: Sequence[int] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Bits [L, H, 2] (int) for an average b̄ = target_bits counting scale + zero overhead.

    importance, alpha [L, H, 2]; beta [2]; distortion [L, H, 2, n_bits] measured at `allowed`
    (for RateQuant's runtime: rescaled by κ, `stream_scale`); min_bits: the lowest admissible
    width per stream (keys, values), default the lowest allowed. Returns the allocation and a
    summary (target / achieved b̄, μ, objective, time).
    """
    t0 = time.perf_counter()
    allowed = check_allowed_bits(allowed)
    w = np.asarray(importance, np.float64)
    alpha = np.asarray(alpha, np.float64)
    beta = np.asarray(beta, np.float64)
    d_table = np.asarray(distortion, np.float64)
    if (
        alpha.shape != w.shape
        or d_table.shape != (*w.shape, len(allowed))
        or beta.shape not in ((2,), w.shape)
    ):
        raise ValueError(
            f"ratequant: allocation inputs disagree: importance {list(w.shape)}, alpha "
            f"{list(alpha.shape)}, beta {list(beta.shape)}, distortion {list(d_table.shape)} "
            f"for {len(allowed)} allowed widths"
        )
    mean_code = code_budget(target_bits, allowed, group_size)
    grid = np.asarray(allowed, np.float64)
    min_bits = (allowed[0], allowed[0]) if min_bits is None else tuple(min_bits)
    if len(min_bits) != 2 or any(b not in allowed for b in min_bits):
        raise ValueError(
            f"ratequant: min_bits {list(min_bits)} must be one allowed width per stream "
            f"(keys, values) from {list(allowed)}"
        )
    floor_bits = np.broadcast_to(np.asarray(min_bits, np.float64), w.shape)
    ovh = kivi.overhead_bits(group_size)
    if mean_code < floor_bits.mean() - 1e-9:
        raise ValueError(
            f"ratequant: bits={target_bits} is below the lowest admissible average "
            f"{floor_bits.mean() + ovh:g} (keys at >= {min_bits[0]} bits, values at >= "
            f"{min_bits[1]}, plus {ovh:g} for scale + zero): a lower width was measured to "
            "break the model (see max_stream_kl); ask for more bits"
        )
    n = w.size
    budget = int(math.floor(mean_code * n + 1e-6))
    cont, ln_mu = water_fill(w, alpha, beta, mean_code, floor_bits, allowed[-1])

    lowest = np.searchsorted(grid, floor_bits.reshape(-1))  # per unit: lowest level allowed
    # snap to the nearest width (the water-fill holds every unit at its floor or above)
    level = np.abs(cont[..., None] - grid).argmin(-1).reshape(-1)
    wf, dt = w.reshape(-1), d_table.reshape(n, len(allowed))
    cost = wf[:, None] * dt  # w·d at every width
    # A unit moved one way is never moved back, so the loop ends (each unit moves at most
    # len(allowed) - 1 times). Moves that fit the remaining gap come first; only when none does
    # (e.g. every unit at 4 or 8) is the best overshooting move taken, and the other direction
    # then closes the gap.
    locked = np.zeros((n, 2), dtype=bool)  # [unit, direction 0 down / 1 up]
    units = np.arange(n)
    moves = 0
    while True:
        total = int(grid[level].sum())
        if total == budget:
            break
        up = total < budget
        nxt = np.clip(level + (1 if up else -1), 0, len(allowed) - 1)
        step = np.abs(grid[nxt] - grid[level])
        ok = (nxt != level) & ~locked[:, int(up)] & (nxt >= lowest)
        # gain per bit spent (up) or minus the cost per bit saved (down): higher is better
        delta = (cost[units, level] - cost[units, nxt]) / np.where(step > 0, step, 1)
        score = np.where(ok, delta, -np.inf)
        fits = ok & (step <= abs(budget - total))
        pick_from = np.where(fits, score, -np.inf) if fits.any() else score
        pick = int(np.argmax(pick_from))
        if not np.isfinite(pick_from[pick]):
            break
        level[pick] = nxt[pick]
        locked[pick, int(not up)] = True
        moves += 1
    total = int(grid[level].sum())
    if total > budget:
        raise ValueError(
            f"ratequant: bits={target_bits} cannot be met with widths {list(allowed)} and "
            f"per-stream floors {list(min_bits)}: the closest allocation found averages "
            f"{total / n + ovh:g}; ask for that, or allow widths with smaller steps"
        )
    exchanges = _exchange(level, lowest, grid, cost)
    bits = grid[level].astype(np.int64).reshape(w.shape)
    info = {
        "target_bits": float(target_bits),
        "achieved_bits": float(bits.mean() + ovh),
        "target_code_bits": mean_code,
        "achieved_code_bits": float(bits.mean()),
        "overhead_bits": ovh,
        "continuous_mean_bits": float(cont.mean()),
        "ln_mu": ln_mu,
        "greedy_moves": moves,
        "exchanges": exchanges,
        "min_bits": [int(b) for b in min_bits],
        "objective": float((wf * _measured_d(dt, allowed, bits.reshape(-1))).sum()),
        "histogram": {int(b): int((bits == b).sum()) for b in allowed},
        "solve_s": time.perf_counter() - t0,
    }
    return bits, info


def _two_best(score: np.ndarray) -> np.ndarray:
    """Indices of the two highest scores (the second is the first if there is one unit)."""
    if score.size < 2:
        return np.zeros(2, dtype=np.int64)
    top = np.argpartition(-score, 1)[:2]
    return top[np.argsort(-score[top], kind="stable")]


def _exchange(level: np.ndarray, lowest: np.ndarray, grid: np.ndarray, cost: np.ndarray) -> int:
    """Improve a budget-exact allocation in place: while raising one unit and lowering another
    by the same number of bits lowers Σ w·d, make the best such pair of moves. The snap and the
    one-way rebalance can leave a unit holding bits that another would use better (the fitted
    curves are not the measured ones); every exchange strictly lowers the objective at the same
    total bits, so this ends. Returns the number of exchanges."""
    n, top = len(level), len(grid) - 1
    units = np.arange(n)
    count = 0
    tol = 1e-12 * max(float(np.abs(cost[units, level]).sum()), 1e-300)
    while True:
        up, down = np.minimum(level + 1, top), np.maximum(level - 1, lowest)
        up_step, down_step = grid[up] - grid[level], grid[level] - grid[down]
        gain = cost[units, level] - cost[units, up]  # objective saved by raising
        loss = cost[units, down] - cost[units, level]  # objective added by lowering
        best, pair = tol, None
        for step in np.unique(up_step[up_step > 0]):
            raise_by = np.where(up_step == step, gain, -np.inf)
            lower_by = np.where(down_step == step, -loss, -np.inf)
            for i in _two_best(raise_by):
                for j in _two_best(lower_by):
                    net = raise_by[i] + lower_by[j]
                    if i != j and np.isfinite(net) and net > best:
                        best, pair = net, (i, j)
        if pair is None:
            return count
        level[pair[0]] += 1
        level[pair[1]] -= 1
        count += 1


def uniform_allocation(
    shape: tuple[int, int, int], target_bits: float, allowed: Sequence[int], group_size: int
) -> np.ndarray:
    """The uncalibrated reference: uniform bits at an average b̄ (counting overhead), [L, H, 2].

    An average between two allowed widths is a fixed interleaved split between them: in flat
    (stream, layer, head) order, unit i gets the upper width when floor((i+1)·f) > floor(i·f),
    f the fraction that needs it (a Bresenham pattern). Keys and values each get the average,
    the upper widths are spread evenly over layers, and nothing about the model is used.
    """
    allowed = check_allowed_bits(allowed)
    mean_code = code_budget(target_bits, allowed, group_size)
    grid = np.asarray(allowed)
    below = grid[grid <= mean_code + 1e-9].max()
    above = grid[grid >= mean_code - 1e-9].min()
    n = int(np.prod(shape))
    out = np.full(n, below, dtype=np.int64)
    if above != below:
        frac = (mean_code - below) / (above - below)
        i = np.arange(n)
        # Bresenham: unit i is raised when the running count of raised units steps up
        up = np.floor((i + 1) * frac + 1e-9) - np.floor(i * frac + 1e-9)
        out[up > 0] = above
    # flat order (stream, layer, head) → [L, H, 2]
    L, H, S = shape
    return out.reshape(S, L, H).transpose(1, 2, 0).copy()
