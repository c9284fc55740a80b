"""Stage capture: per-layer q_post/k_pre/k_post/v samples + exact stats from the calib split."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.capture import capture_activations
from veloxquant.data import data_fingerprint, load_tokens
from veloxquant.model_import import load_model


def main() -> None:
    key, params = model_key_arg(__doc__)
    c = params["capture"]
    model, _ = load_model(artifacts(key) / "model")
    data = artifacts(key) / "data"
    summary = capture_activations(
        model,
        load_tokens(data / "calib.safetensors"),
        artifacts(key) / "activations",
        token_budget=c["token_budget"],
        seed=c["seed"],
        data_sha256=data_fingerprint(data / "data.json", "calib")["sha256"],
    )
    print(summary)


if __name__ == "__main__":
    main()
