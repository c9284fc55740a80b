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

Values: product-VQ codebooks (`veloxquant.kmeans.product_kmeans`) on raw captured v per
(layer, KV head), VecInfer's layout (d4b8 by default).

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
    # One θ per (layer, KV head) ("head", the paper's layout) or per layer, shared by its KV
    # heads ("layer": H_kv times fewer resident codebook bytes; μ and scales stay per head).
    "share": "head",
    # Ridge of the least-squares projection, relative to the mean atom weight.
    "ridge": 1e-3,
    "seed": 0,
    # Training tokens per group (a seeded subset of the non-held-out captured tokens); a stage
    # has only 128 complex parameters per pair, so a thousand tokens fit it.
    "max_tokens": 1024,
    "heldout_fraction": 0.1,
    # Values: VecInfer-style product VQ.
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
    for name in ("iters", "hard_iters"):
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
    p = mx.exp(logits - logits.max(axis=-1, keepdims=True))
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


def m_step(w: mx.array, sa: mx.array, sb: mx.array, theta_old: mx.array, ridge: float) -> mx.array:
    """The commutativity projection: θ [G, P, 64, 2] minimising Σ_ab W_ab ‖m_ab − c_ab(θ)‖²
    (equivalently the expected squared error under the soft assignment), from W [G, 64, 64]
    and the marginal sums SA, SB [G, 64, P, 2]."""
    k = sa.shape[1]
    r, c = w.sum(axis=2), w.sum(axis=1)
    diag = r + c  # [G, 64]
    anti = w - w.swapaxes(1, 2)  # A = W − Wᵀ
    eye = mx.eye(k)
    dg = diag[:, :, None] * eye
    # Real form of (diag + iA) t = SA − i·SB:  [[D, −A], [A, D]] [X; Y] = [RX; RY]
    mat = mx.concatenate(
        [mx.concatenate([dg, -anti], axis=2), mx.concatenate([anti, dg], axis=2)], axis=1
    )  # [G, 128, 128]
    rx = sa[..., 0] + sb[..., 1]  # [G, 64, P]
    ry = sa[..., 1] - sb[..., 0]
    rhs = mx.concatenate([rx, ry], axis=1)  # [G, 128, P]
    # Ridge towards the previous θ: atoms no token uses keep their value, and the system stays
    # well conditioned.
    lam = ridge * mx.maximum(diag.mean(axis=1), 1e-12)[:, None, None]
    old = theta_old.transpose(0, 2, 1, 3)  # [G, 64, P, 2]
    rhs = rhs + lam * mx.concatenate([old[..., 0], old[..., 1]], axis=1)
    mat = mat + lam * mx.eye(2 * k)
    sol = mx.linalg.solve(mat, rhs, stream=mx.cpu)  # LAPACK lives on the CPU stream
    x, y = sol[:, :k], sol[:, k:]  # [G, 64, P]
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

    Returns (tensors: key_theta [L, H_kv, R, P, 64, 2], key_mean [L, H_kv, D] when centred,
    value_codebook [L, H_kv, 2^vb, vd], all float32; json diagnostics)."""
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
    theta, mu, train_diag = train_keys(
        k[:, mx.array(key_train)],
        traditional,
        hp,
        pool=pool,
        progress=progress,
        desc=f"commvq keys R={n_stages}",
    )

    # Values: product k-means per (layer, KV head), as VecInfer trains them.
    vres = product_kmeans(
        v[:, mx.array(value_train)],
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
    for rec in reconstruct_keys(kh, mx.repeat(theta, pool, axis=0), mu, traditional):
        e = kh - rec
        mse = (e * e).sum(-1).mean(axis=1) / head_dim  # per element
        stage_mse.append(mse)
        stage_rel.append(mse * head_dim / mx.maximum(power, 1e-30))
        stage_logit.append(logit_error(q, post(e), k_post))
    vh = v[:, hidx]
    vb = vres.centroids
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
        "key_theta": theta.reshape(n_layers, n_heads // pool, n_stages, head_dim // 2, cb.ATOMS, 2),
        "value_codebook": vb.reshape(n_layers, n_heads, 2 ** hp["value_bits"], hp["value_sub_dim"]),
    }
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
        "per_layer": {
            "key_rel_err": per_layer(stage_rel[-1]),
            "logit_rel_err": per_layer(stage_logit[-1]),
            "key_mean_share": per_layer(mean_share),
            "value_rel_mse": per_layer(v_rel),
            "value_dead": vres.dead.reshape(n_layers, n_heads).sum(axis=1).tolist(),
        },
    }
    for name in ("key_rel_err", "logit_rel_err", "value_rel_mse"):
        vals = diagnostics["per_layer"][name]
        diagnostics[f"mean_{name}"] = float(np.mean(vals))
        diagnostics[f"worst_{name}"] = float(np.max(vals))
        diagnostics[f"worst_{name}_layer"] = int(np.argmax(vals))
    return tensors, diagnostics
