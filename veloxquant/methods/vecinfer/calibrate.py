"""VecInfer calibration: smooth scales and per-(layer, KV head) product-VQ codebooks from a
capture dir (`k_post`, `v`, and the exact `k_post.absmax` over every captured token).

- smooth scales λ[l, h, c] = sqrt(max_t |k_post[t, h, c]|). Per layer, channel maxima above the
  `clip_percentile` percentile (over that layer's H_kv·D channel maxima; the default 99.9 clips
  only the most extreme channel or two) are clipped to it, and λ is floored at `floor` so that a
  dead channel cannot blow k ⊘ λ up.
- keys are coded in the transformed space k̃ = H·(k ⊘ λ) (veloxquant/methods/vecinfer/
  transform.py), values raw.
- product VQ: each D-vector is cut into D/d sub-vectors that share one codebook of 2^b centroids
  per (layer, KV head) (share="head") or per layer (share="layer"); `value_share` sets the
  values' sharing apart from the keys' (None: as `share`). A d4b8 value codebook (256 x 4 fp16,
  2 KB) weighs as much as 128 tokens' value codes of its head, so the default shares it per
  layer and keeps the small d2b6 key codebooks per head. Batched GEMM k-means
  (`veloxquant.kmeans`), k-means++ init, dead centroids reseeded, fixed seed.
- diagnostics on held-out captured tokens the k-means never saw: reconstruction MSE (also
  relative to E[x²]) and mean cosine of keys in the original space (after the inverse transform)
  and of values; dead centroids and code-usage entropy of the training assignment; per layer.

The uncalibrated reference (`gaussian_codebook`): codebooks from the same k-means on N(0, 1)
samples, λ = 1, Hadamard on: what upstream ships.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant.kmeans import assign, kmeans, product_kmeans
from veloxquant.kvstats import logit_error, mean_energy_share, output_error, rotate_at_positions
from veloxquant.methods.base import Artifact, CalibrationInputs, ModelDims, TensorSpec
from veloxquant.rope import RopeSpec
from veloxquant.methods.vecinfer.transform import (
    balanced_scales,
    check_hadamard_dim,
    inverse_smooth_transform,
    smooth_scales,
    smooth_transform,
)

DEFAULTS: dict[str, Any] = {
    "key_sub_dim": 2,
    "key_bits": 6,
    "value_sub_dim": 4,
    "value_bits": 8,
    "share": "head",
    # the values' codebook sharing, "head" or "layer" (None: as `share`)
    "value_share": "layer",
    # code keys relative to RoPE_m(pre-RoPE key mean) and values relative to their mean
    "center": True,
    # key scales before the rotation: "max" (VecInfer's sqrt max|k|), "balanced" (against the
    # queries that read each channel, transform.balanced_scales) or "none"
    "smooth": "max",
    # value scales + rotation: "none" (raw values, VecInfer) or "balanced" (against o_proj)
    "value_smooth": "balanced",
    "hadamard": True,
    "clip_percentile": 99.9,
    "floor": 1e-2,
    "iters": 16,
    "seed": 0,
    # training sub-vectors per codebook (a seeded subset): 128 per centroid at d4b8; bounds the
    # [vectors × centroids] distance work per Lloyd iteration on CPU (d8b12: 8 per centroid).
    "max_vectors": 32768,
    "heldout_fraction": 0.1,
}
# The hyperparameters that define the codebooks' shapes and the runtime transform; the
# uncalibrated variant takes them as KVCacheConfig.options.
SHAPE_KEYS = (
    "key_sub_dim",
    "key_bits",
    "value_sub_dim",
    "value_bits",
    "share",
    "value_share",
    "hadamard",
)
# Shape keys an artifact may lack: it predates them, and their default is what it was made with.
OPTIONAL_SHAPE_KEYS = ("value_share",)


def sharing(hp: dict[str, Any], side: str) -> str:
    """How `side`'s ("key" / "value") codebooks are shared: "head" or "layer"."""
    if side == "value" and hp.get("value_share") is not None:
        return hp["value_share"]
    return hp["share"]


def n_books(hp: dict[str, Any], side: str, n_kv_heads: int) -> int:
    """Codebooks per layer of `side`: one per KV head, or one for the layer."""
    return n_kv_heads if sharing(hp, side) == "head" else 1


def check_hyperparameters(hp: dict[str, Any]) -> None:
    for side in ("key", "value"):
        bits, sub = hp[f"{side}_bits"], hp[f"{side}_sub_dim"]
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 16:
            raise ValueError(f"vecinfer: {side}_bits must be an integer in [1, 16], got {bits!r}")
        if isinstance(sub, bool) or not isinstance(sub, (int, np.integer)) or sub < 1:
            raise ValueError(f"vecinfer: {side}_sub_dim must be an integer >= 1, got {sub!r}")
    if hp["smooth"] not in ("max", "balanced", "none"):
        raise ValueError(
            f"vecinfer: smooth must be 'max', 'balanced' or 'none', got {hp['smooth']!r}"
        )
    if hp["value_smooth"] not in ("balanced", "none"):
        raise ValueError(
            f"vecinfer: value_smooth must be 'balanced' or 'none', got {hp['value_smooth']!r}"
        )
    if hp["share"] not in ("head", "layer"):
        raise ValueError(f"vecinfer: share must be 'head' or 'layer', got {hp['share']!r}")
    if hp.get("value_share") not in (None, "head", "layer"):
        raise ValueError(
            f"vecinfer: value_share must be 'head', 'layer' or null (as share), got "
            f"{hp['value_share']!r}"
        )
    if not 0 < hp["clip_percentile"] <= 100:
        raise ValueError(
            f"vecinfer: clip_percentile must be in (0, 100], got {hp['clip_percentile']}"
        )
    if not hp["floor"] > 0:
        raise ValueError(f"vecinfer: floor must be > 0, got {hp['floor']}")
    if not 0 < hp["heldout_fraction"] < 1:
        raise ValueError(
            f"vecinfer: heldout_fraction must be in (0, 1), got {hp['heldout_fraction']}"
        )


def tensor_specs(dims: ModelDims, hp: dict[str, Any]) -> dict[str, TensorSpec]:
    return {
        # pre-RoPE key mean and value mean (zeros when center=False), fp16-representable
        "key_mean": TensorSpec((dims.L, dims.H_kv, dims.D), "float32"),
        "value_mean": TensorSpec((dims.L, dims.H_kv, dims.D), "float32"),
        "smooth": TensorSpec((dims.L, dims.H_kv, dims.D), "float32"),
        "value_smooth": TensorSpec((dims.L, dims.H_kv, dims.D), "float32"),
        "key_codebook": TensorSpec(
            (
                dims.L,
                n_books(hp, "key", dims.H_kv),
                2 ** int(hp["key_bits"]),
                int(hp["key_sub_dim"]),
            ),
            "float32",
        ),
        "value_codebook": TensorSpec(
            (
                dims.L,
                n_books(hp, "value", dims.H_kv),
                2 ** int(hp["value_bits"]),
                int(hp["value_sub_dim"]),
            ),
            "float32",
        ),
    }


def check_artifact(artifact: Artifact, dims: ModelDims) -> None:
    missing = [
        k for k in SHAPE_KEYS if k not in artifact.hyperparameters and k not in OPTIONAL_SHAPE_KEYS
    ]
    if missing:
        raise ValueError(f"vecinfer artifact lacks hyperparameters {missing}; recalibrate it")
    check_hyperparameters({**DEFAULTS, **artifact.hyperparameters})
    for name in ("smooth", "value_smooth"):
        if not bool(mx.all(artifact.tensors[name] > 0).item()):
            raise ValueError(f"vecinfer {name} scales must be > 0 (a scale of 0 divides by 0)")


# The held-out diagnostics (reconstruction error, cosine) are means over this many tokens at
# least; fewer would make them noise (the same floor as Q-Filters' held-out split).
MIN_HELDOUT_TOKENS = 16


def min_tokens(dims: ModelDims, hp: dict[str, Any]) -> int:
    """The fewest captured tokens whose training part gives every codebook at least as many
    sub-vectors as it has centroids, with at least MIN_HELDOUT_TOKENS held out
    (`heldout_fraction`) for the diagnostics."""
    need = 0
    for side in ("key", "value"):
        per_group = dims.H_kv // n_books(hp, side, dims.H_kv)
        n_sub = dims.D // int(hp[f"{side}_sub_dim"])
        need = max(need, math.ceil(2 ** int(hp[f"{side}_bits"]) / (n_sub * per_group)))
    n = need + 1
    while (
        n - _n_heldout(n, hp["heldout_fraction"]) < need
        or _n_heldout(n, hp["heldout_fraction"]) < MIN_HELDOUT_TOKENS
    ):
        n += 1
    return n


def _n_heldout(n_tokens: int, fraction: float) -> int:
    return max(1, int(round(n_tokens * fraction)))


def calibrate(
    inputs: CalibrationInputs, dims: ModelDims, hp: dict[str, Any], progress: bool
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    return calibrate_vecinfer(inputs.activations_dir, inputs.model_dir, progress=progress, **hp)


def _encode_decode(x: mx.array, codebook: mx.array, sub_dim: int) -> tuple[mx.array, mx.array]:
    """Product-quantize x [G, n, D] with codebook [G, K, d] → (reconstruction, codes [G, n·M])."""
    g, n, dim = x.shape
    sub = x.reshape(g, n * (dim // sub_dim), sub_dim)
    codes, _ = assign(sub, codebook)
    rec = mx.take_along_axis(codebook, codes[..., None].astype(mx.int32), axis=1)
    return rec.reshape(g, n, dim), codes


def calibrate_vecinfer(
    activations_dir: str | Path,
    model: Any,
    *,
    key_sub_dim: int = DEFAULTS["key_sub_dim"],
    key_bits: int = DEFAULTS["key_bits"],
    value_sub_dim: int = DEFAULTS["value_sub_dim"],
    value_bits: int = DEFAULTS["value_bits"],
    share: str = DEFAULTS["share"],
    value_share: str | None = DEFAULTS["value_share"],
    center: bool = DEFAULTS["center"],
    smooth: str = DEFAULTS["smooth"],
    value_smooth: str = DEFAULTS["value_smooth"],
    hadamard: bool = DEFAULTS["hadamard"],
    clip_percentile: float = DEFAULTS["clip_percentile"],
    floor: float = DEFAULTS["floor"],
    iters: int = DEFAULTS["iters"],
    seed: int = DEFAULTS["seed"],
    max_vectors: int | None = DEFAULTS["max_vectors"],
    heldout_fraction: float = DEFAULTS["heldout_fraction"],
    progress: bool = True,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Key/value means, smooth scales and per-(layer, KV head) product-VQ codebooks.

    `model` is the live model or its dir (for its dims and its RoPE). Returns (tensors for the
    bundle: key_mean, value_mean, smooth [L, H_kv, D], key_codebook [L, H_share, 2^kb, kd],
    value_codebook [L, H_share, 2^vb, vd], all f32; json diagnostics). Deterministic in
    (inputs, seed).
    """
    from tqdm.auto import tqdm

    from veloxquant.capture import load_activations, load_capture_info, load_stats

    hp = dict(
        DEFAULTS,
        key_sub_dim=key_sub_dim,
        key_bits=key_bits,
        value_sub_dim=value_sub_dim,
        value_bits=value_bits,
        share=share,
        value_share=value_share,
        center=center,
        smooth=smooth,
        value_smooth=value_smooth,
        hadamard=hadamard,
        clip_percentile=clip_percentile,
        floor=floor,
        iters=iters,
        seed=seed,
        max_vectors=max_vectors,
        heldout_fraction=heldout_fraction,
    )
    check_hyperparameters(hp)
    dims = ModelDims.of(model)
    n_layers, n_heads, head_dim = dims.L, dims.H_kv, dims.D
    for side in ("key", "value"):
        if head_dim % hp[f"{side}_sub_dim"]:
            raise ValueError(
                f"vecinfer: {side}_sub_dim {hp[f'{side}_sub_dim']} must divide head_dim {head_dim}"
            )
    if hadamard:
        check_hadamard_dim(head_dim)
    live = _live_model(model) if center or "balanced" in (smooth, value_smooth) else None
    rope = RopeSpec.of(live) if center else None

    info = load_capture_info(activations_dir)
    if info["num_layers"] != n_layers:
        raise ValueError(
            f"capture {activations_dir} has {info['num_layers']} layers but the model has "
            f"{n_layers}; capture this model's activations first"
        )
    stats = load_stats(activations_dir)
    if tuple(stats["k_post.absmax"].shape) != (n_layers, n_heads, head_dim):
        raise ValueError(
            f"k_post.absmax has shape {list(stats['k_post.absmax'].shape)}, expected "
            f"{[n_layers, n_heads, head_dim]} for this model"
        )
    # The means are exact over every captured token; rounded to the fp16 the cache keeps, so
    # that calibration codes exactly the residual the runtime will code.
    zeros = mx.zeros((n_layers, n_heads, head_dim), dtype=mx.float32)
    key_mean = _fp16_exact(stats["k_pre.mean"]) if center else zeros
    value_mean = _fp16_exact(stats["v.mean"]) if center else zeros

    n_tokens = int(info["n_sampled"])
    perm = np.random.default_rng(seed).permutation(n_tokens)
    n_held = _n_heldout(n_tokens, heldout_fraction)
    held_idx, train_idx = mx.array(np.sort(perm[:n_held])), mx.array(np.sort(perm[n_held:]))
    for side in ("key", "value"):
        per_group = n_heads // n_books(hp, side, n_heads)
        k_cent, n_sub = 2 ** hp[f"{side}_bits"], head_dim // hp[f"{side}_sub_dim"]
        have = len(train_idx) * n_sub * per_group
        if have < k_cent:
            need = min_tokens(dims, hp)
            raise ValueError(
                f"vecinfer: {side} codebook d{hp[f'{side}_sub_dim']}b{hp[f'{side}_bits']} has "
                f"{k_cent} centroids but only {have} training sub-vectors per codebook "
                f"({len(train_idx)} training tokens of {n_tokens} captured); need at least "
                f"{need} captured tokens. Raise the capture token_budget."
            )

    # Load every layer once: [L, n, H, D] per side (2·L·n·H·D·4 bytes, ~190 MB for the default
    # model at 8192 tokens), so the k-means below runs all L·H codebooks as one batch. Keys are
    # kept as residuals k_post − RoPE_m(μ) at each token's captured position m.
    keys, values, key_shift = [], [], []
    for layer in tqdm(range(n_layers), desc="vecinfer load", unit="layer", disable=not progress):
        acts = load_activations(activations_dir, layer, ["k_post", "v", "positions"])
        if tuple(acts["k_post"].shape[1:]) != (n_heads, head_dim):
            raise ValueError(
                f"captured k_post has per-token shape {list(acts['k_post'].shape[1:])}, "
                f"expected {[n_heads, head_dim]} for this model"
            )
        shift = (
            rotate_at_positions(key_mean[layer], rope, acts["positions"])
            if center
            else mx.zeros_like(acts["k_post"])
        )
        keys.append(acts["k_post"])
        key_shift.append(shift)
        values.append(acts["v"])
    keys, key_shift, values = mx.stack(keys), mx.stack(key_shift), mx.stack(values)
    key_res, value_res = keys - key_shift, values - value_mean[:, None]
    ones = mx.ones((n_layers, n_heads, head_dim), dtype=mx.float32)
    if smooth == "none":
        lam = ones
    elif smooth == "balanced":  # the residual's power against the queries' per channel
        query_power = stats["q_post.sq_mean"].reshape(n_layers, n_heads, dims.G, head_dim)
        lam = balanced_scales(mx.mean(key_res[:, train_idx] ** 2, axis=1), query_power.mean(2))
    elif center:  # the channel ranges of what is coded: the residual's, over the training tokens
        lam = smooth_scales(mx.abs(key_res[:, train_idx]).max(axis=1), clip_percentile, floor)
    else:
        lam = smooth_scales(stats["k_post.absmax"], clip_percentile, floor)
    value_hadamard = hadamard and value_smooth != "none"
    lam = _fp16_exact(lam)  # the cache keeps its scales in fp16, like the means
    if value_smooth == "balanced":
        power = mx.mean(value_res[:, train_idx] ** 2, axis=1)
        lam_v = balanced_scales(power, _output_column_power(live, dims))
    else:
        lam_v = ones
    lam_v = _fp16_exact(lam_v)
    lam_b, lam_vb = lam[:, None], lam_v[:, None]  # [L, 1, H, D] against [L, n, H, D]
    spaces = {
        "key": smooth_transform(key_res, lam_b, hadamard),
        "value": smooth_transform(value_res, lam_vb, value_hadamard),
    }

    def groups(x: mx.array, side: str) -> mx.array:  # [L, n, H, D] -> [L·H_share, n·H/H_share, D]
        n_l, n, h, d = x.shape
        if sharing(hp, side) == "head":
            return x.transpose(0, 2, 1, 3).reshape(n_l * h, n, d)
        return x.reshape(n_l, n * h, d)

    def ungroup(x: mx.array, side: str) -> mx.array:  # inverse of groups
        if sharing(hp, side) == "head":
            return x.reshape(n_layers, n_heads, -1, head_dim).transpose(0, 2, 1, 3)
        return x.reshape(n_layers, -1, n_heads, head_dim)

    books: dict[str, mx.array] = {}
    recon: dict[str, mx.array] = {}
    diag: dict[str, list] = {}
    for side in ("key", "value"):
        sub_dim, bits = hp[f"{side}_sub_dim"], hp[f"{side}_bits"]
        x = spaces[side]
        res = product_kmeans(
            groups(x[:, train_idx], side),
            sub_dim,
            2**bits,
            max_vectors=max_vectors,
            iters=iters,
            seed=seed + (side == "value"),
            progress=progress,
            desc=f"vecinfer {side}s d{sub_dim}b{bits}",
        )
        books[side] = res.centroids.reshape(n_layers, -1, 2**bits, sub_dim)
        diag[f"{side}_dead"] = res.dead.reshape(n_layers, -1).sum(axis=1).tolist()
        diag[f"{side}_entropy_bits"] = (
            res.usage_entropy_bits().reshape(n_layers, -1).mean(axis=1).tolist()
        )
        # Held-out reconstruction (tokens k-means never saw), in the original space.
        rec, _ = _encode_decode(groups(x[:, held_idx], side), res.centroids, sub_dim)
        rec = ungroup(rec, side)
        if side == "key":
            rec = inverse_smooth_transform(rec, lam_b, hadamard) + key_shift[:, held_idx]
            orig = keys[:, held_idx]
        else:
            rec = inverse_smooth_transform(rec, lam_vb, value_hadamard) + value_mean[:, None]
            orig = values[:, held_idx]
        recon[side] = rec
        mse = mx.mean((rec - orig) ** 2, axis=(1, 2, 3))
        power = mx.mean(orig * orig, axis=(1, 2, 3))
        cos = (rec * orig).sum(-1) / mx.maximum(
            mx.sqrt((rec * rec).sum(-1) * (orig * orig).sum(-1)), 1e-12
        )
        diag[f"{side}_mse"] = mse.tolist()
        diag[f"{side}_rel_mse"] = (mse / mx.maximum(power, 1e-30)).tolist()
        diag[f"{side}_cos"] = cos.mean(axis=(1, 2)).tolist()

    # What attention does with the errors (veloxquant.kvstats), on held-out queries and keys.
    diag["key_logit_rel_err"], diag["value_output_rel_err"] = [], []
    for layer in range(n_layers):
        q = load_activations(activations_dir, layer, ["q_post"])["q_post"][held_idx]
        k, v = keys[layer, held_idx], values[layer, held_idx]
        diag["key_logit_rel_err"].append(logit_error(q, k, recon["key"][layer]))
        diag["value_output_rel_err"].append(output_error(q, k, v, recon["value"][layer]))

    tensors = {
        "key_mean": key_mean,
        "value_mean": value_mean,
        "smooth": lam,
        "value_smooth": lam_v,
        "key_codebook": books["key"],
        "value_codebook": books["value"],
    }
    mx.eval(tensors)
    share_k = mean_energy_share(stats["k_pre.mean"], stats["k_pre.sq_mean"]).mean(axis=1)
    diagnostics: dict[str, Any] = {
        "per_layer": {**diag, "key_mean_energy_share": share_k.tolist()},
        "n_train_tokens": int(len(train_idx)),
        "n_heldout_tokens": int(len(held_idx)),
        "tokens_seen": int(info["tokens_seen"]),
        "smooth_min": float(lam.min().item()),
        "smooth_max": float(lam.max().item()),
    }
    for name, values_ in diag.items():
        diagnostics[f"mean_{name}"] = float(np.mean(values_))
    for name in ("key_rel_mse", "value_rel_mse", "key_logit_rel_err", "value_output_rel_err"):
        diagnostics[f"worst_{name}"] = float(np.max(diag[name]))
        diagnostics[f"worst_{name}_layer"] = int(np.argmax(diag[name]))
    return tensors, diagnostics


def _fp16_exact(x: mx.array) -> mx.array:
    return x.astype(mx.float16).astype(mx.float32)


def _live_model(model: Any) -> Any:
    """A live model, or the model in a dir (built lazily: weights are read only when used)."""
    if isinstance(model, (str, Path)):
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(model), lazy=True)
    return model


def _output_column_power(model: Any, dims: ModelDims) -> mx.array:
    """[L, H_kv, D]: Σ over the KV head's query heads and over o_proj's rows of W_o², the cost
    per value channel of an error in the attention output it feeds."""
    out = []
    for layer in model.layers:
        proj = layer.self_attn.o_proj
        w = proj.weight
        if hasattr(proj, "scales"):  # a quantized model: its real weights are the dequantized ones
            w = mx.dequantize(w, proj.scales, proj.biases, proj.group_size, proj.bits)
        col = (w.astype(mx.float32) ** 2).sum(axis=0)  # [H_q · D]
        out.append(col.reshape(dims.H_kv, dims.G, dims.D).sum(axis=1))
    return mx.stack(out)


@functools.lru_cache(maxsize=8)
def gaussian_codebook(sub_dim: int, bits: int, seed: int = 0, iters: int = 10) -> mx.array:
    """[2^bits, sub_dim] codebook from the same k-means on N(0, 1) samples (32 per centroid,
    capped at 2^16, i.e. 16 per centroid for d8b12): the uncalibrated reference. Memoised: one
    per process and shape (d8b12 takes ~30 s on a 2-core CPU, d4b8 ~1 s)."""
    k = 2**bits
    n = min(32 * k, 1 << 16)
    x = mx.random.normal((1, n, sub_dim), key=mx.random.key(seed))
    return kmeans(x, k, iters=iters, seed=seed, progress=False, desc="gaussian codebook").centroids[
        0
    ]
