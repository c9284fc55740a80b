"""Train one method's artifact from a capture dir and write it into a bundle.

`calibrate(method, activations_dir, model_dir, bundle_dir, data_json=..., **hyperparameters)`
is what the DVC method stages and `veloxquant calibrate` call. Each calibrated method module
provides `write_<method>(*, activations_dir, model_dir, bundle_dir, data_fingerprint, **hp)`
(called with keywords).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

CALIBRATED_METHODS = ("qfilters", "vecinfer")


def calibrate(
    method: str,
    activations_dir: str | Path,
    model_dir: str | Path,
    bundle_dir: str | Path,
    data_json: str | Path | None = None,
    **hyperparameters: Any,
) -> Path:
    from veloxquant.data import data_fingerprint

    if method not in CALIBRATED_METHODS:
        raise ValueError(f"No calibration for {method!r}; calibrated methods: {CALIBRATED_METHODS}")
    activations_dir = Path(activations_dir)
    if data_json is None:  # the pipeline layout: artifacts/<model>/{data,activations}
        data_json = activations_dir.parent / "data" / "data.json"
    if not Path(data_json).is_file():
        raise FileNotFoundError(
            f"No data.json at {data_json}: pass --data-json (written by prepare-data) so the "
            "bundle records which calibration data it came from."
        )
    module = importlib.import_module(f"veloxquant.methods.{method}")
    writer = getattr(module, f"write_{method}")
    return writer(activations_dir=activations_dir, model_dir=model_dir, bundle_dir=bundle_dir,
                  data_fingerprint=data_fingerprint(data_json, "calib"), **hyperparameters)
