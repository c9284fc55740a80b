"""Stage bundle: merge the per-method bundles into artifacts/<model>/bundle, then verify it
against the model by loading it back through the runtime."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.bundle import inspect_bundle, merge_bundles, verify_bundle
from veloxquant.calibrate import CALIBRATED_METHODS


def main() -> None:
    key, params = model_key_arg(__doc__)
    a = artifacts(key)
    methods = [m for m in CALIBRATED_METHODS if m in params.get("method", {})]
    out = merge_bundles(a / "bundle", [a / "methods" / m for m in methods])
    verify_bundle(out, model_dir=a / "model", strict=True)
    print(inspect_bundle(out))


if __name__ == "__main__":
    main()
