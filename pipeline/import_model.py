"""Stage import_model: write artifacts/<model>/model, a plain mlx-lm model dir."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.model_import import import_model


def main() -> None:
    key, params = model_key_arg(__doc__)
    cfg = params["models"][key]
    out = import_model(
        str(cfg["source"]), artifacts(key) / "model", dtype=cfg.get("dtype", "float32")
    )
    print(f"imported {cfg['source']} -> {out}")


if __name__ == "__main__":
    main()
