"""Stage bundle: merge the per-method bundles into artifacts/<model>/bundle, then verify it
against the model by loading it back through the runtime's checks."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.bundle import merge_bundles, verify_bundle
from veloxquant.cli import render_bundle
from veloxquant.methods import CALIBRATED


def main() -> None:
    key, params = model_key_arg(__doc__)
    a = artifacts(key)
    methods = [m for m in CALIBRATED if m in params.get("method", {})]
    out = merge_bundles(a / "bundle", [a / "methods" / m for m in methods])
    print(render_bundle(verify_bundle(out, model_dir=a / "model", strict=True)))


if __name__ == "__main__":
    main()
