"""Calibration / evaluation text: load, split by document, tokenize into fixed windows.

DESIGN.md sections 3 and 5. Built on the `datasets` library, imported inside the functions so
the runtime package (caches, bundle loading) never needs it.

Sources (`source` dicts, as written in the Hydra data config):
- `{"kind": "pydoc_topics"}` (default): CPython's `pydoc_data.topics`, one row per topic
  (~79 topics, ~113k SmolLM2 tokens of English technical prose). Ships with Python, so it works
  offline everywhere. Its text depends on the Python version, which `data.json` records.
- `{"kind": "hub", "path": ..., "name": None, "split": "train", "revision": None,
  "text_field": "text"}`: `datasets.load_dataset(path, name, split=..., revision=...)`.
- `{"kind": "local", "format": "text"|"json"|"parquet"|"csv", "files": [...],
  "text_field": "text", "sample_by": "paragraph"}`: `datasets.load_dataset(format,
  data_files=files)`. For plain text files `sample_by` picks what one document is
  ("line", "paragraph" or "document" = one file); paragraphs by default, so one file can still
  be split into disjoint calib and eval documents.

Splits are disjoint by document: documents are shuffled with the seed and the eval split takes
whole documents until it holds `eval_fraction` of the characters. Each split's documents are
tokenized one by one, joined with the tokens of "\\n\\n" (neutral prose: an instruct model's
EOS token would put a chat-turn end into plain text) and cut into non-overlapping windows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from veloxquant.io import save_safetensors_atomic, sha256_bytes, write_json_atomic

SOURCE_KINDS = ("pydoc_topics", "hub", "local")
LOCAL_FORMATS = ("text", "json", "parquet", "csv")
DOC_SEPARATOR = "\n\n"
SPLITS = ("calib", "eval")


class DataSourceError(RuntimeError):
    """A dataset source could not be read, or holds too little text for what was asked."""


# --------------------------------------------------------------------------- loading


def normalize_source(source: dict | None) -> dict:
    """Fill in a source dict's defaults and check it; the result is what data.json records."""
    source = dict(source or {"kind": "pydoc_topics"})
    kind = source.get("kind", "pydoc_topics")
    if kind not in SOURCE_KINDS:
        raise DataSourceError(
            f"Unknown data source kind {kind!r}. Use one of {list(SOURCE_KINDS)}, e.g. "
            '{"kind": "local", "format": "text", "files": ["my.txt"]}.'
        )
    if kind == "pydoc_topics":
        return {"kind": kind}
    if kind == "hub":
        if not source.get("path"):
            raise DataSourceError(
                'A "hub" data source needs "path" (a datasets hub name, e.g. "wikitext").'
            )
        return {
            "kind": kind,
            "path": str(source["path"]),
            "name": source.get("name"),
            "split": source.get("split") or "train",
            "revision": source.get("revision"),
            "text_field": source.get("text_field") or "text",
        }
    fmt = source.get("format")
    if fmt not in LOCAL_FORMATS:
        raise DataSourceError(
            f'A "local" data source needs "format" in {list(LOCAL_FORMATS)}; got {fmt!r}.'
        )
    files = source.get("files")
    if isinstance(files, (str, Path)):
        files = [files]
    if not files:
        raise DataSourceError('A "local" data source needs "files": a list of file paths.')
    out = {
        "kind": kind,
        "format": fmt,
        "files": [str(f) for f in files],
        "text_field": source.get("text_field") or "text",
    }
    if fmt == "text":
        out["sample_by"] = source.get("sample_by") or "paragraph"
        if out["sample_by"] not in ("line", "paragraph", "document"):
            raise DataSourceError(
                f'"sample_by" must be "line", "paragraph" or "document"; got {out["sample_by"]!r}.'
            )
    return out


def describe_source(source: dict) -> str:
    kind = source.get("kind")
    if kind == "hub":
        name = f" (config {source['name']!r})" if source.get("name") else ""
        return f"hub dataset {source['path']!r}{name}, split {source['split']!r}"
    if kind == "local":
        return f"local {source['format']} files {source['files']}"
    return "CPython pydoc_data.topics"


def load_text_dataset(source: dict | None = None) -> Any:
    """Load `source` as a `datasets.Dataset` with a `text` column (one row per document)."""
    import datasets

    source = normalize_source(source)
    kind = source["kind"]
    if kind == "pydoc_topics":
        from pydoc_data.topics import topics

        names = sorted(topics)
        return datasets.Dataset.from_dict({"topic": names, "text": [topics[n] for n in names]})

    if kind == "local":
        missing = [
            f for f in source["files"] if not any(c in f for c in "*?[") and not Path(f).is_file()
        ]
        if missing:
            raise DataSourceError(
                f"Could not load {describe_source(source)}: file(s) not found: {missing}. "
                "Fix the paths in the data config (relative paths resolve from the working dir)."
            )
        kwargs: dict[str, Any] = {"data_files": source["files"], "split": "train"}
        if source["format"] == "text":
            kwargs["sample_by"] = source["sample_by"]
        load_args: tuple = (source["format"],)
        fix = (
            f"check that the files are valid {source['format']} "
            "and that `format` in the data config matches them"
        )
    else:
        kwargs = {"split": source["split"], "revision": source["revision"]}
        load_args = (source["path"], source["name"])
        fix = (
            "check the dataset name, config and split; the hub needs network access (or a "
            "local `datasets` cache), otherwise use a local source: "
            '{"kind": "local", "format": "parquet", "files": [...]}'
        )
    try:
        ds = datasets.load_dataset(*load_args, **kwargs)
    except Exception as e:  # datasets raises many types; all mean "this source is unreadable"
        raise DataSourceError(
            f"Could not load {describe_source(source)}: {_error_chain(e)}\nFix: {fix}."
        ) from e

    field = source["text_field"]
    if field not in ds.column_names:
        raise DataSourceError(
            f"{describe_source(source)} has no column {field!r} (columns: {ds.column_names}). "
            'Set "text_field" in the data config to the column holding the text.'
        )
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds


def _error_chain(e: BaseException) -> str:
    # datasets wraps the real cause (e.g. a JSON parse error) in a generic
    # DatasetGenerationError; show the whole chain so the message names the actual problem.
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


# --------------------------------------------------------------------------- splitting


def split_calib_eval(ds: Any, eval_fraction: float, seed: int) -> tuple[Any, Any]:
    """Split `ds` into disjoint (calib, eval) datasets by whole documents.

    Documents are shuffled with `seed`; eval takes them in that order until it holds at least
    `eval_fraction` of all characters (counting characters rather than documents keeps the eval
    size predictable when document lengths vary 200x, as pydoc topics do). Both splits keep at
    least one document.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1); got {eval_fraction}.")
    n = len(ds)
    if n < 2:
        raise DataSourceError(
            f"Need at least 2 documents to split calib/eval by document; the dataset has {n}. "
            'For one big text file use {"format": "text", "sample_by": "paragraph"}.'
        )
    lengths = np.array([len(t or "") for t in ds["text"]], dtype=np.int64)
    order = np.random.default_rng(seed).permutation(n)
    target = eval_fraction * lengths.sum()
    cumulative = np.cumsum(lengths[order])
    n_eval = int(np.searchsorted(cumulative, target, side="left")) + 1
    n_eval = min(max(n_eval, 1), n - 1)
    eval_idx = order[:n_eval].tolist()
    calib_idx = order[n_eval:].tolist()
    return ds.select(calib_idx), ds.select(eval_idx)


# --------------------------------------------------------------------------- tokenizing


def _encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    # Works for mlx-lm's TokenizerWrapper / HF tokenizers (-> list) and `tokenizers.Tokenizer`
    # (-> Encoding).
    out = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def tokenize_windows(
    tokenizer: Any, ds: Any, seq_len: int, max_windows: int | None = None
) -> np.ndarray:
    """Tokenize `ds["text"]` documents, concatenate, cut into int32 windows [N, seq_len].

    Takes the first `max_windows` windows (all full windows when None) and stops tokenizing
    once it has enough. Raises `DataSourceError` when the text holds fewer tokens than asked.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2; got {seq_len}.")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None; got {max_windows}.")
    need = None if max_windows is None else max_windows * seq_len
    separator = _encode(tokenizer, DOC_SEPARATOR, add_special_tokens=False)
    pieces: list[list[int]] = []
    n_tokens = n_docs = 0
    for batch in ds.select_columns(["text"]).iter(batch_size=64):
        for text in batch["text"]:
            if not text:
                continue  # hub text datasets carry many empty rows
            ids = _encode(tokenizer, text) + separator
            pieces.append(ids)
            n_tokens += len(ids)
            n_docs += 1
        if need is not None and n_tokens >= need:
            break
    want = need if need is not None else seq_len
    if n_tokens < want:
        asked = (
            f"{max_windows} windows x {seq_len} tokens = {need} tokens"
            if need is not None
            else f"at least one window of {seq_len} tokens"
        )
        raise DataSourceError(
            f"Too little text: found {n_tokens} tokens in {n_docs} documents, asked for {asked}. "
            "Lower the window count or seq_len, raise eval_fraction, or use a larger dataset."
        )
    n_windows = max_windows if max_windows is not None else n_tokens // seq_len
    flat = np.fromiter((t for ids in pieces for t in ids), dtype=np.int64, count=n_tokens)
    if flat.min() < 0 or flat.max() >= 2**31:
        raise ValueError("token ids do not fit int32")
    return flat[: n_windows * seq_len].astype(np.int32).reshape(n_windows, seq_len)


def tokens_sha256(tokens: np.ndarray) -> str:
    """sha256 of the token ids as little-endian int32 bytes, row-major."""
    return sha256_bytes(np.ascontiguousarray(tokens, dtype="<i4").tobytes())


# --------------------------------------------------------------------------- the stage


def prepare_data(
    tokenizer: Any,
    source: dict | None,
    out_dir: str | Path,
    seq_len: int,
    calib_windows: int | None,
    eval_windows: int | None,
    eval_fraction: float,
    seed: int,
) -> dict:
    """Write `calib.safetensors`, `eval.safetensors` (int32 `tokens` [N, seq_len]) and
    `data.json` (source, split, token counts, sha256 of each split's token ids) to `out_dir`.

    `calib_windows` / `eval_windows` of None take every full window of the split.
    Returns the data.json dict. data.json is written last, so its presence means complete.
    """
    out_dir = Path(out_dir)
    source = normalize_source(source)
    ds = load_text_dataset(source)
    calib_ds, eval_ds = split_calib_eval(ds, eval_fraction, seed)

    recorded_source = dict(source)
    if source["kind"] == "pydoc_topics":
        # pydoc topics change between Python releases: the token hash is only comparable
        # within one version.
        recorded_source["python_version"] = ".".join(map(str, sys.version_info[:3]))
    split: dict[str, Any] = {
        "by": "document",
        "eval_fraction": eval_fraction,
        "seed": seed,
        "calib_documents": len(calib_ds),
        "eval_documents": len(eval_ds),
    }
    if "topic" in eval_ds.column_names:
        split["eval_topics"] = list(eval_ds["topic"])

    info: dict[str, Any] = {
        "source": recorded_source,
        "split": split,
        "seq_len": seq_len,
        "separator": DOC_SEPARATOR,
    }
    parts = (("calib", calib_ds, calib_windows), ("eval", eval_ds, eval_windows))
    for name, part, n_windows in parts:
        try:
            tokens = tokenize_windows(tokenizer, part, seq_len, n_windows)
        except DataSourceError as e:
            raise DataSourceError(f"{name} split of {describe_source(source)}: {e}") from e
        file = f"{name}.safetensors"
        save_safetensors_atomic(out_dir / file, {"tokens": tokens})
        info[name] = {
            "file": file,
            "n_windows": int(tokens.shape[0]),
            "n_tokens": int(tokens.size),
            "sha256": tokens_sha256(tokens),
        }
    write_json_atomic(out_dir / "data.json", info)
    return info


def load_tokens(path: str | Path) -> np.ndarray:
    """Read a token shard written by `prepare_data` as int32 [N, seq_len]."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Token file {path} not found. Run `dvc repro prepare_data` "
            "(or `veloxquant.data.prepare_data`) first."
        )
    tensors = load_file(str(path))
    tokens = tensors.get("tokens")
    if tokens is None or tokens.dtype != np.int32 or tokens.ndim != 2:
        raise ValueError(
            f"{path} is not a token shard (expected int32 'tokens' [N, seq_len]; "
            f"got {[(k, v.dtype, v.shape) for k, v in tensors.items()]}). Re-run prepare_data."
        )
    return tokens


def data_fingerprint(data_json_path: str | Path, split: str) -> dict:
    """{source, split, seq_len, n_tokens, sha256} of one split, for the bundle manifest."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}.")
    path = Path(data_json_path)
    if path.is_dir():
        path = path / "data.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found. Run `dvc repro prepare_data` first.")
    info = json.loads(path.read_text())
    part = info.get(split) if isinstance(info, dict) else None
    if (
        not isinstance(part, dict)
        or any(k not in info for k in ("source", "seq_len"))
        or any(k not in part for k in ("n_tokens", "sha256"))
    ):
        raise ValueError(
            f"{path} is not a data.json written by prepare-data: it needs 'source', 'seq_len' "
            f"and '{split}' with 'n_tokens' and 'sha256'. Re-run `dvc repro prepare_data`."
        )
    return {
        "source": info["source"],
        "split": split,
        "seq_len": info["seq_len"],
        "n_tokens": part["n_tokens"],
        "sha256": part["sha256"],
    }
