"""Stage import_model: write artifacts/<model>/model, a plain mlx-lm model dir.

A model entry with `stress: {key_scale: .., value_scale: .., seed: ..}` is the imported model
with constant k/v-projection biases added (veloxquant/stress.py): the same weights in the key
statistics of families with large key means.
"""

import shutil

from pipeline._common import artifacts, model_key_arg
from veloxquant.model_import import import_model
from veloxquant.stress import write_kv_bias_model

STRESS_KEYS = ("key_scale", "value_scale", "seed")


def main() -> None:
    key, params = model_key_arg(__doc__)
    cfg = params["models"][key]
    out = artifacts(key) / "model"
    stress = cfg.get("stress")
    plain = out.with_name("model.plain") if stress else out
    import_model(str(cfg["source"]), plain, dtype=cfg.get("dtype", "float32"))
    if stress:
        unknown = set(stress) - set(STRESS_KEYS)
        if unknown:
            raise SystemExit(
                f"models.{key}.stress: unknown keys {sorted(unknown)}; expected some of "
                f"{list(STRESS_KEYS)} (veloxquant.stress.write_kv_bias_model)"
            )
        write_kv_bias_model(plain, out, **stress)
        shutil.rmtree(plain)
    print(f"imported {cfg['source']} -> {out}" + (f" with {stress}" if stress else ""))


if __name__ == "__main__":
    main()
