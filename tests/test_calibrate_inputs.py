"""Calibration checks its inputs before use (issue 10, cases 4-6), for every calibrated method
in the table: provenance (data.json vs capture.json vs the calib tokens), the method's minimum
token count, and shard integrity through the capture loader. Each error is asserted through
the same `veloxquant calibrate` users run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import numpy as np
import pytest

from veloxquant.capture import capture_activations
from veloxquant.cli import main
from veloxquant.data import load_tokens, tokens_sha256
from veloxquant.io import save_safetensors_atomic, sha256_file, write_json_atomic
from veloxquant.methods import CALIBRATED, METHODS
from veloxquant.methods.base import ModelDims


def small_layout(root: Path, model, tokens: np.ndarray) -> Path:
    """The pipeline layout (data/ + activations/) for a capture of exactly `tokens`."""
    save_safetensors_atomic(root / "data" / "calib.safetensors", {"tokens": tokens})
    write_json_atomic(
        root / "data" / "data.json",
        {
            "source": {"kind": "pydoc_topics"},
            "seq_len": int(tokens.shape[1]),
            "calib": {
                "n_windows": int(tokens.shape[0]),
                "n_tokens": int(tokens.size),
                "sha256": tokens_sha256(tokens),
            },
        },
    )
    capture_activations(model, tokens, root / "activations", int(tokens.size), progress=False)
    return root


def run_calibrate(capsys, method: str, root: Path, model_dir: Path, *extra: str) -> str:
    rc = main(
        ["calibrate", method, str(root / "activations"), str(model_dir), str(root / "b"), *extra]
    )
    err = capsys.readouterr().err
    assert rc == 1, err
    assert not (root / "b" / "manifest.json").exists()
    return err


@pytest.fixture(scope="module")
def calib_ids(calib_dir) -> np.ndarray:
    return load_tokens(calib_dir / "data" / "calib.safetensors")


@pytest.fixture(scope="module")
def capture18(calib_ids, smollm2, tmp_path_factory) -> Path:
    """The issue's capture: 18 tokens from 1 window, in a consistent layout."""
    return small_layout(tmp_path_factory.mktemp("capture18"), smollm2[0], calib_ids[:1, :18])


@pytest.fixture(scope="module")
def capture100(calib_ids, smollm2, tmp_path_factory) -> Path:
    """Enough tokens for qfilters, few enough to copy and calibrate on in a moment."""
    return small_layout(tmp_path_factory.mktemp("capture100"), smollm2[0], calib_ids[:1, :100])


def copy_of(layout: Path, tmp_path: Path) -> Path:
    shutil.copytree(layout, tmp_path / "layout")
    return tmp_path / "layout"


def test_capture_of_other_tokens_is_false_provenance(
    calib_dir, calib_ids, capture18, smollm2_dir, tmp_path, capsys
):
    """The issue's case: a capture of 18 tokens from 1 window, with the data.json of the full
    calib split (1024 tokens here), must not become a bundle claiming that data."""
    small = copy_of(capture18, tmp_path)
    data_json = calib_dir / "data" / "data.json"
    err = run_calibrate(capsys, "qfilters", small, smollm2_dir, "--data-json", str(data_json))
    assert (
        f"Provenance mismatch: {data_json} describes a calib split of 1024 tokens with sha256 "
        f"{tokens_sha256(calib_ids)[:16]}..., but {small / 'activations' / 'capture.json'} was "
        f"captured from 18 tokens with sha256 {tokens_sha256(calib_ids[:1, :18])[:16]}..."
    ) in err


def test_calib_tokens_that_do_not_match_data_json(
    calib_ids, capture18, smollm2_dir, tmp_path, capsys
):
    root = copy_of(capture18, tmp_path)
    save_safetensors_atomic(root / "data" / "calib.safetensors", {"tokens": calib_ids[:1, 1:19]})
    err = run_calibrate(capsys, "qfilters", root, smollm2_dir)
    assert "Provenance mismatch: the tokens in " in err and "calib.safetensors do not hash" in err


def test_vecinfer_on_18_tokens_is_refused(capture18, smollm2_dir, tmp_path, capsys):
    """The issue's case: vecinfer on 18 captured tokens (16 train, 2 held out) exited 0."""
    root = copy_of(capture18, tmp_path)
    err = run_calibrate(capsys, "vecinfer", root, smollm2_dir)
    assert "holds 18 tokens, but vecinfer needs at least 155 with these hyperparameters" in err


@pytest.mark.parametrize("method", CALIBRATED)
def test_every_method_enforces_its_minimum(
    method, calib_ids, smollm2, smollm2_dir, tmp_path, capsys
):
    """One token short of the method's own `min_tokens` is refused, naming the number."""
    need = METHODS[method].min_tokens(ModelDims.of(smollm2_dir), METHODS[method].hyperparameters())
    assert 18 < need <= calib_ids.size
    root = small_layout(tmp_path, smollm2[0], calib_ids.reshape(1, -1)[:, : need - 1])
    err = run_calibrate(capsys, method, root, smollm2_dir)
    assert f"holds {need - 1} tokens, but {method} needs at least {need}" in err


@pytest.mark.parametrize("tensor", ["k_post", "q_post"])
def test_nan_in_the_capture_fails_calibration_naming_layer_tensor_and_file(
    capture100, smollm2_dir, tmp_path, capsys, tensor
):
    """The issue's case: a NaN in k_post gave `calibrate qfilters` rc 0 and a bundle that
    verifies; a NaN in q_post blamed the output tensor `filters`."""
    from safetensors.numpy import load_file

    root = copy_of(capture100, tmp_path)
    shard = root / "activations" / "layer_01.safetensors"
    arrays = load_file(str(shard))
    arrays[tensor][10, 1, 2] = np.nan
    save_safetensors_atomic(shard, arrays, metadata={"format": "veloxquant-capture-v1"})
    info_path = root / "activations" / "capture.json"
    info = json.loads(info_path.read_text())
    flipped = run_calibrate(capsys, "qfilters", root, smollm2_dir)  # checksum first
    assert f"{shard}: sha256" in flipped and "does not match capture.json's" in flipped
    info["files"][shard.name] = sha256_file(shard)
    info_path.write_text(json.dumps(info))
    err = run_calibrate(capsys, "qfilters", root, smollm2_dir)
    assert (
        f"{shard}: layer 1 tensor '{tensor}' contains NaN or Inf (first at index [10, 1, 2]"
    ) in err


def test_data_json_without_the_calib_split(calib_dir, smollm2_dir, tmp_path, capsys):
    (tmp_path / "data.json").write_text(json.dumps({"source": {}, "seq_len": 256}))
    root = tmp_path / "calib"
    root.mkdir()
    (root / "activations").symlink_to(calib_dir / "activations")
    err = run_calibrate(
        capsys, "qfilters", root, smollm2_dir, "--data-json", str(tmp_path / "data.json")
    )
    assert (
        "data.json is not a data.json written by prepare-data: it needs 'source', 'seq_len' "
        "and 'calib' with 'n_tokens' and 'sha256'"
    ) in err
