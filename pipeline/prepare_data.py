"""Stage prepare_data: tokenized, disjoint calib/eval windows under artifacts/<model>/data."""

from pipeline._common import artifacts, model_key_arg
from veloxquant.data import prepare_data
from veloxquant.model_import import load_tokenizer


def main() -> None:
    key, params = model_key_arg(__doc__)
    d = params["data"]
    info = prepare_data(
        load_tokenizer(artifacts(key) / "model"),
        source=d["source"],
        out_dir=artifacts(key) / "data",
        seq_len=d["seq_len"],
        calib_windows=d["calib_windows"],
        eval_windows=d["eval_windows"],
        eval_fraction=d["eval_fraction"],
        seed=d["seed"],
    )
    print({k: v for k, v in info.items() if k != "source"})


if __name__ == "__main__":
    main()
