"""RateQuant: mixed-precision KIVI with bits water-filled over (layer, KV head, K/V stream).

Paper: "RateQuant", arXiv 2605.06675. DESIGN.md section 8. The runtime is the packed KIVI
cache of veloxquant/methods/kivi/ with per-head bit widths.

Calibration (`calibrate`; stage `ratequant`), from the model, calibration token windows and a
capture (k_post, v):
1. importance w [L, H_kv, 2] (fisher.py): one backward pass per calibration window through
   zero perturbations on every layer's cached K and V, fed the way the runtime serves them
   (chunks, fp16 window and sinks unperturbed) and weighted by the KIVI group range, so that
   w·d is the loss a distortion d costs; with validate_units > 0 (the full experiment), checked
   on a subset of units against forward-only noise injection (Spearman rank correlation in the
   diagnostics). The cheap proxy E‖x‖² per unit is stored beside it for the ablation.
2. distortion d(b) [L, H_kv, 2, 8] (alloc.py): E‖x − Q_b(x)‖² with the runtime quantizer (same
   G; keys per channel in blocks of G tokens, values per token in groups of G channels) on
   the captured k_post / v, at every width 1-8; fit ln d = ln α − b ln β over the allowed
   widths, α per unit and β per stream ([2]: a property of the quantizer, and per-head slopes
   from a few points would be noise), with R² per unit.
3. stream response `stream_kl` [2, n_allowed] (fisher.py): the KL per token when only the
   keys, or only the values, carry the runtime's KIVI error at each allowed width, on
   `response_tokens` of the last calibration window (held out of the Fisher average when
   there are several windows). It rescales each stream's curves
   by κ_s(b) = measured / Σ w·d(b) (the second-order model underestimates 1-2 bit errors
   and weighs keys against values only approximately), and a width costing a stream more
   than `max_stream_kl` nats/token is not admissible for it (on SmolLM2: keys at 1 bit,
   KL ≈ 3; values at 1 bit cost ≈ 0.3 and stay allowed).
4. allocation (alloc.py): reverse water-filling with bisection on μ, snap to the allowed
   widths, greedy rebalance by marginal gain on the measured (rescaled) d until the mean code
   bits meet b̄ − 32/G exactly (b̄ counts the fp16 scale + zero of each group of G), then
   equal-bit exchanges while they lower the objective. Stored for the hyperparameter `bits`
   as `bits` [L, H_kv, 2] int8 (for the heatmap and inspection).

Runtime (`make_caches`): `KVCacheConfig(method="ratequant", bits=b̄, artifact_dir=DIR)` solves
the allocation for that b̄ at load time from the stored importance, distortion and stream
response (a few ms; α and β are refitted to the rescaled curves, the stored ones are the raw
fit's, kept for the R² diagnostics), so one artifact serves every budget; bits=None uses the
calibration's `bits`. Each layer gets a `KIVICache` with its [H_kv, 2] widths. Resident bits
per element are b̄ plus the fp16 window and sinks (read `nbytes`).

Knobs: KVCacheConfig.bits (b̄, counting scale + zero), group_size (must equal the artifact's
G, default 64), window (default 32), sinks (default 4); window and sinks may differ from the
calibration's, but the importance assumed the calibration's. options:
- "importance": "fisher" (default) or "proxy": the E‖x‖² allocation (ablation row; it keeps
  the measured distortion and stream response, so only the within-stream ranking changes);
- "stream_response": True (default); False drops the measured response (κ and the admissible
  widths) and allocates on the plain second-order Σ w·d (ablation row);
- "allowed_bits": widths to allocate from, a subset of the calibration's `allowed_bits`
  (default 1/2/3/4/8; the stream response is measured only there). The lowest b̄ is set by
  the admissible widths; on SmolLM2 the response admits keys from 2 bits and values from 1,
  so b̄ >= 1.5 + 32/G = 2.0.

Uncalibrated reference (`uncalibrated=True`, no bundle): uniform KIVI at the same b̄ and G;
a b̄ between two allowed widths is a fixed interleaved split between them (alloc.py,
`uniform_allocation`), so keys and values each average b̄ and nothing is model-specific.

Why 1-bit values but not 1-bit keys: a value's error reaches the output through the
attention weights, so errors spread over many tokens average out; a key's error moves the
attention logits, and at 1 bit (min/max codes per channel) by enough to pull attention onto
tokens a head otherwise ignores. Small-perturbation Fisher sees neither, which is why the
response is measured.

Why G = 64: with the fp16 scale + zero counted, G = 32 costs 1 bit per element and leaves no
room to mix at low b̄; at equal resident bits G = 64 with more code bits gave lower KL than
G = 32 on the default model.
"""

from __future__ import annotations

import numbers
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from veloxquant import attention, cpu_kernels
from veloxquant.methods import kivi
from veloxquant.methods.base import Artifact, CalibrationInputs, Method, ModelDims, TensorSpec
from veloxquant.methods.ratequant import alloc, fisher
from veloxquant.methods.ratequant.heatmap import write_heatmap

NAME = "ratequant"
MEASURED_BITS = kivi.SUPPORTED_BITS  # distortion is measured at every width the runtime packs
DEFAULT_GROUP_SIZE = 64
DEFAULT_ALLOWED_BITS = (1, 2, 3, 4, 8)
IMPORTANCE_KINDS = ("fisher", "proxy")

DEFAULTS: dict[str, Any] = {
    "group_size": DEFAULT_GROUP_SIZE,
    "window": kivi.DEFAULT_WINDOW,
    "sinks": kivi.DEFAULT_SINKS,
    "allowed_bits": list(DEFAULT_ALLOWED_BITS),
    "bits": 3.0,  # b̄ of the stored allocation (the runtime solves for any b̄)
    "fisher_windows": 8,  # calibration windows for the gradient pass (evenly spaced)
    "fisher_tokens": 1024,  # tokens per window (windows are cut to this)
    "fisher_mode": "runtime",  # or "plain": whole window in one call, every key perturbed
    "fisher_chunk": 64,  # tokens per call in runtime mode
    "range_weighted": True,
    "validate_units": 0,  # units checked against noise injection (0: skip; full experiment: 12)
    "validate_tokens": 512,
    "noise_sigma": 0.1,  # noise RMS relative to the head's RMS
    "noise_draws": 1,
    "response_tokens": 512,  # tokens of the held-out window for the stream response
    "max_stream_kl": 1.0,  # nats/token: a width costing a stream more is not admissible
    "seed": 0,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_max_stream_kl(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"ratequant: max_stream_kl must be a number > 0, got {value!r}")
    return float(value)


def check_hyperparameters(hp: dict[str, Any]) -> None:
    kivi.check_group_size(hp["group_size"])
    for name in ("window", "sinks"):
        if not _is_int(hp[name]) or hp[name] < 0:
            raise ValueError(f"ratequant: {name} must be an integer >= 0, got {hp[name]!r}")
    allowed = alloc.check_allowed_bits(hp["allowed_bits"])
    alloc.code_budget(hp["bits"], allowed, hp["group_size"])
    for name, lo in (
        ("fisher_windows", 1),
        ("fisher_tokens", 2),
        ("fisher_chunk", 1),
        ("validate_units", 0),
        ("validate_tokens", 2),
        ("noise_draws", 1),
        ("response_tokens", 2),
    ):
        if not _is_int(hp[name]) or hp[name] < lo:
            raise ValueError(f"ratequant: {name} must be an integer >= {lo}, got {hp[name]!r}")
    if hp["fisher_mode"] not in fisher.MODES:
        raise ValueError(
            f"ratequant: fisher_mode must be one of {fisher.MODES}, got {hp['fisher_mode']!r}"
        )
    if not isinstance(hp["range_weighted"], bool):
        raise ValueError(f"ratequant: range_weighted must be a bool, got {hp['range_weighted']!r}")
    sigma = hp["noise_sigma"]
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not 0 < sigma < 1:
        raise ValueError(f"ratequant: noise_sigma must be in (0, 1), got {sigma!r}")
    check_max_stream_kl(hp["max_stream_kl"])
    if not _is_int(hp["seed"]):
        raise ValueError(f"ratequant: seed must be an integer, got {hp['seed']!r}")


def tensor_specs(dims: ModelDims, hp: dict[str, Any]) -> dict[str, TensorSpec]:
    unit = (dims.L, dims.H_kv, 2)
    return {
        "importance": TensorSpec(unit, "float32"),
        "fisher_sq": TensorSpec(unit, "float32"),
        "proxy_importance": TensorSpec(unit, "float32"),
        "distortion": TensorSpec((*unit, len(MEASURED_BITS)), "float32"),
        "alpha": TensorSpec(unit, "float32"),
        "beta": TensorSpec((2,), "float32"),
        "bits": TensorSpec(unit, "int8"),
        "stream_kl": TensorSpec((2, len(hp["allowed_bits"])), "float32"),
    }


def min_tokens(dims: Any, hp: dict[str, Any]) -> int:
    # a few whole key blocks of G sampled tokens per sequence, beyond the sinks
    return 8 * int(hp["group_size"])


def check_artifact(artifact: Artifact, dims: ModelDims) -> None:
    """Shapes against the model and values the solve relies on; a clear error otherwise."""
    hp = artifact.hyperparameters
    specs = tensor_specs(dims, hp)
    for name, spec in specs.items():
        if name not in artifact.tensors:
            raise ValueError(f"ratequant artifact lacks tensor {name!r}; recalibrate it")
        shape = tuple(np.asarray(artifact.tensors[name]).shape)
        if shape != spec.shape:
            raise ValueError(
                f"ratequant artifact tensor {name!r} has shape {list(shape)} but this model "
                f"(L={dims.L}, H_kv={dims.H_kv}) needs {list(spec.shape)}: the artifact was "
                "calibrated for another model"
            )
    t = {k: np.asarray(artifact.tensors[k], np.float64) for k in specs}
    for name in (
        "importance",
        "fisher_sq",
        "proxy_importance",
        "alpha",
        "distortion",
        "beta",
        "stream_kl",
    ):
        if not np.all(np.isfinite(t[name])):
            raise ValueError(f"ratequant artifact: {name} holds NaN/inf")
    if np.any(t["stream_kl"] < 0):
        raise ValueError("ratequant artifact: stream_kl (a KL) must be >= 0")
    if np.any(t["importance"] < 0) or np.any(t["proxy_importance"] < 0):
        raise ValueError("ratequant artifact: importance must be >= 0")
    if np.any(t["distortion"] <= 0) or np.any(t["alpha"] <= 0):
        raise ValueError("ratequant artifact: distortion and alpha must be > 0")
    if np.any(t["beta"] <= 1):
        raise ValueError("ratequant artifact: beta must be > 1 (distortion falls with bits)")
    allowed = alloc.check_allowed_bits(hp.get("allowed_bits", ()))
    if not np.all(np.isin(t["bits"], allowed)):
        raise ValueError(f"ratequant artifact: bits outside allowed_bits {list(allowed)}")
    kivi.check_group_size(int(hp["group_size"]), dims.D)


# ---------------------------------------------------------------------------------------------
# Calibration


def _evenly_spaced(n_total: int, n: int) -> np.ndarray:
    return np.unique(np.round(np.linspace(0, n_total - 1, min(n, n_total))).astype(int))


def calibrate(
    inputs: CalibrationInputs, dims: ModelDims, hp: dict[str, Any], progress: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Importance, distortion curves and the default allocation (see the module docstring)."""
    from veloxquant.capture import load_capture_info, load_stats
    from veloxquant.data import load_tokens
    from mlx_lm.utils import load_model

    check_hyperparameters(hp)
    if inputs.calib_tokens is None:
        raise ValueError(
            "ratequant calibration needs calibration token windows "
            "(CalibrationInputs.calib_tokens, data/calib.safetensors) for the "
            "Fisher pass"
        )
    g, window, sinks = int(hp["group_size"]), int(hp["window"]), int(hp["sinks"])
    kivi.check_group_size(g, dims.D)
    allowed = alloc.check_allowed_bits(hp["allowed_bits"])
    info = load_capture_info(inputs.activations_dir)
    if info["num_layers"] != dims.L:
        raise ValueError(
            f"capture {inputs.activations_dir} has {info['num_layers']} layers but "
            f"the model has {dims.L}; capture this model's activations first"
        )
    if info["n_sampled"] < min_tokens(dims, hp):
        raise ValueError(
            f"ratequant needs at least {min_tokens(dims, hp)} captured tokens, the "
            f"capture has {info['n_sampled']}; raise the capture token_budget"
        )

    windows = load_tokens(inputs.calib_tokens)[:, : hp["fisher_tokens"]]
    fisher.check_response_window(
        min(windows.shape[1], hp["response_tokens"]), hp["fisher_chunk"], window, sinks, g
    )
    model, _ = load_model(Path(inputs.model_dir))  # weights only: no tokenizer is needed
    live = ModelDims.of(model)
    if (live.L, live.H_q, live.H_kv, live.D) != (dims.L, dims.H_q, dims.H_kv, dims.D):
        raise ValueError(
            f"ratequant: model {inputs.model_dir} ({live}) does not match the "
            f"dims calibration was asked for ({dims})"
        )
    layout = {"mode": hp["fisher_mode"], "window": window, "sinks": sinks, "group_size": g}
    n_val = int(hp["validate_units"])
    # The last window (the stream response's and the validation's) is held out of the Fisher
    # average when there is more than one, whether or not the validation runs.
    pool = windows.shape[0] - 1 if windows.shape[0] > 1 else windows.shape[0]
    picks = _evenly_spaced(pool, hp["fisher_windows"])

    def importance(tokens: np.ndarray, **options: Any):
        return fisher.fisher_importance(
            model,
            tokens,
            chunk=hp["fisher_chunk"],
            range_weighted=hp["range_weighted"],
            time_forward=False,
            **layout,
            **options,
        )

    # The forward and gradient passes' softmax and swiglu run vectorized (veloxquant.cpu_kernels:
    # MLX's bits, and its gradients').
    with cpu_kernels.vectorized():
        w, w_sq, timing = importance(windows[picks], progress=progress)
        proxy = fisher.proxy_importance(load_stats(inputs.activations_dir))

        validation: dict[str, Any] = {"units": 0}
        if n_val:
            t0 = time.perf_counter()
            val_tokens = windows[-1, : hp["validate_tokens"]]
            units = fisher.stratified_units(w, n_val)
            w_same, _, _ = importance(val_tokens[None])
            noise = fisher.noise_validation(
                model,
                val_tokens,
                units,
                sigma=hp["noise_sigma"],
                draws=hp["noise_draws"],
                seed=hp["seed"],
                chunk=hp["fisher_chunk"],
                range_weighted=hp["range_weighted"],
                **layout,
            )
            pick = lambda a: [float(a[u]) for u in units]  # noqa: E731
            validation = {
                "units": [list(u) for u in units],
                "noise_kl_over_sigma2": noise.tolist(),
                "fisher": pick(w),
                "fisher_same_window": pick(w_same),
                "spearman_fisher_vs_noise": fisher.spearman(pick(w), noise),
                "spearman_same_window_fisher_vs_noise": fisher.spearman(pick(w_same), noise),
                "spearman_proxy_vs_noise": fisher.spearman(pick(proxy), noise),
                "window_tokens": int(len(val_tokens)),
            }
            timing["validation_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        # The last calibration window: held out of the Fisher average (when there is more than one).
        stream_kl = fisher.stream_response(
            model,
            windows[-1, : hp["response_tokens"]],
            allowed,
            chunk=hp["fisher_chunk"],
            window=window,
            sinks=sinks,
            group_size=g,
            progress=progress,
        )
        stream_kl = np.maximum(stream_kl, 0.0)  # float32 can put a KL of ~0 a hair below 0
        response_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    distortion = alloc.distortion_from_capture(
        inputs.activations_dir, dims.L, MEASURED_BITS, g, sinks, progress=progress
    )
    distortion_s = time.perf_counter() - t0
    cols = [MEASURED_BITS.index(b) for b in allowed]
    alpha, beta, r2 = alloc.fit_distortion(allowed, distortion[..., cols])
    bits, solve = solve_from_tensors(
        w, distortion[..., cols], stream_kl, allowed, hp["bits"], g, hp["max_stream_kl"]
    )
    solve_s = solve.pop("solve_s")

    tensors = {
        "importance": w.astype(np.float32),
        "fisher_sq": w_sq.astype(np.float32),
        "proxy_importance": proxy.astype(np.float32),
        "distortion": distortion.astype(np.float32),
        "alpha": alpha.astype(np.float32),
        "beta": beta.astype(np.float32),
        "bits": bits.astype(np.int8),
        "stream_kl": stream_kl.astype(np.float32),
    }
    diagnostics = {
        "fit_r2": r2.tolist(),
        "fit_r2_min": float(r2.min()),
        "fit_r2_median": float(np.median(r2)),
        "beta": beta.tolist(),
        "validation": validation,
        "stream_response": {
            "allowed_bits": list(allowed),
            "kl_keys": stream_kl[0].tolist(),
            "kl_values": stream_kl[1].tolist(),
            "min_bits": solve["min_bits"],
            "stream_scale": solve["stream_scale"],
            "tokens": int(min(windows.shape[1], hp["response_tokens"])),
        },
        "allocation": solve,
        "fisher_windows": picks.tolist(),
        "fisher_tokens": int(windows.shape[1]),
        "n_captured_tokens": int(info["n_sampled"]),
        "measured_bits": list(MEASURED_BITS),
        "key_grouping": "blocks of G consecutive sampled tokens of one sequence (the capture is "
        "a subsample, so key blocks span more positions than at runtime)",
    }
    # Wall times go to the log, not into the artifact: the same inputs give the same bytes.
    timing.update(stream_response_s=response_s, distortion_s=distortion_s, solve_s=solve_s)
    if progress:
        print(
            "ratequant seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in timing.items()),
            file=sys.stderr,
        )
    return tensors, diagnostics


# ---------------------------------------------------------------------------------------------
# Runtime


OPTION_KEYS = ("importance", "allowed_bits", "stream_response")


def _options(config: Any) -> tuple[str, tuple[int, ...] | None, bool]:
    options = dict(config.options or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"ratequant: unknown options {unknown}; known: {list(OPTION_KEYS)}")
    kind = options.get("importance", "fisher")
    if kind not in IMPORTANCE_KINDS:
        raise ValueError(
            f"ratequant: options importance must be one of {IMPORTANCE_KINDS}, got {kind!r}"
        )
    response = options.get("stream_response", True)
    if not isinstance(response, bool):
        raise ValueError(f"ratequant: options stream_response must be a bool, got {response!r}")
    allowed = options.get("allowed_bits")
    return kind, None if allowed is None else alloc.check_allowed_bits(allowed), response


def _layout(config: Any, dims: ModelDims, group_size: int, window: int, sinks: int):
    if config.group_size is not None and config.group_size != group_size:
        raise ValueError(
            f"ratequant: group_size={config.group_size} but the distortion curves were "
            f"measured with G={group_size}; pass group_size={group_size} (or recalibrate)"
        )
    window = window if config.window is None else config.window
    sinks = sinks if config.sinks is None else config.sinks
    for name, v in (("window", window), ("sinks", sinks)):
        if not _is_int(v) or v < 0:
            raise ValueError(f"ratequant: {name} must be an integer >= 0, got {v!r}")
    kivi.check_group_size(group_size, dims.D)
    return group_size, int(window), int(sinks)


def solve_from_tensors(
    importance: np.ndarray,
    distortion: np.ndarray,
    stream_kl: np.ndarray,
    allowed: tuple[int, ...],
    bits: float,
    group_size: int,
    max_stream_kl: float,
    stream_response: bool = True,
) -> tuple[np.ndarray, dict]:
    """The allocation for an average b̄: the measured curves d [L, H, 2, n_bits] rescaled per
    stream and width by κ (`alloc.stream_scale`, from stream_kl [2, n_bits] and this
    importance), α and β fitted to them, and the widths each stream's response admits.
    stream_response=False is the ablation: the plain second-order objective Σ w·d over every
    allowed width."""
    if stream_response:
        kappa = alloc.stream_scale(stream_kl, importance, distortion)
        min_bits = alloc.admissible_min_bits(stream_kl, allowed, max_stream_kl)
    else:
        kappa, min_bits = np.ones(np.shape(stream_kl)), None
    d = distortion * kappa
    alpha, beta, _ = alloc.fit_distortion(allowed, d)
    if not np.all(np.isfinite(beta) & (beta > 1)):
        raise ValueError(
            f"ratequant: the rescaled distortion does not fall with bits (fitted beta "
            f"{np.round(beta, 3).tolist()}); the stream response or the distortion table is "
            "broken, recalibrate"
        )
    out, info = alloc.allocate(importance, alpha, beta, d, allowed, bits, group_size, min_bits)
    return out, info | {"stream_scale": kappa.tolist()}


def solve_allocation(
    artifact: Artifact,
    bits: float,
    importance: str = "fisher",
    allowed: tuple[int, ...] | None = None,
    stream_response: bool = True,
) -> tuple[np.ndarray, dict]:
    """The [L, H_kv, 2] allocation for an average b̄ from an artifact's importance (or proxy),
    distortion and stream response (`solve_from_tensors`); `allowed` must be a subset of the
    calibration's widths, where the response was measured."""
    hp = artifact.hyperparameters
    t = artifact.tensors
    cal_allowed = alloc.check_allowed_bits(hp["allowed_bits"])
    allowed = cal_allowed if allowed is None else allowed
    missing = sorted(set(allowed) - set(cal_allowed))
    if missing:
        raise ValueError(
            f"ratequant: allowed_bits {list(allowed)} includes {missing}, where this artifact "
            f"measured no stream response (it has {list(cal_allowed)}); pick a subset or "
            "recalibrate with those widths"
        )
    table = np.asarray(t["distortion"], np.float64)
    d = table[..., [MEASURED_BITS.index(b) for b in allowed]]
    kl = np.asarray(t["stream_kl"], np.float64)[:, [cal_allowed.index(b) for b in allowed]]
    w = np.asarray(t["importance" if importance == "fisher" else "proxy_importance"], np.float64)
    max_kl = check_max_stream_kl(hp.get("max_stream_kl"))
    return solve_from_tensors(
        w, d, kl, allowed, bits, int(hp["group_size"]), max_kl, stream_response
    )


def make_caches(model: Any, config: Any, artifact: Artifact | None) -> list:
    dims = ModelDims.of(model)
    kind, allowed, response = _options(config)
    if config.uncalibrated:
        if kind != "fisher" or not response:
            raise ValueError(
                "ratequant: options importance and stream_response apply to the calibrated "
                "method; the uncalibrated variant is the uniform allocation"
            )
        if config.bits is None:
            raise ValueError(
                "ratequant uncalibrated=True needs bits (the average b̄, counting "
                "scale + zero), e.g. KVCacheConfig(method='ratequant', bits=3, "
                "uncalibrated=True)"
            )
        g = DEFAULT_GROUP_SIZE if config.group_size is None else config.group_size
        g, window, sinks = _layout(
            config, dims, kivi.check_group_size(g, dims.D), kivi.DEFAULT_WINDOW, kivi.DEFAULT_SINKS
        )
        bits = alloc.uniform_allocation(
            (dims.L, dims.H_kv, 2), config.bits, allowed or DEFAULT_ALLOWED_BITS, g
        )
        caches = kivi.build_caches(bits, g, window, sinks)
        attention.enable_for(model, caches, "ratequant", auto=kivi.KERNELS_DEFAULT)
        return caches
    if artifact is None:
        raise ValueError(
            "ratequant is calibrated: pass artifact_dir=DIR of a bundle with a "
            "ratequant artifact (or uncalibrated=True for uniform KIVI)"
        )
    check_artifact(artifact, dims)
    hp = artifact.hyperparameters
    g, window, sinks = _layout(
        config, dims, int(hp["group_size"]), int(hp["window"]), int(hp["sinks"])
    )
    target = hp["bits"] if config.bits is None else config.bits
    bits, _ = solve_allocation(artifact, target, kind, allowed, response)
    caches = kivi.build_caches(bits, g, window, sinks)
    # fused attention as for KIVI (kivi.KERNELS_DEFAULT)
    attention.enable_for(model, caches, "ratequant", auto=kivi.KERNELS_DEFAULT)
    return caches


def plot_artifact(artifact: Artifact, path: Path) -> None:
    """Heatmap of importance and of the stored allocation's bits (layers × heads × K/V)."""
    bits = artifact.hyperparameters["bits"]
    write_heatmap(
        path,
        artifact.tensors["importance"],
        artifact.tensors["bits"],
        title=f"RateQuant: Fisher importance and bits at b̄ = {bits}",
    )


METHOD = Method(
    name=NAME,
    summary="RateQuant: Fisher-weighted, water-filled per-head bits for a packed KIVI cache",
    make_caches=make_caches,
    fields=("bits", "group_size", "window", "sinks"),
    options={"importance": "fisher", "allowed_bits": None, "stream_response": True},
    cache_classes=(kivi.KIVICache,),
    calibrated=True,
    capture_point="k_post,v",
    defaults=DEFAULTS,
    calibrate=calibrate,
    tensor_specs=tensor_specs,
    check_hyperparameters=check_hyperparameters,
    check_artifact=check_artifact,
    min_tokens=min_tokens,
    plot=plot_artifact,
)

__all__ = [
    "METHOD",
    "calibrate",
    "make_caches",
    "solve_allocation",
    "write_heatmap",
    "check_artifact",
    "tensor_specs",
    "DEFAULTS",
]
