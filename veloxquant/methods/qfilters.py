"""Q-Filters: query-agnostic KV eviction along the queries' dominant direction.

Paper: Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression",
arXiv 2503.02812 (official code: NathanGodey/qfilters). DESIGN.md section 8.

Calibration (`calibrate_qfilters`, from captured post-RoPE queries `q_post`):
- per layer and query head, up to `max_rows_per_head` captured rows X [N, D] (uncentred),
  SVD X = U S V^T, v1 = V^T[0] (inputs float32; computed in float64 as the top eigenvector of
  the D x D Gram matrix X^T X, which is the same vector; output float32);
- orientation: v1 is flipped so that mean(X v1) > 0 (Theorem 3.3 needs kappa = E<q,v1> > 0,
  and then E_q<q,k> ~ kappa <k,v1>);
- GQA: the G = H_q/H_kv query-head filters of each KV head (repeat_kv order: KV head g owns
  query heads gG..gG+G-1) are averaged and renormalised -> filters [L, H_kv, D] float32.
- Sign convention here is POSITIVE: score = +<k_post, f>, keep the highest. (The official hub
  files store -f and their scorer negates again; never mix the two.)
- Diagnostics, on held-out captured tokens that the SVD never saw: kappa = E<q, v1> per query
  head (so "kappa > 0" is a real check, not true by construction), and per layer the Spearman
  rank correlation between <k_post, f> and the true mean attention logit E_q<q, k_post>
  (queries of the KV head's G query heads), plus the same for the uncalibrated key-SVD axis.

Runtime (`QFiltersCache`, an `EvictionCache`, see eviction.py for budget / sinks / window): each
KV head keeps its sinks, its recent window and the tokens with the highest +<k_post, f>.

Uncalibrated reference (`KVCacheConfig(method="qfilters", uncalibrated=True)`, no bundle): the
key-SVD fallback. The axis is the top eigenvector of K^T K over the keys the cache holds at
its first update(s), refitted until it has seen `fit_tokens` keys (default 64; the first prefill
chunk normally), then frozen. It gets the axis but not its orientation: the sign is whatever
LAPACK returns, exactly as an uncalibrated user would get it. Calibration diagnostics use the
same `key_axis` function on captured keys.

Knobs: budget, sinks, window (KVCacheConfig); options={"min_budget": 64} (the floor of a
fractional budget, see eviction.py) and {"fit_tokens": 64} for the fallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant.methods.base import Artifact, CalibrationInputs, Method, ModelDims, TensorSpec
from veloxquant.methods.eviction import (
    DEFAULT_MIN_BUDGET,
    EvictionCache,
    min_budget_option,
)
from veloxquant.methods.eviction import OPTIONS as EVICTION_OPTIONS

DEFAULT_FIT_TOKENS = 64
DEFAULTS = {"max_rows_per_head": 3000, "seed": 0, "heldout_fraction": 0.2}
# Both the SVD rows and the held-out rows the diagnostics are measured on need this many tokens.
MIN_SPLIT_TOKENS = 16


# ---------------------------------------------------------------------------------------------
# Calibration


def key_axis(keys: mx.array) -> mx.array:
    """Unoriented top principal axis (uncentred) of keys [..., S, D] -> [..., D], float32.

    The sign is LAPACK's (syevd), i.e. arbitrary: this is the uncalibrated reference.
    """
    k = keys.astype(mx.float32)
    gram = mx.matmul(k.swapaxes(-1, -2), k)
    _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)
    return vecs[..., :, -1]  # eigh sorts eigenvalues ascending


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(np.float64)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(np.float64)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else 0.0


def _split_tokens(n: int, heldout_fraction: float, max_rows: int, seed: int):
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}.")
    perm = np.random.default_rng(seed).permutation(n)
    n_held = int(round(n * heldout_fraction))
    held, train = np.sort(perm[:n_held]), perm[n_held:]
    if len(held) < MIN_SPLIT_TOKENS or len(train) < MIN_SPLIT_TOKENS:
        need = min_tokens(None, {"heldout_fraction": heldout_fraction})
        raise ValueError(
            f"qfilters: only {n} captured tokens; it needs at least {need} to fit filters and "
            "measure them on held-out tokens. Raise the capture token_budget."
        )
    return np.sort(train[:max_rows]), held


def min_tokens(dims: ModelDims | None, hp: dict[str, Any]) -> int:
    """The fewest captured tokens that leave MIN_SPLIT_TOKENS both for the SVD and held out."""
    f = float(hp.get("heldout_fraction", DEFAULTS["heldout_fraction"]))
    n = 2 * MIN_SPLIT_TOKENS
    while int(round(n * f)) < MIN_SPLIT_TOKENS or n - int(round(n * f)) < MIN_SPLIT_TOKENS:
        n += 1
    return n


def calibrate_qfilters(
    activations_dir: str | Path,
    model_or_dims: Any,
    max_rows_per_head: int = DEFAULTS["max_rows_per_head"],
    seed: int = DEFAULTS["seed"],
    heldout_fraction: float = DEFAULTS["heldout_fraction"],
    progress: bool = True,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Q-Filters from captured q_post -> (tensors for the bundle, json diagnostics summary).

    Tensors: filters [L, H_kv, D], sigma1 [L, H_q], kappa [L, H_q], spearman [L],
    spearman_fallback [L], all float32. Same inputs and seed give bit-identical outputs.
    """
    from tqdm import tqdm

    from veloxquant.capture import load_activations, load_capture_info

    dims = ModelDims.of(model_or_dims)
    L, H_q, H_kv, D = dims.L, dims.H_q, dims.H_kv, dims.D
    if H_q % H_kv:
        raise ValueError(f"query heads {H_q} is not a multiple of KV heads {H_kv}.")
    G = H_q // H_kv
    info = load_capture_info(activations_dir)
    if info["num_layers"] != L:
        raise ValueError(
            f"The capture in {activations_dir} has {info['num_layers']} layers but the model has "
            f"{L}: it was captured from another model. Re-run the capture stage."
        )
    train, held = _split_tokens(info["n_sampled"], heldout_fraction, max_rows_per_head, seed)

    filters = np.zeros((L, H_kv, D), np.float32)
    sigma1 = np.zeros((L, H_q), np.float32)
    kappa = np.zeros((L, H_q), np.float32)
    spearman = np.zeros((L, H_kv), np.float64)
    spearman_fb = np.zeros((L, H_kv), np.float64)
    for layer in tqdm(range(L), desc="qfilters", unit="layer", disable=not progress):
        acts = load_activations(activations_dir, layer, ["q_post", "k_post"])
        q = np.array(acts["q_post"], np.float32)
        k = np.array(acts["k_post"], np.float32)
        if q.shape[1:] != (H_q, D) or k.shape[1:] != (H_kv, D):
            raise ValueError(
                f"layer {layer}: captured q_post {list(q.shape[1:])} / k_post {list(k.shape[1:])} "
                f"do not match the model's [H_q, D] = [{H_q}, {D}] / [H_kv, D] = [{H_kv}, {D}]."
            )
        # V^T[0] and S[0] of X = U S V^T, from the D x D Gram matrix X^T X = V S^2 V^T in
        # float64: same vector, and far cheaper than a LAPACK SVD of the N x D rows.
        x = q[train].transpose(1, 0, 2).astype(np.float64)  # [H_q, N, D]
        eigval, eigvec = np.linalg.eigh(np.matmul(x.transpose(0, 2, 1), x))
        v1 = eigvec[:, :, -1]  # eigh sorts ascending
        sign = np.where(np.einsum("hnd,hd->h", x, v1) < 0, -1.0, 1.0)  # orient: mean(X v1) > 0
        v1 *= sign[:, None]
        sigma1[layer] = np.sqrt(np.maximum(eigval[:, -1], 0))
        kappa[layer] = np.einsum("nhd,hd->h", q[held].astype(np.float64), v1) / len(held)
        f = v1.reshape(H_kv, G, D).mean(axis=1)  # repeat_kv order
        f /= np.linalg.norm(f, axis=-1, keepdims=True)
        filters[layer] = f
        axis = np.array(key_axis(mx.array(k[train].transpose(1, 0, 2))), np.float64)  # [H_kv, D]
        for g in range(H_kv):
            kh = k[held, g].astype(np.float64)
            q_mean = q[held, g * G : (g + 1) * G].astype(np.float64).mean(axis=(0, 1))
            true = kh @ q_mean  # E_q<q, k> over this KV head's query heads
            spearman[layer, g] = _spearman(kh @ f[g], true)
            spearman_fb[layer, g] = _spearman(kh @ axis[g], true)

    tensors = {
        "filters": filters,
        "sigma1": sigma1,
        "kappa": kappa,
        "spearman": spearman.mean(axis=1).astype(np.float32),
        "spearman_fallback": spearman_fb.mean(axis=1).astype(np.float32),
    }
    diagnostics = {
        "n_train_tokens": int(len(train)),
        "n_heldout_tokens": int(len(held)),
        "kappa_positive_fraction": float((kappa > 0).mean()),
        "kappa_mean": float(kappa.mean()),
        "sigma1_mean": float(sigma1.mean()),
        "spearman_mean": float(spearman.mean()),
        "spearman_min_layer": float(tensors["spearman"].min()),
        "spearman_fallback_mean": float(spearman_fb.mean()),
        "spearman_per_layer": [round(float(x), 4) for x in tensors["spearman"]],
        "spearman_fallback_per_layer": [round(float(x), 4) for x in tensors["spearman_fallback"]],
        "sign_convention": "positive: score = +<k_post, f>, keep highest",
    }
    return tensors, diagnostics


def calibrate(
    inputs: CalibrationInputs, dims: ModelDims, hp: dict[str, Any], progress: bool
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    return calibrate_qfilters(inputs.activations_dir, dims, progress=progress, **hp)


def check_hyperparameters(hp: dict[str, Any]) -> None:
    if not isinstance(hp["max_rows_per_head"], int) or hp["max_rows_per_head"] < 1:
        raise ValueError(
            f"qfilters: max_rows_per_head must be an integer >= 1, got {hp['max_rows_per_head']!r}"
        )
    if not 0 < hp["heldout_fraction"] < 1:
        raise ValueError(
            f"qfilters: heldout_fraction must be in (0, 1), got {hp['heldout_fraction']!r}"
        )


def tensor_specs(dims: ModelDims, hp: dict[str, Any]) -> dict[str, TensorSpec]:
    return {
        # unit-norm filter per KV head, positive convention: score = +<k_post, f>, keep highest
        "filters": TensorSpec((dims.L, dims.H_kv, dims.D), "float32"),
        "sigma1": TensorSpec((dims.L, dims.H_q), "float32"),  # top singular value per q head
        "kappa": TensorSpec((dims.L, dims.H_q), "float32"),  # held-out E<q, v1> (> 0)
        "spearman": TensorSpec((dims.L,), "float32"),  # rank corr. of <k,f> vs E_q<q,k>
        "spearman_fallback": TensorSpec((dims.L,), "float32"),  # same, unoriented key axis
    }


def check_artifact(artifact: Artifact, dims: ModelDims) -> None:
    validate_filters(artifact.tensors["filters"], (dims.L, dims.H_kv, dims.D))


# ---------------------------------------------------------------------------------------------
# Runtime


def validate_filters(filters: Any, shape: tuple[int, ...]) -> mx.array:
    """float32 unit-norm filters of exactly `shape`, or a clear error."""
    f = mx.array(filters).astype(mx.float32)
    if tuple(f.shape) != tuple(shape):
        raise ValueError(
            f"Q-Filters have shape {list(f.shape)} but this model needs {list(shape)} "
            "([layers, KV heads, head_dim] or [KV heads, head_dim] per layer). The filters were "
            "made for another model: re-run `dvc repro qfilters@<model>` for this one."
        )
    if not mx.all(mx.isfinite(f)).item():
        raise ValueError("Q-Filters contain NaN or Inf; the calibration is broken. Re-run it.")
    norms = mx.linalg.norm(f, axis=-1)
    if mx.max(mx.abs(norms - 1)).item() > 1e-3:
        raise ValueError(
            f"Q-Filters must be unit-norm (norms range {mx.min(norms).item():.4g}.."
            f"{mx.max(norms).item():.4g}); was this file produced by calibrate_qfilters?"
        )
    return f


class QFiltersCache(EvictionCache):
    """Eviction by +<k_post, f> per KV head; f=None selects the unoriented key-SVD fallback."""

    def __init__(
        self,
        filters: mx.array | None,
        budget: int | float,
        sinks: int | None = None,
        window: int | None = None,
        fit_tokens: int = DEFAULT_FIT_TOKENS,
        min_budget: int = DEFAULT_MIN_BUDGET,
    ):
        super().__init__(budget, sinks, window, min_budget)
        if filters is not None:
            shape = tuple(mx.array(filters).shape)
            if len(shape) != 2:
                raise ValueError(
                    f"QFiltersCache takes one layer's filters [H_kv, D]; got shape {list(shape)}."
                )
            filters = validate_filters(filters, shape)
        self.filters = filters
        self.calibrated = filters is not None
        self.fit_tokens = int(fit_tokens)
        self.fitted_on = 0  # keys the fallback axis was fitted on

    def _before_update(self, keys: mx.array) -> None:
        if self.calibrated and tuple(self.filters.shape) != (keys.shape[1], keys.shape[3]):
            raise ValueError(
                f"Q-Filters of shape {list(self.filters.shape)} do not fit keys with "
                f"{keys.shape[1]} KV heads of dim {keys.shape[3]}: they were made for another "
                "model."
            )

    def _evict(self) -> None:
        if not self.calibrated and self.fitted_on < self.fit_tokens:
            # B, H, S, D -> H, B*S, D: one axis per KV head from every key held so far
            k = self.keys.swapaxes(0, 1).reshape(self.keys.shape[1], -1, self.keys.shape[-1])
            self.filters = key_axis(k)
            self.fitted_on = k.shape[1]
        super()._evict()

    def score(self, keys: mx.array) -> mx.array:
        f = self.filters[None, :, :, None]  # [1, H, D, 1]
        return mx.matmul(keys.astype(mx.float32), f)[..., 0]

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.filters is None else self.filters.nbytes)

    def state_arrays(self) -> dict:
        return {**super().state_arrays(), "filters": self.filters}

    @property
    def meta_state(self) -> dict:
        return {
            **super().meta_state,
            "calibrated": self.calibrated,
            "fit_tokens": self.fit_tokens,
            "fitted_on": self.fitted_on,
        }

    def restore(self, arrays: dict, meta: dict) -> None:
        super().restore(arrays, meta)
        self.filters = arrays["filters"]
        self.calibrated = bool(meta["calibrated"])
        self.fit_tokens, self.fitted_on = int(meta["fit_tokens"]), int(meta["fitted_on"])


def make_caches(model: Any, config: Any, artifact: Artifact | None) -> list:
    dims = ModelDims.of(model)
    fit_tokens = int(config.options.get("fit_tokens", DEFAULT_FIT_TOKENS))
    knobs = (config.budget, config.sinks, config.window, fit_tokens, min_budget_option(config))
    if artifact is None:  # the uncalibrated key-SVD fallback
        return [QFiltersCache(None, *knobs) for _ in range(dims.L)]
    filters = validate_filters(artifact.tensors["filters"], (dims.L, dims.H_kv, dims.D))
    return [QFiltersCache(filters[i], *knobs) for i in range(dims.L)]


METHOD = Method(
    name="qfilters",
    summary="Q-Filters eviction: keep sinks + window + keys with the highest <k, f>, f from an "
    "SVD of calibration queries (budget=N or fraction)",
    make_caches=make_caches,
    fields=("budget", "sinks", "window"),
    options={"fit_tokens": DEFAULT_FIT_TOKENS, **EVICTION_OPTIONS},
    cache_classes=(QFiltersCache,),
    calibrated=True,
    capture_point="q_post",
    defaults=DEFAULTS,
    calibrate=calibrate,
    tensor_specs=tensor_specs,
    check_hyperparameters=check_hyperparameters,
    check_artifact=check_artifact,
    min_tokens=min_tokens,
)
