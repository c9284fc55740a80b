"""Stage vecinfer: smooth scales + product-VQ codebooks from captured k_post / v.

Writes the main artifact to artifacts/<model>/methods/vecinfer and each configured variant
(1.5-bit, ablations) to artifacts/<model>/ablations/vecinfer_<name>.
"""

import shutil

from pipeline._common import artifacts, model_key_arg
from veloxquant.calibrate import calibrate


def main() -> None:
    key, params = model_key_arg(__doc__)
    a = artifacts(key)
    hp = dict(params["method"]["vecinfer"])
    variants = hp.pop("variants", None) or {}
    common = dict(data_json=a / "data" / "data.json")
    print(calibrate("vecinfer", a / "activations", a / "model", a / "methods" / "vecinfer", **common, **hp))
    shutil.rmtree(a / "ablations", ignore_errors=True)  # no stale variants from older params
    for name, overrides in variants.items():
        out = a / "ablations" / f"vecinfer_{name}"
        print(calibrate("vecinfer", a / "activations", a / "model", out, **common, **{**hp, **overrides}))


if __name__ == "__main__":
    main()
