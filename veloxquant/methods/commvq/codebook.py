"""CommVQ codebook math in pure MLX: pair layouts, codewords, separable encoding, RoPE.

Notation (DESIGN.md section 8): a head vector of D channels is P = D/2 complex numbers, one per
RoPE pair j. A stage's parameters are theta [P, 64, 2]: 64 complex numbers t[j, c] = x + iy per
pair. The 12-bit code (a, b), a, b < 64, stored as a·64 + b, decodes on pair j to

    c_j(a, b) = t[j, a] + i·t[j, b] = (x_a − y_b, y_a + x_b) = M(t_a)·e1 + M(t_b)·e2,

with M(t) = [[x, −y], [y, x]]. M(t) is multiplication by t, and complex multiplications commute,
so RoPE at position n (multiplication by exp(i·n·θ_j) on pair j) maps c(a, b) to the codeword of
the same code under the rotated parameters exp(i·n·θ_j)·t[j, :]. That is the commutativity the
cache relies on: codes are position-free, and RoPE is applied exactly at fetch.

Encoding never materialises the 4096 codewords. With x a D-vector in pair view (u_j, v_j):

    ⟨x, c(a, b)⟩ = α_a + β_b,     α_a = Σ_j u_j x_ja + v_j y_ja,  β_b = Σ_j v_j x_jb − u_j y_jb
    ‖c(a, b)‖²  = γ_a + γ_b + cross[a, b],   γ_c = Σ_j |t_jc|²,  cross = 2(YᵀX − XᵀY)

(X, Y the [P, 64] real and imaginary parts; cross is antisymmetric and depends on θ only). So a
token costs one [D] x [D, 128] product for (α, β), then a 64 x 64 table of sums for the argmin.

Everything is batched over a leading group axis G (a KV head, or a (layer, KV head) pair in
training). Codes are uint32 holding a·64 + b.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant import cpu_kernels

HALF_BITS = 6
ATOMS = 1 << HALF_BITS  # 64 complex parameters per pair and stage
CODE_BITS = 2 * HALF_BITS  # 12 bits per stage
CODEWORDS = ATOMS * ATOMS  # 4096
# Scores alive at once in the chunked argmin / softmax ([rows, 4096] float32 blocks).
CHUNK_ELEMS = 1 << 23


# ---------------------------------------------------------------------------------------------
# Pair layouts


def layout_name(traditional: bool) -> str:
    """How channels pair up under RoPE: "interleaved" (2j, 2j+1) or "half" (j, j + D/2)."""
    return "interleaved" if traditional else "half"


def to_pairs(x: mx.array, traditional: bool) -> mx.array:
    """[..., D] → [..., P, 2] in the model's RoPE pair layout."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"commvq: head_dim {d} is odd; RoPE pairs need an even head_dim")
    if traditional:
        return x.reshape(*x.shape[:-1], d // 2, 2)
    return mx.stack([x[..., : d // 2], x[..., d // 2 :]], axis=-1)


def from_pairs(z: mx.array, traditional: bool) -> mx.array:
    """Inverse of `to_pairs`: [..., P, 2] → [..., D]."""
    if traditional:
        return z.reshape(*z.shape[:-2], 2 * z.shape[-2])
    return mx.concatenate([z[..., 0], z[..., 1]], axis=-1)


# ---------------------------------------------------------------------------------------------
# RoPE


def rope_frequencies(dims: int, base: float) -> mx.array:
    """θ_j = base^(−2j/D), j < D/2: the per-pair angular frequencies of mlx's RoPE."""
    return mx.power(mx.array(base, mx.float32), -mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def rotate_pairs(z: mx.array, angles: mx.array) -> mx.array:
    """Multiply each pair z [..., P, 2] (as x + iy) by exp(i·angles), angles broadcasting to
    [..., P]."""
    c, s = mx.cos(angles), mx.sin(angles)
    x, y = z[..., 0], z[..., 1]
    return mx.stack([x * c - y * s, x * s + y * c], axis=-1)


def rope_at(
    x: mx.array, positions: mx.array, *, base: float, traditional: bool, scale: float = 1.0
) -> mx.array:
    """RoPE of x [..., T, D] at arbitrary per-token positions [T] (or broadcasting to
    x.shape[:-1]), built from cos/sin of scale·n·θ_j. Matches `mx.fast.rope` (which only takes
    a start offset) to float rounding; scale = −scale inverts it."""
    d = x.shape[-1]
    angles = (positions.astype(mx.float32) * scale)[..., None] * rope_frequencies(d, base)
    return from_pairs(rotate_pairs(to_pairs(x, traditional), angles), traditional)


def rotate_theta(theta: mx.array, angle_per_pair: mx.array) -> mx.array:
    """θ [..., P, 64, 2] with every parameter of pair j multiplied by exp(i·angle_j); angle
    [..., P]. Decoding a code under the rotated θ equals rotating the decoded pairs."""
    return rotate_pairs(theta, angle_per_pair[..., None])


# ---------------------------------------------------------------------------------------------
# Shared atoms and per-stage gains


def complex_mul(a: mx.array, b: mx.array) -> mx.array:
    """(x + iy)·(u + iv) on [..., 2] pairs, broadcasting."""
    return mx.stack(
        [
            a[..., 0] * b[..., 0] - a[..., 1] * b[..., 1],
            a[..., 0] * b[..., 1] + a[..., 1] * b[..., 0],
        ],
        axis=-1,
    )


def apply_gains(atoms: mx.array, gains: mx.array | None) -> mx.array:
    """Stage parameters θ [H, R, P, 64, 2] from atoms [S, R_θ, P, 64, 2] and gains.

    gains None: θ = atoms (one θ per stage, the paper's codebook; S = H or 1, the layer's heads
    sharing it). gains [H, R, P, 2] (R_θ = 1, H a multiple of S): stage r of head h has
    θ[h, r, j] = g[h, r, j]·atoms[s(h), 0, j], every atom of pair j multiplied by one complex gain.
    Codeword (a, b) becomes g·(t_a + i·t_b), still a complex multiple of each pair, so RoPE
    commutes with it exactly as with a free θ."""
    if gains is None:
        return atoms
    h, s = gains.shape[0], atoms.shape[0]
    if atoms.shape[1] != 1 or h % s:
        raise ValueError(
            f"commvq: atoms {list(atoms.shape)} do not fit gains {list(gains.shape)} "
            "(one atom set per layer or per head, R_θ = 1)"
        )
    shared = mx.repeat(atoms[:, 0], h // s, axis=0)  # [H, P, 64, 2]
    return complex_mul(gains[:, :, :, None, :], shared[:, None])


def quantize_atoms(theta: mx.array) -> tuple[mx.array, mx.array]:
    """θ or atoms [..., P, 64, 2] → (int8 [..., P, 64, 2], fp16 scale [..., P, 1, 1]): one
    symmetric absmax scale per pair over its 64 atoms. A scale multiplies every atom of a pair
    by one real number, so the rounded parameters are still a commutative codebook."""
    amax = mx.abs(theta).max(axis=(-2, -1), keepdims=True)
    scale = (mx.maximum(amax, 1e-30) / 127.0).astype(mx.float16)
    codes = mx.clip(mx.round(theta / scale.astype(mx.float32)), -127, 127).astype(mx.int8)
    return codes, scale


def dequantize_atoms(codes: mx.array, scale: mx.array | None) -> mx.array:
    """Inverse of `quantize_atoms` (scale None: codes already hold float parameters)."""
    if scale is None:
        return codes.astype(mx.float32)
    return codes.astype(mx.float32) * scale.astype(mx.float32)


# ---------------------------------------------------------------------------------------------
# Codewords and decoding


def split_codes(codes: mx.array) -> tuple[mx.array, mx.array]:
    """12-bit codes → (a, b) with code = a·64 + b."""
    codes = codes.astype(mx.uint32)
    return codes >> HALF_BITS, codes & (ATOMS - 1)


def join_codes(a: mx.array, b: mx.array) -> mx.array:
    return (a.astype(mx.uint32) << HALF_BITS) | b.astype(mx.uint32)


def combine(ta: mx.array, tb: mx.array) -> mx.array:
    """t_a + i·t_b for pairs [..., 2]: (x_a − y_b, y_a + x_b)."""
    return mx.stack([ta[..., 0] - tb[..., 1], ta[..., 1] + tb[..., 0]], axis=-1)


def all_codewords(theta: mx.array) -> mx.array:
    """θ [..., P, 64, 2] → every codeword [..., 4096, P, 2] (code a·64 + b). For tests and
    brute-force checks only: the runtime and training never build it."""
    ta = theta[..., :, :, None, :]  # [..., P, 64(a), 1, 2]
    tb = theta[..., :, None, :, :]  # [..., P, 1, 64(b), 2]
    cw = combine(ta, tb)  # [..., P, 64, 64, 2]
    p = theta.shape[-3]
    cw = cw.reshape(*theta.shape[:-3], p, CODEWORDS, 2)
    return mx.swapaxes(cw, -3, -2)


def gather_table(theta: mx.array) -> mx.array:
    """θ [G, R, P, 64, 2] → [G·R·64, P·2]: one row per (group, stage, atom), the layout
    `decode_pairs` gathers from."""
    g, r, p, k, _ = theta.shape
    return theta.transpose(0, 1, 3, 2, 4).reshape(g * r * k, p * 2)


def decode_pairs(codes: mx.array, table: mx.array, n_groups: int, n_stages: int) -> mx.array:
    """Σ_r c(a_r, b_r) for codes [G, N, R] → [G, N, P, 2] (unit-scale, before s and μ).

    table is `gather_table(theta)`. The sum is linear in t_a and t_b, so the a-atoms and the
    b-atoms are summed over stages first and combined once: A + i·B."""
    g, n, r = codes.shape
    if g != n_groups or r != n_stages:
        raise ValueError(f"codes [G={g}, N, R={r}] do not match θ [G={n_groups}, R={n_stages}]")
    a, b = split_codes(codes)
    base = (
        mx.arange(g, dtype=mx.uint32)[:, None, None] * r
        + mx.arange(r, dtype=mx.uint32)[None, None, :]
    ) * ATOMS
    sum_a = mx.take(table, a + base, axis=0).sum(axis=2)  # [G, N, 2P]
    sum_b = mx.take(table, b + base, axis=0).sum(axis=2)
    p2 = table.shape[-1]
    return combine(sum_a.reshape(g, n, p2 // 2, 2), sum_b.reshape(g, n, p2 // 2, 2))


# ---------------------------------------------------------------------------------------------
# Separable encoding


def projection_matrix(theta: mx.array) -> mx.array:
    """θ [G, P, 64, 2] → W [G, 2P, 128] with x_flat @ W = [α | β] (x in pair view, flattened
    (j, component))."""
    x, y = theta[..., 0], theta[..., 1]  # [G, P, 64]
    w_alpha = mx.stack([x, y], axis=2)  # rows (j, 0) = x_ja, (j, 1) = y_ja
    w_beta = mx.stack([-y, x], axis=2)  # rows (j, 0) = −y_jb, (j, 1) = x_jb
    g, p, k = x.shape
    return mx.concatenate([w_alpha.reshape(g, 2 * p, k), w_beta.reshape(g, 2 * p, k)], axis=-1)


def norm_tables(theta: mx.array) -> tuple[mx.array, mx.array]:
    """θ [G, P, 64, 2] → (γ [G, 64], cross [G, 64, 64]): ‖c(a, b)‖² = γ_a + γ_b + cross[a, b]."""
    x, y = theta[..., 0], theta[..., 1]
    gamma = (x * x + y * y).sum(axis=1)
    yx = mx.matmul(y.swapaxes(1, 2), x)  # [G, a, b] = Σ_j y_ja x_jb
    return gamma, 2.0 * (yx - yx.swapaxes(1, 2))


def score_terms(x_flat: mx.array, proj: mx.array, gamma: mx.array) -> tuple[mx.array, mx.array]:
    """x_flat [G, n, 2P] → (u [G, n, 64], v [G, n, 64]) with
    ‖x − c(a, b)‖² = ‖x‖² + u_a + v_b + cross[a, b]."""
    ab = mx.matmul(x_flat, proj)
    k = gamma.shape[-1]
    return gamma[:, None, :] - 2.0 * ab[..., :k], gamma[:, None, :] - 2.0 * ab[..., k:]


def partial_sq_distances(u: mx.array, v: mx.array, cross: mx.array) -> mx.array:
    """[G, n, 4096] of ‖x − c‖² − ‖x‖² (code a·64 + b) from the separable terms."""
    g, n, k = u.shape
    return (u[..., :, None] + v[..., None, :] + cross[:, None]).reshape(g, n, k * k)


def _chunk_rows(g: int, n: int, chunk_elems: int) -> int:
    return max(1, min(n, chunk_elems // max(1, g * CODEWORDS)))


def nearest_codewords(
    x_pairs: mx.array,
    theta: mx.array,
    *,
    chunk_elems: int = CHUNK_ELEMS,
    tables: tuple[mx.array, mx.array, mx.array] | None = None,
) -> tuple[mx.array, mx.array]:
    """Nearest of the 4096 codewords for x [G, N, P, 2] under θ [G, P, 64, 2] →
    (codes [G, N] uint32, squared error [G, N]). Chunked over N; evaluated per chunk. tables:
    θ's (projection_matrix, γ, cross), when the caller already built them (`stage_tables`)."""
    g, n, p, _ = x_pairs.shape
    x_flat = x_pairs.reshape(g, n, 2 * p)
    if tables is None:
        proj = projection_matrix(theta)
        gamma, cross = norm_tables(theta)
    else:
        proj, gamma, cross = tables
    # On an x86 CPU the extension finds the same code and score without the score block. The
    # chunks stay: OpenBLAS's sums in the u/v GEMM depend on a row's place in its block of rows.
    on_kernels = cpu_kernels.usable(x_flat, theta)
    rows = _chunk_rows(g, n, chunk_elems)
    codes, errs = [], []
    for s in range(0, n, rows):
        xs = x_flat[:, s : s + rows]
        u, v = score_terms(xs, proj, gamma)
        if on_kernels:
            c, best = cpu_kernels.nearest_pair_codeword(u, v, cross)
        else:
            d2 = partial_sq_distances(u, v, cross)
            c = mx.argmin(d2, axis=-1)
            best = mx.take_along_axis(d2, c[..., None], axis=-1)[..., 0]
        e = mx.maximum(best + (xs * xs).sum(axis=-1), 0.0)
        if rows < n:
            mx.eval(c, e)
        codes.append(c.astype(mx.uint32))
        errs.append(e)
    if len(codes) == 1:  # one chunk (a decode step's token): no copy through a concatenation
        return codes[0], errs[0]
    return mx.concatenate(codes, axis=1), mx.concatenate(errs, axis=1)


def stage_tables(theta: mx.array) -> list[tuple[mx.array, mx.array, mx.array]]:
    """Every stage's (projection_matrix, γ, cross) of θ [G, R, P, 64, 2], built for all stages
    at once (a few ops, not a few per stage: a one-token encode is bound by the count of ops);
    each stage's tables hold the bits the per-stage functions give (the same sums, one stage a
    matrix of a batch)."""
    g, r, p, k, _ = theta.shape
    flat = theta.reshape(g * r, p, k, 2)
    proj = projection_matrix(flat).reshape(g, r, 2 * p, 2 * k)
    gamma, cross = norm_tables(flat)
    gamma, cross = gamma.reshape(g, r, k), cross.reshape(g, r, k, k)
    return [(proj[:, i], gamma[:, i], cross[:, i]) for i in range(r)]


def encode_residual(
    x_pairs: mx.array, theta: mx.array, *, chunk_elems: int = CHUNK_ELEMS
) -> tuple[mx.array, mx.array]:
    """Greedy additive encoding over R stages: stage r codes what stages < r left.
    x [G, N, P, 2], θ [G, R, P, 64, 2] → (codes [G, N, R] uint32, residual [G, N, P, 2])."""
    r_stages = theta.shape[1]
    tables = stage_tables(theta)
    by_atom = theta.transpose(0, 1, 3, 2, 4)  # [G, R, 64, P, 2]: codeword_pairs' layout
    residual = x_pairs
    codes = []
    for r in range(r_stages):
        c, _ = nearest_codewords(residual, theta[:, r], chunk_elems=chunk_elems, tables=tables[r])
        residual = residual - _codeword_pairs(by_atom[:, r], c)
        codes.append(c)
    return mx.stack(codes, axis=-1), residual


def codeword_pairs(theta: mx.array, codes: mx.array) -> mx.array:
    """One stage: θ [G, P, 64, 2], codes [G, N] → codewords [G, N, P, 2]."""
    return _codeword_pairs(theta.transpose(0, 2, 1, 3), codes)


def _codeword_pairs(by_atom: mx.array, codes: mx.array) -> mx.array:
    # θ laid out by atom, [G, 64, P, 2]; both atoms of every code in one gather
    a, b = split_codes(codes)
    ab = mx.concatenate([a, b], axis=1).astype(mx.int32)[..., None, None]  # [G, 2N, 1, 1]
    t = mx.take_along_axis(by_atom, ab, axis=1)
    n = codes.shape[1]
    return combine(t[:, :n], t[:, n:])


# ---------------------------------------------------------------------------------------------
# Data-free initialisation (also the uncalibrated variant)


def stage_energy_ratio(dims: int) -> float:
    """Shannon's distortion-rate bound for a 12-bit code of a D-dim Gaussian: the fraction of
    energy one stage leaves, ρ = 2^(−2·12/D)."""
    return 2.0 ** (-2.0 * CODE_BITS / dims)


def gaussian_theta(
    key: mx.array,
    n_groups: int,
    n_stages: int,
    pairs: int,
    *,
    energy: mx.array | float = 1.0,
    mean: mx.array | None = None,
) -> mx.array:
    """Gaussian θ [G, R, P, 64, 2] for sources of total energy `energy` ([G] or scalar).

    Stage r is built for the residual a Gaussian source would leave after r stages at the
    distortion-rate bound (energy·ρ^r), and its codewords carry the share 1 − ρ of that
    energy: the nearest-codeword reconstruction of a Gaussian is shorter than the source, and
    on unit Gaussian data this scale is close to the best one for a random codebook.
    E‖c(a, b)‖² = Σ_j E|t_a|² + E|t_b|² = 4·P·σ² for a ≠ b, so σ_r² = energy·ρ^r·(1 − ρ)/(4P).

    mean [G, P, 2] (optional, stage 0 only) centres the codewords on it: t = mean·(1 − i)/2
    gives t_a + i·t_b = mean when every parameter sits at its mean.
    """
    rho = stage_energy_ratio(2 * pairs)
    per_stage = mx.array([rho**r * (1.0 - rho) / (4 * pairs) for r in range(n_stages)])
    energy = mx.broadcast_to(mx.array(energy, dtype=mx.float32), (n_groups,))
    sigma = mx.sqrt(energy[:, None] * per_stage[None, :])[:, :, None, None, None]
    theta = mx.random.normal((n_groups, n_stages, pairs, ATOMS, 2), key=key) * sigma
    if mean is not None:
        half = mx.stack([mean[..., 0] + mean[..., 1], mean[..., 1] - mean[..., 0]], axis=-1) / 2
        stage0 = theta[:, 0] + half[:, :, None, :]
        theta = mx.concatenate([stage0[:, None], theta[:, 1:]], axis=1)
    return theta


def gaussian_shared(
    key: mx.array, n_sets: int, n_heads: int, n_stages: int, pairs: int
) -> tuple[mx.array, mx.array]:
    """The data-free shared form: atoms [S, 1, P, 64, 2] as `gaussian_theta`'s stage 0 for a
    unit-energy source, gains [H, R, P, 2] real ρ^(r/2), so that stage r has the same scale as
    `gaussian_theta`'s stage r (with stage 0's draw reused by every stage)."""
    atoms = gaussian_theta(key, n_sets, 1, pairs)
    rho = stage_energy_ratio(2 * pairs)
    scale = mx.array([rho ** (r / 2) for r in range(n_stages)], dtype=mx.float32)
    gains = mx.broadcast_to(scale[None, :, None], (n_heads, n_stages, pairs))
    return atoms, mx.stack([gains, mx.zeros_like(gains)], axis=-1)
