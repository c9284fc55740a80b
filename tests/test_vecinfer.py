"""VecInfer (veloxquant/methods/vecinfer.py): transforms, code packing, the runtime cache
contract, and calibrated-vs-uncalibrated quality on the real model with real captured activations.

The module fixture captures 4 x 256 tokens of calibration prose (pydoc topics other than the
ones `eval_text` uses) and calibrates the default codebooks (d2b6 keys per KV head, d4b8 values
per layer) at a tiny k-means budget.
"""

from __future__ import annotations

import math

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from veloxquant import KVCacheConfig, make_cache
from veloxquant.calibrate import calibrate
from veloxquant.codes import code_bytes, pack_codes, unpack_codes
from veloxquant.methods.vecinfer import (
    VecInferCache,
    calibrate_vecinfer,
    check_hadamard_dim,
    inverse_smooth_transform,
    query_transform,
    smooth_scales,
    smooth_transform,
)

TINY = {"iters": 4, "max_vectors": 4096}


@pytest.fixture(scope="module")
def tiny(calib_dir, smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vecinfer")
    calibrate(
        "vecinfer", calib_dir / "activations", smollm2_dir, root / "bundle", progress=False, **TINY
    )
    return {"capture": calib_dir / "activations", "bundle": root / "bundle"}


def hadamard_matrix(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


# ------------------------------------------------------------------------------- transforms


def test_transform_inverts_and_preserves_attention_logits(tiny):
    from veloxquant.capture import load_activations, load_stats

    layer = 3
    acts = load_activations(tiny["capture"], layer, ["q_post", "k_post"])
    q, k = acts["q_post"][:200], acts["k_post"][:200]  # [n, 9, D], [n, 3, D]
    lam = smooth_scales(load_stats(tiny["capture"])["k_post.absmax"])[layer]  # [3, D]
    kt = smooth_transform(k, lam, True)
    # really a different space (channels rescaled by up to ~3x and rotated)
    assert float(mx.abs(kt - k).max().item()) > 1.0
    np.testing.assert_allclose(
        np.array(inverse_smooth_transform(kt, lam, True)), np.array(k), rtol=1e-5, atol=1e-4
    )
    # GQA: query head j reads KV head j // 3
    lam_q = mx.repeat(lam, 3, axis=0)
    k_rep = mx.repeat(k, 3, axis=1)
    qt = query_transform(q, lam_q, True)
    kt_rep = mx.repeat(kt, 3, axis=1)
    logits = np.array((q[:, None] * k_rep[None]).sum(-1))  # all query/key token pairs
    logits_t = np.array((qt[:, None] * kt_rep[None]).sum(-1))
    np.testing.assert_allclose(logits_t, logits, rtol=1e-4, atol=1e-3)
    # matches the explicit normalised Walsh-Hadamard matrix
    h = hadamard_matrix(k.shape[-1])
    np.testing.assert_allclose(
        np.array(kt), (np.array(k) / np.array(lam)) @ h.T, rtol=1e-4, atol=1e-4
    )


def test_hadamard_needs_power_of_two():
    check_hadamard_dim(64)
    with pytest.raises(ValueError, match="not a power of two.*hadamard=False"):
        check_hadamard_dim(96)
    book = mx.zeros((1, 256, 4))
    with pytest.raises(ValueError, match="power of two"):
        VecInferCache(
            mx.ones((2, 48)),
            book,
            book,
            key_bits=8,
            key_sub_dim=4,
            value_bits=8,
            value_sub_dim=4,
            hadamard=True,
        )
    VecInferCache(
        mx.ones((2, 48)),
        book,
        book,
        key_bits=8,
        key_sub_dim=4,
        value_bits=8,
        value_sub_dim=4,
        hadamard=False,
    )


def test_smooth_scales_clip_and_floor():
    absmax = np.full((2, 3, 64), 4.0, np.float32)
    absmax[0, 1, 5] = 400.0  # one outlier channel
    absmax[1, 2, 7] = 0.0  # one dead channel
    lam = np.array(smooth_scales(mx.array(absmax), clip_percentile=99.9, floor=1e-2))
    assert lam[0, 0, 0] == pytest.approx(2.0)
    cap = np.percentile(absmax[0].ravel(), 99.9)  # 4 + 0.8 * (400 - 4), per layer
    assert lam[0, 1, 5] == pytest.approx(math.sqrt(cap)) and 2.0 < lam[0, 1, 5] < 20.0
    assert lam[1, 2, 7] == pytest.approx(1e-2)
    unclipped = np.array(smooth_scales(mx.array(absmax), clip_percentile=100.0))
    assert unclipped[0, 1, 5] == pytest.approx(20.0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16])
def test_pack_unpack_roundtrip(bits):
    rng = np.random.default_rng(bits)
    codes = mx.array(rng.integers(0, 2**bits, size=(2, 3, 5, 16)).astype(np.uint32))
    packed = pack_codes(codes, bits)
    assert packed.nbytes == 2 * 3 * 5 * code_bytes(bits, 16)
    assert mx.array_equal(unpack_codes(packed, bits, 16), codes).item()


def test_code_bytes():
    assert code_bytes(8, 16) == 16  # d4b8, D=64: 2 bits/elem
    assert code_bytes(12, 8) == 12  # d8b12, D=64: 1.5 bits/elem
    assert code_bytes(4, 16) == 8
    assert code_bytes(10, 16) == 20  # packed back to back, not one uint16 per code
    assert code_bytes(9, 16) == 18
    assert code_bytes(7, 3) == 3  # 21 bits round up to whole bytes


def test_generic_packing_is_little_endian_bit_order():
    # codes 0b101 and 0b011 at 3 bits: bits 1,0,1,1,1,0 -> byte 0b00011101
    packed = pack_codes(mx.array([[5, 3]], dtype=mx.uint32), 3)
    assert packed.tolist() == [[0b011101]]


@pytest.mark.parametrize("bits", range(1, 17))
def test_word_packing_is_the_bit_expansion(bits, monkeypatch):
    """Widths packed through one integer word per group give the bytes, and read back the
    codes, of the generic bit expansion, for code counts that fill whole groups and ones that
    do not (those take the expansion)."""
    from veloxquant import codes as codes_mod

    rng = np.random.default_rng(100 + bits)
    cases = []
    for m in (1, 3, 4, 8, 16, 24, 32):
        c = mx.array(rng.integers(0, 2**bits, size=(2, 3, 5, m)).astype(np.uint32))
        cases.append((m, c, pack_codes(c, bits)))
        assert mx.array_equal(unpack_codes(cases[-1][2], bits, m), c).item(), m  # word path
    took_words = [codes_mod._word_groups(bits, m) is not None for m, _, _ in cases]
    monkeypatch.setattr(codes_mod, "_word_groups", lambda bits, n: None)
    for (m, c, packed), words in zip(cases, took_words, strict=True):
        if bits == 8:
            continue
        expanded = pack_codes(c, bits)
        assert mx.array_equal(packed, expanded).item(), (m, words)
        assert mx.array_equal(unpack_codes(packed, bits, m), c).item()
    if bits in (3, 5, 6, 7, 10, 12, 14):
        assert any(took_words)


def test_six_bit_packing_is_little_endian_bit_order():
    # 1 | 2 << 6 | 3 << 12 | 4 << 18 = 0x103081 -> bytes 0x81 0x30 0x10
    packed = pack_codes(mx.array([[1, 2, 3, 4]], dtype=mx.uint32), 6)
    assert packed.tolist() == [[0x81, 0x30, 0x10]]
    assert unpack_codes(packed, 6, 4).tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize("bits,sub_dim,n_books", [(6, 2, 3), (6, 2, 1), (3, 2, 3), (4, 4, 1)])
def test_pair_decoding_is_the_per_code_gather(bits, sub_dim, n_books, monkeypatch):
    """Two codes gathered at once from the pair table give the per-code gather's floats, bit
    for bit, and the pair path is the one long spans take."""
    from veloxquant import codes as codes_mod
    from veloxquant.codes import pq_decode

    rng = np.random.default_rng(bits * 10 + n_books)
    d, k = 64, 2**bits
    book = mx.array(rng.normal(size=(n_books, k, sub_dim)).astype(np.float32))
    c = rng.integers(0, k, size=(1, 3, 700, d // sub_dim)).astype(np.uint32)
    packed = pack_codes(mx.array(c), bits)
    own = c + (np.arange(3)[None, :, None, None] * k if n_books > 1 else 0)
    expected = np.array(book).reshape(n_books * k, sub_dim)[own].reshape(1, 3, 700, d)
    taken = []
    monkeypatch.setattr(
        codes_mod, "unpack_codes", lambda p, b, m: taken.append(b) or unpack_codes(p, b, m)
    )
    np.testing.assert_array_equal(np.array(pq_decode(packed, book, sub_dim, bits, d)), expected)
    assert taken == [2 * bits]
    monkeypatch.setattr(codes_mod, "PAIR_BITS", 0)
    np.testing.assert_array_equal(np.array(pq_decode(packed, book, sub_dim, bits, d)), expected)
    assert taken[-1] == bits


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("freqs", [False, True])
def test_rotated_mean_from_the_table_is_the_models_rope(traditional, freqs):
    """RoPE_m(μ) from the shared cos / sin table is `mx.fast.rope` of μ at every position,
    bit for bit; the table is computed once for the layers of a step, and a spec with other
    frequencies gets its own."""
    from veloxquant import rope as rope_mod
    from veloxquant.rope import RopeSpec, rotated_mean

    rng = np.random.default_rng(int(traditional) * 2 + int(freqs))
    table = mx.array(rng.uniform(1e-4, 1.0, size=(32,)).astype(np.float32)) if freqs else None
    spec = RopeSpec(64, traditional, None if freqs else 1e5, 1.0 if freqs else 0.5, table)
    mean = mx.array(rng.normal(size=(3, 64)).astype(np.float32) * 4)
    offset, length = 37, 3000
    direct = spec.apply(mx.broadcast_to(mean[None, :, None, :], (1, 3, length, 64)), offset)
    np.testing.assert_array_equal(
        np.array(rotated_mean(mean, spec, offset, length)), np.array(direct)
    )
    kept = rope_mod.rotation_table(spec, offset, length)
    assert all(
        a is b for a, b in zip(rope_mod.rotation_table(spec, offset, length), kept, strict=True)
    )
    other = RopeSpec(
        64, traditional, None if freqs else 2e4, 1.0 if freqs else 0.5, table * 2 if freqs else None
    )
    assert not mx.array_equal(rope_mod.rotation_table(other, offset, length)[0], kept[0]).item()
    shifted = spec.apply(mx.broadcast_to(mean[None, :, None, :], (1, 3, length, 64)), offset + 1)
    np.testing.assert_array_equal(  # the offset is part of the memo's key
        np.array(rotated_mean(mean, spec, offset + 1, length)), np.array(shifted)
    )
    huge = rope_mod.TABLE_KEPT_ELEMENTS // 64 + 1  # tables this long are not kept
    assert (
        rope_mod.rotation_table(spec, 0, huge)[0] is not rope_mod.rotation_table(spec, 0, huge)[0]
    )
    short = rotated_mean(mean, spec, 5, 3)  # short spans rotate directly
    np.testing.assert_array_equal(
        np.array(short),
        np.array(spec.apply(mx.broadcast_to(mean[None, :, None, :], (1, 3, 3, 64)), 5)),
    )


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("freqs", [False, True])
def test_the_phase_table_gives_q_dot_the_rotated_mean(traditional, freqs, monkeypatch):
    """[a | b]·phase_table[m] (the CPU kernel's mean term) is q·RoPE_m(μ) with the model's own
    rotation, to float32 rounding, at every position; the table's cos / sin are the rotation
    table's own values, and it is kept like it (and apart from it)."""
    from veloxquant import rope as rope_mod
    from veloxquant.rope import RopeSpec, phase_coefficients, phase_table

    pair_angles = rope_mod._pair_angles
    rng = np.random.default_rng(int(traditional) * 2 + int(freqs))
    table = mx.array(rng.uniform(1e-4, 1.0, size=(32,)).astype(np.float32)) if freqs else None
    spec = RopeSpec(64, traditional, None if freqs else 1e5, 1.0 if freqs else 0.5, table)
    mean = mx.array(rng.normal(size=(3, 64)).astype(np.float32) * 4)
    q = mx.array(rng.normal(size=(1, 3, 5, 64)).astype(np.float32))
    offset, length = 37, 2000
    rotated = spec.apply(mx.broadcast_to(mean[None, :, None, :], (1, 3, length, 64)), offset)
    want = np.array(q @ rotated.swapaxes(-1, -2), np.float64)  # [1, 3, 5, length]
    ab = phase_coefficients(q, mean[None, :, None, :], spec)
    phases = phase_table(spec, offset, length)
    got = np.array(ab @ phases.T)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
    cos, sin = rope_mod.rotation_table(spec, offset, length)
    first = np.arange(64) % 2 == 0 if traditional else np.arange(64) < 32
    np.testing.assert_array_equal(np.array(phases)[:, :32], np.array(cos)[:, first])
    np.testing.assert_array_equal(np.array(phases)[:, 32:], np.array(sin)[:, ~first])
    assert phase_table(spec, offset, length) is phases
    assert phase_table(spec, offset + 1, length) is not phases
    # a longer span is the kept shorter table plus the rows it lacks, the same bits as built
    # whole; kept whatever its length (the CPU kernel reads one every layer of every step)
    rope_mod._tables().clear()
    asked = []
    monkeypatch.setattr(
        rope_mod, "_pair_angles", lambda r, o, n: asked.append(n) or pair_angles(r, o, n)
    )
    phase_table(spec, offset, 700)
    grown = phase_table(spec, offset, length)
    assert asked == [700, length - 700]
    np.testing.assert_array_equal(np.array(grown), np.array(phases))
    huge = rope_mod.TABLE_KEPT_ELEMENTS // 64 + 1
    assert phase_table(spec, 0, huge) is phase_table(spec, 0, huge)


def test_rotation_tables_are_kept_per_thread():
    """A table another thread built (and may not have evaluated: MLX evaluates an array only in
    the thread whose stream built it) is not handed to this one."""
    import threading

    from veloxquant.rope import RopeSpec, rotated_mean

    spec = RopeSpec(64, False, 1e4, 1.0)
    mean = mx.ones((2, 64))
    other = {}

    def build():
        other["mu"] = rotated_mean(mean, spec, 3, 500)  # lazy, on that thread's stream

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    here = rotated_mean(mean, spec, 3, 500)
    direct = spec.apply(mx.broadcast_to(mean[None, :, None, :], (1, 2, 500, 64)), 3)
    np.testing.assert_array_equal(np.array(here), np.array(direct))


# ------------------------------------------------------------------------------- the cache


def random_cache(hadamard=True, n_books=3, window=16, sinks=2, seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    h, d = 3, 64
    lam = mx.array(rng.uniform(0.5, 3.0, size=(h, d)).astype(np.float32))
    kb = mx.array(rng.normal(size=(n_books, 256, 4)).astype(np.float32))  # d4b8
    vb = mx.array(rng.normal(size=(n_books, 4096, 8)).astype(np.float32))  # d8b12
    return VecInferCache(
        lam,
        kb,
        vb,
        key_bits=8,
        key_sub_dim=4,
        value_bits=12,
        value_sub_dim=8,
        hadamard=hadamard,
        window=window,
        sinks=sinks,
        **kwargs,
    )


def check_pq(x, packed, decoded, book, sub_dim, bits, lam=None, hadamard=False):
    """Independent numpy check of one side of the cache: the decoded vectors are exactly the
    codebook lookup of the stored codes (then the inverse transform), and every stored code is
    the nearest codeword by explicit float64 distances (up to float32 near-ties)."""
    x = np.asarray(x, np.float64)  # [B, H, T, D]
    h_mat = hadamard_matrix(x.shape[-1])
    if lam is not None:
        x = x / lam[:, None, :]
        if hadamard:
            x = x @ h_mat.T
    b, h, t, d = x.shape
    m = d // sub_dim
    codes = np.array(unpack_codes(packed, bits, m))  # [B, H, T, M]
    book = np.asarray(book, np.float64)
    book = np.repeat(book, h, axis=0) if book.shape[0] == 1 else book
    rec = np.stack([book[head][codes[:, head]] for head in range(h)], axis=1).reshape(b, h, t, d)
    if lam is not None:
        rec = (rec @ h_mat if hadamard else rec) * lam[:, None, :]  # H is symmetric
    np.testing.assert_allclose(np.array(decoded), rec, rtol=1e-5, atol=1e-5)
    sub = x.reshape(b, h, t, m, sub_dim)
    for head in range(h):
        dist = ((sub[:, head, :, :, None, :] - book[head]) ** 2).sum(-1)  # [B, T, M, K]
        chosen = np.take_along_axis(dist, codes[:, head][..., None].astype(np.int64), -1)[..., 0]
        best = dist.min(-1)
        # the GEMM form ‖x‖² − 2x·c + ‖c‖² loses ~1e-5 of ‖x‖² + ‖c‖² (~16 here) to rounding
        np.testing.assert_allclose(chosen, best, rtol=1e-4, atol=2e-3)
        assert (codes[:, head] == dist.argmin(-1)).mean() > 0.99
    return rec


@pytest.mark.parametrize("hadamard,n_books", [(True, 3), (False, 1)])
def test_cache_roundtrip_equals_codebook_lookup(hadamard, n_books):
    cache = random_cache(hadamard=hadamard, n_books=n_books)
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(1, 3, 100, 64)).astype(np.float32) * 2
    vals = rng.normal(size=(1, 3, 100, 64)).astype(np.float32)
    out = None
    for lo, hi in ((0, 40), (40, 41), (41, 100)):
        out = cache.update_and_fetch(mx.array(keys[:, :, lo:hi]), mx.array(vals[:, :, lo:hi]))
    assert cache.offset == cache.size() == 100
    # the call's own tokens come back exactly; the whole history is returned in order
    assert out[0].shape == (1, 3, 100, 64)
    np.testing.assert_array_equal(np.array(out[0][:, :, 41:]), keys[:, :, 41:])
    # 2 sinks + 82 coded + 16 window
    assert cache.key_codes.shape[2] == cache.value_codes.shape[2] == 82
    lam = np.array(cache.smooth)
    kb16 = np.array(cache.key_codebook.astype(mx.float32))  # resident fp16 codebooks
    vb16 = np.array(cache.value_codebook.astype(mx.float32))
    exp_k = check_pq(
        keys[:, :, 2:84],
        cache.key_codes,
        cache.decode_keys(cache.key_codes, cache.sinks),
        kb16,
        4,
        8,
        lam,
        hadamard,
    )
    check_pq(
        vals[:, :, 2:84], cache.value_codes, cache.decode_values(cache.value_codes), vb16, 8, 12
    )
    # what attention sees next: fp16 sinks, decoded codes, fp16 window, the new token exactly
    new_k = rng.normal(size=(1, 3, 1, 64)).astype(np.float32)
    k_out, v_out = cache.update_and_fetch(mx.array(new_k), mx.array(new_k))
    k_out = np.array(k_out)
    np.testing.assert_array_equal(
        k_out[:, :, :2], keys[:, :, :2].astype(np.float16).astype(np.float32)
    )
    np.testing.assert_allclose(k_out[:, :, 2:84], exp_k, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(
        k_out[:, :, 84:100], keys[:, :, 84:].astype(np.float16).astype(np.float32)
    )
    np.testing.assert_array_equal(k_out[:, :, 100:], new_k)
    assert cache.key_codes.shape[2] == 83 and cache.window_keys.shape[2] == 16


def test_centered_cache_codes_the_residual_and_adds_the_rotated_mean_back():
    """Keys are coded as k − RoPE_m(μ) at each token's own position m and decoded with
    RoPE_m(μ) added back; values as v − μ_v. Checked against an uncentered cache with the same
    codebooks fed the residuals, with RoPE applied here per token (independent positions)."""
    import mlx.nn as nn

    from veloxquant.rope import RopeSpec

    rng = np.random.default_rng(7)
    mu_k = rng.normal(size=(3, 64)).astype(np.float16).astype(np.float32) * 4
    mu_v = rng.normal(size=(3, 64)).astype(np.float16).astype(np.float32)
    rope = RopeSpec.from_module(nn.RoPE(64, traditional=True, base=1e4), 64)
    centered = random_cache(key_mean=mx.array(mu_k), value_mean=mx.array(mu_v), rope=rope)
    plain = random_cache()
    t = 90
    positions = mx.arange(t)
    mu_rot = mx.fast.rope(
        mx.broadcast_to(mx.array(mu_k)[None, :, None], (t, 3, 1, 64)),
        64,
        traditional=True,
        base=1e4,
        scale=1.0,
        offset=positions,
    )[:, :, 0].transpose(1, 0, 2)[None]  # [1, H, T, D]
    keys = mu_rot + mx.array(rng.normal(size=(1, 3, t, 64)).astype(np.float32))
    vals = mx.array(mu_v)[None, :, None] + mx.array(rng.normal(size=(1, 3, t, 64)), mx.float32)
    for lo, hi in ((0, 30), (30, 31), (31, t)):
        centered.update_and_fetch(keys[:, :, lo:hi], vals[:, :, lo:hi])
        plain.update_and_fetch(
            (keys - mu_rot)[:, :, lo:hi], vals[:, :, lo:hi] - mx.array(mu_v)[None, :, None]
        )
    # Same codes up to near-ties: the centered cache rounds k to fp16 in its window before
    # subtracting, the plain one rounds k − RoPE_m(μ).
    for side in ("key_codes", "value_codes"):
        bits = 8 if side == "key_codes" else 12
        m = 16 if side == "key_codes" else 8
        a = np.array(unpack_codes(getattr(centered, side), bits, m))
        b = np.array(unpack_codes(getattr(plain, side), bits, m))
        assert (a == b).mean() > 0.99, side
    n = centered.key_codes.shape[2]
    coded = slice(2, 2 + n)  # codes start after the 2 sinks
    np.testing.assert_allclose(
        np.array(centered.decode_keys(centered.key_codes, 2)),
        np.array(plain.decode_keys(centered.key_codes, 2) + mu_rot[:, :, coded]),
        atol=1e-4,
    )
    np.testing.assert_allclose(
        np.array(centered.decode_values(centered.value_codes)),
        np.array(plain.decode_values(centered.value_codes)) + mu_v[None, :, None],
        atol=1e-5,
    )
    # the window and sinks stay exact (fp16) whatever the means
    np.testing.assert_array_equal(
        np.array(centered.window_keys), np.array(keys[:, :, t - 16 :].astype(mx.float16))
    )


def test_nbytes_counts_exactly_codes_window_codebooks():
    import mlx.nn as nn

    from veloxquant.rope import RopeSpec

    rope = RopeSpec.from_module(nn.RoPE(64, traditional=True, base=1e4), 64)
    means = {
        "key_mean": mx.ones((3, 64)),
        "value_mean": mx.ones((3, 64)),
        "rope": rope,
        "value_smooth": mx.ones((3, 64)),
    }
    cache = random_cache(**means)
    # fp16 codebooks, λ, key and value means and value scales
    assert cache.nbytes == 3 * 256 * 4 * 2 + 3 * 4096 * 8 * 2 + 4 * 3 * 64 * 2
    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(1, 3, 1024, 64)).astype(np.float32))
    cache.update_and_fetch(x, x)
    coded = 1024 - 16 - 2
    expected = (
        coded * 3 * 16  # d4b8 key codes: 16 uint8 per head-vector
        + coded * 3 * 12  # d8b12 value codes: 8 x 12 bits = 12 bytes
        + 2 * (16 + 2) * 3 * 64 * 2  # fp16 window + sinks, K and V
        + 3 * 256 * 4 * 2
        + 3 * 4096 * 8 * 2  # fp16 codebooks, once per layer
        + 4 * 3 * 64 * 2  # fp16 λ, means and value scales
    )
    assert cache.nbytes == expected
    # nothing else is resident: every array the cache holds is counted
    held = sum(v.nbytes for v in vars(cache).values() if isinstance(v, mx.array))
    assert held == cache.nbytes


@pytest.mark.parametrize("fused", [False, True])
def test_window_keeps_a_16bit_model_dtype_and_halves_float32(fused):
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(1, 3, 40, 64)).astype(np.float32))
    for dtype, kept in (
        (mx.bfloat16, mx.bfloat16),
        (mx.float16, mx.float16),
        (mx.float32, mx.float16),
    ):
        cache = random_cache()
        cache.fused = fused
        y = x.astype(dtype)
        for chunk in (y[:, :, :39], y[:, :, 39:]):  # then a decode step: the ring turns
            cache.update_and_fetch(chunk, chunk)
            if fused:  # the fused path finishes an update with its attention
                cache.fused_attention(chunk, scale=0.125)
        assert cache.window_keys.dtype == kept and cache.window_values.dtype == kept
        # the newest tokens, exactly as the model produced them (rounded once when float32)
        want = y[:, :, -cache.window :].astype(kept)
        assert mx.array_equal(cache.window_keys, want).item()


# ------------------------------------------------------------------------------- real model


def test_calibration_artifact_and_determinism(tiny, smollm2_dir):
    from veloxquant.bundle import load_bundle

    bundle = load_bundle(tiny["bundle"])
    info = bundle.method_info("vecinfer")
    hp, diag = info["hyperparameters"], info["diagnostics"]
    assert hp["key_bits"] == 6 and hp["key_sub_dim"] == 2 and hp["share"] == "head"
    assert hp["value_bits"] == 8 and hp["value_share"] == "layer"
    assert hp["center"] is True and hp["value_smooth"] == "balanced"
    assert info["capture_point"] == "k_post,v"
    stored = bundle.tensors("vecinfer")
    assert stored["key_codebook"].shape == (30, 3, 64, 2)
    assert stored["value_codebook"].shape == (30, 1, 256, 4)
    # the stored means are the exact capture means, rounded to the fp16 the cache keeps
    from veloxquant.capture import load_stats

    stats = load_stats(tiny["capture"])
    want = stats["k_pre.mean"].astype(mx.float16).astype(mx.float32)
    assert mx.array_equal(stored["key_mean"], want).item()
    # held-out reconstruction of real keys/values is good but not lossless, and the error
    # that attention sees is reported beside MSE
    assert 0.005 < diag["mean_key_rel_mse"] < 0.1 and diag["mean_key_cos"] > 0.95
    assert 0.01 < diag["mean_value_rel_mse"] < 0.3 and diag["mean_value_cos"] > 0.85
    assert 0.005 < diag["mean_key_logit_rel_err"] < 0.2
    assert 0.01 < diag["mean_value_output_rel_err"] < 0.4
    assert diag["mean_key_entropy_bits"] > 5.0  # of 6: codes are well used
    assert len(diag["per_layer"]["key_logit_rel_err"]) == 30
    tensors, _ = calibrate_vecinfer(tiny["capture"], smollm2_dir, progress=False, **TINY)
    for name in stored:
        assert mx.array_equal(tensors[name], stored[name]).item(), name


def test_value_share_sets_the_value_codebooks_apart(calib_dir, smollm2_dir):
    from veloxquant.methods.base import Artifact, ModelDims
    from veloxquant.methods.vecinfer import DEFAULTS, check_artifact, make_caches, tensor_specs
    from veloxquant.model_import import load_model

    acts = calib_dir / "activations"
    small = {**TINY, "value_bits": 6}
    runs = {
        (share, value_share): calibrate_vecinfer(
            acts, smollm2_dir, share=share, value_share=value_share, progress=False, **small
        )[0]
        for share, value_share in (("head", "head"), ("head", "layer"), ("layer", "head"))
    }
    books = {k: (t["key_codebook"].shape[1], t["value_codebook"].shape[1]) for k, t in runs.items()}
    assert books == {("head", "head"): (3, 3), ("head", "layer"): (3, 1), ("layer", "head"): (1, 3)}
    # the values' sharing leaves the keys alone, and pools the heads' values into one codebook
    hh, hl, lh = runs[("head", "head")], runs[("head", "layer")], runs[("layer", "head")]
    assert mx.array_equal(hh["key_codebook"], hl["key_codebook"]).item()
    assert mx.array_equal(hh["value_codebook"], lh["value_codebook"]).item()
    assert not mx.allclose(hl["value_codebook"], hh["value_codebook"][:, :1]).item()
    # an artifact from before value_share (no such hyperparameter) still loads: its values
    # were shared as `share`
    model, _ = load_model(smollm2_dir)
    dims = ModelDims.of(model)
    old_hp = {k: v for k, v in {**DEFAULTS, "value_bits": 6}.items() if k != "value_share"}
    specs = tensor_specs(dims, old_hp)
    assert {k: tuple(s.shape) for k, s in specs.items()} == {k: v.shape for k, v in hh.items()}
    old = Artifact("vecinfer", dict(hh), old_hp, {})
    check_artifact(old, dims)
    # and options name its sharing as it is, not as it was spelled
    asked = KVCacheConfig(method="vecinfer", options={"value_share": "head"})
    assert len(make_caches(model, asked, old)) == 30
    with pytest.raises(ValueError, match="value_share='layer'"):
        make_caches(model, KVCacheConfig(method="vecinfer", options={"value_share": "layer"}), old)
    with pytest.raises(ValueError, match="value_share must be"):
        calibrate_vecinfer(acts, smollm2_dir, value_share="token", progress=False, **small)


def test_calibrated_beats_uncalibrated_and_stays_close_to_fp16(tiny, smollm2, eval_text):
    from veloxquant.evaluate import evaluate_rows

    model, tok = smollm2
    window = np.array(tok.encode(eval_text)[:384], dtype=np.int32)[None]
    # the uncalibrated row is what upstream ships: Gaussian d4b8 codebooks at the same budget
    upstream = {"key_sub_dim": 4, "key_bits": 8, "value_bits": 8}
    rows = [
        {"name": "calibrated", "method": "vecinfer", "artifact_dir": str(tiny["bundle"])},
        {
            "name": "uncalibrated",
            "method": "vecinfer",
            "uncalibrated": True,
            "window": 48,
            "options": upstream,
        },
        {"name": "same-shape", "method": "vecinfer", "uncalibrated": True},
    ]
    cal, unc, same = evaluate_rows(model, window, rows, prefill=256, chunk=64, progress=False)
    print({r["name"]: (round(r["ppl_ratio"], 3), round(r["kl"], 4)) for r in (cal, unc, same)})
    assert cal["ppl_ratio"] < 1.1 and cal["kl"] < 0.06 and cal["top1"] > 0.88
    assert unc["kl"] > 1.0 and unc["kl"] > 20 * cal["kl"] and unc["ppl_ratio"] > 3.0
    # Gaussian codebooks of the calibrated shape are no rescue either
    assert same["kl"] > 10 * cal["kl"]
    # within upstream's budget; calibration adds only its means and scales (fp16, per head)
    assert cal["kv_bits_per_element"] <= unc["kv_bits_per_element"] + 0.05
    # exactly: key mean, value mean and value scales, 3 fp16 [H, D] arrays per layer, i.e.
    # 8 · 3 · 2 bytes over 2 · T elements per (head, channel)
    extra = cal["kv_bits_per_element"] - same["kv_bits_per_element"]
    assert extra == pytest.approx(24 / window.shape[1])


def test_generate_with_quantized_history(tiny, smollm2):
    from mlx_lm import generate

    model, tok = smollm2
    # window 0, one sink: every other token of the prompt is coded at 2 bits.
    cfg = KVCacheConfig(method="vecinfer", artifact_dir=str(tiny["bundle"]), window=0, sinks=1)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    caches = make_cache(model, cfg)
    text = generate(model, tok, prompt, max_tokens=12, prompt_cache=caches)
    assert "Paris" in text
    assert caches[0].key_codes.shape[2] == caches[0].offset - 1


def test_bad_inputs(tiny, smollm2, smollm2_dir, tmp_path):
    from veloxquant.bundle import BundleError

    model, _ = smollm2
    book = mx.zeros((3, 256, 4))
    with pytest.raises(ValueError, match=r"d4b7 needs \[3 or 1, 128, 4\]"):
        VecInferCache(
            mx.ones((3, 64)),
            book,
            book,
            key_bits=7,
            key_sub_dim=4,
            value_bits=8,
            value_sub_dim=4,
            hadamard=True,
        )
    nan_book = mx.where(mx.arange(256)[None, :, None] == 3, mx.nan, mx.zeros((3, 256, 4)))
    with pytest.raises(ValueError, match="NaN"):
        VecInferCache(
            mx.ones((3, 64)),
            nan_book,
            book,
            key_bits=8,
            key_sub_dim=4,
            value_bits=8,
            value_sub_dim=4,
            hadamard=True,
        )
    with pytest.raises(ValueError, match="calibrated with key_bits=6"):
        make_cache(
            model,
            KVCacheConfig(
                method="vecinfer", artifact_dir=str(tiny["bundle"]), options={"key_bits": 12}
            ),
        )
    with pytest.raises(ValueError, match=r"bits=2\) does not apply to method 'vecinfer'"):
        make_cache(
            model, KVCacheConfig(method="vecinfer", artifact_dir=str(tiny["bundle"]), bits=2)
        )
    with pytest.raises(BundleError, match="vecinfer"):
        make_cache(model, KVCacheConfig(method="vecinfer"))
    # 922 training tokens x 16 sub-vectors < 65536 centroids: refuse, naming the minimum
    # (4551 captured -> 455 held out, 4096 x 16 = 65536 training sub-vectors)
    with pytest.raises(ValueError, match=r"65536 centroids.*need at least 4551 captured tokens"):
        calibrate_vecinfer(tiny["capture"], smollm2_dir, key_sub_dim=4, key_bits=16, progress=False)
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        calibrate("vecinfer", tiny["capture"], smollm2_dir, tmp_path, key_bitz=8, progress=False)
