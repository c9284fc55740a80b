"""Batched k-means in MLX, the trainer behind product-VQ codebooks (VecInfer, CommVQ).

`kmeans(x [G, N, d], K)` solves G independent problems at once: one per codebook (e.g. per
layer and KV head). `product_kmeans(vectors [G, n, D], sub_dim, K)` splits each D-vector into
D/sub_dim sub-vectors that share one codebook per group (VecInfer's layout) and pools them.

- Distances are GEMMs: ‖x − c‖² = ‖x‖² − 2 x·cᵀ + ‖c‖², computed as one batched GEMM
  [x | 1] · [−2c | ‖c‖²]ᵀ, chunked over points so the [G, n, K] score block stays bounded
  (`chunk_elems`). The argmin never needs ‖x‖², so it is added back only for the error.
- Init: k-means++ (D² sampling, on a subsample) for small K, distinct random points for large K,
  where k-means++'s K sequential passes cost more than the Lloyd iterations themselves. Each
  draw takes one uniform per group and the inverse of the cumulative D² (`_d2_draws`; on the CPU
  all K - 1 draws are one pass of `cpu_kernels.kmeanspp_draws`, the same indices).
- Empty clusters are reseeded greedily to the worst-fit points of the last assignment
  (farthest-point style, so two dead centroids never land on one spot); the final count of dead
  centroids is reported.
- Deterministic: every random draw comes from `mx.random.key(seed)` splits, and there is no
  tolerance-dependent control flow that differs between identical runs. The per-cluster sums
  are scatter-adds on the CPU, and one-hot GEMMs on a GPU (a GPU scatter-add uses atomics, so
  its float sums depend on thread order). Same inputs + seed give bit-identical centroids on
  one device; the CPU's and a GPU's differ in rounding.
- On an x86 CPU with `veloxquant.cpu_kernels` built, the cluster sums and the k-means++ draws
  run there, and the assignment too (d <= 6, OpenBLAS's pinned kernels; sixteen points at a
  time on AVX-512): the same scores summed in the same order, the same codes, sums and
  centroids bit for bit, without the score block (tests compare both).
- Score blocks of `chunk_elems` (2M floats, 8 MB by default) stay in the CPU's caches between
  the distance GEMM and the argmin; larger blocks made assignment 2.7x slower (memory-bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from veloxquant import _platform, cpu_kernels

# k-means++ is used up to this many centroids with init="auto" (its K sequential D²-sampling
# passes dominate beyond it; d8b12's 4096 centroids use sampled init instead).
KMEANS_PP_MAX_CENTROIDS = 1024
# Points per group used for k-means++ init: enough to place K seeds well, cheap to rescan K times.
KMEANS_PP_SAMPLE_PER_CENTROID = 16


@dataclass
class KMeansResult:
    """centroids [G, K, d] f32; counts [G, K] int32 of the final assignment; mse [G] mean
    squared error per vector; dead [G] centroids with no vector; history: mean error per
    Lloyd iteration (before that iteration's update), over all groups."""

    centroids: mx.array
    counts: mx.array
    mse: mx.array
    dead: mx.array
    history: list[float] = field(default_factory=list)

    def usage_entropy_bits(self) -> mx.array:
        """[G] entropy of the code histogram, in bits (log2 K = every code used equally)."""
        p = self.counts.astype(mx.float32) / mx.maximum(self.counts.sum(axis=1, keepdims=True), 1)
        return -(mx.where(p > 0, p * mx.log2(mx.maximum(p, 1e-30)), 0.0)).sum(axis=1)


def check_finite(x: mx.array, what: str) -> None:
    if not bool(mx.all(mx.isfinite(x)).item()):
        n_bad = int((~mx.isfinite(x)).sum().item())
        raise ValueError(
            f"{what} contains {n_bad} NaN/inf values; re-run the capture (check the model "
            "weights and the data) rather than training codebooks on them"
        )


def sq_distances(x: mx.array, c: mx.array) -> mx.array:
    """‖x − c‖² for x [G, n, d], c [G, K, d] → [G, n, K], as one batched GEMM."""
    xn = (x * x).sum(axis=-1, keepdims=True)
    cn = (c * c).sum(axis=-1)[:, None, :]
    return mx.maximum(mx.addmm(cn, x, c.transpose(0, 2, 1), alpha=-2.0, beta=1.0) + xn, 0.0)


def _chunk_rows(g: int, k: int, n: int, chunk_elems: int) -> int:
    return max(1, min(n, chunk_elems // max(1, g * k)))


def augment_codebook(c: mx.array) -> mx.array:
    """[G, K, d] → [G, d+1, K] = [−2c | ‖c‖²]ᵀ, so that [x | 1] @ it = ‖c‖² − 2x·c in one GEMM
    (no separate elementwise pass over the [n, K] score block)."""
    return mx.concatenate([-2.0 * c, (c * c).sum(axis=-1, keepdims=True)], axis=-1).transpose(
        0, 2, 1
    )


def _partial_scores(x: mx.array, c_aug: mx.array) -> mx.array:
    """‖c‖² − 2x·c [G, n, K]; ‖x‖² is constant per row so it cannot change the argmin."""
    xa = mx.concatenate([x, mx.ones((*x.shape[:-1], 1), dtype=x.dtype)], axis=-1)
    return mx.matmul(xa, c_aug)


def nearest(x: mx.array, c: mx.array, c_aug: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Nearest centroid, lazily (no eval): x [G, n, d], c [G or 1, K, d] →
    (codes [G, n] uint32, squared error [G, n] f32). The one score that training and the
    runtime encoder share; both take the first index of the minimum, so they break ties
    identically."""
    if c_aug is None:
        c_aug = augment_codebook(c)
    partial = _partial_scores(x, c_aug)
    codes = mx.argmin(partial, axis=-1)
    best = mx.take_along_axis(partial, codes[..., None], axis=-1)[..., 0]
    return codes, mx.maximum(best + (x * x).sum(axis=-1), 0.0)


def _nearest_on_host(x: mx.array, c_aug: mx.array) -> tuple[mx.array, mx.array]:
    """`nearest`, evaluated, with the argmin and the error on numpy: on the CPU MLX's
    reduction over the centroid axis is a scalar loop (2-5x slower than numpy's, which is most
    of an assignment pass). The same float32 scores and sums; argmin, gather, add and maximum
    are exact, and both argmins take the first index of the minimum, so the codes and errors
    are bit for bit `nearest`'s (tested)."""
    partial = _partial_scores(x, c_aug)
    x_sq = (x * x).sum(axis=-1)
    mx.eval(partial, x_sq)
    scores = np.array(partial, copy=False)
    codes = scores.argmin(axis=-1)
    best = np.take_along_axis(scores, codes[..., None], axis=-1)[..., 0]
    err = np.maximum(best + np.array(x_sq, copy=False), np.float32(0.0))
    return mx.array(codes.astype(np.uint32)), mx.array(err)


CHUNK_ELEMS = 1 << 21


def assign(
    x: mx.array, c: mx.array, *, chunk_elems: int = CHUNK_ELEMS
) -> tuple[mx.array, mx.array]:
    """`nearest` over all of x [G, N, d], chunked over N so at most ~chunk_elems scores exist
    at once, each chunk evaluated before the next is built."""
    g, n, _ = x.shape
    if _kernels_assign(x, c):
        return cpu_kernels.nearest_centroid(x, c)
    c_aug = augment_codebook(c)
    rows = _chunk_rows(g, c.shape[1], n, chunk_elems)
    # numpy's argmin on the CPU for float32 (kmeans' dtype; numpy has no bfloat16)
    on_cpu = mx.default_device() == mx.cpu and x.dtype == mx.float32
    codes, errs = [], []
    for s in range(0, n, rows):
        if on_cpu:
            a, e = _nearest_on_host(x[:, s : s + rows], c_aug)
        else:
            a, e = nearest(x[:, s : s + rows], c, c_aug)
            mx.eval(a, e)
        codes.append(a)
        errs.append(e)
    return mx.concatenate(codes, axis=1), mx.concatenate(errs, axis=1)


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def _kernels_assign(x: mx.array, c: mx.array) -> bool:
    # The extension reproduces the scores of OpenBLAS's pinned kernels only; with any other
    # BLAS the GEMM runs, so that the codes never depend on whether the extension is built.
    return (
        x.shape[-1] <= cpu_kernels.NEAREST_MAX_DIM
        and cpu_kernels.usable(x, c)
        and _platform.blas_pinned()
    )


def cluster_sums(x: mx.array, codes: mx.array, k: int, chunk_elems: int = CHUNK_ELEMS) -> mx.array:
    """Σ of the vectors assigned to each centroid, x [G, N, d], codes [G, N] → [G, K, d], as
    chunked one-hot GEMMs: a fixed summation order on any device (no atomics)."""
    g, n, d = x.shape
    rows = _chunk_rows(g, k, n, chunk_elems)
    ids = mx.arange(k, dtype=mx.uint32)
    total = None
    for s in range(0, n, rows):
        onehot = (codes[:, s : s + rows, None] == ids).astype(mx.float32)  # [G, n, K]
        part = mx.matmul(onehot.swapaxes(1, 2), x[:, s : s + rows])
        total = part if total is None else total + part
        mx.eval(total)
    return total


def _gather_rows(x: mx.array, idx: mx.array) -> mx.array:
    """x [G, N, d], idx [G, m] → [G, m, d]."""
    return mx.take_along_axis(x, idx[..., None], axis=1)


def _smallest_first(u: np.ndarray, k: int) -> np.ndarray:
    """`mx.argsort(u, axis=1)[:, :k]` (MLX's CPU argsort is stable: ties in index order), from a
    partition and a sort of the k kept per row instead of a sort of all n (3 s of a
    calibration's subsample of 21M sub-vectors)."""
    kth = np.partition(u, k - 1, axis=1)[:, k - 1 : k]
    out = np.empty((u.shape[0], k), dtype=np.int64)
    for r in range(u.shape[0]):
        below = np.flatnonzero(u[r] < kth[r])
        ties = np.flatnonzero(u[r] == kth[r])[: k - below.size]
        kept = np.sort(np.concatenate([below, ties]))
        out[r] = kept[np.argsort(u[r, kept], kind="stable")]
    return out


def _init_sample(x: mx.array, k: int, key: mx.array) -> mx.array:
    """k of each group's points, at random without replacement (in the order of their draws)."""
    g, n, _ = x.shape
    u = mx.random.uniform(shape=(g, n), key=key)
    if mx.default_device() == mx.cpu and 4 * k < n:
        order = mx.array(_smallest_first(np.array(u), k))
    else:
        order = mx.argsort(u, axis=1)[:, :k]
    return _gather_rows(x, order)


def _init_kmeans_pp(x: mx.array, k: int, key: mx.array, progress: bool, desc: str) -> mx.array:
    g, n, d = x.shape
    k_sub, k_first, k_steps = mx.random.split(key, 3)
    m = min(n, max(k, KMEANS_PP_SAMPLE_PER_CENTROID * k))
    if m < n:
        x = _init_sample(x, m, k_sub)
    first = mx.random.randint(0, m, shape=(g,), key=k_first).astype(mx.uint32)
    u = mx.random.uniform(shape=(k - 1, g), key=k_steps)  # one draw per step and group
    if cpu_kernels.usable(x, u):
        idx = cpu_kernels.kmeanspp_draws(x, first, u)
    else:
        idx = _d2_draws(x, first, u, progress, desc)
    return _gather_rows(x, idx)


def _d2_draws(x: mx.array, first: mx.array, u: mx.array, progress: bool, desc: str) -> mx.array:
    """k-means++'s D² sampling: from the point `first` [G] of each group of x [G, m, d], K - 1
    draws (one per row of the uniforms u [K - 1, G] in [0, 1)), each point drawn with
    probability proportional to its squared distance to the nearest point drawn so far, by
    the inverse of the cumulative distance: the first point whose cumulative D² exceeds
    u · total. Drawn points (D² = 0) are never drawn again unless every point coincides with
    one, where any draw is as good. -> indices [G, K] uint32. (`cpu_kernels.kmeanspp_draws`
    computes the same indices in one pass on the CPU.)"""
    m = x.shape[1]
    idx = first[:, None]
    drawn = [idx]
    d2 = mx.square(x - _gather_rows(x, idx)).sum(axis=-1)
    for i in tqdm(
        range(u.shape[0]), desc=f"{desc} init (k-means++)", disable=not progress, leave=False
    ):
        cum = mx.cumsum(d2, axis=-1)
        below = (cum <= u[i][:, None] * cum[:, -1:]).sum(axis=-1, keepdims=True)
        idx = mx.minimum(below, m - 1).astype(mx.uint32)
        drawn.append(idx)
        d2 = mx.minimum(d2, mx.square(x - _gather_rows(x, idx)).sum(axis=-1))
        if i % 16 == 15:
            mx.eval(d2, drawn)
    return mx.concatenate(drawn, axis=1)


def _reseed_dead(
    x: mx.array, err: mx.array, dead: mx.array, n_dead: mx.array, c: mx.array
) -> mx.array:
    """Greedy farthest-point reseeding: the r-th dead centroid of each group moves to the point
    with the largest error so far, which then counts as covered, so dead centroids never land on
    the same spot (or on copies of one point).

    Step r only involves the groups that still have more than r dead centroids (re-selected at
    r = 1, 2, 4, 8, ...): a sampled init over layer-0 values, which repeat with the token id,
    leaves thousands dead in a few groups and almost none elsewhere, and each step scans its
    groups' points (d8b12 values: 11 minutes when every step scanned all 90 groups). Each group's
    arithmetic is the same whichever groups share the batch, so the centroids are too."""
    rank = mx.cumsum(dead.astype(mx.int32), axis=1) - 1
    c, err = mx.array(c), mx.array(err)  # written per stage below; leave the caller's alone
    per_group = n_dead.tolist()
    max_dead = max(per_group)
    r = 0
    while r < max_dead:
        end = min(max_dead, max(1, 2 * r))
        sel = mx.array([g for g, n in enumerate(per_group) if n > r], dtype=mx.int32)
        xs, es, cs, ds, rs, ns = (a[sel] for a in (x, err, c, dead, rank, n_dead))
        for step in range(r, end):
            worst = mx.argmax(es, axis=1)[:, None]
            p = _gather_rows(xs, worst)
            cs = mx.where((ds & (rs == step))[..., None], p, cs)
            es = mx.where((ns > step)[:, None], mx.minimum(es, mx.square(xs - p).sum(-1)), es)
            if step % 32 == 31:
                mx.eval(cs, es)
        c[sel], err[sel] = cs, es
        mx.eval(c, err)
        r = end
    return c


def kmeans(
    x: mx.array,
    n_centroids: int,
    *,
    iters: int = 20,
    seed: int = 0,
    init: str = "auto",
    chunk_elems: int = CHUNK_ELEMS,
    progress: bool = True,
    desc: str = "k-means",
) -> KMeansResult:
    """Lloyd's k-means on G independent groups at once. x [G, N, d] float32 (N ≥ n_centroids)."""
    if x.ndim != 3:
        raise ValueError(f"kmeans expects x of shape [groups, vectors, dim], got {x.shape}")
    g, n, d = x.shape
    k = int(n_centroids)
    if k < 1:
        raise ValueError(f"n_centroids must be >= 1, got {k}")
    if n < k:
        raise ValueError(
            f"{desc}: {n} training vectors per codebook but {k} centroids; k-means needs at "
            f"least {k} vectors per codebook (a degenerate codebook would be silently useless). "
            "Capture more tokens (raise the capture token budget / max_vectors) or use fewer bits."
        )
    x = x.astype(mx.float32)
    check_finite(x, f"{desc} training data")
    if init == "auto":
        init = "kmeans++" if k <= KMEANS_PP_MAX_CENTROIDS else "sample"
    key_init, _ = mx.random.split(mx.random.key(seed))
    if init == "kmeans++":
        c = _init_kmeans_pp(x, k, key_init, progress, desc)
    elif init == "sample":
        c = _init_sample(x, k, key_init)
    else:
        raise ValueError(f"init must be 'auto', 'kmeans++' or 'sample', got {init!r}")
    mx.eval(c)

    history: list[float] = []
    group_offset = (mx.arange(g, dtype=mx.uint32) * k)[:, None]
    flat_x = x.reshape(g * n, d)
    for _ in tqdm(range(iters), desc=desc, disable=not progress, leave=False):
        codes, err = assign(x, c, chunk_elems=chunk_elems)
        history.append(float(err.mean().item()))
        if cpu_kernels.usable(x):
            sums, counts = cpu_kernels.cluster_sums(x, codes, k)
        else:
            flat = (codes + group_offset).reshape(-1)
            sums = (
                cluster_sums(x, codes, k, chunk_elems)
                if _on_gpu()
                else (mx.zeros((g * k, d), dtype=mx.float32).at[flat].add(flat_x).reshape(g, k, d))
            )
            # integer-valued float sums are exact in any order, so a scatter-add is deterministic
            counts = mx.zeros((g * k,), dtype=mx.float32).at[flat].add(1.0).reshape(g, k)
        new_c = mx.where(counts[..., None] > 0, sums / mx.maximum(counts, 1.0)[..., None], c)
        dead = counts == 0
        n_dead = dead.sum(axis=1)
        max_dead = int(n_dead.max().item())
        if max_dead:
            new_c = _reseed_dead(x, err, dead, n_dead, new_c)
        c = new_c
        mx.eval(c)

    codes, err = assign(x, c, chunk_elems=chunk_elems)
    flat = (codes + group_offset).reshape(-1)
    counts = mx.zeros((g * k,), dtype=mx.int32).at[flat].add(1).reshape(g, k)
    result = KMeansResult(
        centroids=c,
        counts=counts,
        mse=err.mean(axis=1),
        dead=(counts == 0).sum(axis=1),
        history=history,
    )
    mx.eval(result.centroids, result.counts, result.mse, result.dead)
    return result


def split_subvectors(vectors: mx.array, sub_dim: int) -> mx.array:
    """[G, n, D] → [G, n·D/sub_dim, sub_dim] (sub-vectors of a vector stay consecutive)."""
    g, n, dim = vectors.shape
    if sub_dim < 1 or dim % sub_dim:
        raise ValueError(f"sub_dim {sub_dim} must divide the vector dimension {dim}")
    return vectors.reshape(g, n * (dim // sub_dim), sub_dim)


def product_kmeans(
    vectors: mx.array,
    sub_dim: int,
    n_centroids: int,
    *,
    max_vectors: int | None = None,
    iters: int = 20,
    seed: int = 0,
    init: str = "auto",
    chunk_elems: int = CHUNK_ELEMS,
    progress: bool = True,
    desc: str = "product k-means",
) -> KMeansResult:
    """One codebook per group shared by all D/sub_dim sub-spaces. vectors [G, n, D].

    max_vectors caps the training sub-vectors per group (a seeded random subset) to bound cost.
    """
    sub = split_subvectors(vectors.astype(mx.float32), sub_dim)
    g, m, _ = sub.shape
    if m < n_centroids:
        per = vectors.shape[-1] // sub_dim
        raise ValueError(
            f"{desc}: {vectors.shape[1]} vectors × {per} sub-vectors = {m} training sub-vectors "
            f"per codebook, but the codebook has {n_centroids} centroids; need at least "
            f"{math.ceil(n_centroids / per)} captured tokens (minimum {n_centroids} sub-vectors). "
            "Raise the capture token budget or use fewer bits."
        )
    if max_vectors is not None and m > max_vectors:
        if max_vectors < n_centroids:
            raise ValueError(
                f"max_vectors={max_vectors} is below the {n_centroids} centroids; "
                f"set it to at least {n_centroids}"
            )
        key = mx.random.split(mx.random.key(seed))[1]
        sub = _init_sample(sub, max_vectors, key)
    return kmeans(
        sub,
        n_centroids,
        iters=iters,
        seed=seed,
        init=init,
        chunk_elems=chunk_elems,
        progress=progress,
        desc=desc,
    )
