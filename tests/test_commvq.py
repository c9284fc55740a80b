"""CommVQ: commutativity, separable encoding, the EM projection, the cache contract, and
calibrated-beats-uncalibrated on tiny and real models. Tiny budgets throughout."""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from veloxquant.config import KVCacheConfig
from veloxquant.methods.base import Artifact, CalibrationInputs, ModelDims
from veloxquant.methods.commvq import (
    METHOD,
    CommVQCache,
    check_artifact,
    make_caches,
    pq_baseline,
)
from veloxquant.methods.commvq import codebook as cb
from veloxquant.methods.commvq import train as tr
from veloxquant.methods.commvq.cache import (
    key_code_bytes,
    pack12,
    rope_params,
    unpack12,
)

LAYOUTS = [True, False]  # rope_traditional: interleaved pairs, half-split pairs


def random_theta(seed: int, g: int, r: int, p: int) -> mx.array:
    return cb.gaussian_theta(mx.random.key(seed), g, r, p)


def random_codes(seed: int, shape: tuple[int, ...]) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, cb.CODEWORDS, shape), mx.uint32)


def decode(theta: mx.array, codes: mx.array) -> mx.array:
    """Σ_r c(a_r, b_r) for θ [G, R, P, 64, 2] and codes [G, N, R] → [G, N, P, 2]."""
    return cb.decode_pairs(codes, cb.gather_table(theta), theta.shape[0], theta.shape[1])


# ------------------------------------------------------------------------------- codebook math


@pytest.mark.parametrize("traditional", LAYOUTS)
def test_pairs_and_rope_match_mlx(traditional):
    x = mx.random.normal((1, 2, 7, 16), key=mx.random.key(0))
    z = cb.to_pairs(x, traditional)
    # pair j is (2j, 2j+1) interleaved, (j, j + 8) half-split
    j = 3
    want = (x[..., 2 * j], x[..., 2 * j + 1]) if traditional else (x[..., j], x[..., j + 8])
    np.testing.assert_array_equal(np.array(z[..., j, 0]), np.array(want[0]))
    np.testing.assert_array_equal(np.array(z[..., j, 1]), np.array(want[1]))
    np.testing.assert_array_equal(np.array(cb.from_pairs(z, traditional)), np.array(x))
    fast = mx.fast.rope(x, 16, traditional=traditional, base=1e4, scale=0.5, offset=11)
    ours = cb.rope_at(x, mx.arange(11, 18), base=1e4, traditional=traditional, scale=0.5)
    np.testing.assert_allclose(np.array(ours), np.array(fast), atol=2e-5)
    back = mx.fast.rope(fast, 16, traditional=traditional, base=1e4, scale=-0.5, offset=11)
    np.testing.assert_allclose(np.array(back), np.array(x), atol=2e-5)


@pytest.mark.parametrize("traditional", LAYOUTS)
def test_decode_then_rope_equals_decoding_with_rotated_parameters(traditional):
    """The commutativity CommVQ rests on: for random codes and random positions n,
    RoPE_n(decode(codes; θ)) = decode(codes; θ with pair j's parameters times exp(i·n·θ_j))."""
    g, r, p, n = 2, 3, 16, 40
    d = 2 * p
    theta = random_theta(1, g, r, p)
    codes = random_codes(2, (g, n, r))
    positions = mx.array(np.random.default_rng(3).integers(0, 100_000, n))
    base = 1e4
    keys = cb.from_pairs(decode(theta, codes), traditional)  # [G, N, D]
    roped = cb.rope_at(keys, positions, base=base, traditional=traditional)
    angles = positions.astype(mx.float32)[:, None] * cb.rope_frequencies(d, base)  # [N, P]
    for t in range(n):
        rotated = cb.rotate_theta(theta, mx.broadcast_to(angles[t], (g, r, p)))
        one = cb.from_pairs(decode(rotated, codes[:, t : t + 1]), traditional)[:, 0]
        np.testing.assert_allclose(np.array(one), np.array(roped[:, t]), atol=1e-4, rtol=1e-4)


def test_plain_product_vq_fails_the_same_test():
    """Upstream's plain PQ (per-sub-space codebooks over consecutive channels) in the half-split
    layout: rotating "each pair's parameters" needs the two channels of a pair from two
    different sub-vectors, whose codes differ, so decode-with-rotated-parameters is not RoPE.
    (Sub-vectors that are unions of whole RoPE pairs, e.g. interleaved with even sub_dim, would
    pass: then PQ is a per-pair lookup, commutative but not additive.)"""
    rng = np.random.default_rng(4)
    d, sub, k, n = 32, 4, 256, 40
    m = d // sub
    books = mx.array(rng.standard_normal((m, k, sub)), mx.float32)  # per sub-space codebooks
    codes = mx.array(rng.integers(0, k, (n, m)), mx.int32)
    positions = mx.array(rng.integers(1, 100_000, n))

    def pq_decode(books_, codes_):
        return mx.concatenate([books_[i][codes_[:, i]] for i in range(m)], axis=-1)  # [N, D]

    roped = cb.rope_at(pq_decode(books, codes), positions, base=1e4, traditional=False)
    # The PQ parameters in pair view: codeword index c's flat D-vector, paired as RoPE pairs.
    flat = books.transpose(1, 0, 2).reshape(k, d)  # [K, D]
    params = cb.to_pairs(flat, traditional=False)  # [K, P, 2]
    angles = positions.astype(mx.float32)[:, None] * cb.rope_frequencies(d, 1e4)
    errs, norms = [], []
    for t in range(n):
        rot = cb.from_pairs(cb.rotate_pairs(params, angles[t][None]), traditional=False)
        rot_books = rot.reshape(k, m, sub).transpose(1, 0, 2)
        one = pq_decode(rot_books, codes[t : t + 1])[0]
        errs.append(float(mx.abs(one - roped[t]).max()))
        norms.append(float(mx.abs(roped[t]).max()))
    assert max(errs) > 0.3 * max(norms), "plain PQ unexpectedly commuted with RoPE"
    # ... while the same check passes for CommVQ at the same positions (previous test).


def test_the_encoders_kernel_path_has_the_score_block_paths_bits(monkeypatch):
    from veloxquant import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    theta = random_theta(5, 3, 1, 16)[:, 0]
    x = mx.random.normal((3, 700, 16, 2), key=mx.random.key(8)) * 0.3
    got = cb.nearest_codewords(x, theta, chunk_elems=1 << 18)  # several chunks
    monkeypatch.setattr(cpu_kernels, "usable", lambda *a: False)
    want = cb.nearest_codewords(x, theta, chunk_elems=1 << 18)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


def test_separable_encoding_equals_brute_force():
    g, n, p = 3, 300, 16
    theta = random_theta(5, g, 1, p)[:, 0]
    x = mx.random.normal((g, n, p, 2), key=mx.random.key(6)) * 0.3
    codes, err = cb.nearest_codewords(x, theta, chunk_elems=1 << 18)  # several chunks
    every = cb.all_codewords(theta)  # [G, 4096, P, 2]
    d2 = ((x[:, :, None] - every[:, None]) ** 2).sum(axis=(-1, -2))
    np.testing.assert_array_equal(np.array(codes), np.array(mx.argmin(d2, axis=-1)))
    np.testing.assert_allclose(np.array(err), np.array(d2.min(axis=-1)), rtol=1e-4, atol=1e-5)
    # codeword_pairs picks exactly the enumerated codeword
    picked = mx.take_along_axis(every, codes.astype(mx.int32)[..., None, None], axis=1)
    np.testing.assert_allclose(
        np.array(cb.codeword_pairs(theta, codes)), np.array(picked), atol=1e-6
    )
    # the greedy residual encoder = brute force stage by stage
    theta2 = random_theta(7, g, 2, p)
    codes2, residual = cb.encode_residual(x, theta2)
    rec = x - residual
    np.testing.assert_allclose(np.array(decode(theta2, codes2)), np.array(rec), atol=1e-5)
    first, _ = cb.nearest_codewords(x, theta2[:, 0])
    np.testing.assert_array_equal(np.array(codes2[..., 0]), np.array(first))


def test_m_step_is_the_weighted_least_squares_fit():
    """The projection equals numpy's least squares on the explicit design matrix for one pair,
    and the gradient of the expected error vanishes there."""
    rng = np.random.default_rng(8)
    g, n, p = 1, 500, 3
    x = mx.array(rng.standard_normal((g, n, p, 2)), mx.float32)
    logits = mx.array(rng.standard_normal((g, n, cb.CODEWORDS)) * 3, mx.float32)
    prob = mx.softmax(logits, axis=-1)
    p4 = prob.reshape(g, n, 64, 64)
    w = prob.sum(axis=1).reshape(g, 64, 64)
    xf = x.reshape(g, n, 2 * p)
    sa = mx.matmul(p4.sum(-1).swapaxes(1, 2), xf).reshape(g, 64, p, 2)
    sb = mx.matmul(p4.sum(-2).swapaxes(1, 2), xf).reshape(g, 64, p, 2)
    theta_old = random_theta(9, g, 1, p)[:, 0]
    theta = tr.m_step(w, sa, sb, theta_old, ridge=1e-9)
    # explicit: rows (a, b, component) with weight W_ab; unknowns (x_0..63, y_0..63) of pair j
    ww = np.array(w[0]).reshape(-1)
    pr = np.array(prob[0])
    xn = np.array(x[0])
    design = np.zeros((2 * 4096, 128))
    for a in range(64):
        for b in range(64):
            row = 2 * (a * 64 + b)
            design[row, a], design[row, 64 + b] = 1, -1  # x_a − y_b
            design[row + 1, 64 + a], design[row + 1, b] = 1, 1  # y_a + x_b
    for j in range(p):
        means = (pr.T @ xn[:, j]) / np.maximum(ww, 1e-30)[:, None]  # soft means m_ab [4096, 2]
        sw = np.sqrt(np.repeat(ww, 2))
        sol = np.linalg.lstsq(design * sw[:, None], means.reshape(-1) * sw, rcond=None)[0]
        np.testing.assert_allclose(np.array(theta[0, j, :, 0]), sol[:64], atol=2e-4)
        np.testing.assert_allclose(np.array(theta[0, j, :, 1]), sol[64:], atol=2e-4)


@pytest.mark.parametrize("traditional", LAYOUTS)
def test_shared_atoms_with_gains_still_commute_with_rope(traditional):
    """θ_r = g_r·atoms is a commutative codebook: rotating the gains by exp(i·n·θ_j) gives
    RoPE_n of the decoded key, so the cache may apply RoPE at fetch as for a free θ."""
    h, r, p, n = 2, 3, 16, 12
    atoms = random_theta(20, 1, 1, p)  # one atom set for both heads
    gains = mx.random.normal((h, r, p, 2), key=mx.random.key(21))
    theta = cb.apply_gains(atoms, gains)
    assert theta.shape == (h, r, p, 64, 2)
    # stage r of head h is the atoms times one complex number per pair
    want = cb.complex_mul(gains[1, 2][:, None], atoms[0, 0])
    np.testing.assert_allclose(np.array(theta[1, 2]), np.array(want), atol=1e-6)
    codes = random_codes(22, (h, n, r))
    positions = mx.array(np.random.default_rng(23).integers(0, 50_000, n))
    roped = cb.rope_at(
        cb.from_pairs(decode(theta, codes), traditional),
        positions,
        base=1e4,
        traditional=traditional,
    )
    angles = positions.astype(mx.float32)[:, None] * cb.rope_frequencies(2 * p, 1e4)
    for t in range(n):
        turned = cb.rotate_pairs(gains, mx.broadcast_to(angles[t], (h, r, p)))
        one = cb.from_pairs(decode(cb.apply_gains(atoms, turned), codes[:, t : t + 1]), traditional)
        np.testing.assert_allclose(np.array(one[:, 0]), np.array(roped[:, t]), atol=1e-4)
    with pytest.raises(ValueError, match="atoms"):
        cb.apply_gains(random_theta(20, 1, 2, p), gains)  # two atom slots: not a shared set


def _complex_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(design, target, rcond=None)[0]


def test_gain_and_atom_solves_are_the_least_squares_fits():
    """solve_gains and solve_atoms equal numpy's complex least squares on the explicit design
    matrices (one pair, fixed codes), with a pool of two heads sharing the atoms."""
    rng = np.random.default_rng(24)
    h, n, r, p = 2, 300, 3, 2
    atoms = random_theta(25, 1, 1, p)  # [1, 1, P, 64, 2]
    gains = mx.array(rng.standard_normal((h, r, p, 2)), mx.float32)
    codes = random_codes(26, (h, n, r))
    x = mx.array(rng.standard_normal((h, n, p, 2)), mx.float32)
    a, b = (np.array(c) for c in cb.split_codes(codes))
    xc = np.array(x[..., 0]) + 1j * np.array(x[..., 1])  # [H, N, P]
    t = np.array(atoms[0, 0, ..., 0]) + 1j * np.array(atoms[0, 0, ..., 1])  # [P, 64]
    gc = np.array(gains[..., 0]) + 1j * np.array(gains[..., 1])  # [H, R, P]
    unit = mx.repeat(atoms[:, 0], h, axis=0)
    got_g = tr.solve_gains(x, codes, unit, gains, ridge=1e-9)
    got_t = tr.solve_atoms(x, codes, gains, h, atoms[:, 0], ridge=1e-9)
    for j in range(p):
        for hh in range(h):
            z = t[j][a[hh]] + 1j * t[j][b[hh]]  # [N, R] unit-gain codewords
            want = _complex_lstsq(z, xc[hh, :, j])
            got = np.array(got_g[hh, :, j, 0]) + 1j * np.array(got_g[hh, :, j, 1])
            np.testing.assert_allclose(got, want, atol=1e-3)
        rows = []
        for hh in range(h):
            design = np.zeros((n, 64), complex)
            for rr in range(r):
                np.add.at(design, (np.arange(n), a[hh, :, rr]), gc[hh, rr, j])
                np.add.at(design, (np.arange(n), b[hh, :, rr]), 1j * gc[hh, rr, j])
            rows.append(design)
        want = _complex_lstsq(np.concatenate(rows), xc[:, :, j].reshape(-1))
        got = np.array(got_t[0, j, :, 0]) + 1j * np.array(got_t[0, j, :, 1])
        np.testing.assert_allclose(got, want, atol=1e-3)


def test_shared_training_improves_on_its_start_and_is_deterministic():
    k = structured_keys(27, 2, 700, 16)
    train, held = k[:, :600], k[:, 600:]
    hp = METHOD.hyperparameters({"stages": 3, "hard_iters": 2, "rounds": 2})
    atoms_a, gains_a, mu, diag = tr.train_keys_shared(train, True, hp, pool=2, progress=False)
    atoms_b, gains_b, _, _ = tr.train_keys_shared(train, True, hp, pool=2, progress=False)
    assert np.array_equal(np.array(atoms_a), np.array(atoms_b))
    assert np.array_equal(np.array(gains_a), np.array(gains_b))
    assert atoms_a.shape == (1, 1, 8, 64, 2) and gains_a.shape == (2, 3, 8, 2)
    hist = diag["round_history"]
    assert len(hist) == 3 and hist[-1] < hist[0], hist  # the rounds lower the greedy error
    # every stage helps on held-out keys, and the result beats the per-stage gains alone
    recs = tr.reconstruct_keys(held, cb.apply_gains(atoms_a, gains_a), mu, True)
    errs = [float(((held - rec) ** 2).sum().item()) for rec in recs]
    assert errs[2] < errs[1] < errs[0], errs
    no_rounds, no_gains, _, _ = tr.train_keys_shared(
        train, True, {**hp, "rounds": 0}, pool=2, progress=False
    )
    base = tr.reconstruct_keys(held, cb.apply_gains(no_rounds, no_gains), mu, True)[-1]
    assert errs[-1] < float(((held - base) ** 2).sum().item())


def test_8bit_atoms_round_trip_and_are_what_the_cache_decodes():
    theta = random_theta(28, 2, 3, 8) * 5
    q, scale = cb.quantize_atoms(theta)
    assert q.dtype == mx.int8 and scale.shape == (2, 3, 8, 1, 1)
    back = cb.dequantize_atoms(q, scale)
    step = np.array(scale.astype(mx.float32))
    assert np.all(np.abs(np.array(back - theta)) <= 0.5 * step + 1e-7)
    q2, scale2 = cb.quantize_atoms(back)  # the artifact ships `back`: the cache's rounding
    assert np.array_equal(np.array(q2), np.array(q))  # of it changes nothing
    assert np.array_equal(np.array(scale2), np.array(scale))
    c8 = small_cache(True)
    c8.theta, c8.theta_scale = cb.quantize_atoms(c8.theta.astype(mx.float32))
    c16 = small_cache(True)
    c16.theta = cb.dequantize_atoms(c8.theta, c8.theta_scale).astype(mx.float16)
    _, _, out8 = feed(c8, [9, 2])
    _, _, out16 = feed(c16, [9, 2])
    np.testing.assert_array_equal(np.array(c8.key_codes), np.array(c16.key_codes))
    # same codes; the decoded keys differ only by the fp16 rounding of the dequantized atoms
    np.testing.assert_allclose(np.array(out8[-1][0]), np.array(out16[-1][0]), atol=5e-3)
    assert (
        c16.theta.nbytes - c8.theta.nbytes - c8.theta_scale.nbytes
        == c8.theta.size - 2 * c8.theta_scale.size
    )


def test_code_packing_round_trip():
    for r in (1, 2, 5, 11, 21):
        codes = random_codes(r, (2, 3, 7, r))
        packed = pack12(codes)
        assert packed.dtype == mx.uint8 and packed.shape[-1] == key_code_bytes(r)
        np.testing.assert_array_equal(np.array(unpack12(packed, r)), np.array(codes))
    assert key_code_bytes(11) == 17 and key_code_bytes(5) == 8 and key_code_bytes(2) == 3


# ------------------------------------------------------------------------------- EM


def structured_keys(seed: int, g: int, n: int, d: int) -> mx.array:
    """Key-like data: a large per-group mean plus a low-rank token part plus noise."""
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal((g, 1, d)) * 3
    basis = rng.standard_normal((g, 6, d))
    z = rng.standard_normal((g, n, 6)) * np.array([3, 2, 1.5, 1, 0.7, 0.5])
    return mx.array(mean + z @ basis + 0.2 * rng.standard_normal((g, n, d)), mx.float32)


def test_em_lowers_error_and_is_deterministic():
    k = structured_keys(10, 2, 700, 16)
    train, held = k[:, :600], k[:, 600:]
    hp = METHOD.hyperparameters({"stages": 2, "iters": 2, "hard_iters": 2})
    theta_a, mu_a, diag = tr.train_keys(train, True, hp, progress=False)
    theta_b, mu_b, _ = tr.train_keys(train, True, hp, progress=False)
    assert np.array_equal(np.array(theta_a), np.array(theta_b))
    assert np.array_equal(np.array(mu_a), np.array(mu_b))
    for hist in diag["em_history"]:
        assert hist[-1] < 0.8 * hist[0], hist  # the final θ beats its initialisation
    init = mx.stack(
        [
            tr.init_stage(
                mx.random.split(mx.random.key(0), 2)[0],
                cb.to_pairs(tr.normalise(train, mu_a)[0], True),
                0,
            )
        ],
        axis=1,
    )
    rel = {}
    for name, th in (("em", theta_a[:, :1]), ("init", init)):
        e = held - tr.reconstruct_keys(held, th, mu_a, True)[-1]
        rel[name] = float(((e * e).sum() / ((held - mu_a[:, None]) ** 2).sum()).item())
    assert rel["em"] < 0.8 * rel["init"], rel
    # another seed gives another (still valid) codebook
    theta_c, _, _ = tr.train_keys(train, True, {**hp, "seed": 1}, progress=False)
    assert not np.array_equal(np.array(theta_a), np.array(theta_c))


# ------------------------------------------------------------------------------- the cache


def small_cache(
    traditional: bool, *, r: int = 3, window: int = 5, sinks: int = 2, center: bool = True
) -> CommVQCache:
    h, d = 2, 16
    theta = random_theta(11, h, r, d // 2)
    vbook = mx.random.normal((h, 16, 4), key=mx.random.key(12))
    mean = mx.random.normal((h, d), key=mx.random.key(13)) if center else None
    return CommVQCache(
        theta,
        vbook,
        mean,
        rope_base=1e4,
        rope_traditional=traditional,
        rope_scale=1.0,
        value_bits=4,
        value_sub_dim=4,
        window=window,
        sinks=sinks,
    )


def feed(cache, chunks, seed=14, d=16, h=2):
    rng = np.random.default_rng(seed)
    total = sum(chunks)
    k = mx.array(rng.standard_normal((1, h, total, d)), mx.float32)
    v = mx.array(rng.standard_normal((1, h, total, d)), mx.float32)
    outs, s = [], 0
    for c in chunks:
        outs.append(cache.update_and_fetch(k[:, :, s : s + c], v[:, :, s : s + c]))
        s += c
    return k, v, outs


@pytest.mark.parametrize("traditional", LAYOUTS)
def test_cache_sinks_window_exact_and_coded_keys_are_rope_of_decoded_codes(traditional):
    cache = small_cache(traditional)
    k, v, outs = feed(cache, [7, 1, 6, 1, 1])
    total, sinks, window = 16, 2, 5
    ok, ov = outs[-1]
    assert ok.shape == (1, 2, total, 16) and cache.offset == total and cache.size() == total

    def f16(a):
        return np.array(a.astype(mx.float16).astype(mx.float32))

    np.testing.assert_array_equal(np.array(ok[:, :, :sinks]), f16(k[:, :, :sinks]))
    np.testing.assert_array_equal(np.array(ov[:, :, :sinks]), f16(v[:, :, :sinks]))
    # the last call's own token is exact, the window before it fp16
    np.testing.assert_array_equal(np.array(ok[:, :, -1]), np.array(k[:, :, -1]))
    np.testing.assert_array_equal(
        np.array(ok[:, :, -window - 1 : -1]), f16(k[:, :, -window - 1 : -1])
    )
    n_coded = total - 1 - sinks - window
    assert cache.key_codes.shape[2] == total - sinks - window
    # coded keys: RoPE at their positions of μ + s·Σ codewords, decoded here independently
    codes = unpack12(cache.key_codes, 3)[0]  # [H, C, R]
    theta = cache.theta.astype(mx.float32)
    every = cb.all_codewords(theta.reshape(-1, *theta.shape[2:])).reshape(2, 3, 4096, 8, 2)
    pairs = sum(
        mx.take_along_axis(every[:, r], codes[..., r].astype(mx.int32)[..., None, None], axis=1)
        for r in range(3)
    )
    pre = cb.from_pairs(pairs, traditional) * cache.key_scales[0].astype(mx.float32)[..., None]
    pre = pre + cache.key_mean[:, None]
    positions = mx.arange(sinks, sinks + pre.shape[1])
    want = cb.rope_at(pre, positions, base=1e4, traditional=traditional)
    got = ok[0, :, sinks : sinks + n_coded]
    np.testing.assert_allclose(np.array(got), np.array(want[:, :n_coded]), atol=1e-4)
    # ... and they are a quantization of the keys, not something else
    err = float(((got - k[0, :, sinks : sinks + n_coded]) ** 2).mean().item())
    assert err < 1.0  # unit-variance keys; a wrong position or layout would give ~2


def test_cache_nbytes_offsets_masks_and_contract():
    cache = small_cache(True, r=3, window=5, sinks=2)
    feed(cache, [9, 1, 1])
    h, d, r, c = 2, 16, 3, 11 - 2 - 5
    want = (
        c * h * key_code_bytes(r)  # codes
        + c * h * 2  # fp16 scales
        + c * h * (d // 4) * 4 // 8  # value codes, 4-bit codes of 4 dims
        + 2 * (2 + 5) * h * d * 2  # fp16 sinks and window, K and V
        + h * r * (d // 2) * 64 * 2 * 2  # fp16 θ
        + h * 16 * 4 * 2  # fp16 value codebook
        + h * d * 4
    )  # f32 μ
    assert cache.nbytes == want
    assert cache.offset == 11 and cache.size() == 11
    mask = cache.make_mask(3, return_array=True)
    expected = np.concatenate([np.ones((3, 11), bool), np.tril(np.ones((3, 3), bool))], axis=1)
    np.testing.assert_array_equal(np.array(mask), expected)
    assert cache.make_mask(1) is None
    # the rest of the mlx-lm contract (bits, to_quantized, merge, state): tests/test_contract.py


# ------------------------------------------------------------------------------- models

VOCAB = 128


def tiny_llama(scaling=None) -> nn.Module:
    mx.random.seed(1)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        rope_traditional=True,
        tie_word_embeddings=False,
        rope_scaling=scaling,
    )
    model = llama.Model(args)
    for layer in model.layers:  # peaked attention, as in a trained model, so key errors matter
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * 3.0
        attn.k_proj.weight = attn.k_proj.weight * 3.0
    mx.eval(model.parameters())
    return model


def tiny_qwen3() -> nn.Module:
    mx.random.seed(2)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        head_dim=32,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    model = qwen3.Model(args)
    for layer in model.layers:  # a non-trivial k_norm, and a key mean
        layer.self_attn.k_norm.weight = mx.random.uniform(0.5, 2.0, (32,))
    mx.eval(model.parameters())
    return model


def _tokens(n, s, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (n, s)).astype(np.int32)


def _kl_vs_fp16(model, make, tokens, prefill=48, chunk=16):
    """Mean KL(fp16 || cache) over the positions after the prefill, fed like the eval."""
    ref, ours = [KVCache() for _ in model.layers], make(model)
    kls = []
    for s in [0] + list(range(prefill, tokens.shape[1], chunk)):
        e = prefill if s == 0 else min(s + chunk, tokens.shape[1])
        x = mx.array(tokens[:, s:e])
        a = nn.log_softmax(model(x, cache=ref).astype(mx.float32), axis=-1)
        b = nn.log_softmax(model(x, cache=ours).astype(mx.float32), axis=-1)
        if s:
            kls.append(float((mx.exp(a) * (a - b)).sum(-1).mean().item()))
    return float(np.mean(kls)), ours


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_bundle(request, tmp_path_factory):
    """A tiny model (llama: interleaved pairs; qwen3: half-split), its capture and a calibrated
    artifact at a small budget."""
    from veloxquant.capture import capture_activations

    model = tiny_llama() if request.param == "llama" else tiny_qwen3()
    out = tmp_path_factory.mktemp(f"capture_{request.param}")
    capture_activations(
        model, _tokens(8, 128, seed=3), out, token_budget=1024, seed=0, progress=False
    )
    hp = METHOD.hyperparameters({"iters": 2, "hard_iters": 2, "max_tokens": 800, "value_iters": 6})
    dims = ModelDims.of(model)
    tensors, diag = METHOD.calibrate(CalibrationInputs(out, out), dims, hp, progress=False)
    artifact = Artifact("commvq", tensors, hp, diag)
    return model, artifact, out


def test_tiny_models_calibrated_beats_uncalibrated_and_plain_pq(tiny_bundle):
    """Small-budget version of the eval: calibrated CommVQ at ~2 key bits stays close to fp16
    and beats both its uncalibrated variant and plain pre-RoPE PQ at the same key bits."""
    model, artifact, capture = tiny_bundle
    dims = ModelDims.of(model)
    assert artifact.diagnostics["pair_layout"] == cb.layout_name(dims.rope_traditional)
    specs = METHOD.tensor_specs(dims, artifact.hyperparameters)
    assert {k: tuple(v.shape) for k, v in artifact.tensors.items()} == {
        k: s.shape for k, s in specs.items()
    }
    tokens = _tokens(1, 144, seed=7)
    cfg = KVCacheConfig(method="commvq", window=8, sinks=2)
    kl_cal, caches = _kl_vs_fp16(model, lambda m: make_caches(m, cfg, artifact), tokens)
    kl_unc, _ = _kl_vs_fp16(
        model,
        lambda m: make_caches(
            m, KVCacheConfig(method="commvq", uncalibrated=True, window=8, sinks=2), None
        ),
        tokens,
    )

    from veloxquant.capture import load_activations

    # plain PQ on pre-RoPE keys at the same key code bits (d = 6 would be 12 bits per 6 dims;
    # use d4b8 = 2 bits per element, as upstream), same values, window and sinks
    k = mx.stack(
        [load_activations(capture, i, ["k_pre"])["k_pre"] for i in range(dims.L)]
    ).transpose(0, 2, 1, 3)
    kb, mu = pq_baseline.train_prerope_pq(k.reshape(-1, *k.shape[2:]), 4, 8, center=True, iters=8)
    kb = kb.reshape(dims.L, dims.H_kv, *kb.shape[1:])
    mu = mu.reshape(dims.L, dims.H_kv, dims.D)
    kl_pq, _ = _kl_vs_fp16(
        model,
        lambda m: pq_baseline.make_caches(
            m,
            kb,
            artifact.tensors["value_codebook"],
            mu,
            key_bits=8,
            key_sub_dim=4,
            value_bits=8,
            value_sub_dim=4,
            window=8,
            sinks=2,
        ),
        tokens,
    )
    assert kl_cal < 0.08, kl_cal
    assert kl_cal < 0.5 * kl_unc, (kl_cal, kl_unc)
    assert kl_cal < kl_pq, (kl_cal, kl_pq)
    assert caches[0].key_codes.shape[2] == 144 - 2 - 8


def test_tiny_models_inverse_rope_recovers_captured_pre_rope_keys(tiny_bundle):
    """The cache's inverse RoPE at its own positions gives back the model's k_pre, in either
    layout (the model's RoPE applied by mlx-lm, not by us)."""
    from veloxquant.capture import record_attention, recording_caches

    model = tiny_bundle[0]
    caches = make_caches(model, KVCacheConfig(method="commvq", uncalibrated=True), None)
    with record_attention(model) as ropes:
        rec = recording_caches(ropes)
        model(mx.array(_tokens(1, 20)), cache=rec)
        model(mx.array(_tokens(1, 5, seed=1)), cache=rec)  # offset 20
    r = rec[0].records[1]
    back = caches[0]._rope(r["k_post"], 20, inverse=True)
    np.testing.assert_allclose(np.array(back), np.array(r["k_pre"]), atol=1e-4)


def test_save_and_load_prompt_cache_round_trip(tiny_bundle, tmp_path):
    model, artifact, _ = tiny_bundle
    cfg = KVCacheConfig(method="commvq", window=8, sinks=2)
    caches = make_caches(model, cfg, artifact)
    model(mx.array(_tokens(1, 40, seed=8)), cache=caches)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [CommVQCache] * len(caches)
    assert loaded[0].offset == 40 and loaded[0].nbytes == caches[0].nbytes
    # a loaded cache attends the way a fresh one would here (fused where the CPU kernel runs),
    # from its second update on: its first is transient (attention.route_proven)
    assert loaded[0].fused == caches[0].fused
    nxt = mx.array(_tokens(1, 1, seed=9))
    a, b = model(nxt, cache=caches), model(nxt, cache=loaded)
    assert loaded[0].last_attention == "transient"
    fused = caches[0].last_attention == "cpu-kernel"
    # the same bits on one path; float32 rounding between the CPU kernel and the transient path
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4 if fused else 0, rtol=0)
    a, b = model(nxt, cache=caches), model(nxt, cache=loaded)
    assert loaded[0].last_attention == caches[0].last_attention
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4 if fused else 0, rtol=0)


# ------------------------------------------------------------------------------- bad input


def test_bad_rope_and_head_dim():
    with pytest.raises(ValueError, match="odd"):
        rope_params(ModelDims(L=1, H_q=1, H_kv=1, D=15))
    with pytest.raises(ValueError, match="partial rotary"):
        rope_params(ModelDims(L=1, H_q=1, H_kv=1, D=64, rope_dims=32))
    with pytest.raises(ValueError, match="'yarn'"):
        rope_params(
            ModelDims(L=1, H_q=1, H_kv=1, D=64, rope_scaling={"type": "yarn", "factor": 4.0})
        )
    with pytest.raises(ValueError, match="'llama3'"):
        rope_params(
            tiny_llama(
                {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            )
        )
    # linear scaling is applied exactly: the cache inverts the model's own (scaled) RoPE
    model = tiny_llama({"type": "linear", "factor": 4.0})
    assert rope_params(model) == (10000.0, True, 0.25)
    from veloxquant.capture import record_attention, recording_caches

    caches = make_caches(model, KVCacheConfig(method="commvq", uncalibrated=True), None)
    with record_attention(model) as ropes:
        rec = recording_caches(ropes)
        model(mx.array(_tokens(1, 9)), cache=rec)
    r = rec[1].records[0]
    np.testing.assert_allclose(
        np.array(caches[1]._rope(r["k_post"], 0, inverse=True)), np.array(r["k_pre"]), atol=1e-4
    )


def test_nan_keys_are_refused():
    cache = small_cache(True)
    k = mx.random.normal((1, 2, 3, 16))
    k = mx.where(mx.arange(16) == 5, mx.array(float("nan")), k)
    with pytest.raises(ValueError, match="NaN"):
        cache.update_and_fetch(k, mx.zeros((1, 2, 3, 16)))


def test_artifact_layout_and_stage_mismatches_are_refused(tiny_bundle):
    model, artifact, _ = tiny_bundle
    dims = ModelDims.of(model)
    other = "half" if dims.rope_traditional else "interleaved"
    wrong = Artifact(
        "commvq",
        artifact.tensors,
        artifact.hyperparameters,
        {**artifact.diagnostics, "pair_layout": other},
    )
    with pytest.raises(ValueError, match="RoPE pairs"):
        check_artifact(wrong, dims)
    with pytest.raises(ValueError, match="RoPE pairs"):
        make_caches(model, KVCacheConfig(method="commvq"), wrong)
    r = artifact.tensors["key_gain"].shape[2]  # the default: shared atoms, per-stage gains
    assert artifact.tensors["key_theta"].shape[2] == 1
    with pytest.raises(ValueError, match=f"R={r}"):
        make_caches(model, KVCacheConfig(method="commvq", options={"stages": r + 1}), artifact)
    with pytest.raises(ValueError, match=f"R={r}"):
        make_caches(model, KVCacheConfig(method="commvq", options={"key_bits": 1}), artifact)
    with pytest.raises(ValueError, match="stages"):
        check_artifact(
            Artifact(
                "commvq",
                artifact.tensors,
                {**artifact.hyperparameters, "stages": r + 2},
                artifact.diagnostics,
            ),
            dims,
        )
    gainless = {k: v for k, v in artifact.tensors.items() if k != "key_gain"}
    with pytest.raises(ValueError, match="key_gain"):
        check_artifact(
            Artifact("commvq", gainless, artifact.hyperparameters, artifact.diagnostics), dims
        )
    with pytest.raises(ValueError, match="key_gain"):
        check_artifact(
            Artifact(
                "commvq",
                artifact.tensors,
                {**artifact.hyperparameters, "atoms": "stage"},
                artifact.diagnostics,
            ),
            dims,
        )
    with pytest.raises(ValueError, match="pair_layout"):
        tr.resolve_layout({**artifact.hyperparameters, "pair_layout": other}, dims.rope_traditional)
    with pytest.raises(ValueError, match="unknown options"):
        make_caches(model, KVCacheConfig(method="commvq", options={"bogus": 1}), artifact)


def test_bad_hyperparameters():
    for bad in (
        {"key_bits": 0},
        {"stages": 0},
        {"center": "yes"},
        {"iters": -1},
        {"temperature_end": 0},
        {"heldout_fraction": 1.0},
        {"pair_layout": "odd"},
        {"atoms": "tied"},
        {"rounds": -1},
        {"gain_iters": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            METHOD.hyperparameters(bad)
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        METHOD.hyperparameters({"temperature": 1})
    assert tr.resolve_stages(64, tr.DEFAULTS) == 11
    assert tr.resolve_stages(64, {**tr.DEFAULTS, "key_bits": 1}) == 5
    assert tr.resolve_stages(128, tr.DEFAULTS) == 21


# ------------------------------------------------------------------------------- real model


def test_real_model_rope_and_uncalibrated_cache(smollm2, eval_text):
    """SmolLM2 (interleaved pairs, base 1e5): the cache re-applies the model's RoPE exactly, and
    the (uncalibrated) cache runs on real text with the honest byte count."""
    model, tok = smollm2
    assert rope_params(model) == (100000.0, True, 1.0)
    caches = make_caches(
        model, KVCacheConfig(method="commvq", uncalibrated=True, options={"key_bits": 1}), None
    )
    ids = mx.array(np.array(tok.encode(eval_text)[:80], np.int32))[None]
    logits = model(ids, cache=caches)
    assert bool(mx.all(mx.isfinite(logits)).item())
    c = caches[0]
    assert c.stages == 5 and c.key_codes.shape == (1, 3, 80 - 4 - 26, 8)
    assert c.nbytes == sum(a.nbytes for a in c._arrays().values() if a is not None)
    # the default form: one int8 atom set per KV head, fp16 scales per pair, fp16 gains
    assert c.theta.nbytes == 3 * 32 * 64 * 2 and c.theta.dtype == mx.int8
    assert c.theta_scale.nbytes == 3 * 32 * 2
    assert c.key_gain.nbytes == 3 * 5 * 32 * 2 * 2
    assert c.value_codebook.shape[0] == 1  # values: one codebook per layer


def test_layer_shared_theta_equals_the_same_theta_repeated_per_head():
    """share="layer": one θ for the layer's KV heads codes exactly like per-head copies of it,
    and is counted once."""
    shared = small_cache(False)
    shared.theta = shared.theta[:1]  # [1, R, P, 64, 2]
    per_head = small_cache(False)
    per_head.theta = mx.repeat(shared.theta, 2, axis=0)
    _, _, out_a = feed(shared, [9, 1, 3])
    _, _, out_b = feed(per_head, [9, 1, 3])
    np.testing.assert_array_equal(np.array(shared.key_codes), np.array(per_head.key_codes))
    np.testing.assert_array_equal(np.array(out_a[-1][0]), np.array(out_b[-1][0]))
    assert per_head.nbytes - shared.nbytes == shared.theta.nbytes


def test_layer_shared_calibration_shapes(tmp_path):
    from veloxquant.capture import capture_activations

    model = tiny_llama()
    capture_activations(
        model, _tokens(4, 128, seed=5), tmp_path, token_budget=512, seed=0, progress=False
    )
    hp = METHOD.hyperparameters(
        {"stages": 2, "iters": 1, "hard_iters": 1, "share": "layer", "value_iters": 2}
    )
    dims = ModelDims.of(model)
    tensors, diag = METHOD.calibrate(
        CalibrationInputs(tmp_path, tmp_path), dims, hp, progress=False
    )
    specs = METHOD.tensor_specs(dims, hp)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "key_theta": (2, 1, 1, 16, 64, 2),  # one atom set per layer
        "key_gain": (2, 2, 2, 16, 2),  # gains per KV head and stage
        "key_mean": (2, 2, 32),
        "value_codebook": (2, 1, 256, 4),
    }
    assert {k: s.shape for k, s in specs.items()} == {k: v.shape for k, v in tensors.items()}
    caches = make_caches(
        model, KVCacheConfig(method="commvq"), Artifact("commvq", tensors, hp, diag)
    )
    model(mx.array(_tokens(1, 70)), cache=caches)
    assert caches[0].theta.shape[0] == 1 and caches[0].key_codes.shape[:3] == (1, 2, 70 - 30)
    assert diag["stage_key_rel_err"][1] < diag["stage_key_rel_err"][0] < 1
    # the paper's form: a free θ per stage, no gains
    hp = METHOD.hyperparameters({**hp, "atoms": "stage", "value_share": "head"})
    tensors, _ = METHOD.calibrate(CalibrationInputs(tmp_path, tmp_path), dims, hp, progress=False)
    assert tuple(tensors["key_theta"].shape) == (2, 1, 2, 16, 64, 2)
    assert "key_gain" not in tensors and tensors["value_codebook"].shape == (2, 2, 256, 4)
    assert METHOD.tensor_specs(dims, hp)["key_theta"].shape == (2, 1, 2, 16, 64, 2)
    # an artifact from before `atoms`, `atom_bits` and `value_share` existed is this form, and
    # still loads (bundles shipped earlier keep working)
    old_hp = {k: v for k, v in hp.items() if k not in ("atoms", "atom_bits", "value_share")}
    assert METHOD.tensor_specs(dims, old_hp) == METHOD.tensor_specs(dims, hp)
    tokens = mx.array(_tokens(1, 50))
    logits = {}
    for name, h in (("new", hp), ("old", old_hp)):
        art = Artifact("commvq", tensors, h, diag)
        check_artifact(art, dims)
        logits[name] = model(tokens, cache=make_caches(model, KVCacheConfig(method="commvq"), art))
    np.testing.assert_array_equal(np.array(logits["old"]), np.array(logits["new"]))


def test_real_model_inverse_rope_recovers_captured_pre_rope_keys(smollm2):
    from veloxquant.capture import record_attention, recording_caches

    model, _ = smollm2
    cache = make_caches(model, KVCacheConfig(method="commvq", uncalibrated=True), None)[7]
    with record_attention(model) as ropes:
        rec = recording_caches(ropes)
        model(mx.array(_tokens(1, 12)), cache=rec)
        model(mx.array(_tokens(1, 3, seed=2)), cache=rec)
    r = rec[7].records[1]
    np.testing.assert_allclose(
        np.array(cache._rope(r["k_post"], 12, inverse=True)),
        np.array(r["k_pre"]),
        atol=2e-3,
        rtol=1e-4,
    )


# ------------------------------------------------------------------ fused attention (twin)


@pytest.mark.parametrize("traditional", LAYOUTS)
@pytest.mark.parametrize("center", [True, False])
def test_fused_twin_matches_float64_over_the_transient_fetch(traditional, center, monkeypatch):
    # Two caches fed the same calls store the same codes; the transient one's fetch is what
    # mlx-lm's attention sees. The twin decodes the coded past in pieces of 7 tokens (RoPE at
    # each piece's own positions), across decode steps and a prefill chunk under mlx-lm's
    # sliding-window array mask (hiding whole leading pieces).
    from mlx_lm.models.base import create_causal_mask

    from veloxquant.methods.commvq import kernels

    monkeypatch.setattr(kernels, "PIECE_TOKENS", 7)
    a, b = small_cache(traditional, center=center), small_cache(traditional, center=center)
    b.fused = True
    rng = np.random.default_rng(3)
    for n in [9, 1, 30, 1, 1, 6, 1, 1]:
        k = mx.array(rng.standard_normal((1, 2, n, 16)), mx.float32)
        v = mx.array(rng.standard_normal((1, 2, n, 16)), mx.float32)
        q = mx.array(rng.standard_normal((1, 6, n, 16)) * 2, mx.float32)
        keys, values = a.update_and_fetch(k, v)
        assert b.update_and_fetch(k, v) == (k, v)  # the fused update hands back its inputs
        mask = None if n == 1 else create_causal_mask(n, a.offset - n, window_size=20)
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=mask)
        got = b.fused_attention(q, scale=0.25, mask=mask)
        assert b.last_attention == "reference"
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=0)
    assert a.compressed_tokens == b.compressed_tokens > 3 * 7
    for name in a.array_names:  # the same bits stored
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or mx.array_equal(x, y).item()), name


def test_fused_path_is_opt_in_and_attends_as_the_transient_path(monkeypatch):
    # VELOXQUANT_FUSED=auto (the default) fuses where the CPU kernel runs (here, on x86 Linux
    # with the extension built) and keeps the transient path otherwise, a GPU included (its
    # kernels not yet run on one); =0 keeps it, =1 fuses everywhere (the twin where no kernel
    # runs), with the transient path's logits
    from veloxquant.methods.commvq import kernels

    model = tiny_llama()
    config = KVCacheConfig(method="commvq", uncalibrated=True, window=8, sinks=2)
    monkeypatch.setenv("VELOXQUANT_FUSED", "auto")
    auto = make_caches(model, config, None)
    assert all(c.fused == kernels.cpu_kernel_here() for c in auto)
    monkeypatch.setattr(kernels, "CPU_KERNEL", False)  # as where the extension is not built
    assert not any(c.fused for c in make_caches(model, config, None))
    monkeypatch.undo()
    monkeypatch.setenv("VELOXQUANT_FUSED", "0")
    ref = make_caches(model, config, None)
    assert not any(c.fused for c in ref) and ref[0].attention_path == "transient"
    monkeypatch.setenv("VELOXQUANT_FUSED", "1")
    monkeypatch.setattr(kernels, "CPU_KERNEL", False)  # the twin
    fused = make_caches(model, config, None)
    assert all(c.fused for c in fused) and fused[0].attention_path == "reference"
    tokens = mx.array(_tokens(1, 40, seed=5))
    la = model(tokens[:, :32], cache=ref)[:, -1]
    lb = model(tokens[:, :32], cache=fused)[:, -1]
    for t in range(32, 40):
        np.testing.assert_allclose(np.array(lb), np.array(la), atol=1e-3, rtol=0)
        la = model(tokens[:, t : t + 1], cache=ref)[:, -1]
        lb = model(tokens[:, t : t + 1], cache=fused)[:, -1]
    assert {c.last_attention for c in fused} == {"reference"}
    assert sum(c.nbytes for c in fused) == sum(c.nbytes for c in ref)
    # an update whose attention never ran is refused at the next one
    k = mx.zeros((1, fused[0].n_heads, 1, fused[0].head_dim))
    fused[0].update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="never followed by its attention"):
        fused[0].update_and_fetch(k, k)
