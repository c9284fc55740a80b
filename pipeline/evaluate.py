"""Stage evaluate: held-out ppl / KL / top-1 / resident KV bytes for every configured row."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.data import load_tokens
from veloxquant.io import recorded_path
from veloxquant.evaluate import evaluate_rows, is_calibrated, write_outputs
from veloxquant.model_import import load_model


def main() -> None:
    key, params = model_key_arg(__doc__)
    e = params["eval"]
    model, _ = load_model(artifacts(key) / "model")
    windows = load_tokens(artifacts(key) / "data" / "eval.safetensors")[: e["windows"]]
    rows = [dict(r) for r in e["rows"]]
    for r in rows:
        if is_calibrated(r):  # artifact_dir is relative to artifacts/<model>/; default the bundle
            where = artifacts(key) / (r.get("artifact_dir") or "bundle")
            r["artifact_dir"] = recorded_path(where)  # eval.csv names it without the checkout
    results = evaluate_rows(model, windows, rows, prefill=e["prefill"], chunk=e["chunk"])
    write_outputs(results, artifacts(key))


if __name__ == "__main__":
    main()
