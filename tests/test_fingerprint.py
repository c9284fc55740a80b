"""Fingerprints of models loaded with plain `mlx_lm.load` (issue 11): bundle discovery, and
strict=True refusing a 4-bit copy, work as with veloxquant's own loader; a model that cannot say
where it came from is still checked by its parameters, and the errors say what is wrong."""

from __future__ import annotations

import shutil
import warnings

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx_lm
import pytest

from veloxquant import KVCacheConfig, make_cache
from veloxquant.bundle import BUNDLE_SUBDIR, BundleError, export_bundle
from veloxquant.fingerprint import (
    MODEL_DIR_ATTR,
    fingerprint_live_model,
    fingerprint_model_dir,
    params_digest,
)

QF = {"method": "qfilters", "budget": 64}


@pytest.fixture(scope="module")
def dirs(artifacts_root, tmp_path_factory) -> dict:
    """The model with its bundle exported into it, and a 4-bit mlx_lm.convert copy of it with
    the same bundle exported into it."""
    art = artifacts_root / "artifacts" / "smollm2-135m"
    root = tmp_path_factory.mktemp("fingerprint")
    full = root / "full"
    shutil.copytree(art / "model", full, symlinks=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_bundle(art / "bundle", full)
    q4 = root / "q4"
    mlx_lm.convert(str(full), mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=64)
    shutil.rmtree(q4 / BUNDLE_SUBDIR, ignore_errors=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_bundle(art / "bundle", q4)  # export checks non-strictly: warnings
    assert any("weights_sha256 differs" in str(w.message) for w in seen)
    return {"bundle": art / "bundle", "full": full, "q4": q4}


def test_mlx_lm_load_records_the_dir_and_finds_the_exported_bundle(dirs):
    model, _ = mlx_lm.load(str(dirs["full"]))
    assert getattr(model, MODEL_DIR_ATTR) == str(dirs["full"].resolve())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same model: no digest differs
        caches = make_cache(model, KVCacheConfig(**QF, strict=True))
    assert type(caches[0]).__name__ == "QFiltersCache"
    live = fingerprint_live_model(model)
    assert live["params_digest"] == fingerprint_model_dir(dirs["full"])["params_digest"]


def test_strict_refuses_a_4bit_copy_loaded_with_mlx_lm_load(dirs):
    model, _ = mlx_lm.load(str(dirs["q4"]))
    live = fingerprint_live_model(model)
    assert "4-bit" in live["weights_format"]
    with pytest.raises(BundleError, match="differs.*4-bit.*strict") as e:
        make_cache(model, KVCacheConfig(**QF, strict=True))
    assert "has no" not in str(e.value)  # it has a bundle; the complaint is the copy
    with pytest.warns(UserWarning, match="differs"):
        make_cache(model, KVCacheConfig(**QF))


def test_without_its_dir_a_model_is_still_checked_by_its_parameters(dirs):
    model, _ = mlx_lm.load(str(dirs["q4"]))
    delattr(model, MODEL_DIR_ATTR)  # e.g. loaded before veloxquant was imported
    with pytest.raises(BundleError, match="does not record which dir"):
        make_cache(model, KVCacheConfig(**QF))
    with pytest.raises(BundleError, match="params_digest differs.*strict"):
        make_cache(model, KVCacheConfig(**QF, strict=True, artifact_dir=str(dirs["bundle"])))
    full, _ = mlx_lm.load(str(dirs["full"]))
    delattr(full, MODEL_DIR_ATTR)
    make_cache(full, KVCacheConfig(**QF, strict=True, artifact_dir=str(dirs["bundle"])))
    assert params_digest(full) != params_digest(model)


def test_strict_refuses_what_it_cannot_compare(dirs, tmp_path):
    """A bundle from before params_digest, and a model without its dir: nothing to compare."""
    import json

    old = tmp_path / "old"
    shutil.copytree(dirs["bundle"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["model"]["params_digest"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    model, _ = mlx_lm.load(str(dirs["full"]))
    make_cache(model, KVCacheConfig(**QF, strict=True, artifact_dir=str(old)))  # weights_sha256
    delattr(model, MODEL_DIR_ATTR)
    with pytest.raises(BundleError, match="cannot be compared"):
        make_cache(model, KVCacheConfig(**QF, strict=True, artifact_dir=str(old)))
