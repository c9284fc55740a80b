"""Stage <method>: train one calibrated method's artifact from the capture.

    python -m pipeline.calibrate <method> <model-key>

Writes artifacts/<model>/methods/<method>/ (a single-method bundle) from `method.<method>` in
params.yaml, each entry of its `variants:` (ablations, alternative bit widths) to
artifacts/<model>/ablations/<method>/<variant>/ with those overrides applied, and, for a method
that draws its artifact, artifacts/<model>/plots/<method>.png.
"""

import argparse
import shutil

from pipeline._common import artifacts, load_params
from veloxquant.bundle import load_bundle
from veloxquant.calibrate import calibrate
from veloxquant.methods import CALIBRATED, METHODS


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
    inputs = (a / "activations", a / "model")
    data_json = a / "data" / "data.json"
    main_dir = a / "methods" / args.method
    print(calibrate(args.method, *inputs, main_dir, data_json=data_json, **hp))
    method = METHODS[args.method]
    if method.plot is not None:
        method.plot(load_bundle(main_dir).artifact(args.method), a / "plots" / f"{args.method}.png")
    ablations = a / "ablations" / args.method
    shutil.rmtree(ablations, ignore_errors=True)  # no stale variants from older params
    ablations.mkdir(parents=True)  # a declared output, even with no variants
    for name, overrides in variants.items():
        out = ablations / name
        print(calibrate(args.method, *inputs, out, data_json=data_json, **{**hp, **overrides}))


if __name__ == "__main__":
    main()
