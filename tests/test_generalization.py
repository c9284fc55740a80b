"""Calibration that holds beyond the default model's key statistics (DESIGN.md section 11).

The stress variant of the default model (veloxquant/stress.py: large constant k_proj / v_proj
biases, so the per-head key mean carries most of the key energy, as in families with projection
biases) is judged against its own fp16 output: calibrated VecInfer must stay far closer to it
than the uncalibrated variant, and mean removal must be what makes the difference there.
"""

from __future__ import annotations

import numpy as np
import pytest

from veloxquant.calibrate import calibrate
from veloxquant.evaluate import evaluate_rows
from veloxquant.kvstats import mean_energy_share

TINY = {"iters": 4, "max_vectors": 4096}


@pytest.fixture(scope="module")
def stress(smollm2, smollm2_dir, calib_dir, tmp_path_factory):
    """The stress model, a capture of it on the calib_dir tokens, and bundles with and without
    mean removal."""
    import shutil

    from veloxquant.capture import capture_activations
    from veloxquant.data import load_tokens
    from veloxquant.model_import import load_model
    from veloxquant.stress import write_kv_bias_model

    root = tmp_path_factory.mktemp("stress")
    model_dir = write_kv_bias_model(smollm2_dir, root / "model", key_scale=3.0, value_scale=0.1)
    model, tok = load_model(model_dir)
    shutil.copytree(calib_dir / "data", root / "data")
    ids = load_tokens(root / "data" / "calib.safetensors")
    capture_activations(model, ids, root / "activations", token_budget=ids.size, progress=False)
    for name, hp in (("center", {}), ("nocenter", {"center": False})):
        calibrate(
            "vecinfer", root / "activations", model_dir, root / name, progress=False, **TINY, **hp
        )
    return {"root": root, "model": model, "tok": tok}


def test_the_stress_model_has_dominant_key_means(stress, calib_dir):
    from veloxquant.capture import load_stats

    def share(capture):
        s = load_stats(capture)
        return np.array(mean_energy_share(s["k_pre.mean"], s["k_pre.sq_mean"]))

    plain, stressed = share(calib_dir / "activations"), share(stress["root"] / "activations")
    assert stressed.mean() > 0.9 and stressed.min() > 0.75
    assert stressed.mean() > plain.mean() + 0.1


def test_calibrated_stays_near_fp16_where_uncalibrated_does_not(stress, eval_text):
    model, tok = stress["model"], stress["tok"]
    window = np.array(tok.encode(eval_text)[:384], np.int32)[None]
    root = stress["root"]
    rows = [
        {"name": "calibrated", "method": "vecinfer", "artifact_dir": str(root / "center")},
        {"name": "nocenter", "method": "vecinfer", "artifact_dir": str(root / "nocenter")},
        {"name": "uncalibrated", "method": "vecinfer", "uncalibrated": True},
    ]
    res = {
        r["name"]: r
        for r in evaluate_rows(model, window, rows, prefill=256, chunk=64, progress=False)
    }
    table = {k: (round(r["ppl_ratio"], 3), round(r["kl"], 4)) for k, r in res.items()}
    cal, unc, noc = res["calibrated"], res["uncalibrated"], res["nocenter"]
    assert 3 * (cal["ppl_ratio"] - 1) < unc["ppl_ratio"] - 1, table
    assert 3 * cal["kl"] < unc["kl"], table
    # mean removal is what holds it there: without it the same codebook budget does worse
    assert cal["kl"] < noc["kl"], table


def test_logit_error_diagnostic_moves_with_mean_removal(stress):
    from veloxquant.bundle import load_bundle

    def diag(name):
        return load_bundle(stress["root"] / name).method_info("vecinfer")["diagnostics"]

    center, nocenter = diag("center"), diag("nocenter")
    assert center["mean_key_logit_rel_err"] < 0.7 * nocenter["mean_key_logit_rel_err"]
    assert len(center["per_layer"]["key_logit_rel_err"]) == 30


def test_tensor_core_decode_holds_on_the_stress_model(stress, eval_text, monkeypatch):
    """The tensor-core kernel's f16 operands (q~, the phase coefficients, the cos / -sin table)
    err in proportion to q . mu_k, which the stress model makes large: decode logits through it
    (emulated, as on a GPU) stay near the transient path's, as the CUDA-core kernel's do."""
    import mlx.core as mx

    import veloxquant.kernels as vk
    from tests import kernel_emulator as emu
    from tests.test_kernels import _emulated_launch, _emulated_launcher
    from veloxquant import KVCacheConfig, make_cache
    from veloxquant.methods.vecinfer import kernels as K

    if emu.CXX is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    model, tok = stress["model"], stress["tok"]
    config = KVCacheConfig(method="vecinfer", artifact_dir=str(stress["root"] / "center"))
    prompt = mx.array(np.array(tok.encode(eval_text)[:160], np.int32)[None])
    worst, scale, coding = {}, 0.0, 0.0
    for mma in (False, True):
        fp16 = make_cache(model, KVCacheConfig(method="fp16"))
        monkeypatch.setenv("VELOXQUANT_FUSED", "0")
        ref = make_cache(model, config)
        monkeypatch.setenv("VELOXQUANT_FUSED", "1")
        fused = make_cache(model, config)
        with monkeypatch.context() as m:
            m.setattr(K, "MMA", mma)
            m.setattr(vk, "backend", lambda: "cuda")
            m.setattr(vk, "launch", _emulated_launch)
            m.setattr(vk, "launcher", _emulated_launcher)
            la, lb = model(prompt, cache=ref)[:, -1], model(prompt, cache=fused)[:, -1]
            model(prompt, cache=fp16)
            diffs = []
            for _ in range(3):
                nxt = mx.argmax(la, axis=-1)[:, None]
                la, lb = model(nxt, cache=ref)[:, -1], model(nxt, cache=fused)[:, -1]
                lf = model(nxt, cache=fp16)[:, -1]
                assert mx.array_equal(mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1)).item()
                diffs.append(float(mx.abs(la - lb).max()))
                scale = max(scale, float(mx.abs(la).max()))
                coding = max(coding, float(mx.abs(la - lf).max()))
            assert {c.last_attention for c in fused} == {"kernel"}
            assert K.mma_takes(K.layout_of(fused[0], model.args.num_attention_heads)) is mma
        worst[mma] = max(diffs)
    # the tensor cores add at most 1e-3 of the logits' scale to what the CUDA cores give (run
    # alone: 1.0e-2 against 2e-4 at logits up to 29; in one full `make test` run both read
    # 2.2e-2, not yet explained: a near-tie code encoded differently by the launch's encoder is
    # a candidate), and both stay far inside what the coding itself moves them from fp16's (4.0-4.4)
    report = {"kernel": worst, "logits": scale, "transient vs fp16": coding}
    assert worst[True] < worst[False] + 1e-3 * scale, report
    assert max(worst.values()) < 0.05 * coding, report


def test_cpu_kernel_decode_holds_on_the_stress_model(stress, eval_text, monkeypatch):
    """The CPU kernel's rotated-mean term ([a | b] against the phase table) is largest where
    q . mu_k is, which the stress model makes large: its prefill and decode logits stay with the
    transient path's (same argmax), far inside what the coding moves them from fp16's."""
    import mlx.core as mx

    from veloxquant import KVCacheConfig, cpu_kernels, make_cache

    if not cpu_kernels.available():
        pytest.skip("the CPU extension is not built here")
    model, tok = stress["model"], stress["tok"]
    config = KVCacheConfig(method="vecinfer", artifact_dir=str(stress["root"] / "center"))
    prompt = mx.array(np.array(tok.encode(eval_text)[:300], np.int32)[None])
    fp16 = make_cache(model, KVCacheConfig(method="fp16"))
    monkeypatch.setenv("VELOXQUANT_FUSED", "0")
    ref = make_cache(model, config)
    monkeypatch.setenv("VELOXQUANT_FUSED", "auto")  # the CPU kernel, the CPU default
    fused = make_cache(model, config)
    for chunk in (prompt[:, :200], prompt[:, 200:]):  # the second chunk attends coded tokens
        la, lb = model(chunk, cache=ref)[:, -1], model(chunk, cache=fused)[:, -1]
        model(chunk, cache=fp16)
    diffs, scale, coding = [float(mx.abs(la - lb).max())], 0.0, 0.0
    for _ in range(8):
        nxt = mx.argmax(la, axis=-1)[:, None]
        la, lb = model(nxt, cache=ref)[:, -1], model(nxt, cache=fused)[:, -1]
        lf = model(nxt, cache=fp16)[:, -1]
        assert mx.array_equal(mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1)).item()
        diffs.append(float(mx.abs(la - lb).max()))
        scale = max(scale, float(mx.abs(la).max()))
        coding = max(coding, float(mx.abs(la - lf).max()))
    assert {c.last_attention for c in fused} == {"cpu-kernel"}
    # measured: 3.8e-5 after the prefill's second chunk (the same codes on both paths), up to
    # 3.2e-2 over the decode steps (near-tie codes of the tokens leaving the window drift) at
    # logits up to 30, where the coding moves them 2.6 from fp16's. The mean term's b
    # coefficients scaled by 0.98 give 2.0e-2 and 0.12-0.16.
    report = {"cpu kernel vs transient": diffs, "logits": scale, "transient vs fp16": coding}
    assert diffs[0] < 1e-3 and max(diffs) < 0.03 * coding, report
