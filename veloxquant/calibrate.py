"""Train one method's artifact from a capture dir and write it into a bundle.

`calibrate(method, activations_dir, model_dir, bundle_dir, data_json=..., **hyperparameters)` is
what the DVC calibration stages and `veloxquant calibrate` call, for every calibrated method in
`veloxquant.methods.METHODS`: resolve the hyperparameters against the method's defaults, check
the capture holds enough tokens, run the method's `calibrate`, and write its tensors with the
one bundle writer. The stored hyperparameters are the full resolved set, so the runtime knows
how the artifact was made (an ablation bundle says what it ablates).
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
    """Calibrate `method` on a capture and write `<bundle_dir>/<method>.safetensors`."""
    from veloxquant.bundle import write_method
    from veloxquant.capture import load_capture_info
    from veloxquant.data import data_fingerprint
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
    need = spec.min_tokens(dims, hp)
    if info["n_sampled"] < need:
        raise ValueError(
            f"{method}: the capture {activations_dir} holds {info['n_sampled']} tokens, but "
            f"{method} needs at least {need} with these hyperparameters. Raise the capture "
            "token_budget (or the calibration data) and capture again."
        )
    calib_tokens = Path(data_json).parent / "calib.safetensors"
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
        data_fingerprint=data_fingerprint(data_json, "calib"),
        capture_point=spec.capture_point,
        hyperparameters=hp,
        diagnostics=diagnostics,
    )
