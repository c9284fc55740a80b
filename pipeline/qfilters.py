"""Stage qfilters: Q-Filter directions from captured q_post -> artifacts/<model>/methods/qfilters."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.calibrate import calibrate


def main() -> None:
    key, params = model_key_arg(__doc__)
    a = artifacts(key)
    print(calibrate("qfilters", a / "activations", a / "model", a / "methods" / "qfilters",
                    data_json=a / "data" / "data.json", **params["method"]["qfilters"]))


if __name__ == "__main__":
    main()
