"""Data preparation: disjoint document splits, deterministic token shards, clear errors."""

from __future__ import annotations

import hashlib
import json
import re

import veloxquant  # noqa: F401  (must precede mlx imports)
import numpy as np
import pytest

from veloxquant.data import (
    DataSourceError,
    data_fingerprint,
    load_text_dataset,
    load_tokens,
    prepare_data,
    split_calib_eval,
    tokenize_windows,
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    # The model's real tokenizer, without loading the weights.
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def test_default_source_splits_topics_disjointly():
    from pydoc_data.topics import topics

    ds = load_text_dataset({"kind": "pydoc_topics"})
    assert ds.column_names == ["topic", "text"]
    assert sorted(ds["topic"]) == sorted(topics) and len(ds) == len(topics)

    calib, held_out = split_calib_eval(ds, eval_fraction=0.1, seed=0)
    calib_topics, eval_topics = set(calib["topic"]), set(held_out["topic"])
    assert not calib_topics & eval_topics
    assert calib_topics | eval_topics == set(topics)
    eval_chars = sum(len(t) for t in held_out["text"])
    total_chars = sum(len(t) for t in topics.values())
    assert 0.1 <= eval_chars / total_chars < 0.3

    again_calib, again_eval = split_calib_eval(ds, eval_fraction=0.1, seed=0)
    assert again_eval["topic"] == held_out["topic"] and again_calib["topic"] == calib["topic"]
    _, other_eval = split_calib_eval(ds, eval_fraction=0.1, seed=1)
    assert set(other_eval["topic"]) != eval_topics


def test_prepare_data_is_deterministic_and_fingerprinted(tokenizer, tmp_path):
    args = dict(
        source=None, seq_len=1024, calib_windows=8, eval_windows=None, eval_fraction=0.1, seed=0
    )
    info = prepare_data(tokenizer, out_dir=tmp_path / "a", **args)
    prepare_data(tokenizer, out_dir=tmp_path / "b", **args)
    for name in ("calib.safetensors", "eval.safetensors", "data.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    assert json.loads((tmp_path / "a" / "data.json").read_text()) == info
    calib = load_tokens(tmp_path / "a" / "calib.safetensors")
    held_out = load_tokens(tmp_path / "a" / "eval.safetensors")
    assert calib.dtype == np.int32 and calib.shape == (8, 1024)
    # The default eval split must hold several 1024-token windows for the eval stage.
    assert held_out.shape[0] >= 4 and held_out.shape[1] == 1024
    for split, tokens in (("calib", calib), ("eval", held_out)):
        digest = hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()
        assert info[split]["sha256"] == digest
        assert info[split]["n_tokens"] == tokens.size
        fp = data_fingerprint(tmp_path / "a" / "data.json", split)
        assert fp == {
            "source": info["source"],
            "split": split,
            "seq_len": 1024,
            "n_tokens": tokens.size,
            "sha256": digest,
        }

    # Each split's windows decode to exactly its own topics' text, in the seeded order.
    calib_ds, eval_ds = split_calib_eval(load_text_dataset(None), eval_fraction=0.1, seed=0)
    assert info["split"]["eval_topics"] == eval_ds["topic"]
    for tokens, part in ((calib, calib_ds), (held_out, eval_ds)):
        stream = "".join(t + "\n\n" for t in part["text"])
        decoded = tokenizer.decode(tokens.ravel().tolist())
        assert len(decoded) > 4000 and stream.startswith(decoded)


def test_too_little_text_names_both_counts(tokenizer, tmp_path):
    text = "A short paragraph.\n\nAnother one, also short."
    (tmp_path / "small.txt").write_text(text)
    ds = load_text_dataset(
        {"kind": "local", "format": "text", "files": [str(tmp_path / "small.txt")]}
    )
    sep = len(tokenizer.encode("\n\n", add_special_tokens=False).ids)
    found = sum(len(tokenizer.encode(t).ids) + sep for t in ds["text"])
    with pytest.raises(DataSourceError) as err:
        tokenize_windows(tokenizer, ds, seq_len=64, max_windows=10)
    msg = str(err.value)
    assert re.search(rf"found {found} tokens\b", msg), msg
    assert "640 tokens" in msg, msg
    with pytest.raises(DataSourceError, match=rf"found {found} tokens.*one window of 64"):
        tokenize_windows(tokenizer, ds, seq_len=64, max_windows=None)


def test_local_text_and_json_sources(tokenizer, tmp_path):
    paragraphs = [f"Paragraph number {i} talks about topic {i * 7}." for i in range(40)]
    (tmp_path / "doc.txt").write_text("\n\n".join(paragraphs) + "\n")
    ds = load_text_dataset(
        {"kind": "local", "format": "text", "files": [str(tmp_path / "doc.txt")]}
    )
    assert [t.strip() for t in ds["text"]] == paragraphs

    rows = [{"body": p, "id": i} for i, p in enumerate(paragraphs)]
    (tmp_path / "doc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {
        "kind": "local",
        "format": "json",
        "files": [str(tmp_path / "doc.jsonl")],
        "text_field": "body",
    }
    ds = load_text_dataset(source)
    assert ds.column_names == ["text"] and ds["text"] == paragraphs

    info = prepare_data(
        tokenizer,
        source,
        tmp_path / "out",
        seq_len=16,
        calib_windows=4,
        eval_windows=2,
        eval_fraction=0.25,
        seed=3,
    )
    assert info["split"]["calib_documents"] + info["split"]["eval_documents"] == 40
    held_out = load_tokens(tmp_path / "out" / "eval.safetensors")
    assert held_out.shape == (2, 16)
    assert tokenizer.decode(held_out[0].tolist()).split("\n\n")[0] in paragraphs


def test_unreadable_dataset_gives_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{broken\n')
    expected = r"(?s)Could not load local json files.*bad\.jsonl.*JSON parse error.*Fix:"
    with pytest.raises(DataSourceError, match=expected):
        load_text_dataset({"kind": "local", "format": "json", "files": [str(bad)]})

    missing = tmp_path / "missing.parquet"
    with pytest.raises(DataSourceError, match=r"file\(s\) not found.*missing\.parquet"):
        load_text_dataset({"kind": "local", "format": "parquet", "files": [str(missing)]})

    good = tmp_path / "good.jsonl"
    good.write_text('{"body": "x"}\n')
    with pytest.raises(DataSourceError, match=r"no column 'text'.*\['body'\].*text_field"):
        load_text_dataset({"kind": "local", "format": "json", "files": [str(good)]})

    with pytest.raises(DataSourceError, match="Unknown data source kind 'ftp'"):
        load_text_dataset({"kind": "ftp"})
