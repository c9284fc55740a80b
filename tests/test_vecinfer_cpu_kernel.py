"""VecInfer's CPU attention kernel (`veloxquant.cpu_kernels.vecinfer_coded_attention`, through
`kernels.cpu_kernel_attention`) against its oracle, the pure-MLX twin (`reference_attention`):
every code width that packs across bytes, every sub-vector size, shared and per-head books, with
and without the key mean, both RoPE layouts, several queries and batch rows, coded spans around
its block and segment edges; bit-identical reruns; which calls it takes; bad input refused.
The real model's greedy tokens on this path are tests/test_kernels.py's (`cpu-kernel` arms)."""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant import cpu_kernels
from veloxquant.codes import code_bytes
from veloxquant.methods.vecinfer import VecInferCache
from veloxquant.methods.vecinfer import kernels as K
from veloxquant.rope import RopeSpec

pytestmark = pytest.mark.skipif(
    not cpu_kernels.wanted_here(), reason="the extension is for x86-64 Linux"
)

# (head_dim, query heads per KV head, key (bits, sub_dim), value (bits, sub_dim), shared key
# book): the default layout at SmolLM2's and Llama-3-8B's shapes, codes that cross bytes (3, 5,
# 10 bits), one query head per KV head, sub_dim 1 and 8, a book shared by the heads
LAYOUTS = [
    (64, 3, (6, 2), (8, 4), False),
    (128, 4, (6, 2), (8, 4), False),
    (32, 5, (5, 1), (10, 2), False),
    (64, 1, (3, 4), (6, 1), True),
    (48, 2, (8, 8), (3, 2), False),
    # widths 1, 2, 12 and 16, sub-vectors of 3 and 5 (the loops not unrolled for them), and
    # head_dims 48 and 80 (the score and output loops not unrolled either)
    (48, 2, (12, 3), (2, 16), False),
    (80, 1, (1, 5), (16, 5), True),
]


def _cache(
    layout,
    n_coded: int,
    *,
    batch=1,
    h=2,
    mean=True,
    traditional=False,
    freqs=False,
    seed=0,
    spare=37,
):
    """A fused VecInferCache of `layout` holding n_coded random codes (in buffers with room for
    more, as a decode step finds them), 3 sinks and a 20-token window, and a pending attention
    of `n_new` new tokens (`_pending`)."""
    d, g, (kb, kd), (vb, vd), shared = layout
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return mx.array((rng.normal(size=shape) * scale).astype(np.float32))

    kw = {}
    if mean:
        kw = dict(
            key_mean=normal(h, d, scale=2.0),
            value_mean=normal(h, d, scale=0.5),
            rope=RopeSpec.from_module(nn.RoPE(d, traditional=traditional, base=10000.0), d),
        )
        if freqs:  # a frequency table, as Llama-3's rope gives
            table = mx.array(rng.uniform(1.0, 1e4, size=(d // 2,)).astype(np.float32))
            kw["rope"] = RopeSpec(d, traditional, None, 1.0, table)
    c = VecInferCache(
        mx.array(rng.uniform(0.5, 2.0, (h, d)).astype(np.float32)),
        normal(1 if shared else h, 2**kb, kd),
        normal(1, 2**vb, vd, scale=0.5),
        key_bits=kb,
        key_sub_dim=kd,
        value_bits=vb,
        value_sub_dim=vd,
        hadamard=d & (d - 1) == 0,
        window=20,
        sinks=3,
        value_smooth=mx.array(rng.uniform(0.5, 2.0, (h, d)).astype(np.float32)),
        **kw,
    )
    cap = n_coded + spare  # whatever follows the filled rows must not be read
    nk, nv = code_bytes(kb, d // kd), code_bytes(vb, d // vd)
    c._kbuf = mx.array(rng.integers(0, 256, (batch, h, cap, nk), dtype=np.uint8))
    c._vbuf = mx.array(rng.integers(0, 256, (batch, h, cap, nv), dtype=np.uint8))
    c._n_coded = n_coded
    c.sink_keys = normal(batch, h, 3, d, scale=2.0).astype(mx.float16)
    c.sink_values = normal(batch, h, 3, d).astype(mx.float16)
    c.window_keys = normal(batch, h, 20, d, scale=2.0).astype(mx.float16)
    c.window_values = normal(batch, h, 20, d).astype(mx.float16)
    c.offset = 3 + n_coded + 20
    return c, normal


def _attend(c, normal, g: int, n_new: int, batch: int = 1, mask=None):
    """(twin, CPU kernel) outputs of one call with n_new new tokens and queries of g query
    heads per KV head."""
    h, d = c.smooth.shape
    q = normal(batch, h * g, n_new, d, scale=2.0)
    new = (normal(batch, h, n_new, d, scale=2.0), normal(batch, h, n_new, d))
    pending = {"n_coded": c._n_coded, "win": (c._wk, c._wv), "new": new}
    twin = K.reference_attention(c, q, 0.125, mask, pending)
    kernel = K.cpu_kernel_attention(c, q, 0.125, mask, pending)
    return np.array(twin), np.array(kernel)


# 2e-5 of outputs of size ~1: the two sum the same terms in other orders (measured up to 3e-6);
# a wrong term (a phase's sign, a rescale skipped, a code read off by a bit) is 1e-2 or more
ATOL = 2e-5


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"d{x[0]}g{x[1]}k{x[2][0]}v{x[3][0]}")
@pytest.mark.parametrize("n_coded", [1, 64, 513, 1500])
def test_the_cpu_kernel_is_the_twin_over_block_and_segment_edges(layout, n_coded):
    c, normal = _cache(layout, n_coded, seed=n_coded)
    twin, kernel = _attend(c, normal, layout[1], 1)
    assert np.abs(twin).max() > 0.1
    np.testing.assert_allclose(kernel, twin, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "case",
    [
        "no-mean",
        "traditional",
        "freqs",
        "batch-2-prefill",
        "empty-past",
        "just-past-a-segment",
        "buffers-full",
    ],
)
def test_the_cpu_kernel_is_the_twin_on_every_variant(case):
    layout = LAYOUTS[0]
    batch = 2 if case == "batch-2-prefill" else 1
    n_coded = {"empty-past": 0, "just-past-a-segment": 1025}.get(case, 700)
    c, normal = _cache(
        layout,
        n_coded,
        batch=batch,
        mean=case != "no-mean",
        traditional=case == "traditional",
        freqs=case == "freqs",
        spare=0 if case == "buffers-full" else 37,
    )
    n_new = 9 if case == "batch-2-prefill" else 1
    twin, kernel = _attend(c, normal, layout[1], n_new, batch, "causal" if n_new > 1 else None)
    np.testing.assert_allclose(kernel, twin, atol=ATOL, rtol=0)


def test_a_long_prefill_chunk_takes_longer_segments_and_the_same_result():
    # 256 queries of 4 query heads over 9000 coded tokens: the segments' partial outputs would
    # take 18 segments x 2 heads x 1024 rows x 128 floats (19 MiB); the kernel lengthens them to
    # 16 of 576 tokens (CODED_SCRATCH_FLOATS) rather than hold that
    layout = LAYOUTS[1]
    c, normal = _cache(layout, 9000, seed=3)
    twin, kernel = _attend(c, normal, layout[1], 256, 1, "causal")
    # the rounding of two orders of 9000-term sums: 2.5e-5 measured with 16 or 64 queries too
    # (no longer segments), 1e-5 of the outputs' scale
    np.testing.assert_allclose(kernel, twin, atol=1e-5 * np.abs(twin).max(), rtol=0)


def test_the_bits_do_not_depend_on_the_threads():
    """The same call in two processes, one held to a single core (the kernel then runs one
    thread), one on every core: the same bytes."""
    import os
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "if sys.argv[1] == 'one':\n"
        "    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "import hashlib\n"
        "import numpy as np\n"
        "from tests.test_vecinfer_cpu_kernel import LAYOUTS, _attend, _cache\n"
        "c, normal = _cache(LAYOUTS[1], 5000, batch=2, seed=7)\n"
        "_, kernel = _attend(c, normal, 4, 3, 2, 'causal')\n"
        "print(hashlib.sha256(kernel.tobytes()).hexdigest())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = [
        subprocess.run(
            [sys.executable, "-c", code, arm], capture_output=True, text=True, cwd=root, check=True
        ).stdout.split()[-1]
        for arm in ("one", "all")
    ]
    assert digests[0] == digests[1]


def test_reruns_are_bit_identical():
    c, normal = _cache(LAYOUTS[0], 3000)
    h, d = c.smooth.shape
    q = normal(1, 3 * h, 1, d)
    new = (normal(1, h, 1, d), normal(1, h, 1, d))
    pending = {"n_coded": c._n_coded, "win": (c._wk, c._wv), "new": new}
    first = np.array(K.cpu_kernel_attention(c, q, 0.125, None, pending))
    for _ in range(3):
        again = np.array(K.cpu_kernel_attention(c, q, 0.125, None, pending))
        np.testing.assert_array_equal(again, first)


def test_the_cache_takes_it_and_leaves_mask_arrays_to_the_twin(monkeypatch):
    import copy

    from mlx_lm.models.base import create_causal_mask

    c, normal = _cache(LAYOUTS[0], 200)
    c.fused = True
    h, d = c.smooth.shape
    assert c.attention_path == "cpu-kernel"
    k, v, q = normal(1, h, 1, d), normal(1, h, 1, d), normal(1, 3 * h, 1, d, scale=2.0)
    window = create_causal_mask(1, c.offset, window_size=100)
    outputs = {}
    for arm, cpu_kernel, mask, path in [
        ("kernel", True, None, "cpu-kernel"),
        ("twin", False, None, "reference"),
        ("window", True, window, "reference"),  # a mask array (sliding window): the twin
    ]:
        monkeypatch.setattr(K, "CPU_KERNEL", cpu_kernel)
        step = copy.copy(c)  # buffers of its own
        step.update_and_fetch(k, v)
        outputs[arm] = np.array(step.fused_attention(q, scale=0.125, mask=mask))
        assert step.last_attention == path
        assert step.compressed_tokens == 201  # the token leaving the window was encoded
    np.testing.assert_allclose(outputs["kernel"], outputs["twin"], atol=ATOL, rtol=0)
    assert np.abs(outputs["window"] - outputs["twin"]).max() > 1e-3  # the mask did hide tokens
    monkeypatch.setattr(K, "CPU_KERNEL", True)
    assert K.cpu_kernel_takes(c, q, "causal")
    assert not K.cpu_kernel_takes(c, q, window)


def test_bad_input_is_refused_with_what_is_wrong():
    c, normal = _cache(LAYOUTS[0], 100)
    h, d = c.smooth.shape
    qt = normal(1, h, 3, d)
    kb, vb = c.key_codebook.astype(mx.float32), c.value_codebook.astype(mx.float32)

    def call(**change):
        args = dict(
            qt=qt, ab=None, key_codes=c._kbuf, key_book=kb, value_codes=c._vbuf, value_book=vb,
            phases=None, n_coded=100, key_bits=6, value_bits=8,
        )  # fmt: skip
        args.update(change)
        return mx.eval(cpu_kernels.vecinfer_coded_attention(**args))

    call()
    with pytest.raises(ValueError, match="n_coded must be within the buffers"):
        call(n_coded=10_000)
    with pytest.raises(ValueError, match="2\\^bits codewords"):
        call(key_bits=5)
    with pytest.raises(ValueError, match="packed bytes"):
        call(key_codes=c._kbuf[..., :-1])
    with pytest.raises(ValueError, match="float32"):
        call(qt=qt.astype(mx.float16))
    with pytest.raises(ValueError, match="come together"):
        call(ab=mx.zeros((1, h, 3, d)))
    with pytest.raises(ValueError, match="ab \\[B, H, R, D\\] and phases \\[n_coded, D\\]"):
        call(ab=mx.zeros((1, h, 3, d)), phases=mx.zeros((99, d)))
