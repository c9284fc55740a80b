"""VecInfer: smoothed + Hadamard-rotated product-VQ KV cache, codebooks calibrated on real keys.

Paper: "VecInfer: Efficient LLM Inference with Low-Bit KV Cache via Outlier-Suppressed Vector
Quantization", arXiv 2510.06175 (no public code). DESIGN.md section 8.

Calibration (`calibrate_vecinfer`, from a capture dir: `k_post`, `v`, exact `k_post.absmax`):
- smooth scales λ[l, h, c] = sqrt(max_t |k_post[t, h, c]|) from the exact absmax over every
  captured token. Per layer, channel maxima above the `clip_percentile` percentile (over that
  layer's H_kv·D channel maxima; default 99.9, i.e. only the most extreme channel or two) are
  clipped to it, and λ is floored at `floor` (default 1e-2, i.e. channels with max|k| < 1e-4)
  so a dead channel cannot blow k ⊘ λ up.
- key transform k̃ = H·(k ⊘ λ), H the orthonormal Walsh-Hadamard transform
  (`mx.hadamard_transform`, default scale 1/sqrt(D)); H is symmetric and orthogonal, so
  k = H·k̃ ⊙ λ, and the matching query transform q̃ = H·(q ⊙ λ) keeps ⟨q̃, k̃⟩ = ⟨q, k⟩.
  head_dim must be a power of two (clear error otherwise; use hadamard=False).
- product VQ: each D-vector is cut into D/d sub-vectors that share one codebook of 2^b
  centroids per (layer, KV head) (share="head", default) or per layer (share="layer"); keys are
  trained on k̃, values on raw v; batched GEMM k-means (`veloxquant.kmeans`), k-means++ init,
  dead centroids reseeded, fixed seed. Configs d{d}b{b}: d4b8 = 2 bits/elem (default, K and V),
  d8b12 = 1.5 bits/elem.
- diagnostics on held-out captured tokens the k-means never saw: reconstruction MSE (also
  relative to E[x²]) and mean cosine of keys in the original space (after the inverse transform)
  and of values; dead centroids and code-usage entropy of the training assignment; per layer.

Runtime (`VecInferCache`, method "vecinfer"):
- resident: packed codes (d4b8: one uint8 per 4 elements; 12-bit codes two per 3 bytes; see
  `code_bytes`), an fp16 window of the most recent `window` tokens (default 48), the first
  `sinks` tokens in fp16 (default 4: the attention-sink token's key is small and atypical, and
  coding it more than doubles the KL; see Measured), the layer's codebooks in fp16 and λ in
  f32. `nbytes` counts exactly these.
- `update_and_fetch`: the tokens of the call join the fp16 window; what falls out of it is
  encoded (smooth + Hadamard, argmin by GEMM distances) and appended to the codes. Attention gets
  keys/values dequantized transiently (codes → codewords → inverse transform), then the window
  and the call's own tokens in full precision, like any prefill; the dequantized copy is dropped
  after the call. (The fused LUT path that never materializes keys is the kernels issue.)
- at 1024 tokens with d4b8, window 48, 4 sinks: 1.90 (codes) + 0.75 (window) + 0.06 (sinks)
  + 0.25 (fp16 codebooks) + 0.016 (λ) ≈ 2.98 resident bits per element. d8b12's per-head
  codebooks (4096 × 8 fp16 per head, K and V) cost ~8 bits/elem at 1024 tokens and only amortise
  over long contexts (0.25 bits/elem at 32K); they are counted honestly.

Uncalibrated reference (`KVCacheConfig(method="vecinfer", uncalibrated=True)`, no bundle):
codebooks trained by the same k-means on N(0, 1) samples, tiled to the calibrated shapes, λ = 1,
Hadamard on: what upstream ships.

Measured (SmolLM2-135M, pydoc held-out windows of 1024 tokens, prefill 512, chunk 64; 8192
captured tokens): d4b8 calibrated, first 4 eval windows ppl x1.088, KL 0.087, top-1 0.855 at
2.76 bits; 8 further windows x1.162, KL 0.129; mlx-lm 4-bit there x1.168 / x1.201, KL 0.140 /
0.156 at 5 bits; uncalibrated x104, KL 4.5. Keys carry nearly all the loss (one window: keys alone
KL 0.124, values alone 0.015); without sinks KL 0.199; window 48 (2.98 bits) KL 0.082 / 0.113.

Knobs: KVCacheConfig.window (fp16 recent tokens, default 48), KVCacheConfig.sinks (default 4);
options (uncalibrated only, or checked against the artifact): key_sub_dim, key_bits, value_sub_dim, value_bits, share, hadamard.
Ablations (no smoothing, no Hadamard, per-layer codebooks, d8b12) are separate calibrated bundles
of the same method "vecinfer" whose hyperparameters say what they are: point artifact_dir at them.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from veloxquant.config import model_dims
from veloxquant.kmeans import assign, check_finite, kmeans, nearest, product_kmeans

CALIBRATED = True
METHOD = "vecinfer"
CAPTURE_POINT = "k_post,v"
# 48 fp16 recent tokens spend the 3-bit budget at 1024 tokens (2.98 bits/elem) where it buys
# the most: keys carry the loss, and the newest keys get the most attention.
DEFAULT_WINDOW = 48
DEFAULT_SINKS = 4

DEFAULTS: dict[str, Any] = {
    "key_sub_dim": 4,
    "key_bits": 8,
    "value_sub_dim": 4,
    "value_bits": 8,
    "share": "head",
    "smooth": True,
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
# Options a user may pass in KVCacheConfig.options (the shape-defining hyperparameters).
OPTION_KEYS = ("key_sub_dim", "key_bits", "value_sub_dim", "value_bits", "share", "hadamard")


def resolve_hyperparameters(**overrides: Any) -> dict[str, Any]:
    """DEFAULTS with `overrides` applied and checked; unknown names are an error."""
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"vecinfer: unknown hyperparameters {unknown}; known: {sorted(DEFAULTS)}")
    hp = {**DEFAULTS, **overrides}
    for side in ("key", "value"):
        bits, sub = hp[f"{side}_bits"], hp[f"{side}_sub_dim"]
        if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 16:
            raise ValueError(f"vecinfer: {side}_bits must be an integer in [1, 16], got {bits!r}")
        if not isinstance(sub, (int, np.integer)) or sub < 1:
            raise ValueError(f"vecinfer: {side}_sub_dim must be an integer >= 1, got {sub!r}")
    if hp["share"] not in ("head", "layer"):
        raise ValueError(f"vecinfer: share must be 'head' or 'layer', got {hp['share']!r}")
    if not 0 < hp["clip_percentile"] <= 100:
        raise ValueError(f"vecinfer: clip_percentile must be in (0, 100], got {hp['clip_percentile']}")
    if not hp["floor"] > 0:
        raise ValueError(f"vecinfer: floor must be > 0, got {hp['floor']}")
    return hp


# ---------------------------------------------------------------------------------------------
# Transforms


def check_hadamard_dim(dim: int) -> None:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(
            f"vecinfer: head_dim {dim} is not a power of two, so the Walsh-Hadamard rotation "
            "is undefined for it; calibrate with hadamard=False for this model."
        )


def smooth_scales(absmax: mx.array, clip_percentile: float = 99.9, floor: float = 1e-2) -> mx.array:
    """λ = sqrt(clipped per-channel max|k|), floored. absmax [L, H, D] → λ [L, H, D] f32."""
    a = np.asarray(absmax, dtype=np.float64)
    if a.ndim != 3:
        raise ValueError(f"smooth_scales expects absmax [L, H, D], got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("k_post.absmax contains NaN/inf; re-run the capture")
    cap = np.percentile(a.reshape(a.shape[0], -1), clip_percentile, axis=1)[:, None, None]
    lam = np.maximum(np.sqrt(np.minimum(a, cap)), floor)
    return mx.array(lam.astype(np.float32))


def smooth_transform(x: mx.array, smooth: mx.array, hadamard: bool) -> mx.array:
    """k̃ = H·(k ⊘ λ); smooth broadcasts against x [..., D]."""
    y = x / smooth
    return mx.hadamard_transform(y) if hadamard else y


def inverse_smooth_transform(y: mx.array, smooth: mx.array, hadamard: bool) -> mx.array:
    """k = (H·k̃) ⊙ λ (H is its own inverse)."""
    return (mx.hadamard_transform(y) if hadamard else y) * smooth


def query_transform(q: mx.array, smooth: mx.array, hadamard: bool) -> mx.array:
    """q̃ = H·(q ⊙ λ), so ⟨q̃, k̃⟩ = ⟨q, k⟩ (for the LUT attention path)."""
    y = q * smooth
    return mx.hadamard_transform(y) if hadamard else y


# ---------------------------------------------------------------------------------------------
# Code packing


def code_bytes(bits: int, n_codes: int) -> int:
    """Bytes per vector of n_codes codes as stored: 8/bits codes per byte when bits divides 8,
    two 12-bit codes per 3 bytes, else one uint8 (bits < 8) or uint16 (bits <= 16) per code."""
    if bits in (1, 2, 4, 8) and (n_codes * bits) % 8 == 0:
        return n_codes * bits // 8
    if bits == 12 and n_codes % 2 == 0:
        return n_codes * 3 // 2
    return n_codes * (1 if bits <= 8 else 2)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes [..., M] (< 2**bits) → packed [..., code_bytes(bits, M)] uint8/uint16."""
    m = codes.shape[-1]
    if bits == 8:
        return codes.astype(mx.uint8)
    c = codes.astype(mx.uint32)
    if bits in (1, 2, 4) and (m * bits) % 8 == 0:
        per = 8 // bits
        c = c.reshape(*c.shape[:-1], m // per, per)
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        return (c << shifts).sum(axis=-1).astype(mx.uint8)
    if bits == 12 and m % 2 == 0:
        a, b = c[..., 0::2], c[..., 1::2]
        packed = mx.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=-1)
        return packed.reshape(*c.shape[:-1], m // 2 * 3).astype(mx.uint8)
    return c.astype(mx.uint8 if bits <= 8 else mx.uint16)


def unpack_codes(packed: mx.array, bits: int, n_codes: int) -> mx.array:
    """Inverse of `pack_codes` → [..., n_codes] uint32."""
    p = packed.astype(mx.uint32)
    m = n_codes
    if bits == 8:
        return p
    if bits in (1, 2, 4) and (m * bits) % 8 == 0:
        per = 8 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        c = (p[..., None] >> shifts) & ((1 << bits) - 1)
        return c.reshape(*p.shape[:-1], m)
    if bits == 12 and m % 2 == 0:
        p = p.reshape(*p.shape[:-1], m // 2, 3)
        a = p[..., 0] | ((p[..., 1] & 0xF) << 8)
        b = (p[..., 1] >> 4) | (p[..., 2] << 4)
        return mx.stack([a, b], axis=-1).reshape(*p.shape[:-2], m)
    return p


# ---------------------------------------------------------------------------------------------
# Calibration


def _encode_decode(x: mx.array, codebook: mx.array, sub_dim: int) -> tuple[mx.array, mx.array]:
    """Product-quantize x [G, n, D] with codebook [G, K, d] → (reconstruction, codes [G, n·M])."""
    g, n, dim = x.shape
    sub = x.reshape(g, n * (dim // sub_dim), sub_dim)
    codes, _ = assign(sub, codebook)
    rec = mx.take_along_axis(codebook, codes[..., None].astype(mx.int32), axis=1)
    return rec.reshape(g, n, dim), codes


def calibrate_vecinfer(
    activations_dir: str | Path,
    model_or_config: Any,
    *,
    key_sub_dim: int = DEFAULTS["key_sub_dim"],
    key_bits: int = DEFAULTS["key_bits"],
    value_sub_dim: int = DEFAULTS["value_sub_dim"],
    value_bits: int = DEFAULTS["value_bits"],
    share: str = DEFAULTS["share"],
    smooth: bool = DEFAULTS["smooth"],
    hadamard: bool = DEFAULTS["hadamard"],
    clip_percentile: float = DEFAULTS["clip_percentile"],
    floor: float = DEFAULTS["floor"],
    iters: int = DEFAULTS["iters"],
    seed: int = DEFAULTS["seed"],
    max_vectors: int | None = DEFAULTS["max_vectors"],
    heldout_fraction: float = DEFAULTS["heldout_fraction"],
    progress: bool = True,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Smooth scales + per-(layer, KV head) product-VQ codebooks from a capture dir.

    Returns (tensors for the bundle: smooth [L, H_kv, D], key_codebook [L, H_share, 2^kb, kd],
    value_codebook [L, H_share, 2^vb, vd], all f32; json diagnostics). Deterministic in
    (inputs, seed).
    """
    from tqdm.auto import tqdm

    from veloxquant.capture import load_activations, load_capture_info, load_stats

    hp = resolve_hyperparameters(
        key_sub_dim=key_sub_dim, key_bits=key_bits, value_sub_dim=value_sub_dim,
        value_bits=value_bits, share=share, smooth=smooth, hadamard=hadamard,
        clip_percentile=clip_percentile, floor=floor, iters=iters, seed=seed,
        max_vectors=max_vectors, heldout_fraction=heldout_fraction,
    )
    dims = model_dims(model_or_config)
    n_layers, n_heads, head_dim = dims["L"], dims["H_kv"], dims["D"]
    for side in ("key", "value"):
        if head_dim % hp[f"{side}_sub_dim"]:
            raise ValueError(
                f"vecinfer: {side}_sub_dim {hp[f'{side}_sub_dim']} must divide head_dim {head_dim}"
            )
    if hadamard:
        check_hadamard_dim(head_dim)
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"vecinfer: heldout_fraction must be in (0, 1), got {heldout_fraction}")

    info = load_capture_info(activations_dir)
    if info["num_layers"] != n_layers:
        raise ValueError(
            f"capture {activations_dir} has {info['num_layers']} layers but the model has "
            f"{n_layers}; capture this model's activations first"
        )
    absmax = load_stats(activations_dir)["k_post.absmax"]
    if tuple(absmax.shape) != (n_layers, n_heads, head_dim):
        raise ValueError(
            f"k_post.absmax has shape {list(absmax.shape)}, expected {[n_layers, n_heads, head_dim]}"
            " for this model"
        )
    lam = (smooth_scales(absmax, clip_percentile, floor) if smooth
           else mx.ones((n_layers, n_heads, head_dim), dtype=mx.float32))

    n_tokens = int(info["n_sampled"])
    perm = np.random.default_rng(seed).permutation(n_tokens)
    n_held = max(1, int(round(n_tokens * heldout_fraction)))
    held_idx, train_idx = mx.array(np.sort(perm[:n_held])), mx.array(np.sort(perm[n_held:]))
    per_group = 1 if share == "head" else n_heads
    for side in ("key", "value"):
        k_cent, n_sub = 2 ** hp[f"{side}_bits"], head_dim // hp[f"{side}_sub_dim"]
        have = len(train_idx) * n_sub * per_group
        if have < k_cent:
            need_train = math.ceil(k_cent / (n_sub * per_group))
            need = need_train
            while need - max(1, int(round(need * heldout_fraction))) < need_train:
                need += 1
            raise ValueError(
                f"vecinfer: {side} codebook d{hp[f'{side}_sub_dim']}b{hp[f'{side}_bits']} has "
                f"{k_cent} centroids but only {have} training sub-vectors per codebook "
                f"({len(train_idx)} training tokens of {n_tokens} captured); need at least "
                f"{need} captured tokens. Raise the capture token_budget."
            )

    # Load every layer once: [L, n, H, D] per side (2·L·n·H·D·4 bytes, ~190 MB for the default
    # model at 8192 tokens), so the k-means below runs all L·H codebooks as one batch.
    keys, values = [], []
    for layer in tqdm(range(n_layers), desc="vecinfer load", unit="layer", disable=not progress):
        acts = load_activations(activations_dir, layer, ["k_post", "v"])
        check_finite(acts["k_post"], f"layer {layer} k_post")
        check_finite(acts["v"], f"layer {layer} v")
        keys.append(acts["k_post"])
        values.append(acts["v"])
    keys, values = mx.stack(keys), mx.stack(values)
    if tuple(keys.shape[2:]) != (n_heads, head_dim) or tuple(values.shape[2:]) != (n_heads, head_dim):
        raise ValueError(
            f"captured k_post/v have per-token shape {list(keys.shape[2:])}/"
            f"{list(values.shape[2:])}, expected {[n_heads, head_dim]} for this model"
        )
    lam_b = lam[:, None]  # [L, 1, H, D] against [L, n, H, D]
    spaces = {"key": smooth_transform(keys, lam_b, hadamard), "value": values}

    def groups(x: mx.array) -> mx.array:  # [L, n, H, D] -> [L·H_share, n·(H/H_share), D]
        n_l, n, h, d = x.shape
        if share == "head":
            return x.transpose(0, 2, 1, 3).reshape(n_l * h, n, d)
        return x.reshape(n_l, n * h, d)

    def ungroup(x: mx.array) -> mx.array:  # inverse of groups
        if share == "head":
            return x.reshape(n_layers, n_heads, -1, head_dim).transpose(0, 2, 1, 3)
        return x.reshape(n_layers, -1, n_heads, head_dim)

    books: dict[str, mx.array] = {}
    diag: dict[str, list] = {}
    for side in ("key", "value"):
        sub_dim, bits = hp[f"{side}_sub_dim"], hp[f"{side}_bits"]
        x = spaces[side]
        res = product_kmeans(
            groups(x[:, train_idx]), sub_dim, 2**bits, max_vectors=max_vectors, iters=iters,
            seed=seed + (side == "value"), progress=progress,
            desc=f"vecinfer {side}s d{sub_dim}b{bits}",
        )
        books[side] = res.centroids.reshape(n_layers, -1, 2**bits, sub_dim)
        diag[f"{side}_dead"] = res.dead.reshape(n_layers, -1).sum(axis=1).tolist()
        diag[f"{side}_entropy_bits"] = res.usage_entropy_bits().reshape(n_layers, -1).mean(axis=1).tolist()
        # Held-out reconstruction (tokens k-means never saw), in the original space for keys.
        rec, _ = _encode_decode(groups(x[:, held_idx]), res.centroids, sub_dim)
        rec = ungroup(rec)
        orig = (keys if side == "key" else values)[:, held_idx]
        if side == "key":
            rec = inverse_smooth_transform(rec, lam_b, hadamard)
        mse = mx.mean((rec - orig) ** 2, axis=(1, 2, 3))
        power = mx.mean(orig * orig, axis=(1, 2, 3))
        cos = (rec * orig).sum(-1) / mx.maximum(
            mx.sqrt((rec * rec).sum(-1) * (orig * orig).sum(-1)), 1e-12)
        diag[f"{side}_mse"] = mse.tolist()
        diag[f"{side}_rel_mse"] = (mse / mx.maximum(power, 1e-30)).tolist()
        diag[f"{side}_cos"] = cos.mean(axis=(1, 2)).tolist()

    tensors = {
        "smooth": lam,
        "key_codebook": books["key"],
        "value_codebook": books["value"],
    }
    mx.eval(tensors)
    diagnostics: dict[str, Any] = {
        "per_layer": diag,
        "n_train_tokens": int(len(train_idx)),
        "n_heldout_tokens": int(len(held_idx)),
        "tokens_seen": int(info["tokens_seen"]),
        "smooth_min": float(lam.min().item()),
        "smooth_max": float(lam.max().item()),
    }
    for name, values in diag.items():
        diagnostics[f"mean_{name}"] = float(np.mean(values))
    for name in ("key_rel_mse", "value_rel_mse"):
        diagnostics[f"worst_{name}"] = float(np.max(diag[name]))
        diagnostics[f"worst_{name}_layer"] = int(np.argmax(diag[name]))
    return tensors, diagnostics


def write_vecinfer(
    bundle_dir: str | Path,
    activations_dir: str | Path,
    model_dir: str | Path,
    *,
    data_fingerprint: dict | None = None,
    progress: bool = True,
    **hyperparameters: Any,
) -> Path:
    """Calibrate and write `vecinfer.safetensors` into `bundle_dir` (manifest updated last).

    The stored hyperparameters are the full resolved set, so the runtime knows how the codebooks
    were made (an ablation bundle says smooth=False, hadamard=False or share="layer").
    """
    from veloxquant.bundle import write_method

    hp = resolve_hyperparameters(**hyperparameters)
    tensors, diagnostics = calibrate_vecinfer(activations_dir, model_dir, progress=progress, **hp)
    return write_method(
        bundle_dir, METHOD, tensors, model_dir=model_dir, data_fingerprint=data_fingerprint or {},
        capture_point=CAPTURE_POINT, hyperparameters=hp, diagnostics=diagnostics,
    )


@functools.lru_cache(maxsize=8)
def gaussian_codebook(sub_dim: int, bits: int, seed: int = 0, iters: int = 10) -> mx.array:
    """[2^bits, sub_dim] codebook from the same k-means on N(0, 1) samples (32 per centroid,
    capped at 2^16, i.e. 16 per centroid for d8b12): the uncalibrated reference. Memoised: one
    per process and shape (d8b12 takes ~30 s on a 2-core CPU, d4b8 ~1 s)."""
    k = 2**bits
    n = min(32 * k, 1 << 16)
    x = mx.random.normal((1, n, sub_dim), key=mx.random.key(seed))
    return kmeans(x, k, iters=iters, seed=seed, progress=False, desc="gaussian codebook").centroids[0]


# ---------------------------------------------------------------------------------------------
# Runtime cache


class VecInferCache(_BaseCache):
    """Product-VQ KV cache for one layer. See the module docstring for what is resident.

    No `bits` attribute (it would route mlx-lm attention to quantized_matmul); not a KVCache
    subclass (no inherited `to_quantized`); cannot batch (`merge` raises).
    """

    def __init__(
        self,
        smooth: mx.array,
        key_codebook: mx.array,
        value_codebook: mx.array,
        *,
        key_bits: int,
        key_sub_dim: int,
        value_bits: int,
        value_sub_dim: int,
        hadamard: bool,
        window: int = DEFAULT_WINDOW,
        sinks: int = DEFAULT_SINKS,
    ):
        h, d = smooth.shape
        for side, book, bits, sub in (("key", key_codebook, key_bits, key_sub_dim),
                                      ("value", value_codebook, value_bits, value_sub_dim)):
            want = (2**bits, sub)
            if book.ndim != 3 or tuple(book.shape[1:]) != want or book.shape[0] not in (1, h):
                raise ValueError(
                    f"vecinfer: {side} codebook has shape {list(book.shape)} but the configured "
                    f"d{sub}b{bits} needs [{h} or 1, {2**bits}, {sub}] (2^{side}_bits centroids of "
                    f"{side}_sub_dim dims); the artifact was made with other hyperparameters"
                )
            if d % sub:
                raise ValueError(f"vecinfer: {side}_sub_dim {sub} must divide head_dim {d}")
            check_finite(book, f"vecinfer {side} codebook")
        check_finite(smooth, "vecinfer smooth scales")
        if not bool(mx.all(smooth > 0).item()):
            raise ValueError("vecinfer: smooth scales must be > 0")
        if hadamard:
            check_hadamard_dim(d)
        if window < 0 or sinks < 0:
            raise ValueError(f"vecinfer: window and sinks must be >= 0, got {window}, {sinks}")
        self.smooth = smooth.astype(mx.float32)
        self.key_codebook = key_codebook.astype(mx.float16)
        self.value_codebook = value_codebook.astype(mx.float16)
        self.key_bits, self.key_sub_dim = int(key_bits), int(key_sub_dim)
        self.value_bits, self.value_sub_dim = int(value_bits), int(value_sub_dim)
        self.hadamard = bool(hadamard)
        self.window, self.sinks = int(window), int(sinks)
        self.sink_keys = self.sink_values = None
        self.key_codes = self.value_codes = None
        self.window_keys = self.window_values = None
        self.offset = 0

    # -- encode / decode (float32)

    def _lam(self) -> mx.array:
        return self.smooth[:, None, :]  # [H, 1, D] against [B, H, T, D]

    def _encode(self, x: mx.array, book: mx.array, sub_dim: int, bits: int) -> mx.array:
        b, h, t, d = x.shape
        m = d // sub_dim
        sub = x.transpose(1, 0, 2, 3).reshape(h, b * t * m, sub_dim)
        codes, _ = nearest(sub, book.astype(mx.float32))
        return pack_codes(codes.reshape(h, b, t, m).transpose(1, 0, 2, 3), bits)

    def _decode(self, packed: mx.array, book: mx.array, sub_dim: int, bits: int) -> mx.array:
        b, h, t, _ = packed.shape
        m = self.smooth.shape[-1] // sub_dim
        codes = unpack_codes(packed, bits, m)
        n_books, k, _ = book.shape
        if n_books > 1:
            codes = codes + (mx.arange(h, dtype=mx.uint32) * k)[None, :, None, None]
        words = mx.take(book.astype(mx.float32).reshape(n_books * k, sub_dim), codes, axis=0)
        return words.reshape(b, h, t, m * sub_dim)

    def encode_keys(self, keys: mx.array) -> mx.array:
        """keys [B, H, T, D] → packed key codes (smooth, rotate, nearest codeword)."""
        kt = smooth_transform(keys.astype(mx.float32), self._lam(), self.hadamard)
        return self._encode(kt, self.key_codebook, self.key_sub_dim, self.key_bits)

    def decode_keys(self, packed: mx.array) -> mx.array:
        kt = self._decode(packed, self.key_codebook, self.key_sub_dim, self.key_bits)
        return inverse_smooth_transform(kt, self._lam(), self.hadamard)

    def encode_values(self, values: mx.array) -> mx.array:
        return self._encode(values.astype(mx.float32), self.value_codebook, self.value_sub_dim,
                            self.value_bits)

    def decode_values(self, packed: mx.array) -> mx.array:
        return self._decode(packed, self.value_codebook, self.value_sub_dim, self.value_bits)

    # -- mlx-lm cache protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        dtype = keys.dtype
        recent_k, recent_v = keys.astype(mx.float32), values.astype(mx.float32)
        n_sink = min(max(self.sinks - self.offset, 0), keys.shape[2])
        if n_sink:
            # The first `sinks` tokens (attention sinks) stay in fp16 for good.
            sk, sv = recent_k[:, :, :n_sink].astype(mx.float16), recent_v[:, :, :n_sink].astype(mx.float16)
            if self.sink_keys is None:
                self.sink_keys, self.sink_values = sk, sv
            else:
                self.sink_keys = mx.concatenate([self.sink_keys, sk], axis=2)
                self.sink_values = mx.concatenate([self.sink_values, sv], axis=2)
            recent_k, recent_v = recent_k[:, :, n_sink:], recent_v[:, :, n_sink:]
        if self.window_keys is not None:
            recent_k = mx.concatenate([self.window_keys.astype(mx.float32), recent_k], axis=2)
            recent_v = mx.concatenate([self.window_values.astype(mx.float32), recent_v], axis=2)
        # Transient dequantization of the coded past; attention sees it, nothing keeps it.
        if self.key_codes is not None:
            out_k = mx.concatenate([self.decode_keys(self.key_codes), recent_k], axis=2)
            out_v = mx.concatenate([self.decode_values(self.value_codes), recent_v], axis=2)
        else:
            out_k, out_v = recent_k, recent_v
        if self.sink_keys is not None:
            out_k = mx.concatenate([self.sink_keys.astype(mx.float32), out_k], axis=2)
            out_v = mx.concatenate([self.sink_values.astype(mx.float32), out_v], axis=2)
        n_old = recent_k.shape[2] - self.window
        if n_old > 0:
            new_kc = self.encode_keys(recent_k[:, :, :n_old])
            new_vc = self.encode_values(recent_v[:, :, :n_old])
            if self.key_codes is None:
                self.key_codes, self.value_codes = new_kc, new_vc
            else:
                self.key_codes = mx.concatenate([self.key_codes, new_kc], axis=2)
                self.value_codes = mx.concatenate([self.value_codes, new_vc], axis=2)
            recent_k, recent_v = recent_k[:, :, n_old:], recent_v[:, :, n_old:]
        self.window_keys = recent_k.astype(mx.float16)
        self.window_values = recent_v.astype(mx.float16)
        self.offset += keys.shape[2]
        return out_k.astype(dtype), out_v.astype(dtype)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # nothing is evicted, so the stored length is always the absolute offset
        return create_attention_mask(N, self.offset, return_array, window_size)

    def is_trimmable(self) -> bool:
        return False

    @classmethod
    def merge(cls, caches: list) -> Any:
        raise NotImplementedError(
            "VecInferCache cannot be merged into a batch cache (batched generation would "
            "silently drop the compression); generate one sequence at a time."
        )

    @property
    def nbytes(self) -> int:
        # Everything resident and nothing else: packed codes, the fp16 window and sinks, this
        # layer's fp16 codebooks (so once per layer) and f32 smooth scales. The dequantized keys/values built in
        # update_and_fetch are transient and not counted.
        arrays = (self.key_codes, self.value_codes, self.window_keys, self.window_values,
                  self.sink_keys, self.sink_values, self.key_codebook, self.value_codebook, self.smooth)
        return int(sum(a.nbytes for a in arrays if a is not None))

    @property
    def state(self):
        return (self.key_codes, self.value_codes, self.window_keys, self.window_values,
                self.sink_keys, self.sink_values, self.smooth, self.key_codebook,
                self.value_codebook, self.offset, self.key_bits, self.key_sub_dim,
                self.value_bits, self.value_sub_dim, self.hadamard, self.window, self.sinks)

    @state.setter
    def state(self, v) -> None:
        (self.key_codes, self.value_codes, self.window_keys, self.window_values,
         self.sink_keys, self.sink_values, self.smooth, self.key_codebook,
         self.value_codebook, offset, key_bits, key_sub_dim, value_bits, value_sub_dim,
         hadamard, window, sinks) = v
        self.offset, self.window, self.sinks = int(offset), int(window), int(sinks)
        self.key_bits, self.key_sub_dim = int(key_bits), int(key_sub_dim)
        self.value_bits, self.value_sub_dim = int(value_bits), int(value_sub_dim)
        self.hadamard = bool(hadamard)


# load_prompt_cache resolves class names in mlx_lm.models.cache.
mlx_cache.VecInferCache = VecInferCache


# ---------------------------------------------------------------------------------------------
# make_caches


def _check_options(options: dict, hp: dict | None) -> dict:
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"vecinfer: unknown options {unknown}; known: {list(OPTION_KEYS)}")
    if hp is not None:
        for key, want in options.items():
            if hp.get(key) != want:
                raise ValueError(
                    f"vecinfer: options ask for {key}={want!r} but the artifact was calibrated "
                    f"with {key}={hp.get(key)!r}; point artifact_dir at a bundle calibrated with "
                    "those hyperparameters (or drop the option)"
                )
    return options


def make_caches(model: Any, config: Any) -> list[VecInferCache]:
    dims = model_dims(model)
    n_layers, n_heads, head_dim = dims["L"], dims["H_kv"], dims["D"]
    if config.bits is not None:
        raise ValueError(
            "vecinfer: KVCacheConfig.bits does not apply; bits come from the artifact "
            "(key_bits / value_bits hyperparameters) or options for the uncalibrated variant"
        )
    window = DEFAULT_WINDOW if config.window is None else int(config.window)
    sinks = DEFAULT_SINKS if config.sinks is None else int(config.sinks)
    options = dict(config.options or {})
    if config.uncalibrated:
        hp = resolve_hyperparameters(**_check_options(options, None))
        n_books = n_heads if hp["share"] == "head" else 1
        books = {}
        for side in ("key", "value"):
            cb = gaussian_codebook(hp[f"{side}_sub_dim"], hp[f"{side}_bits"], hp["seed"])
            books[side] = mx.broadcast_to(cb[None, None], (n_layers, n_books, *cb.shape))
        smooth = mx.ones((n_layers, n_heads, head_dim), dtype=mx.float32)
    else:
        from veloxquant.bundle import require_method

        tensors, info = require_method(model, config, METHOD)
        hp = info.get("hyperparameters") or {}
        missing = [k for k in OPTION_KEYS if k not in hp]
        if missing:
            raise ValueError(f"vecinfer artifact lacks hyperparameters {missing}; recalibrate it")
        _check_options(options, hp)
        smooth, books = tensors["smooth"], {"key": tensors["key_codebook"],
                                            "value": tensors["value_codebook"]}
        if tuple(smooth.shape) != (n_layers, n_heads, head_dim):
            raise ValueError(f"vecinfer: smooth has shape {list(smooth.shape)}, expected "
                             f"{[n_layers, n_heads, head_dim]} for this model")
        for side in ("key", "value"):
            if books[side].shape[0] != n_layers:
                raise ValueError(f"vecinfer: {side} codebook covers {books[side].shape[0]} "
                                 f"layers but the model has {n_layers}")
    return [
        VecInferCache(
            smooth[i], books["key"][i], books["value"][i],
            key_bits=hp["key_bits"], key_sub_dim=hp["key_sub_dim"],
            value_bits=hp["value_bits"], value_sub_dim=hp["value_sub_dim"],
            hadamard=hp["hadamard"], window=window, sinks=sinks,
        )
        for i in range(n_layers)
    ]
