"""Train one method's artifact from a capture dir and write it into a bundle.

`calibrate(method, activations_dir, model_dir, bundle_dir, data_json=..., **hyperparameters)` is
what the DVC calibration stages and `veloxquant calibrate` call, for every calibrated method in
`veloxquant.methods.METHODS`: resolve the hyperparameters against the method's defaults, check
the inputs, run the method's `calibrate`, and write its tensors with the one bundle writer. The
stored hyperparameters are the full resolved set, so the runtime knows how the artifact was made
(an ablation bundle says what it ablates).

Inputs are checked before any work, each failure naming the files involved:
- provenance: the calib split in data.json (sha256 and token count) must be the tokens the
  capture was made from (capture.json's tokens_sha256 and tokens_seen), or the bundle would
  record a data fingerprint it was not calibrated on; the calib tokens next to data.json
  (which methods that probe the model read) must hash to it too;
- size: the capture must hold at least the method's `min_tokens` for these hyperparameters;
- integrity: every shard the method reads is checked against capture.json's sha256 and for
  NaN/Inf by the capture loader (veloxquant.capture.load_activations / load_stats).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from veloxquant.methods import CALIBRATED, METHODS
from veloxquant.methods.base import CalibrationInputs, ModelDims


def calibrate(
    method: str,
    activations_dir: str | Path,
    model_dir: str | Path,
    bundle_dir: str | Path,
    data_json: str | Path | None = None,
    progress: bool = True,
    **hyperparameters: Any,
) -> Path:
    """Calibrate `method` on a capture and write its artifact into `bundle_dir` (one bundle
    transaction); returns the method file's path."""
    from veloxquant.bundle import write_method
    from veloxquant.capture import load_capture_info
    from veloxquant.data import data_fingerprint, load_tokens, tokens_sha256
    from veloxquant.fingerprint import fingerprint_model_dir

    if method not in CALIBRATED:
        raise ValueError(f"No calibration for {method!r}; calibrated methods: {list(CALIBRATED)}")
    spec = METHODS[method]
    activations_dir, model_dir = Path(activations_dir), Path(model_dir)
    if data_json is None:  # the pipeline layout: artifacts/<model>/{data,activations}
        data_json = activations_dir.parent / "data" / "data.json"
    if not Path(data_json).is_file():
        raise FileNotFoundError(
            f"No data.json at {data_json}: pass --data-json (written by prepare-data) so the "
            "bundle records which calibration data it came from."
        )
    hp = spec.hyperparameters(hyperparameters)
    dims = ModelDims.of(model_dir)
    info = load_capture_info(activations_dir)
    data = data_fingerprint(data_json, "calib")
    check_provenance(data, info, Path(data_json), activations_dir / "capture.json")
    calib_tokens = Path(data_json).parent / "calib.safetensors"
    if calib_tokens.is_file() and tokens_sha256(load_tokens(calib_tokens)) != data["sha256"]:
        raise ValueError(
            f"Provenance mismatch: the tokens in {calib_tokens} do not hash to the calib sha256 "
            f"that {data_json} records; re-run prepare_data."
        )
    need = spec.min_tokens(dims, hp)
    if info["n_sampled"] < need:
        raise ValueError(
            f"{method}: the capture {activations_dir} holds {info['n_sampled']} tokens, but "
            f"{method} needs at least {need} with these hyperparameters. Raise the capture "
            "token_budget (or the calibration data) and capture again."
        )
    inputs = CalibrationInputs(
        activations_dir=activations_dir,
        model_dir=model_dir,
        calib_tokens=calib_tokens if calib_tokens.is_file() else None,
    )
    tensors, diagnostics = spec.calibrate(inputs, dims, hp, progress)
    return write_method(
        bundle_dir,
        method,
        tensors,
        model_dir=fingerprint_model_dir(model_dir),
        data_fingerprint=data,
        capture_point=spec.capture_point,
        hyperparameters=hp,
        diagnostics=diagnostics,
    )


def check_provenance(
    data: dict[str, Any], capture: dict[str, Any], data_json: Path, capture_json: Path
) -> None:
    """data.json's calib split must be the tokens the capture was made from: the same sha256
    (both hash the int32 token ids) and the same number of tokens."""
    recorded = capture.get("data_sha256")  # what the capture stage read from data.json
    if (
        capture.get("tokens_sha256") != data["sha256"]
        or capture.get("tokens_seen") != data["n_tokens"]
        or recorded not in (None, data["sha256"])
    ):
        raise ValueError(
            f"Provenance mismatch: {data_json} describes a calib split of {data['n_tokens']} "
            f"tokens with sha256 {str(data['sha256'])[:16]}..., but {capture_json} was captured "
            f"from {capture.get('tokens_seen')} tokens with sha256 "
            f"{str(capture.get('tokens_sha256'))[:16]}...; the bundle would record data it was "
            "not calibrated on. Pass the data.json the capture was made from (--data-json), or "
            "re-run the capture on this data."
        )
