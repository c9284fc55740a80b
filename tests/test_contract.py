"""The mlx-lm cache contract (DESIGN.md section 7), checked for every method in METHODS.

A method gets these checks by being in the table: each one is built on a tiny random llama
(calibrated from a capture of that model when the method is calibrated, and as its uncalibrated
variant), fed a chunked prefill plus decode steps, and checked for: absolute offset and stored
size, masks, no `bits` attribute, no inherited `to_quantized`, `merge` that refuses or works,
`nbytes` equal to the arrays it holds, and a save_prompt_cache / load_prompt_cache round trip
in a fresh process that continues greedy generation with identical tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from veloxquant import KVCacheConfig, make_cache
from veloxquant.methods import CALIBRATED, METHODS

PREFILL = (30, 12)  # two chunks, as generation with prefill_step_size feeds them
DECODE = 6  # greedy steps before saving, and again after loading
VOCAB = 96
# Hyperparameters that keep each calibration on the tiny model fast; unlisted methods use
# their defaults.
SMALL = {
    "vecinfer": {"iters": 2},
    "ratequant": {"group_size": 32, "window": 8, "fisher_chunk": 16},
    "commvq": {"hard_iters": 2},
}


def knobs(name: str) -> dict:
    """Small knobs that make every method compress within the test's 48 tokens."""
    fields = METHODS[name].fields
    out = {}
    if "budget" in fields:
        out["budget"] = 24
    if "window" in fields:
        out["window"] = 8
    if "sinks" in fields:
        out["sinks"] = 2
    if "bits" in fields:
        out["bits"] = 4
    if "group_size" in fields:
        out["group_size"] = 32
    return out


def configs() -> list[tuple[str, dict]]:
    out = []
    for name, method in METHODS.items():
        out.append((name, {"method": name, **knobs(name)}))
        if method.calibrated:
            out.append(
                (f"{name}-uncalibrated", {"method": name, "uncalibrated": True, **knobs(name)})
            )
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny random llama saved as an mlx-lm model dir, a capture of it, and one bundle with
    every calibrated method."""
    from veloxquant.calibrate import calibrate
    from veloxquant.capture import capture_activations
    from veloxquant.data import tokens_sha256
    from veloxquant.io import save_safetensors_atomic, write_json_atomic

    root = tmp_path_factory.mktemp("contract")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "rope_theta": 1e4,
        "rope_traditional": True,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    model_dir = root / "model"
    model_dir.mkdir()
    mx.save_safetensors(
        str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (model_dir / "config.json").write_text(json.dumps(config))

    ids = np.random.default_rng(0).integers(0, VOCAB, (8, 64)).astype(np.int32)
    save_safetensors_atomic(root / "data" / "calib.safetensors", {"tokens": ids})
    write_json_atomic(
        root / "data" / "data.json",
        {
            "source": {"kind": "random", "seed": 0},
            "seq_len": 64,
            "calib": {
                "file": "calib.safetensors",
                "n_windows": 8,
                "n_tokens": int(ids.size),
                "sha256": tokens_sha256(ids),
            },
        },
    )
    capture_activations(model, ids, root / "activations", token_budget=ids.size, progress=False)
    for name in CALIBRATED:
        calibrate(
            name,
            root / "activations",
            model_dir,
            root / "bundle",
            progress=False,
            **SMALL.get(name, {}),
        )
    return {"model": model, "model_dir": model_dir, "bundle": root / "bundle", "root": root}


def build(tiny: dict, fields: dict) -> list:
    fields = dict(fields)
    method = METHODS[fields["method"]]
    if method.calibrated and not fields.get("uncalibrated"):
        fields["artifact_dir"] = str(tiny["bundle"])
    return make_cache(tiny["model"], KVCacheConfig(**fields))


def greedy(model, caches: list, first: int, steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens, and the first step's logits (a shifted RoPE position or a lost window
    token may not flip a greedy token of a random model, but it changes these)."""
    out, tok, first_logits = [], first, None
    for _ in range(steps):
        logits = model(mx.array([[tok]]), cache=caches)[0, -1]
        first_logits = logits.tolist() if first_logits is None else first_logits
        tok = int(mx.argmax(logits).item())
        out.append(tok)
    return out, first_logits


def arrays_held(obj) -> int:
    """Bytes of every mx.array reachable from the cache's attributes."""
    leaves = tree_flatten(vars(obj), is_leaf=lambda x: isinstance(x, mx.array))
    return sum(x.nbytes for _, x in leaves if isinstance(x, mx.array))


CONFIGS = configs()


@pytest.fixture(scope="module")
def saved(tiny) -> dict:
    """Every config prefilled and decoded, saved as a prompt cache; the continuation of each
    computed in this process; then a fresh process continues from the saved files."""
    model = tiny["model"]
    prompt = mx.array(np.random.default_rng(1).integers(0, VOCAB, (1, sum(PREFILL))))
    results = {}
    jobs = []
    for label, fields in CONFIGS:
        caches = build(tiny, fields)
        start = 0
        for n in PREFILL:
            logits = model(prompt[:, start : start + n], cache=caches)
            start += n
        first = int(mx.argmax(logits[0, -1]).item())
        decoded, _ = greedy(model, caches, first, DECODE)
        path = tiny["root"] / f"{label}.safetensors"
        mx.eval([c.state for c in caches])
        save_prompt_cache(str(path), caches)
        after, logits = greedy(model, caches, decoded[-1], DECODE)
        # the same file loaded here: a loaded cache's first update takes the transient path
        # (attention.route_proven), where these caches may have kept fusing
        loaded_after, loaded_logits = greedy(
            model, load_prompt_cache(str(path)), decoded[-1], DECODE
        )
        results[label] = {
            "caches": caches,
            "after": after,
            "logits": logits,
            "loaded": (loaded_after, loaded_logits),
            "fields": fields,
        }
        jobs.append({"label": label, "path": str(path), "first": decoded[-1]})
    code = (
        "import json, sys\n"
        "import veloxquant\n"
        "import mlx.core as mx\n"
        "from mlx_lm.models.cache import load_prompt_cache\n"
        "from mlx_lm.utils import load_model\n"
        "model, _ = load_model(__import__('pathlib').Path(sys.argv[1]))\n"
        "out = {}\n"
        "for job in json.loads(sys.argv[2]):\n"
        "    caches = load_prompt_cache(job['path'])\n"
        "    tok, toks, first = job['first'], [], None\n"
        f"    for _ in range({DECODE}):\n"
        "        logits = model(mx.array([[tok]]), cache=caches)[0, -1]\n"
        "        first = logits.tolist() if first is None else first\n"
        "        tok = int(mx.argmax(logits).item())\n"
        "        toks.append(tok)\n"
        "    out[job['label']] = {'tokens': toks, 'logits': first,\n"
        "                         'classes': [type(c).__name__ for c in caches]}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tiny["model_dir"]), json.dumps(jobs)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    for label in results:
        results[label]["fresh"] = fresh[label]
    return results


@pytest.mark.parametrize("label", [c[0] for c in CONFIGS])
def test_offset_size_and_mask(saved, label):
    total = sum(PREFILL) + 2 * DECODE
    ours = METHODS[saved[label]["fields"]["method"]].cache_classes
    for cache in saved[label]["caches"]:
        assert cache.offset == total, "offset must stay the absolute position (RoPE)"
        # mlx-lm's QuantizedKVCache leaves size() at the base class's 0
        stored = cache.size() if type(cache) in ours else cache.offset
        assert 0 < stored <= total
        mask = cache.make_mask(3, return_array=True, window_size=None)
        assert mask.shape[-2:] == (3, stored + 3), "the mask covers what is stored + the chunk"
        m = np.array(mask)
        if m.dtype == np.bool_:
            np.testing.assert_array_equal(m[..., stored:], np.tril(np.ones((3, 3), bool)))
        assert cache.make_mask(1, return_array=False, window_size=None) is None


@pytest.mark.parametrize("label", [c[0] for c in CONFIGS])
def test_our_caches_keep_the_contract(saved, label):
    method = METHODS[saved[label]["fields"]["method"]]
    for cache in saved[label]["caches"]:
        if type(cache) not in method.cache_classes:
            continue  # mlx-lm's own classes (fp16, quantized) follow mlx-lm's own contract
        # a `bits` attribute routes mlx-lm attention to quantized_matmul on our arrays
        assert not hasattr(cache, "bits")
        to_q = getattr(cache, "to_quantized", None)
        if to_q is not None:
            with pytest.raises(NotImplementedError):
                to_q()
        merge = getattr(type(cache), "merge", None)
        if merge is not None:
            try:
                batched = merge([cache, cache])
            except NotImplementedError as e:
                assert "batch" in str(e) or "merge" in str(e)
            else:
                assert batched is not None


@pytest.mark.parametrize("label", [c[0] for c in CONFIGS])
def test_nbytes_counts_exactly_the_arrays_held(saved, label):
    for cache in saved[label]["caches"]:
        assert cache.nbytes == arrays_held(cache) > 0


@pytest.mark.parametrize("label", [c[0] for c in CONFIGS])
def test_prompt_cache_round_trip_in_a_fresh_process(saved, label):
    got = saved[label]["fresh"]
    assert got["classes"] == [type(c).__name__ for c in saved[label]["caches"]]
    # a fresh process continues from the file exactly as this one does from it
    loaded_after, loaded_logits = saved[label]["loaded"]
    assert got["tokens"] == loaded_after == saved[label]["after"]
    np.testing.assert_array_equal(np.array(got["logits"]), np.array(loaded_logits))
    # and as the saved caches themselves did: the same bits where both took one path, within
    # float32 rounding where the saved ones kept fusing (the CPU kernel) and the loaded ones'
    # first step was transient
    fused = any(getattr(c, "last_attention", None) == "cpu-kernel" for c in saved[label]["caches"])
    np.testing.assert_allclose(
        np.array(loaded_logits), np.array(saved[label]["logits"]), atol=1e-5 if fused else 0, rtol=0
    )


def test_eviction_actually_happened(saved):
    """The knobs above must make the eviction methods evict, or the checks prove little."""
    total = sum(PREFILL) + 2 * DECODE
    evicting = [label for label, r in saved.items() if "budget" in r["fields"]]
    assert evicting
    for label in evicting:
        assert saved[label]["caches"][0].size() < total, label
