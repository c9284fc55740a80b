"""CommVQ calibration: pre-RoPE key codebooks by soft EM, value codebooks by k-means.

Keys (per (layer, KV head) group, all groups batched):
1. k_pre [N, H_kv, D] from a capture; optionally subtract the group's mean μ (`center`), then
   scale each token to unit norm (s = ‖k − μ‖, stored per token at run time).
2. Pair the channels in the model's RoPE layout (`codebook.to_pairs`).
3. R stages, greedy on the residual. Per stage: θ starts from a moment-matched Gaussian
   (`codebook.gaussian_theta` centred on the residual's mean), then `iters` soft-EM steps and
   `hard_iters` hard ones (the T → 0 limit: nearest-codeword assignments, statistics as one-hot
   GEMMs):
   - E-step: p(a, b | x) = softmax(−‖x − c(a, b)‖ / T) over the 4096 codewords, the distances
     from the separable terms, in chunks of tokens. T = τ · mean ‖x‖ of the stage's input,
     τ annealed geometrically from `temperature_start` to `temperature_end`.
   - M-step: the soft means m_ab with weights W_ab, projected onto the commutative family: the
     weighted least-squares fit min_θ Σ_ab W_ab ‖m_ab − c_ab(θ)‖². Its normal equations need
     only W [64, 64] and the marginal-weighted sums SA = Σ_n p_n(a) x_n, SB = Σ_n p_n(b) x_n:
     in complex form (diag(r + k) + i(W − Wᵀ)) t_j = SA_j − i·SB_j for every pair j, with
     r, k the row and column sums of W; one Hermitian 64 x 64 system shared by all P pairs
     (solved as its real 128 x 128 form, with a small ridge towards the previous θ so that
     unused atoms stay put).
   - the stage keeps the θ with the lowest hard (nearest-codeword) training error seen, the
     initialisation included, so EM never returns something worse than its start.
4. The stage's hard codes are subtracted; the next stage trains on the residual.

That is atoms="stage". The default, atoms="shared" (`train_keys_shared`), trains stage 0's θ
that way and keeps it as the one atom set of every stage: stage r of head h is g[h, r, j] times
pair j's atoms, a complex gain per (head, stage, pair). Per stage the gains alternate with
nearest-codeword codes (`gain_iters`); after each stage the atoms and all gains so far are
refitted to the chosen codes by linear least squares (`solve_atoms`, `solve_gains`), and
`rounds` rounds re-encode every stage greedily, as the cache does, and refit. `atom_bits` = 8
rounds the atoms to int8 with one scale per pair before the diagnostics, as the cache holds them.

Values: product-VQ codebooks (`veloxquant.kmeans.product_kmeans`) on raw captured v per layer
(its KV heads pooled, VecInfer's default) or per (layer, KV head) (`value_share`), d4b8 by
default.

Diagnostics on held-out captured tokens: per-stage key MSE (original scale) and relative key
error ‖k − k̂‖² / ‖k‖², the relative attention-logit error E[(q·(k − k̂))²] / Var_k[q·k]
with the captured q_post of the KV head's query group and keys post-RoPE at their captured
positions, the key-mean energy share, and value MSE.

Deterministic: every random draw comes from `mx.random.key(seed)` splits or numpy's
default_rng(seed); all reductions are dense (no scatter-adds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant import cpu_kernels
from veloxquant.methods.commvq import codebook as cb

DEFAULTS: dict[str, Any] = {
    # Code bits per key element: R = round(key_bits · D / 12) stages (D = 64: 2 → 11, 1 → 5).
    "key_bits": 2,
    # Explicit number of stages R; overrides key_bits when set.
    "stages": None,
    # Subtract the per-(layer, KV head) pre-RoPE key mean before normalising (DESIGN §11).
    "center": True,
    # Soft EM iterations per stage, τ (the temperature relative to the stage input's mean
    # norm) annealed geometrically from start to end, then `hard_iters` hard (T → 0)
    # iterations: the soft E-step's 4096 exponentials per token cost several hard steps, and
    # at the end of the anneal the assignment is one-hot anyway. Default hard EM only: on the
    # default model soft EM gave the same held-out key and logit errors at 1.4x the time
    # (README, CommVQ); set iters > 0 for the annealed soft EM.
    "iters": 0,
    "temperature_start": 0.02,
    "temperature_end": 0.005,
    "hard_iters": 4,
    # How the R stages are parameterised. "shared": one set of 64 atoms per pair for all stages,
    # stage r of head h multiplying pair j's atoms by a complex gain g[h, r, j] (R·P gains per
    # head instead of R·P·64 parameters: at 1024 tokens the paper's fp16 θ alone costs 5.5 bits
    # per K/V element on SmolLM2, the shared form 0.34 with 8-bit atoms). "stage": a free θ per
    # stage, the paper's codebook.
    "atoms": "shared",
    # Where one atom set (or one θ) applies: per (layer, KV head) ("head", the paper's layout)
    # or per layer, shared by its KV heads ("layer"; μ, scales and gains stay per head).
    "share": "head",
    # atoms="shared": per stage, `gain_iters` alternations of nearest-codeword codes and the
    # least-squares gain; after each stage the atoms and every gain so far are refitted to the
    # codes (linear least squares); then `rounds` rounds of re-encoding all stages greedily
    # and refitting both.
    "gain_iters": 4,
    "rounds": 2,
    # Resident precision of θ / the atoms: 8 (int8, one fp16 scale per pair and atom set; the
    # artifact holds the rounded values, so calibration diagnostics see what the cache decodes)
    # or 16 (fp16).
    "atom_bits": 8,
    # Ridge of the least-squares projection, relative to the mean atom weight.
    "ridge": 1e-3,
    "seed": 0,
    # Training tokens per group (a seeded subset of the non-held-out captured tokens); a stage
    # has only 128 complex parameters per pair, so a thousand tokens fit it.
    "max_tokens": 1024,
    "heldout_fraction": 0.1,
    # Values: VecInfer-style product VQ, one codebook per layer ("layer", VecInfer's default)
    # or per (layer, KV head) ("head").
    "value_share": "layer",
    "value_sub_dim": 4,
    "value_bits": 8,
    "value_iters": 16,
    "value_max_vectors": 32768,
    # RoPE pair layout the codebook is trained in: "auto" (the model's), "interleaved" or
    # "half"; an explicit value must match the model.
    "pair_layout": "auto",
}

# Queries per group (KV head) used by the logit-error diagnostic.
LOGIT_QUERIES = 384


def resolve_stages(head_dim: int, hp: dict[str, Any]) -> int:
    """R: `stages` if set, else round(key_bits · D / 12), at least 1."""
    if hp.get("stages") is not None:
        return int(hp["stages"])
    return max(1, round(float(hp["key_bits"]) * head_dim / cb.CODE_BITS))


def check_hyperparameters(hp: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad hyperparameter."""

    def bad(name: str, why: str) -> None:
        raise ValueError(f"commvq: hyperparameter {name}={hp.get(name)!r}: {why}")

    kb = hp["key_bits"]
    if isinstance(kb, bool) or not isinstance(kb, (int, float)) or not kb > 0:
        bad("key_bits", "must be a number > 0 (code bits per key element)")
    st = hp["stages"]
    if st is not None and (isinstance(st, bool) or not isinstance(st, (int, np.integer)) or st < 1):
        bad("stages", "must be None or an integer >= 1")
    if not isinstance(hp["center"], bool):
        bad("center", "must be true or false")
    for name in ("iters", "hard_iters", "gain_iters", "rounds"):
        if (
            isinstance(hp[name], bool)
            or not isinstance(hp[name], (int, np.integer))
            or hp[name] < 0
        ):
            bad(name, "must be an integer >= 0")
    for name in ("temperature_start", "temperature_end"):
        if not isinstance(hp[name], (int, float)) or not hp[name] > 0:
            bad(name, "must be > 0")
    if not isinstance(hp["ridge"], (int, float)) or not hp["ridge"] > 0:
        bad("ridge", "must be > 0")
    mt = hp["max_tokens"]
    if isinstance(mt, bool) or not isinstance(mt, (int, np.integer)) or mt < 1:
        bad("max_tokens", "must be an integer >= 1")
    if not isinstance(hp["heldout_fraction"], (int, float)) or not 0 < hp["heldout_fraction"] < 1:
        bad("heldout_fraction", "must be in (0, 1)")
    vb, vd = hp["value_bits"], hp["value_sub_dim"]
    if isinstance(vb, bool) or not isinstance(vb, (int, np.integer)) or not 1 <= vb <= 16:
        bad("value_bits", "must be an integer in [1, 16]")
    if isinstance(vd, bool) or not isinstance(vd, (int, np.integer)) or vd < 1:
        bad("value_sub_dim", "must be an integer >= 1")
    if hp["share"] not in ("head", "layer"):
        bad("share", "must be 'head' or 'layer'")
    if hp["atom_bits"] not in (8, 16) or isinstance(hp["atom_bits"], bool):
        bad("atom_bits", "must be 8 or 16")
    if hp["value_share"] not in ("head", "layer"):
        bad("value_share", "must be 'head' or 'layer'")
    if hp["atoms"] not in ("shared", "stage"):
        bad("atoms", "must be 'shared' (one atom set, per-stage gains) or 'stage' (θ per stage)")
    if hp["atoms"] == "shared" and hp["gain_iters"] < 1:
        bad("gain_iters", "must be >= 1 with atoms='shared' (each stage fits its gain)")
    if hp["pair_layout"] not in ("auto", "interleaved", "half"):
        bad("pair_layout", "must be 'auto', 'interleaved' or 'half'")


def resolve_layout(hp: dict[str, Any], rope_traditional: bool) -> str:
    """The model's pair layout; an explicit `pair_layout` that contradicts it is an error."""
    model_layout = cb.layout_name(rope_traditional)
    if hp["pair_layout"] not in ("auto", model_layout):
        raise ValueError(
            f"commvq: pair_layout={hp['pair_layout']!r} but the model's RoPE pairs channels "
            f"{'(2j, 2j+1)' if rope_traditional else '(j, j + D/2)'} ({model_layout!r}, "
            f"rope_traditional={rope_traditional}); drop the override or use {model_layout!r}"
        )
    return model_layout


def temperatures(hp: dict[str, Any]) -> list[float]:
    """τ for each EM iteration: `iters` soft ones geometric from temperature_start to
    temperature_end, then `hard_iters` at τ = 0 (nearest-codeword assignments)."""
    n = int(hp["iters"])
    t0, t1 = float(hp["temperature_start"]), float(hp["temperature_end"])
    soft = [t1] * n if n <= 1 else [t0 * (t1 / t0) ** (i / (n - 1)) for i in range(n)]
    return soft + [0.0] * int(hp["hard_iters"])


# ---------------------------------------------------------------------------------------------
# Soft EM for one stage


def _estep_chunk(xs: mx.array, proj: mx.array, gamma: mx.array, cross: mx.array, inv_t: mx.array):
    """Sufficient statistics of one token chunk xs [G, n, 2P]: soft weights W [G, 4096],
    marginal sums SA, SB [G, 64, 2P], and the summed hard (nearest-codeword) error [G]."""
    g, n, _ = xs.shape
    u, v = cb.score_terms(xs, proj, gamma)
    d2 = mx.maximum(cb.partial_sq_distances(u, v, cross) + (xs * xs).sum(-1)[..., None], 0.0)
    hard = d2.min(axis=-1).sum(axis=1)
    logits = -mx.sqrt(d2) * inv_t
    p = cpu_kernels.exp(logits - logits.max(axis=-1, keepdims=True))  # mx.exp, vectorized
    p = p / p.sum(axis=-1, keepdims=True)
    p4 = p.reshape(g, n, cb.ATOMS, cb.ATOMS)
    pa, pb = p4.sum(axis=-1), p4.sum(axis=-2)  # marginals over a and over b: [G, n, 64]
    sa = mx.matmul(pa.swapaxes(1, 2), xs)
    sb = mx.matmul(pb.swapaxes(1, 2), xs)
    return p.sum(axis=1), sa, sb, hard


_estep_chunk_compiled = mx.compile(_estep_chunk)


def _hard_chunk(xs: mx.array, proj: mx.array, gamma: mx.array, cross: mx.array):
    """The T → 0 limit of `_estep_chunk`: one-hot assignments to the nearest codeword, the
    statistics as dense one-hot GEMMs (deterministic on every device, no scatter-add)."""
    g = xs.shape[0]
    u, v = cb.score_terms(xs, proj, gamma)
    if cpu_kernels.usable(u, v, cross):  # the same codes and scores, no score block
        codes, best = cpu_kernels.nearest_pair_codeword(u, v, cross)
    else:
        d2 = cb.partial_sq_distances(u, v, cross)
        codes = mx.argmin(d2, axis=-1)
        best = mx.take_along_axis(d2, codes[..., None], axis=-1)[..., 0]
    hard = mx.maximum(best + (xs * xs).sum(-1), 0.0).sum(axis=1)
    atoms = mx.arange(cb.ATOMS, dtype=mx.uint32)
    a, b = cb.split_codes(codes)
    oa = (a[..., None] == atoms).astype(xs.dtype)  # [G, n, 64]
    ob = (b[..., None] == atoms).astype(xs.dtype)
    w = mx.matmul(oa.swapaxes(1, 2), ob).reshape(g, cb.CODEWORDS)
    return w, mx.matmul(oa.swapaxes(1, 2), xs), mx.matmul(ob.swapaxes(1, 2), xs), hard


def e_step(
    x_flat: mx.array, theta: mx.array, inv_t: mx.array | None, *, chunk_elems: int = 1 << 24
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Soft assignment statistics over all tokens x_flat [G, N, 2P] for θ [G, P, 64, 2];
    inv_t [G] is 1/T per group, None for hard assignments (T → 0). Returns (W [G, 64, 64],
    SA, SB [G, 64, P, 2], hard mean squared error [G])."""
    g, n, p2 = x_flat.shape
    proj = cb.projection_matrix(theta)
    gamma, cross = cb.norm_tables(theta)
    it = None if inv_t is None else inv_t[:, None, None]
    rows = max(1, min(n, chunk_elems // (g * cb.CODEWORDS)))
    w = sa = sb = hard = None
    for s in range(0, n, rows):
        xs = x_flat[:, s : s + rows]
        if it is None:
            parts = _hard_chunk(xs, proj, gamma, cross)
        else:
            parts = _estep_chunk_compiled(xs, proj, gamma, cross, it)
        if w is None:
            w, sa, sb, hard = parts
        else:
            accs = (w, sa, sb, hard)
            w, sa, sb, hard = (acc + part for acc, part in zip(accs, parts, strict=True))
        mx.eval(w, sa, sb, hard)
    k = cb.ATOMS
    return (
        w.reshape(g, k, k),
        sa.reshape(g, k, p2 // 2, 2),
        sb.reshape(g, k, p2 // 2, 2),
        hard / n,
    )


def solve_hermitian(
    s: mx.array,
    k: mx.array,
    b_re: mx.array,
    b_im: mx.array,
    old_re: mx.array,
    old_im: mx.array,
    ridge: float,
) -> tuple[mx.array, mx.array]:
    """Solve (S + iK)(x + iy) = b_re + i·b_im for the Hermitian S + iK (S [B, n, n] symmetric,
    K antisymmetric), right-hand sides [B, n, m], in its real form [[S, −K], [K, S]]. A ridge
    λ = ridge · mean diag(S) pulls towards (old_re, old_im): unused unknowns keep their value
    and the system stays well conditioned. Returns (x, y) [B, n, m]."""
    n = s.shape[-1]
    lam = ridge * mx.maximum(mx.diagonal(s, axis1=-2, axis2=-1).mean(axis=-1), 1e-12)
    lam = lam[:, None, None]
    mat = mx.concatenate(
        [mx.concatenate([s, -k], axis=2), mx.concatenate([k, s], axis=2)], axis=1
    ) + lam * mx.eye(2 * n)
    rhs = mx.concatenate([b_re + lam * old_re, b_im + lam * old_im], axis=1)
    sol = mx.linalg.solve(mat, rhs, stream=mx.cpu)  # LAPACK lives on the CPU stream
    return sol[:, :n], sol[:, n:]


def m_step(w: mx.array, sa: mx.array, sb: mx.array, theta_old: mx.array, ridge: float) -> mx.array:
    """The commutativity projection: θ [G, P, 64, 2] minimising Σ_ab W_ab ‖m_ab − c_ab(θ)‖²
    (equivalently the expected squared error under the soft assignment), from W [G, 64, 64]
    and the marginal sums SA, SB [G, 64, P, 2]."""
    k = sa.shape[1]
    diag = w.sum(axis=2) + w.sum(axis=1)  # row + column sums [G, 64]
    dg = diag[:, :, None] * mx.eye(k)
    old = theta_old.transpose(0, 2, 1, 3)  # [G, 64, P, 2]
    # (diag + i(W − Wᵀ)) t = SA − i·SB, one system for all P pairs (right-hand sides)
    x, y = solve_hermitian(
        dg,
        w - w.swapaxes(1, 2),
        sa[..., 0] + sb[..., 1],
        sa[..., 1] - sb[..., 0],
        old[..., 0],
        old[..., 1],
        ridge,
    )  # [G, 64, P]
    return mx.stack([x, y], axis=-1).transpose(0, 2, 1, 3)


def train_stage(
    x_pairs: mx.array,
    theta0: mx.array,
    taus: list[float],
    ridge: float,
    *,
    on_iter: Callable[[], None] | None = None,
) -> tuple[mx.array, list[float]]:
    """Soft EM for one stage on x [G, N, P, 2] from θ0 [G, P, 64, 2] → (best θ, history of
    the mean hard training MSE per iteration, the last entry being the returned θ's)."""
    g, n, p, _ = x_pairs.shape
    x_flat = x_pairs.reshape(g, n, 2 * p)
    scale = mx.maximum(mx.sqrt((x_flat * x_flat).sum(-1)).mean(axis=1), 1e-30)  # [G]
    theta = theta0
    best_theta, best_err = theta0, None
    history = []
    for tau in taus:
        w, sa, sb, hard = e_step(x_flat, theta, None if tau == 0 else 1.0 / (tau * scale))
        history.append(float(hard.mean().item()))
        if best_err is None:
            best_err = hard
        else:
            better = hard < best_err
            best_theta = mx.where(better[:, None, None, None], theta, best_theta)
            best_err = mx.minimum(hard, best_err)
        theta = m_step(w, sa, sb, theta, ridge)
        mx.eval(theta, best_theta, best_err)
        if on_iter is not None:
            on_iter()
    if taus:
        _, hard = cb.nearest_codewords(x_pairs, theta)
        hard = hard.mean(axis=1)
        better = hard < best_err
        best_theta = mx.where(better[:, None, None, None], theta, best_theta)
        best_err = mx.minimum(hard, best_err)
        mx.eval(best_theta, best_err)
        history.append(float(best_err.mean().item()))
    return best_theta, history


def init_stage(key: mx.array, x_pairs: mx.array, stage: int) -> mx.array:
    """Moment-matched Gaussian θ [G, P, 64, 2] for the stage's input x [G, N, P, 2]: centred on
    its mean, scaled to its variance (as `gaussian_theta`'s stage 0)."""
    g, _, p, _ = x_pairs.shape
    mean = x_pairs.mean(axis=1)  # [G, P, 2]
    var = ((x_pairs - mean[:, None]) ** 2).sum(axis=(2, 3)).mean(axis=1)  # [G]
    return cb.gaussian_theta(key, g, 1, p, energy=var, mean=mean)[:, 0]


def normalise(k: mx.array, mu: mx.array | None) -> tuple[mx.array, mx.array]:
    """k [G, N, D] → (unit-norm (k − μ)/s, s [G, N]); zero vectors stay zero."""
    x = k if mu is None else k - mu[:, None]
    s = mx.sqrt((x * x).sum(axis=-1))
    return x / mx.maximum(s, 1e-30)[..., None], s


def train_keys(
    k_pre: mx.array,
    traditional: bool,
    hp: dict[str, Any],
    *,
    pool: int = 1,
    progress: bool = True,
    desc: str = "commvq keys",
) -> tuple[mx.array, mx.array | None, dict[str, Any]]:
    """θ [G / pool, R, P, 64, 2] (and μ [G, D] when `center`) from training keys
    k_pre [G, N, D]. pool > 1 trains one θ for each run of `pool` consecutive groups (a layer's
    KV heads), on their normalised tokens together; μ and the scales stay per group."""
    from tqdm.auto import tqdm

    g, n, d = k_pre.shape
    if g % pool:
        raise ValueError(f"commvq: {g} groups do not split into pools of {pool}")
    n_stages = resolve_stages(d, hp)
    mu = k_pre.mean(axis=1) if hp["center"] else None
    x, _ = normalise(k_pre, mu)
    residual = cb.to_pairs(x.reshape(g // pool, pool * n, d), traditional)
    keys = mx.random.split(mx.random.key(int(hp["seed"])), n_stages)
    taus = temperatures(hp)
    thetas, histories = [], []
    with tqdm(
        total=n_stages * max(len(taus), 1), desc=desc, disable=not progress, leave=False
    ) as bar:
        for r in range(n_stages):
            theta0 = init_stage(keys[r], residual, r)
            theta, hist = train_stage(
                residual, theta0, taus, float(hp["ridge"]), on_iter=bar.update
            )
            if not taus:
                bar.update()
            codes, _ = cb.nearest_codewords(residual, theta)
            residual = residual - cb.codeword_pairs(theta, codes)
            mx.eval(residual)
            thetas.append(theta)
            histories.append(hist)
    theta = mx.stack(thetas, axis=1)
    mx.eval(theta)
    return theta, mu, {"em_history": histories}


# ---------------------------------------------------------------------------------------------
# Shared atoms with per-stage gains (atoms="shared")


def solve_gains(
    x_pairs: mx.array, codes: mx.array, unit_theta: mx.array, old: mx.array, ridge: float
) -> mx.array:
    """Least-squares gains [G, R, P, 2] for fixed codes [G, N, R]: per (group, pair) the R
    complex g_r minimising Σ_n |x_nj − Σ_r g_r·z_rnj|², z the unit-gain codewords under
    unit_theta [G, P, 64, 2] (the group's atoms), x [G, N, P, 2]; ridge towards old."""
    g, n, r = codes.shape
    p = x_pairs.shape[2]
    z = mx.stack([cb.codeword_pairs(unit_theta, codes[..., i]) for i in range(r)], axis=-1)
    zr = z[..., 0, :].transpose(0, 2, 1, 3)  # [G, P, N, R]
    zi = z[..., 1, :].transpose(0, 2, 1, 3)
    xr = x_pairs[..., 0].transpose(0, 2, 1)[..., None]  # [G, P, N, 1]
    xi = x_pairs[..., 1].transpose(0, 2, 1)[..., None]
    zrt, zit = zr.swapaxes(-1, -2), zi.swapaxes(-1, -2)
    flat = (g * p, r, r)
    o = old.transpose(0, 2, 1, 3).reshape(g * p, r, 1, 2)
    gr, gi = solve_hermitian(
        (zrt @ zr + zit @ zi).reshape(flat),
        (zrt @ zi - zit @ zr).reshape(flat),
        (zrt @ xr + zit @ xi).reshape(g * p, r, 1),
        (zrt @ xi - zit @ xr).reshape(g * p, r, 1),
        o[..., 0],
        o[..., 1],
        ridge,
    )
    return mx.stack([gr[..., 0], gi[..., 0]], axis=-1).reshape(g, p, r, 2).transpose(0, 2, 1, 3)


def solve_atoms(
    x_pairs: mx.array,
    codes: mx.array,
    gains: mx.array,
    pool: int,
    old_atoms: mx.array,
    ridge: float,
) -> mx.array:
    """Least-squares atoms [S, P, 64, 2] for fixed codes [G, N, R] and gains [G, R, P, 2], one
    atom set per run of `pool` groups (S = G / pool): per pair j the 64 complex t minimising
    Σ_n |x_nj − A_nj·t|², A_nj[c] = Σ_r g_rj·([a_rn = c] + i·[b_rn = c]). The design matrix is
    built per group from one-hot GEMMs and its Gram summed over the pool's groups."""
    g, n, r = codes.shape
    p, k = x_pairs.shape[2], cb.ATOMS
    atoms_ids = mx.arange(k, dtype=mx.uint32)
    a, b = cb.split_codes(codes)
    out = []
    for s in range(g // pool):
        gram = rhs = None
        for h in range(s * pool, (s + 1) * pool):
            oa = (a[h][..., None] == atoms_ids).astype(mx.float32).transpose(1, 0, 2)
            ob = (b[h][..., None] == atoms_ids).astype(mx.float32).transpose(1, 0, 2)
            oa, ob = oa.reshape(r, n * k), ob.reshape(r, n * k)
            gr, gi = gains[h, :, :, 0].T, gains[h, :, :, 1].T  # [P, R]
            design = mx.concatenate(
                [(gr @ oa - gi @ ob).reshape(p, n, k), (gi @ oa + gr @ ob).reshape(p, n, k)],
                axis=-1,
            )  # [P, N, 128]: [Re A | Im A]
            dt = design.swapaxes(1, 2)
            qr = dt @ x_pairs[h, :, :, 0].T[..., None]  # [P, 128, 1]
            qi = dt @ x_pairs[h, :, :, 1].T[..., None]
            part_rhs = mx.concatenate([qr[:, :k] + qi[:, k:], qi[:, :k] - qr[:, k:]], axis=1)
            part = dt @ design
            gram = part if gram is None else gram + part
            rhs = part_rhs if rhs is None else rhs + part_rhs
        old = old_atoms[s]  # [P, 64, 2]
        tr_, ti_ = solve_hermitian(
            gram[:, :k, :k] + gram[:, k:, k:],
            gram[:, :k, k:] - gram[:, k:, :k],
            rhs[:, :k],
            rhs[:, k:],
            old[..., 0:1],
            old[..., 1:2],
            ridge,
        )
        out.append(mx.concatenate([tr_, ti_], axis=-1))
        mx.eval(out[-1])
    return mx.stack(out)


def fit_stage_gain(
    residual: mx.array, unit_theta: mx.array, iters: int
) -> tuple[mx.array, mx.array]:
    """One stage's gains [G, P, 2] over fixed atoms unit_theta [G, P, 64, 2] for the residual
    [G, N, P, 2]: start from the per-pair energy ratio, then `iters` alternations of
    nearest-codeword codes and the least-squares gain for them; returns the gain with the
    lowest error seen and its codes [G, N]."""
    energy = (residual * residual).sum(-1).mean(axis=1)  # [G, P]
    atom_energy = 2.0 * (unit_theta * unit_theta).sum(-1).mean(axis=-1)  # E|t_a + i t_b|²
    gain = mx.sqrt(energy / mx.maximum(atom_energy, 1e-30))
    gain = mx.stack([gain, mx.zeros_like(gain)], axis=-1)
    best = best_err = best_codes = None
    for i in range(iters + 1):
        codes, err = cb.nearest_codewords(residual, cb.complex_mul(gain[:, :, None], unit_theta))
        err = err.mean(axis=1)
        if best is None:
            best, best_err, best_codes = gain, err, codes
        else:
            better = err < best_err
            best = mx.where(better[:, None, None], gain, best)
            best_codes = mx.where(better[:, None], codes, best_codes)
            best_err = mx.minimum(err, best_err)
        if i == iters:
            break
        z = cb.codeword_pairs(unit_theta, codes)
        num_r = (z[..., 0] * residual[..., 0] + z[..., 1] * residual[..., 1]).sum(axis=1)
        num_i = (z[..., 0] * residual[..., 1] - z[..., 1] * residual[..., 0]).sum(axis=1)
        den = mx.maximum((z * z).sum(-1).sum(axis=1), 1e-30)
        gain = mx.stack([num_r / den, num_i / den], axis=-1)
        mx.eval(gain, best, best_err, best_codes)
    return best, best_codes


def decode_sum(codes: mx.array, theta: mx.array) -> mx.array:
    """Σ_r c(a_r, b_r) under θ [G, R, P, 64, 2] for codes [G, N, R] → [G, N, P, 2]."""
    g, _, r = codes.shape
    return cb.decode_pairs(codes, cb.gather_table(theta), g, r)


def train_keys_shared(
    k_pre: mx.array,
    traditional: bool,
    hp: dict[str, Any],
    *,
    pool: int = 1,
    progress: bool = True,
    desc: str = "commvq keys",
) -> tuple[mx.array, mx.array, mx.array | None, dict[str, Any]]:
    """atoms="shared": atoms [G / pool, 1, P, 64, 2], gains [G, R, P, 2] (and μ [G, D] when
    `center`) from training keys k_pre [G, N, D]; see DEFAULTS for the schedule.

    Stage 0's atoms are trained by the same EM as a free stage (on the pool's tokens together);
    every later stage fits its gains on the residual, and after each stage the atoms and every
    gain so far are refitted by least squares to the codes chosen, the residual recomputed from
    them. Each of `rounds` then re-encodes every stage greedily (as the cache does) and refits;
    each atom set keeps its lowest greedy training error."""
    from tqdm.auto import tqdm

    g, n, d = k_pre.shape
    if g % pool:
        raise ValueError(f"commvq: {g} groups do not split into pools of {pool}")
    n_stages = resolve_stages(d, hp)
    ridge = float(hp["ridge"])
    mu = k_pre.mean(axis=1) if hp["center"] else None
    x = cb.to_pairs(normalise(k_pre, mu)[0], traditional)  # [G, N, P, 2]
    p = d // 2
    taus = temperatures(hp)
    n_sets = g // pool

    def set_mean(err: mx.array) -> mx.array:
        return err.reshape(n_sets, pool).mean(axis=1)

    total = max(len(taus), 1) + (n_stages - 1) + int(hp["rounds"])
    with tqdm(total=total, desc=desc, disable=not progress, leave=False) as bar:
        pooled = x.reshape(n_sets, pool * n, p, 2)
        key0 = mx.random.split(mx.random.key(int(hp["seed"])), n_stages)[0]
        atoms, hist0 = train_stage(
            pooled, init_stage(key0, pooled, 0), taus, ridge, on_iter=bar.update
        )
        if not taus:
            bar.update()
        atoms = atoms[:, None]  # [S, 1, P, 64, 2]
        unit = mx.repeat(atoms[:, 0], pool, axis=0)  # [G, P, 64, 2]
        codes0, _ = cb.nearest_codewords(x, unit)
        residual = x - cb.codeword_pairs(unit, codes0)
        codes = [codes0]
        gains = mx.stack([mx.ones((g, 1, p)), mx.zeros((g, 1, p))], axis=-1)
        for _ in range(1, n_stages):
            gain, c = fit_stage_gain(residual, unit, int(hp["gain_iters"]))
            codes.append(c)
            stacked = mx.stack(codes, axis=-1)
            gains = mx.concatenate([gains, gain[:, None]], axis=1)
            atoms = solve_atoms(x, stacked, gains, pool, atoms[:, 0], ridge)[:, None]
            unit = mx.repeat(atoms[:, 0], pool, axis=0)
            gains = solve_gains(x, stacked, unit, gains, ridge)
            residual = x - decode_sum(stacked, cb.apply_gains(atoms, gains))
            mx.eval(residual, atoms, gains)
            bar.update()
        history = []
        best = None
        for i in range(int(hp["rounds"]) + 1):
            stacked, res = cb.encode_residual(x, cb.apply_gains(atoms, gains))
            err = set_mean((res * res).sum(axis=(2, 3)).mean(axis=1))
            history.append(float(err.mean().item()))
            if best is None:
                best = (atoms, gains, err)
            else:
                better = err < best[2]
                best = (
                    mx.where(better[:, None, None, None, None], atoms, best[0]),
                    mx.where(mx.repeat(better, pool)[:, None, None, None], gains, best[1]),
                    mx.minimum(err, best[2]),
                )
            mx.eval(*best)
            if i == int(hp["rounds"]):
                break
            atoms = solve_atoms(x, stacked, gains, pool, atoms[:, 0], ridge)[:, None]
            gains = solve_gains(x, stacked, mx.repeat(atoms[:, 0], pool, axis=0), gains, ridge)
            mx.eval(atoms, gains)
            bar.update()
    atoms, gains, _ = best
    return atoms, gains, mu, {"em_history": [hist0], "round_history": history}


# ---------------------------------------------------------------------------------------------
# Reconstruction (shared with the cache) and diagnostics


def reconstruct_keys(
    k_pre: mx.array, theta: mx.array, mu: mx.array | None, traditional: bool
) -> list[mx.array]:
    """Greedy encode/decode of k_pre [G, N, D] → the reconstruction after each stage,
    [R] x [G, N, D] (scale stored in float16, as the cache stores it)."""
    x, s = normalise(k_pre, mu)
    s = s.astype(mx.float16).astype(mx.float32)
    residual = cb.to_pairs(x, traditional)
    acc = mx.zeros_like(residual)
    out = []
    for r in range(theta.shape[1]):
        codes, _ = cb.nearest_codewords(residual, theta[:, r])
        cw = cb.codeword_pairs(theta[:, r], codes)
        residual, acc = residual - cw, acc + cw
        rec = cb.from_pairs(acc, traditional) * s[..., None]
        out.append(rec if mu is None else rec + mu[:, None])
        mx.eval(out[-1], residual)
    return out


def logit_error(q_post: mx.array, err_post: mx.array, k_post: mx.array) -> mx.array:
    """E[(q·e)²] / Var_k[q·k] per group: q [G, m, D], e and k [G, n, D] (post-RoPE)."""
    num = mx.square(mx.matmul(q_post, err_post.swapaxes(1, 2))).mean(axis=(1, 2))
    scores = mx.matmul(q_post, k_post.swapaxes(1, 2))  # [G, m, n]
    den = mx.var(scores, axis=2).mean(axis=1)
    return num / mx.maximum(den, 1e-30)


# ---------------------------------------------------------------------------------------------
# Calibration from a capture dir

# Fewest training tokens per group the key EM accepts: the projection fits 128 real
# parameters per pair and stage.
MIN_KEY_TRAIN_TOKENS = 2 * cb.ATOMS


def min_tokens(dims: Any, hp: dict[str, Any]) -> int:
    """Fewest captured tokens calibration accepts (keys: MIN_KEY_TRAIN_TOKENS training tokens;
    values: as many sub-vectors as centroids, assuming D >= 64) plus the held-out share."""
    need_train = max(
        MIN_KEY_TRAIN_TOKENS, math.ceil(2 ** hp["value_bits"] * hp["value_sub_dim"] / 64)
    )
    need = need_train
    while need - max(1, round(need * hp["heldout_fraction"])) < need_train:
        need += 1
    return need


def calibrate(
    inputs: Any, dims: Any, hp: dict[str, Any], progress: bool = True
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Key θ (and μ) and value codebooks from a capture dir: see the module docstring.

    Returns (tensors: key_theta [L, H_kv or 1, R or 1, P, 64, 2] (the stages' θ, or the
    shared atoms), key_gain [L, H_kv, R, P, 2] with atoms="shared", key_mean [L, H_kv, D] when
    centred, value_codebook [L, H_kv or 1, 2^vb, vd], all float32; json diagnostics)."""
    from tqdm.auto import tqdm

    from veloxquant.capture import load_activations, load_capture_info
    from veloxquant.codes import pq_decode, pq_encode
    from veloxquant.kmeans import check_finite, product_kmeans
    from veloxquant.methods.base import ModelDims
    from veloxquant.methods.commvq.cache import rope_params

    check_hyperparameters(hp)
    dims = ModelDims.of(dims)
    base, traditional, rope_scale = rope_params(dims)
    layout = resolve_layout(hp, traditional)
    n_layers, n_heads, head_dim, group = dims.L, dims.H_kv, dims.D, dims.G
    n_stages = resolve_stages(head_dim, hp)
    if head_dim % hp["value_sub_dim"]:
        raise ValueError(
            f"commvq: value_sub_dim {hp['value_sub_dim']} must divide head_dim {head_dim}"
        )
    act_dir = inputs.activations_dir
    info = load_capture_info(act_dir)
    if info["num_layers"] != n_layers:
        raise ValueError(
            f"capture {act_dir} has {info['num_layers']} layers but the model has "
            f"{n_layers}; capture this model's activations first"
        )
    n_tokens = int(info["n_sampled"])
    if n_tokens < min_tokens(dims, hp):
        raise ValueError(
            f"commvq: the capture holds {n_tokens} tokens; calibration needs at "
            f"least {min_tokens(dims, hp)}. Raise the capture token_budget."
        )
    rng = np.random.default_rng(int(hp["seed"]))
    perm = rng.permutation(n_tokens)
    n_held = max(1, round(n_tokens * hp["heldout_fraction"]))
    held = np.sort(perm[:n_held])
    rest = perm[n_held:]
    key_train = np.sort(rest[: int(hp["max_tokens"])])
    value_train = np.sort(rest)
    n_q = max(1, LOGIT_QUERIES // group)
    q_tok = np.sort(rng.choice(n_tokens, size=min(n_q, n_tokens), replace=False))

    k_all, v_all, q_all = [], [], []
    positions = None
    for layer in tqdm(range(n_layers), desc="commvq load", unit="layer", disable=not progress):
        acts = load_activations(act_dir, layer, ["k_pre", "v", "q_post", "positions"])
        for name in ("k_pre", "v"):
            check_finite(acts[name], f"layer {layer} {name}")
            if tuple(acts[name].shape[1:]) != (n_heads, head_dim):
                raise ValueError(
                    f"captured {name} has per-token shape "
                    f"{list(acts[name].shape[1:])}, expected "
                    f"{[n_heads, head_dim]} for this model"
                )
        k_all.append(acts["k_pre"])
        v_all.append(acts["v"])
        q_all.append(acts["q_post"][mx.array(q_tok)])
        positions = acts["positions"]
    # [L·H, n, D] groups in (layer, KV head) order
    k = mx.stack(k_all).transpose(0, 2, 1, 3).reshape(n_layers * n_heads, n_tokens, head_dim)
    v = mx.stack(v_all).transpose(0, 2, 1, 3).reshape(n_layers * n_heads, n_tokens, head_dim)
    # queries of KV head g are heads gG..gG+G−1 (repeat_kv order): [L·H, n_q·G, D]
    q = mx.stack(q_all).reshape(n_layers, len(q_tok), n_heads, group, head_dim)
    q = q.transpose(0, 2, 1, 3, 4).reshape(n_layers * n_heads, len(q_tok) * group, head_dim)
    del k_all, v_all, q_all

    pool = n_heads if hp["share"] == "layer" else 1
    train_args = dict(pool=pool, progress=progress, desc=f"commvq keys R={n_stages}")
    if hp["atoms"] == "shared":
        theta, gains, mu, train_diag = train_keys_shared(
            k[:, mx.array(key_train)], traditional, hp, **train_args
        )
    else:
        theta, mu, train_diag = train_keys(k[:, mx.array(key_train)], traditional, hp, **train_args)
        gains = None
    if hp["atom_bits"] == 8:
        # Ship the values the cache will hold, so the diagnostics below are the cache's.
        theta = cb.dequantize_atoms(*cb.quantize_atoms(theta))
    if gains is not None:
        gains = gains.astype(mx.float16).astype(mx.float32)
        theta_per_group = cb.apply_gains(theta, gains)
    else:
        theta_per_group = mx.repeat(theta, pool, axis=0)

    # Values: product k-means per layer (pooling its KV heads) or per (layer, KV head), as
    # VecInfer trains them.
    vpool = n_heads if hp["value_share"] == "layer" else 1
    vres = product_kmeans(
        v[:, mx.array(value_train)].reshape(
            n_layers * n_heads // vpool, vpool * len(value_train), head_dim
        ),
        hp["value_sub_dim"],
        2 ** hp["value_bits"],
        max_vectors=hp["value_max_vectors"],
        iters=hp["value_iters"],
        seed=int(hp["seed"]) + 1,
        progress=progress,
        desc=f"commvq values d{hp['value_sub_dim']}b{hp['value_bits']}",
    )

    # Held-out diagnostics.
    hidx = mx.array(held)
    kh, ph = k[:, hidx], positions[hidx]

    def post(x: mx.array) -> mx.array:
        return cb.rope_at(x, ph, base=base, traditional=traditional, scale=rope_scale)

    k_post = post(kh)
    power = (kh * kh).sum(-1).mean(axis=1)  # [G]
    stage_mse, stage_rel, stage_logit = [], [], []
    for rec in reconstruct_keys(kh, theta_per_group, mu, traditional):
        e = kh - rec
        mse = (e * e).sum(-1).mean(axis=1) / head_dim  # per element
        stage_mse.append(mse)
        stage_rel.append(mse * head_dim / mx.maximum(power, 1e-30))
        stage_logit.append(logit_error(q, post(e), k_post))
    vh = v[:, hidx]
    vb = mx.repeat(vres.centroids, vpool, axis=0)  # one codebook per group
    vrec = pq_decode(
        pq_encode(vh[None], vb, hp["value_sub_dim"], hp["value_bits"]),
        vb,
        hp["value_sub_dim"],
        hp["value_bits"],
        head_dim,
    )[0]
    v_rel = ((vh - vrec) ** 2).sum(-1).mean(axis=1) / mx.maximum((vh * vh).sum(-1).mean(1), 1e-30)
    k_mean = kh.mean(axis=1)
    mean_share = (k_mean * k_mean).sum(-1) / mx.maximum(power, 1e-30)

    def per_layer(x: mx.array) -> list[float]:
        return x.reshape(n_layers, n_heads).mean(axis=1).tolist()

    tensors = {
        "key_theta": theta.reshape(n_layers, n_heads // pool, *theta.shape[1:]),
        "value_codebook": vres.centroids.reshape(
            n_layers, n_heads // vpool, 2 ** hp["value_bits"], hp["value_sub_dim"]
        ),
    }
    if gains is not None:
        tensors["key_gain"] = gains.reshape(n_layers, n_heads, n_stages, head_dim // 2, 2)
    if mu is not None:
        tensors["key_mean"] = mu.reshape(n_layers, n_heads, head_dim)
    mx.eval(tensors)
    diagnostics: dict[str, Any] = {
        "pair_layout": layout,
        "stages": n_stages,
        "key_bits_per_element": n_stages * cb.CODE_BITS / head_dim,
        "centered": bool(hp["center"]),
        "n_key_train_tokens": len(key_train),
        "n_value_train_tokens": len(value_train),
        "n_heldout_tokens": int(n_held),
        "tokens_seen": int(info["tokens_seen"]),
        # Means over (layer, KV head) groups, one entry per stage (cumulative).
        "stage_key_mse": [float(x.mean().item()) for x in stage_mse],
        "stage_key_rel_err": [float(x.mean().item()) for x in stage_rel],
        "stage_logit_rel_err": [float(x.mean().item()) for x in stage_logit],
        # Mean hard training error (unit-norm space) at each EM iteration, per stage.
        "em_history": [[float(v) for v in h] for h in train_diag["em_history"]],
        # atoms="shared": the greedy training error after the per-stage fit, then each round.
        "round_history": train_diag.get("round_history", []),
        "per_layer": {
            "key_rel_err": per_layer(stage_rel[-1]),
            "logit_rel_err": per_layer(stage_logit[-1]),
            "key_mean_share": per_layer(mean_share),
            "value_rel_mse": per_layer(v_rel),
            "value_dead": vres.dead.reshape(n_layers, -1).sum(axis=1).tolist(),
        },
    }
    for name in ("key_rel_err", "logit_rel_err", "value_rel_mse"):
        vals = diagnostics["per_layer"][name]
        diagnostics[f"mean_{name}"] = float(np.mean(vals))
        diagnostics[f"worst_{name}"] = float(np.max(vals))
        diagnostics[f"worst_{name}_layer"] = int(np.argmax(vals))
    return tensors, diagnostics
