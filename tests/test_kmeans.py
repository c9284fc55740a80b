"""Batched GEMM k-means (veloxquant/kmeans.py) on synthetic data with known answers."""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from veloxquant.kmeans import assign, kmeans, nearest, product_kmeans, sq_distances


def clustered(groups=3, k=16, n=2000, d=4, spread=0.05, seed=1):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(groups, k, d)).astype(np.float32) * 5
    labels = rng.integers(0, k, size=(groups, n))
    x = np.take_along_axis(centers, labels[..., None], axis=1)
    x = x + spread * rng.normal(size=x.shape).astype(np.float32)
    return mx.array(centers), mx.array(x.astype(np.float32))


def test_recovers_centers_and_beats_random_codebook():
    centers, x = clustered()
    res = kmeans(x, 16, iters=15, progress=False)
    # every true center has a learnt centroid within a few noise widths
    nearest_dist = mx.sqrt(sq_distances(centers, res.centroids).min(axis=-1))
    assert float(nearest_dist.max().item()) < 0.05
    # within-cluster error ~ d * spread^2 = 0.01
    assert float(res.mse.max().item()) < 0.012
    assert int(res.dead.sum().item()) == 0
    # a random codebook (16 random data points, no iterations) is far worse
    rand = x[:, :16]
    _, rand_err = assign(x, rand)
    assert float(res.mse.mean().item()) < 0.1 * float(rand_err.mean().item())


def test_deterministic_and_seed_dependent():
    _, x = clustered(n=1500)
    a = kmeans(x, 32, iters=5, seed=3, progress=False)
    b = kmeans(x, 32, iters=5, seed=3, progress=False)
    c = kmeans(x, 32, iters=5, seed=4, progress=False)
    assert mx.array_equal(a.centroids, b.centroids).item()
    assert mx.array_equal(a.counts, b.counts).item()
    assert a.history == b.history
    assert not mx.array_equal(a.centroids, c.centroids).item()
    s = kmeans(x, 32, iters=5, seed=3, init="sample", progress=False)
    s2 = kmeans(x, 32, iters=5, seed=3, init="sample", progress=False)
    assert mx.array_equal(s.centroids, s2.centroids).item()


def test_gemm_distances_equal_brute_force():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 300, 8)).astype(np.float32) * 3
    c = rng.normal(size=(2, 64, 8)).astype(np.float32) * 3
    brute = ((x[:, :, None, :].astype(np.float64) - c[:, None, :, :]) ** 2).sum(-1)
    gemm = np.array(sq_distances(mx.array(x), mx.array(c)))
    np.testing.assert_allclose(gemm, brute, rtol=1e-4, atol=1e-3)
    codes, err = assign(mx.array(x), mx.array(c), chunk_elems=1000)  # many chunks
    codes = np.array(codes)
    # same argmin as brute force except where two centroids tie within float32 rounding
    best = brute.min(-1)
    picked = np.take_along_axis(brute, codes[..., None].astype(np.int64), -1)[..., 0]
    np.testing.assert_allclose(picked, best, rtol=1e-5, atol=1e-4)
    assert (codes == brute.argmin(-1)).mean() > 0.999
    np.testing.assert_allclose(np.array(err), best, rtol=1e-4, atol=1e-3)
    # a shared codebook [1, K, d] broadcasts over groups
    shared, _ = nearest(mx.array(x), mx.array(c[:1]))
    brute_shared = ((x[:, :, None, :] - c[:1, None, :, :]) ** 2).sum(-1)
    assert (np.array(shared) == brute_shared.argmin(-1)).mean() > 0.999


def test_dead_centroids_are_reseeded():
    # 24 distinct points, each repeated 20 times, 24 centroids: a sampled init almost surely
    # picks duplicates; only reseeding to the worst-fit points reaches zero error.
    rng = np.random.default_rng(0)
    distinct = rng.normal(size=(1, 24, 4)).astype(np.float32) * 4
    x = mx.array(np.repeat(distinct, 20, axis=1))
    res = kmeans(x, 24, iters=10, init="sample", seed=0, progress=False)
    assert int(res.dead.sum().item()) == 0
    assert float(res.mse.max().item()) < 1e-4  # GEMM-form rounding; one merged pair costs ~1
    assert np.array_equal(np.sort(np.array(res.counts)[0]), np.full(24, 20))
    # its usage entropy is exactly log2(24): every code used equally
    assert abs(float(res.usage_entropy_bits()[0].item()) - np.log2(24)) < 1e-4


def test_product_kmeans_pools_subvectors():
    # D=8 vectors whose two 4-dim halves come from the same 8 centers: one shared codebook of
    # 8 centroids fits both halves.
    centers, _ = clustered(groups=1, k=8, n=10, d=4)
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 8, size=(1, 1000, 2))
    halves = np.take(np.array(centers)[0], idx, axis=0)  # [1, 1000, 2, 4]
    vecs = mx.array(
        halves.reshape(1, 1000, 8) + 0.01 * rng.normal(size=(1, 1000, 8)).astype(np.float32)
    )
    res = product_kmeans(vecs, 4, 8, iters=10, progress=False)
    assert res.centroids.shape == (1, 8, 4)
    assert float(res.mse.item()) < 4 * 0.01**2 * 1.5


def test_bad_inputs():
    _, x = clustered(n=100)
    with pytest.raises(ValueError, match="at least 256 vectors"):
        kmeans(x, 256, progress=False)
    with pytest.raises(ValueError, match="need at least 64 captured tokens"):
        product_kmeans(mx.zeros((1, 10, 16)), 4, 256, progress=False)
    bad = np.array(x)
    bad[0, 5, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        kmeans(mx.array(bad), 4, progress=False)
    with pytest.raises(ValueError, match="init"):
        kmeans(x, 4, init="random", progress=False)
    with pytest.raises(ValueError, match="divide"):
        product_kmeans(mx.zeros((1, 10, 10)), 4, 2, progress=False)


def test_reseeding_equals_plain_greedy_farthest_point_per_group():
    """`_reseed_dead` batches only the groups that still have dead centroids; it must place every
    dead centroid exactly where one-group-at-a-time greedy farthest-point reseeding does, and
    leave its inputs alone."""
    from veloxquant.kmeans import _init_sample, _reseed_dead

    rng = np.random.default_rng(0)
    groups, n, k, d = 5, 1500, 300, 8
    # few distinct points in some groups (most sampled centroids collide and die), many in others
    x = np.stack(
        [
            rng.normal(size=(m, d)).astype(np.float32)[rng.integers(0, m, n)]
            for m in (4, 40, 1500, 300, 12)
        ]
    )
    x = mx.array(x)
    c = _init_sample(x, k, mx.random.key(3))
    codes, err = assign(x, c)
    counts = np.zeros((groups, k), np.int64)
    for g, row in enumerate(np.array(codes)):
        np.add.at(counts[g], row, 1)
    dead = mx.array(counts == 0)
    n_dead = dead.sum(axis=1)
    assert sorted(n_dead.tolist())[0] < 50 < sorted(n_dead.tolist())[-1]  # uneven, as in practice
    c_before, err_before = np.array(c), np.array(err)

    got = np.array(_reseed_dead(x, err, dead, n_dead, c))

    assert np.array_equal(np.array(c), c_before) and np.array_equal(np.array(err), err_before)
    xn, en, deadn = np.array(x), np.array(err), counts == 0
    for g in range(groups):
        want, e = c_before[g].copy(), en[g].copy()
        for i in np.flatnonzero(deadn[g]):  # dead centroids in index order
            p = xn[g, int(np.argmax(e))]
            want[i] = p
            e = np.minimum(e, ((xn[g] - p) ** 2).sum(-1))
        np.testing.assert_allclose(got[g], want, rtol=0, atol=0)


def test_one_hot_cluster_sums_equal_the_scatter_add():
    """The GPU's deterministic cluster sums (one-hot GEMMs, chunked) equal the CPU's
    scatter-add, chunk boundaries included."""
    from veloxquant.kmeans import cluster_sums

    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(3, 1000, 4)).astype(np.float32))
    codes = mx.array(rng.integers(0, 37, (3, 1000)).astype(np.uint32))
    flat = (codes + (mx.arange(3, dtype=mx.uint32) * 37)[:, None]).reshape(-1)
    want = mx.zeros((3 * 37, 4)).at[flat].add(x.reshape(-1, 4)).reshape(3, 37, 4)
    for chunk in (37 * 3 * 64, 1 << 21):  # several chunks, and one
        got = cluster_sums(x, codes, 37, chunk_elems=chunk)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sub_dim,k", [(2, 64), (4, 256)])
def test_host_assignment_is_bit_identical_to_nearest(sub_dim, k):
    # training assigns with numpy's argmin on the CPU; the runtime encoder uses `nearest`.
    # Both must give the same codes and errors bit for bit, exact ties (duplicated
    # centroids) included, and across chunk boundaries.
    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(size=(5, 3000, sub_dim)).astype(np.float32))
    half = mx.array(rng.normal(size=(5, k // 2, sub_dim)).astype(np.float32))
    c = mx.concatenate([half, half], axis=1)
    want_codes, want_err = nearest(x, c)
    codes, err = assign(x, c, chunk_elems=5 * k * 700)  # several chunks
    assert codes.dtype == mx.uint32 and err.dtype == mx.float32
    assert int((np.array(want_codes) >= k // 2).sum()) == 0  # ties went to the first copy
    np.testing.assert_array_equal(np.array(codes), np.array(want_codes))
    np.testing.assert_array_equal(np.array(err), np.array(want_err))


needs_kernels = pytest.mark.skipif(
    not __import__("veloxquant.cpu_kernels").cpu_kernels.wanted_here(),
    reason="the CPU kernels are for x86-64 Linux",
)


def _captured_keys(calib_dir, sub_dim: int) -> mx.array:
    """Real pre-RoPE keys of three layers of the real model, as sub-vectors [3, n, sub_dim]."""
    from veloxquant.capture import load_activations

    layers = [load_activations(calib_dir / "activations", i)["k_pre"] for i in (0, 7, 29)]
    x = mx.stack([k[:, 0].astype(mx.float32) for k in layers]).reshape(3, -1)  # head 0
    n = x.shape[1] // sub_dim
    return x[:, : n * sub_dim].reshape(3, n, sub_dim)


@pytest.fixture(params=["avx512", "avx2"])
def assign_isa(request):
    """The assignment kernel's sixteen-lane (AVX-512, where the CPU has it) and eight-lane
    paths, each in turn (the same bits; a CPU without AVX-512 runs the eight-lane one twice)."""
    from veloxquant import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built")
    ext = cpu_kernels._module
    ext.set_wide_assign(request.param == "avx512")
    yield request.param
    ext.set_wide_assign(True)


@needs_kernels
@pytest.mark.parametrize("sub_dim", [1, 2, 3, 4, 5, 6])
def test_the_assignment_kernel_has_the_gemm_paths_bits_on_real_keys(calib_dir, sub_dim, assign_isa):
    from veloxquant import cpu_kernels
    from veloxquant.kmeans import _nearest_on_host, augment_codebook

    x = _captured_keys(calib_dir, sub_dim)
    rng = np.random.default_rng(sub_dim)
    for c in (
        x[:, mx.array(rng.choice(x.shape[1], 200, replace=False))],  # one codebook per group
        x[:1, mx.array(rng.choice(x.shape[1], 64, replace=False))],  # one shared by all
    ):
        codes, err = cpu_kernels.nearest_centroid(x, c)
        want_codes, want_err = _nearest_on_host(x, augment_codebook(c))
        np.testing.assert_array_equal(np.array(codes), np.array(want_codes))
        np.testing.assert_array_equal(np.array(err), np.array(want_err))


@needs_kernels
def test_the_assignment_kernel_fails_closed_where_it_would_not_match(monkeypatch):
    from veloxquant import cpu_kernels
    from veloxquant.kmeans import _kernels_assign

    x = mx.random.normal((2, 100, 7))
    assert not _kernels_assign(x, x)  # d + 1 = 8: OpenBLAS sums in another order; GEMM runs
    assert _kernels_assign(x[..., :6], x[..., :6])
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SkylakeX")  # other kernels: the GEMM runs
    assert not _kernels_assign(x[..., :6], x[..., :6])
    with pytest.raises(ValueError, match="d <= 6"):
        cpu_kernels.nearest_centroid(x, x[:, :10])
    x = mx.random.normal((2, 100, 2))
    c = mx.concatenate([x[:, :9], mx.full((2, 1, 2), np.nan)], axis=1)
    with pytest.raises(RuntimeError, match="NaN"):
        mx.eval(cpu_kernels.nearest_centroid(x, c))


@needs_kernels
def test_the_cluster_sums_kernel_is_the_scatter_add_bit_for_bit():
    from veloxquant import cpu_kernels

    rng = np.random.default_rng(0)
    x = mx.array((rng.normal(size=(3, 5000, 4)) * 10).astype(np.float32))
    codes = mx.array(rng.integers(0, 37, (3, 5000)).astype(np.uint32))
    flat = (codes + (mx.arange(3, dtype=mx.uint32) * 37)[:, None]).reshape(-1)
    want = mx.zeros((3 * 37, 4)).at[flat].add(x.reshape(-1, 4)).reshape(3, 37, 4)
    want_counts = mx.zeros((3 * 37,)).at[flat].add(1.0).reshape(3, 37)
    sums, counts = cpu_kernels.cluster_sums(x, codes, 37)
    np.testing.assert_array_equal(np.array(sums).view(np.uint32), np.array(want).view(np.uint32))
    np.testing.assert_array_equal(np.array(counts), np.array(want_counts))
    with pytest.raises(RuntimeError, match=">= k"):
        mx.eval(cpu_kernels.cluster_sums(x, codes, 30))


@needs_kernels
@pytest.mark.parametrize("sub_dim,bits", [(2, 6), (4, 8)])
def test_kmeans_on_the_kernels_is_kmeans_on_mlx_bit_for_bit(calib_dir, monkeypatch, sub_dim, bits):
    import veloxquant.kmeans as km

    x = _captured_keys(calib_dir, sub_dim)
    got = km.kmeans(x, 2**bits, iters=4, seed=0, progress=False)
    monkeypatch.setattr(km, "_kernels_assign", lambda x, c: False)
    monkeypatch.setattr(km.cpu_kernels, "usable", lambda *a: False)
    want = km.kmeans(x, 2**bits, iters=4, seed=0, progress=False)
    np.testing.assert_array_equal(
        np.array(got.centroids).view(np.uint32), np.array(want.centroids).view(np.uint32)
    )
    np.testing.assert_array_equal(np.array(got.counts), np.array(want.counts))
    assert got.history == want.history


def test_the_subsample_takes_the_draws_mlx_argsort_takes_ties_included():
    from veloxquant.kmeans import _smallest_first

    u = mx.random.uniform(shape=(4, 20000), key=mx.random.key(1))
    for draws in (u, mx.round(u * 300) / 300):  # many exact ties
        for k in (1, 17, 4999):
            want = np.array(mx.argsort(draws, axis=1)[:, :k])
            np.testing.assert_array_equal(_smallest_first(np.array(draws), k), want)


def _draw_once(d2_target: np.ndarray, u: np.ndarray, kernel: bool) -> np.ndarray:
    """One D² draw per uniform, in groups that all start from point 0 of the same points,
    placed so that point i's squared distance to point 0 is d2_target[i]."""
    from veloxquant import cpu_kernels
    from veloxquant.kmeans import _d2_draws

    g = u.shape[0]
    pts = np.sqrt(d2_target).astype(np.float32)[None, :, None].repeat(g, 0)  # 1-D, point 0 at 0
    x, first = mx.array(pts), mx.zeros((g,), mx.uint32)
    uu = mx.array(u.astype(np.float32))[None]
    if kernel:
        return np.array(cpu_kernels.kmeanspp_draws(x, first, uu))[:, 1]
    return np.array(_d2_draws(x, first, uu, False, ""))[:, 1]


@pytest.mark.parametrize("kernel", [False, True])
def test_kmeans_pp_draws_points_in_proportion_to_their_squared_distance(kernel):
    from veloxquant import cpu_kernels

    if kernel and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built")
    d2 = np.array([0.0, 1.0, 0.0, 4.0, 2.0, 0.0, 9.0], np.float64)
    u = np.random.default_rng(0).uniform(size=20000)
    got = np.bincount(_draw_once(d2, u, kernel), minlength=d2.size) / u.size
    np.testing.assert_allclose(got, d2 / d2.sum(), atol=0.01)
    assert got[[0, 2, 5]].sum() == 0  # points at distance 0 (the first one too) never drawn
    # the inverse of the cumulative distance, at its edges: u = 0 draws the first point with a
    # positive distance, u just below 1 the last
    edges = _draw_once(d2, np.array([0.0, np.nextafter(1.0, 0.0)]), kernel)
    assert edges.tolist() == [1, 6]


@needs_kernels
@pytest.mark.parametrize("sub_dim,k", [(2, 64), (4, 256), (1, 1), (3, 9)])
def test_the_kmeans_pp_kernel_draws_what_the_mlx_loop_draws(calib_dir, sub_dim, k):
    from veloxquant import cpu_kernels
    from veloxquant.kmeans import _d2_draws

    x = _captured_keys(calib_dir, sub_dim)[:, :2000]
    x = mx.concatenate([x, x[:, :500]], axis=1)  # repeated points: distances of exactly 0
    first = mx.array([0, 7, 1999], dtype=mx.uint32)
    u = mx.random.uniform(shape=(k - 1, 3), key=mx.random.key(k))
    got = cpu_kernels.kmeanspp_draws(x, first, u)
    want = _d2_draws(x, first, u, False, "")
    assert got.shape == (3, k)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    with pytest.raises(RuntimeError, match="first index"):
        mx.eval(cpu_kernels.kmeanspp_draws(x, mx.array([0, 1, 2500], dtype=mx.uint32), u))
