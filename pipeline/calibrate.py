"""Stage <method>: train one calibrated method's artifact from the capture.

    python -m pipeline.calibrate <method> <model-key>

Writes artifacts/<model>/methods/<method>/ (a single-method bundle) from `method.<method>` in
params.yaml, and each entry of its `variants:` (ablations, alternative bit widths) to
artifacts/<model>/ablations/<method>/<variant>/ with those overrides applied.
"""

import argparse
import shutil

from pipeline._common import artifacts, load_params
from veloxquant.calibrate import calibrate
from veloxquant.methods import CALIBRATED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("method", choices=CALIBRATED)
    parser.add_argument("model", help="model key under `models:` in params.yaml")
    args = parser.parse_args()
    params = load_params()
    if args.model not in params.get("models", {}):
        raise SystemExit(
            f"Unknown model {args.model!r}; params.yaml has {sorted(params['models'])}"
        )
    a = artifacts(args.model)
    hp = dict(params["method"][args.method])
    variants = hp.pop("variants", None) or {}
    common = dict(data_json=a / "data" / "data.json")
    print(
        calibrate(
            args.method, a / "activations", a / "model", a / "methods" / args.method, **common, **hp
        )
    )
    ablations = a / "ablations" / args.method
    shutil.rmtree(ablations, ignore_errors=True)  # no stale variants from older params
    for name, overrides in variants.items():
        print(
            calibrate(
                args.method,
                a / "activations",
                a / "model",
                ablations / name,
                **common,
                **{**hp, **overrides},
            )
        )


if __name__ == "__main__":
    main()
