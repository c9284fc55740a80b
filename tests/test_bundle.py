"""Bundle format: round-trip, determinism, and one clear error per kind of bad input.

The tensors here are random but spec-shaped (bundle tests are about the format); the real
calibration -> bundle -> make_cache -> generate path is in test_qfilters.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save as st_save

from veloxquant import KVCacheConfig, make_cache
from veloxquant.bundle import (
    BUNDLE_SUBDIR,
    MANIFEST,
    BundleError,
    BundleWarning,
    export_bundle,
    load_bundle,
    merge_bundles,
    method_file,
    verify_bundle,
    write_method,
)
from veloxquant.cli import render_bundle
from veloxquant.fingerprint import attach_model_dir, fingerprint_model_dir

L, H_Q, H_KV, D = 30, 9, 3, 64  # SmolLM2-135M
DATA = {
    "source": {"kind": "pydoc_topics"},
    "split": "calib",
    "seq_len": 1024,
    "n_tokens": 8192,
    "sha256": "ab" * 32,
}
VECINFER_HP = {
    "key_bits": 8,
    "key_sub_dim": 4,
    "value_bits": 8,
    "value_sub_dim": 4,
    "hadamard": True,
    "share": "layer",
}


def qfilters_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((L, H_KV, D)).astype(np.float32)
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    return {
        "filters": f,
        "sigma1": rng.random((L, H_Q), np.float32),
        "kappa": rng.random((L, H_Q), np.float32),
        "spearman": rng.random(L, np.float32),
        "spearman_fallback": rng.random(L, np.float32),
    }


def vecinfer_tensors(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "smooth": rng.random((L, H_KV, D), np.float32) + 0.5,
        "value_smooth": rng.random((L, H_KV, D), np.float32) + 0.5,
        "key_mean": rng.standard_normal((L, H_KV, D)).astype(np.float32),
        "value_mean": rng.standard_normal((L, H_KV, D)).astype(np.float32),
        "key_codebook": rng.standard_normal((L, 1, 256, 4)).astype(np.float32),
        "value_codebook": rng.standard_normal((L, 1, 256, 4)).astype(np.float32),
    }


def write_qf(bundle: Path, model_dir: Path, seed: int = 0, data: dict = DATA) -> Path:
    return write_method(
        bundle,
        "qfilters",
        qfilters_tensors(seed),
        model_dir=model_dir,
        data_fingerprint=data,
        capture_point="q_post",
        hyperparameters={"max_rows_per_head": 3000, "seed": seed},
        diagnostics={"spearman_mean": 0.7, "kappa_positive_fraction": 1.0},
    )


@pytest.fixture(scope="module")
def model_fp(smollm2_dir) -> dict:
    return fingerprint_model_dir(smollm2_dir)


@pytest.fixture
def bundle(tmp_path, model_fp) -> Path:
    write_qf(tmp_path / "b", model_fp)
    return tmp_path / "b"


def manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def method_path(bundle: Path, method: str) -> Path:
    return bundle / manifest(bundle)["methods"][method]["file"]


def rewrite(bundle: Path, method: str, data: bytes) -> None:
    """Replace a method file AND fix its manifest entry (content address, size, sha256), so
    later checks are exercised."""
    m = manifest(bundle)
    entry = m["methods"][method]
    (bundle / entry["file"]).unlink()
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    entry["size"] = len(data)
    entry["file"] = method_file(method, entry["sha256"])
    (bundle / entry["file"]).write_bytes(data)
    (bundle / MANIFEST).write_text(json.dumps(m))


def edit_manifest(bundle: Path, fn) -> None:
    m = manifest(bundle)
    fn(m)
    (bundle / MANIFEST).write_text(json.dumps(m))


# ------------------------------------------------------------------------------- good paths


def test_round_trip(bundle, smollm2, model_fp):
    model, _ = smollm2
    b = load_bundle(bundle, model)
    assert b.methods == ["qfilters"]
    want = qfilters_tensors(0)
    got = b.tensors("qfilters")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == mx.float32
        np.testing.assert_array_equal(np.array(got[k]), want[k])
    info = b.method_info("qfilters")
    assert info["capture_point"] == "q_post"
    assert info["hyperparameters"] == {"max_rows_per_head": 3000, "seed": 0}
    assert info["diagnostics"]["spearman_mean"] == 0.7
    assert info["data"] == DATA
    m = b.manifest
    assert (m["format"], m["format_version"]) == ("veloxquant-bundle", 2)
    assert m["model"]["num_layers"] == 30 and m["model"]["num_kv_heads"] == 3
    assert m["model"]["rope_traditional"] is True and m["model"]["rope_theta"] == 1e5
    assert m["model"]["weights_sha256"] == model_fp["weights_sha256"] is not None
    assert m["model"]["tokenizer_sha256"] == model_fp["tokenizer_sha256"] is not None
    e = m["methods"]["qfilters"]
    assert e["file"] == f"qfilters-{e['sha256'][:16]}.safetensors"  # named by its content
    assert e["size"] == (bundle / e["file"]).stat().st_size
    assert set(e["versions"]) >= {"veloxquant", "mlx", "mlx-lm"}
    assert e["tensors"]["filters"] == {"shape": [30, 3, 64], "dtype": "float32"}


def test_determinism(tmp_path, model_fp):
    """Same content, same bytes: file names and manifest (no timestamps), so DVC outputs of a
    rerun do not churn; and a rerun into the same dir changes nothing on disk."""
    write_qf(tmp_path / "a", model_fp)
    write_qf(tmp_path / "b", model_fp)
    fa, fb = (method_path(tmp_path / d, "qfilters") for d in "ab")
    assert fa.name == fb.name and fa.read_bytes() == fb.read_bytes()
    ta = (tmp_path / "a" / MANIFEST).read_bytes()
    assert ta == (tmp_path / "b" / MANIFEST).read_bytes()
    assert "created_at" not in ta.decode()
    # the json itself is canonical (sorted keys), so equal content means equal bytes
    assert ta.decode() == json.dumps(json.loads(ta), indent=2, sort_keys=True) + "\n"
    stat = os.stat(tmp_path / "a" / MANIFEST)
    write_qf(tmp_path / "a", model_fp)
    assert os.stat(tmp_path / "a" / MANIFEST).st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
        [".lock", fa.name, MANIFEST]
    )


def test_refresh_one_method_leaves_the_other_untouched(bundle, model_fp):
    write_method(
        bundle,
        "vecinfer",
        vecinfer_tensors(),
        model_dir=model_fp,
        data_fingerprint=DATA,
        capture_point="k_post,v",
        hyperparameters=VECINFER_HP,
        diagnostics={"mse": 0.1},
    )
    vec = method_path(bundle, "vecinfer")
    before = vec.read_bytes()
    entry = manifest(bundle)["methods"]["vecinfer"]
    stat = os.stat(vec)
    write_qf(bundle, model_fp, seed=5, data={**DATA, "sha256": "cd" * 32})
    assert method_path(bundle, "vecinfer") == vec and vec.read_bytes() == before
    assert os.stat(vec).st_mtime_ns == stat.st_mtime_ns
    m = manifest(bundle)
    assert m["methods"]["vecinfer"] == entry
    assert m["methods"]["qfilters"]["data"]["sha256"] == "cd" * 32
    b = load_bundle(bundle)
    assert b.methods == ["qfilters", "vecinfer"]
    assert b.tensors("vecinfer")["key_codebook"].shape == (30, 1, 256, 4)


def test_inspect_and_verify(bundle, smollm2_dir):
    text = render_bundle(load_bundle(bundle))
    for needle in (
        "qfilters",
        "[30, 3, 64]",
        "capture=q_post",
        "layers=30",
        "kv_heads=3",
        "spearman_mean",
        "sha256=",
        "KiB",
        "pydoc_topics",
    ):
        assert needle in text, needle
    verify_bundle(bundle)
    verify_bundle(bundle, model_dir=smollm2_dir, strict=True)


def _sha(bundle: Path, method: str, seed: int) -> str:
    """sha256 of the qfilters file write_qf(seed) gives (written to a scratch bundle)."""
    scratch = bundle.parent / f"scratch-{seed}"
    write_qf(scratch, manifest(bundle)["model"], seed=seed)
    return manifest(scratch)["methods"][method]["sha256"]


def test_export_next_to_model_and_found_by_make_cache(
    bundle, smollm2, smollm2_dir, tmp_path, model_fp
):
    model, _ = smollm2
    # a model dir of links to the real files: same digests, and exporting does not touch it
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.is_file():
            (model_dir / f.name).symlink_to(f.resolve())
    dest = export_bundle(bundle, model_dir)
    assert dest == model_dir / BUNDLE_SUBDIR
    qf = method_path(bundle, "qfilters")
    assert sorted(p.name for p in dest.iterdir()) == [".lock", MANIFEST, qf.name]
    assert (dest / qf.name).read_bytes() == qf.read_bytes()
    assert (dest / MANIFEST).read_bytes() == (bundle / MANIFEST).read_bytes()
    write_qf(bundle, model_fp, seed=3)
    export_bundle(bundle, model_dir)  # re-export replaces it in place
    assert (dest / MANIFEST).read_bytes() == (bundle / MANIFEST).read_bytes()
    # the previous generation's file is kept for readers that are still on it; one more
    # export collects it
    assert (dest / qf.name).exists()
    write_qf(bundle, model_fp, seed=0)
    export_bundle(bundle, model_dir)
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [".lock", MANIFEST, qf.name, method_file("qfilters", _sha(bundle, "qfilters", 3))]
    )
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".")]
    verify_bundle(model_dir)  # a model dir resolves to its shipped bundle

    old = getattr(model, "_veloxquant_model_dir", None)
    try:
        attach_model_dir(model, model_dir)
        caches = make_cache(model, KVCacheConfig(method="qfilters", budget=64))  # no artifact_dir
        want = qfilters_tensors(0)["filters"][7]
        np.testing.assert_array_equal(np.array(caches[7].filters), want)
    finally:
        model._veloxquant_model_dir = old


def test_merge_bundles(bundle, model_fp, tmp_path):
    other = tmp_path / "vi"
    write_method(
        other,
        "vecinfer",
        vecinfer_tensors(),
        model_dir=model_fp,
        data_fingerprint=DATA,
        capture_point="k_post,v",
        hyperparameters=VECINFER_HP,
        diagnostics={},
    )
    out = merge_bundles(tmp_path / "merged", [bundle, other])
    assert load_bundle(out).methods == ["qfilters", "vecinfer"]
    vec = method_path(other, "vecinfer")
    assert (out / vec.name).read_bytes() == vec.read_bytes()
    with pytest.raises(BundleError, match="more than one input"):
        merge_bundles(tmp_path / "twice", [bundle, bundle])


# ------------------------------------------------------------------------------- fail closed


def test_calibrated_method_without_bundle_fails_closed(smollm2):
    model, _ = smollm2
    with pytest.raises(BundleError, match=r"dvc repro qfilters@<model>.*uncalibrated=True"):
        make_cache(model, KVCacheConfig(method="qfilters", budget=64))
    caches = make_cache(model, KVCacheConfig(method="qfilters", budget=64, uncalibrated=True))
    assert len(caches) == 30 and caches[0].filters is None


def test_missing_method_names_its_stage(bundle, smollm2):
    model, _ = smollm2
    with pytest.raises(BundleError, match=r"no 'vecinfer' artifact.*dvc repro vecinfer@<model>"):
        load_bundle(bundle, model).tensors("vecinfer")


# ------------------------------------------------------------------------------- bad input


def test_truncated_file(bundle):
    f = method_path(bundle, "qfilters")
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(
        BundleError, match=r"size is \d+ bytes but the manifest says \d+ \(truncated"
    ):
        load_bundle(bundle)


def test_flipped_byte(bundle):
    f = method_path(bundle, "qfilters")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256 mismatch"):
        load_bundle(bundle)


def test_truncated_file_with_matching_checksum_is_caught_by_the_header_check(bundle):
    rewrite(bundle, "qfilters", method_path(bundle, "qfilters").read_bytes()[:-100])
    with pytest.raises(BundleError, match="inconsistent data offsets|trailing bytes|truncated"):
        load_bundle(bundle)


def test_missing_tensor(bundle, model_fp):
    t = qfilters_tensors()
    del t["kappa"]
    with pytest.raises(BundleError, match="tensor 'kappa' is missing"):
        write_method(
            bundle,
            "qfilters",
            t,
            model_dir=model_fp,
            data_fingerprint=DATA,
            capture_point="q_post",
            hyperparameters={},
            diagnostics={},
        )
    rewrite(bundle, "qfilters", st_save(t))
    with pytest.raises(BundleError, match="tensor 'kappa' is missing"):
        load_bundle(bundle)


def test_wrong_shape(bundle):
    t = qfilters_tensors()
    t["filters"] = t["filters"][:, :2]
    rewrite(bundle, "qfilters", st_save(t))
    with pytest.raises(
        BundleError, match=r"'filters' has shape \[30, 2, 64\], expected \[30, 3, 64\]"
    ):
        load_bundle(bundle)


def test_wrong_dtype(bundle):
    t = qfilters_tensors()
    t["filters"] = t["filters"].astype(np.float16)
    rewrite(bundle, "qfilters", st_save(t))
    with pytest.raises(BundleError, match="'filters' has dtype float16, expected float32"):
        load_bundle(bundle)


def test_unexpected_tensor(bundle):
    t = qfilters_tensors()
    t["secret"] = np.zeros(3, np.float32)
    rewrite(bundle, "qfilters", st_save(t))
    with pytest.raises(BundleError, match=r"unexpected tensors \['secret'\]"):
        load_bundle(bundle)


def test_nan_tensor_refused_at_write(tmp_path, model_fp):
    t = qfilters_tensors()
    t["filters"][3, 1, 5] = np.nan
    with pytest.raises(BundleError, match="'filters' contains NaN"):
        write_method(
            tmp_path / "b",
            "qfilters",
            t,
            model_dir=model_fp,
            data_fingerprint=DATA,
            capture_point="q_post",
            hyperparameters={},
            diagnostics={},
        )
    assert not (tmp_path / "b" / MANIFEST).exists()


def _tiny_llama_dir(path: Path, tokenizer_from: Path, layers: int, kv_heads: int) -> Path:
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 64,
        "num_attention_heads": 9,
        "num_key_value_heads": kv_heads,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128,
        "rope_theta": 1e5,
        "rope_traditional": True,
    }
    model = llama.Model(llama.ModelArgs(**config))
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(Path(tokenizer_from) / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.mark.parametrize(
    "layers, kv_heads, field, theirs, ours",
    [(2, 3, "num_layers", 2, 30), (30, 1, "num_kv_heads", 1, 3)],
)
def test_wrong_model_bundle(tmp_path, smollm2, smollm2_dir, layers, kv_heads, field, theirs, ours):
    model, _ = smollm2
    tiny = _tiny_llama_dir(tmp_path / "tiny", smollm2_dir, layers, kv_heads)
    fp = fingerprint_model_dir(tiny)
    rng = np.random.default_rng(0)
    f = rng.standard_normal((layers, kv_heads, 64)).astype(np.float32)
    t = {
        "filters": f / np.linalg.norm(f, axis=-1, keepdims=True),
        "sigma1": np.ones((layers, 9), np.float32),
        "kappa": np.ones((layers, 9), np.float32),
        "spearman": np.ones(layers, np.float32),
        "spearman_fallback": np.ones(layers, np.float32),
    }
    write_method(
        tmp_path / "b",
        "qfilters",
        t,
        model_dir=fp,
        data_fingerprint=DATA,
        capture_point="q_post",
        hyperparameters={},
        diagnostics={},
    )
    load_bundle(tmp_path / "b")  # a valid bundle, just for another model
    msg = rf"{field} is {theirs} in the bundle but {ours} in the model"
    with pytest.raises(BundleError, match=msg):
        load_bundle(tmp_path / "b", model)
    with pytest.raises(BundleError, match=msg):
        verify_bundle(tmp_path / "b", model_dir=smollm2_dir)
    with pytest.raises(BundleError, match=msg):
        make_cache(
            model, KVCacheConfig(method="qfilters", artifact_dir=str(tmp_path / "b"), budget=64)
        )


def test_other_copy_of_the_model_warns_or_fails_under_strict(bundle, smollm2):
    model, _ = smollm2
    assert getattr(model, "_veloxquant_model_dir", None), "load_model should record the model dir"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's own digests must not warn
        load_bundle(bundle, model, strict=True)
    edit_manifest(bundle, lambda m: m["model"].update(weights_sha256="0" * 64))
    with pytest.warns(BundleWarning, match="weights_sha256 differs"):
        load_bundle(bundle, model)
    with pytest.raises(BundleError, match="weights_sha256 differs.*strict"):
        load_bundle(bundle, model, strict=True)
    with pytest.raises(BundleError, match="weights_sha256 differs"):
        make_cache(
            model,
            KVCacheConfig(method="qfilters", artifact_dir=str(bundle), budget=64, strict=True),
        )


def test_unknown_format_version(bundle):
    edit_manifest(bundle, lambda m: m.update(format_version=3))
    with pytest.raises(BundleError, match="unknown bundle format_version 3.*Upgrade veloxquant"):
        load_bundle(bundle)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="not a veloxquant bundle"):
        load_bundle(tmp_path)


@pytest.mark.parametrize(
    "name, match",
    [
        ("../qfilters.safetensors", r"escapes the bundle dir"),
        ("sub/../../x.safetensors", r"escapes the bundle dir"),
        ("/etc/passwd", r"absolute path"),
    ],
)
def test_path_traversal_in_manifest(bundle, name, match):
    shutil.copy(method_path(bundle, "qfilters"), bundle.parent / "qfilters.safetensors")
    edit_manifest(bundle, lambda m: m["methods"]["qfilters"].update(file=name))
    with pytest.raises(BundleError, match=match):
        load_bundle(bundle)


def test_symlink_out_of_the_bundle(bundle, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(method_path(bundle, "qfilters"), outside)
    (bundle / "link.safetensors").symlink_to(outside)
    edit_manifest(bundle, lambda m: m["methods"]["qfilters"].update(file="link.safetensors"))
    with pytest.raises(BundleError, match="outside the bundle dir"):
        load_bundle(bundle)


def test_pickle_named_safetensors(bundle):
    payload = pickle.dumps(qfilters_tensors(), protocol=4)
    method_path(bundle, "qfilters").write_bytes(payload)  # manifest checksum not even fixed
    with pytest.raises(BundleError, match="is a Python pickle, not safetensors"):
        load_bundle(bundle)
    rewrite(bundle, "qfilters", payload)  # ... nor when the checksum matches
    with pytest.raises(BundleError, match="is a Python pickle, not safetensors"):
        load_bundle(bundle)


def test_garbage_header(bundle):
    rewrite(bundle, "qfilters", b"\xff" * 8 + b"{}")
    with pytest.raises(BundleError, match="not a safetensors file or truncated"):
        load_bundle(bundle)


def test_writing_a_different_model_into_a_bundle_is_refused(bundle, model_fp):
    other = {**model_fp, "weights_sha256": "0" * 64, "path": "/elsewhere"}
    with pytest.raises(BundleError, match="Use a separate bundle dir per model"):
        write_method(
            bundle,
            "vecinfer",
            vecinfer_tensors(),
            model_dir=other,
            data_fingerprint=DATA,
            capture_point="k_post,v",
            hyperparameters=VECINFER_HP,
            diagnostics={},
        )


# ------------------------------------------------------------------------------- issue 10
# One test per case of issue 10 that concerns bundles; each asserts the message users see.


def test_format_version_1_names_the_fix(bundle):
    edit_manifest(bundle, lambda m: m.update(format_version=1))
    with pytest.raises(
        BundleError,
        match=r"format_version 1 was written by an older veloxquant.*reads version 2.*"
        r"veloxquant calibrate METHOD ACTIVATIONS MODEL NEW_DIR.*veloxquant bundle export",
    ):
        load_bundle(bundle)
    with pytest.raises(BundleError, match="format_version 1 was written by an older"):
        write_qf(bundle, manifest(bundle)["model"], seed=1)  # no silent overwrite either


def test_manifest_that_is_a_json_list(bundle):
    (bundle / MANIFEST).write_text("[1, 2, 3]")
    with pytest.raises(BundleError, match="the manifest is a json array; expected an object"):
        load_bundle(bundle)


def vecinfer_bundle(bundle: Path, model_fp: dict) -> Path:
    write_method(
        bundle,
        "vecinfer",
        vecinfer_tensors(),
        model_dir=model_fp,
        data_fingerprint=DATA,
        capture_point="k_post,v",
        hyperparameters=VECINFER_HP,
        diagnostics={},
    )
    return bundle


def _set(path: str, value):
    def edit(m):
        *parents, last = path.split(".")
        for p in parents:
            m = m[p]
        if value is KeyError:
            del m[last]
        else:
            m[last] = value

    return edit


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("model.num_layers", KeyError, r"required field 'model.num_layers' is missing"),
        (
            "methods.vecinfer.hyperparameters.key_bits",
            20000,
            r"field 'methods.vecinfer.hyperparameters': vecinfer: key_bits must be an integer "
            r"in \[1, 16\], got 20000",
        ),
        ("methods", {}, r"field 'methods' is empty; a bundle holds at least one calibrated"),
        ("model.num_kv_heads", "3", r"field 'model.num_kv_heads' must be an integer, got '3'"),
        ("model.num_heads", 10, r"'model.num_heads' \(10\) is not a multiple of 'model.num_kv"),
        ("model.head_dim", 0, r"field 'model.head_dim' is 0, outside \[1, 1048576\]"),
        ("model.rope_theta", -1.0, r"field 'model.rope_theta' must be > 0"),
        ("model.weights_sha256", "xyz", r"'model.weights_sha256' must be null or a sha256"),
        ("methods.vecinfer.size", -5, r"field 'methods.vecinfer.size' is -5, outside \[8, "),
        ("methods.vecinfer.sha256", KeyError, r"required field 'methods.vecinfer.sha256'"),
        ("methods.vecinfer.capture_point", "q_post", r"is 'q_post', but vecinfer is calibrated"),
        ("methods.vecinfer.data.n_tokens", 0, r"'methods.vecinfer.data.n_tokens' is 0, outside"),
        ("methods.vecinfer.tensors.smooth.shape", [30, 3, 32], r"'methods.vecinfer.tensors' "),
        ("methods.vecinfer.hyperparameters.key_bitz", 8, r"unknown hyperparameters \['key_bitz'"),
        ("methods.vecinfer.file", "vecinfer.safetensors", r"named by their content"),
        ("methods.commvq2", {}, r"lists 'commvq2', which is not a calibrated method"),
        ("format", "other", r"not a veloxquant-bundle manifest \(field 'format' is 'other'\)"),
    ],
)
def test_manifest_schema_names_the_field(tmp_path, model_fp, field, value, match):
    bundle = vecinfer_bundle(tmp_path / "b", model_fp)
    edit_manifest(bundle, _set(field, value))
    with pytest.raises(BundleError, match=match):
        verify_bundle(bundle)


@pytest.mark.parametrize(
    "filters, match",
    [
        (lambda f: 2 * f, r"Q-Filters must be unit-norm \(norms range 2\.\.2\)"),
        (lambda f: 0 * f, r"Q-Filters must be unit-norm \(norms range 0\.\.0\)"),
    ],
)
def test_bad_filter_values_fail_verify_exactly_as_make_cache(bundle, smollm2, filters, match):
    t = qfilters_tensors()
    t["filters"] = filters(t["filters"])
    rewrite(bundle, "qfilters", st_save(dict(sorted(t.items()))))
    with pytest.raises(BundleError, match=match):
        verify_bundle(bundle)
    model, _ = smollm2
    with pytest.raises(BundleError, match=match):
        make_cache(model, KVCacheConfig(method="qfilters", artifact_dir=str(bundle), budget=64))


def test_manifest_symlink_out_of_the_bundle(bundle, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.copy(bundle / MANIFEST, outside)
    (bundle / MANIFEST).unlink()
    (bundle / MANIFEST).symlink_to(outside)
    with pytest.raises(
        BundleError, match=r"manifest.json is a symlink to .*elsewhere.json, outside"
    ):
        load_bundle(bundle)


def test_uncalibrated_with_artifact_dir_is_contradictory(bundle, smollm2):
    # refused as soon as the config is built, before any cache or bundle is touched
    with pytest.raises(ValueError, match=r"uncalibrated=True, artifact_dir=.* is contradictory"):
        KVCacheConfig(method="qfilters", budget=64, uncalibrated=True, artifact_dir=str(bundle))


def test_two_copies_of_one_model_are_one_model(bundle, model_fp, tmp_path):
    """The path is information only: merging, adding a method and loading across copies at
    different paths all work; a different digest is still refused, naming the field."""
    copy = {**model_fp, "path": "/somewhere/else/smollm2"}
    other = vecinfer_bundle(tmp_path / "vi", copy)
    out = merge_bundles(tmp_path / "merged", [bundle, other])
    assert load_bundle(out).methods == ["qfilters", "vecinfer"]
    vecinfer_bundle(bundle, copy)  # into a bundle made from the other copy
    assert load_bundle(bundle).methods == ["qfilters", "vecinfer"]

    changed = vecinfer_bundle(tmp_path / "vi2", {**copy, "weights_sha256": "0" * 64})
    with pytest.raises(
        BundleError,
        match=r"calibrated for a different model than .*: weights_sha256 is '\w{16}\.\.\.' vs "
        r"'0{16}\.\.\.' \(models at /somewhere/else/smollm2 and /somewhere/else/smollm2\)",
    ):
        merge_bundles(tmp_path / "bad", [tmp_path / "vi", changed])


def test_missing_listed_file(bundle):
    path = method_path(bundle, "qfilters")
    path.unlink()
    with pytest.raises(BundleError, match=rf"{path.name}: file listed in the manifest is missing"):
        load_bundle(bundle)


def test_rerun_cleans_a_killed_writers_debris(bundle, model_fp):
    """What a SIGKILL leaves (a temp file, a method file no manifest lists) goes on the next
    write, under the writer lock."""
    (bundle / ".qfilters-0123456789abcdef.safetensors.x1y2.tmp").write_bytes(b"half")
    (bundle / ".manifest.json.abcd.tmp").write_bytes(b"{")
    (bundle / "qfilters-0123456789abcdef.safetensors").write_bytes(b"orphan")
    write_qf(bundle, model_fp, seed=0)  # same content: nothing to commit, debris still goes
    assert sorted(p.name for p in bundle.iterdir()) == sorted(
        [".lock", MANIFEST, method_path(bundle, "qfilters").name]
    )


def test_recorded_model_path_does_not_depend_on_the_checkout(tmp_path, smollm2_dir, monkeypatch):
    # DVC runs every stage from the project root, so two clones of the project record the same
    # model path and build the same bundle bytes (an absolute path differed by clone)
    fps = []
    for clone in ("a", "b"):
        (tmp_path / clone / "artifacts").mkdir(parents=True)
        (tmp_path / clone / "artifacts" / "model").symlink_to(smollm2_dir)
        monkeypatch.chdir(tmp_path / clone)
        fps.append(fingerprint_model_dir(tmp_path / clone / "artifacts" / "model"))
        write_qf(tmp_path / clone / "bundle", fps[-1])
    assert fps[0] == fps[1] and fps[0]["path"] == "artifacts/model"
    a, b = (tmp_path / clone / "bundle" / MANIFEST for clone in "ab")
    assert a.read_bytes() == b.read_bytes()
    # a model outside the working directory keeps its absolute path, for the messages
    assert fingerprint_model_dir(tmp_path / "a" / "artifacts" / "model")["path"] == str(
        tmp_path / "a" / "artifacts" / "model"
    )
