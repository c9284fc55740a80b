"""CommVQ: RoPE-commutative additive vector quantization of pre-RoPE keys.

Paper: "CommVQ: Commutative Vector Quantization for KV Cache Compression" (Li et al., ICML 2025,
arXiv 2506.18879); official code UMass-Embodied-AGI/CommVQ. DESIGN.md section 8.

Codebook (`codebook.py`): a key head vector is P = D/2 complex numbers, paired in the model's own
RoPE layout (interleaved (2j, 2j+1) for rope_traditional, else half-split (j, j + D/2)). R
additive stages; stage r has parameters θ_r [P, 64, 2] and 4096 codewords, code (a, b) giving
c_j = t_ja + i·t_jb on pair j: a multiplication by a complex number, so RoPE commutes with it and
the codes never depend on the position. 12 bits per stage: R·12/D code bits per key element.
Encoding is separable (two [D] x [D, 64] products and a 64 x 64 table per token and stage), never
a 4096 x D distance matrix.

Parameterisation (`atoms`): the paper's free θ per stage costs R·P·64 complex numbers per KV
head, 5.5 bits per K/V element at 1024 tokens on SmolLM2 in fp16, more than everything else
resident together. The default ("shared") keeps one set of 64 atoms per pair for all stages and a
complex gain per (KV head, stage, pair): θ_r = g_r·atoms, still a complex multiple per pair, so
still RoPE-commutative (`codebook.apply_gains`). The atoms are held in int8 with one fp16 scale
per pair (`atom_bits`). Together 0.34 bits per element at 1024 tokens; they amortise with context
like any codebook, and for long contexts the paper's layout ("stage") is an option.

Calibration (`train.py`, from a capture's `k_pre`, `v` and, for diagnostics, `q_post`):
- keys per (layer, KV head): optional mean removal (`center`: μ = E k_pre is coded exactly
  apart, since RoPE is linear), per-token norm scaling, then EM whose M-step is the
  commutativity projection (a weighted least-squares fit of θ; soft with an annealed temperature
  or hard), greedy on the residual between stages: for every stage (atoms="stage") or for stage
  0, whose θ becomes the shared atoms, the later stages fitting gains and least-squares refits of
  atoms and gains (atoms="shared"); fixed seed;
- values: VecInfer-style product-VQ k-means codebooks per layer (`value_share`, d4b8 default);
- diagnostics on held-out tokens: per-stage key MSE and relative error, the relative attention-
  logit error E[(q·(k − k̂))²] / Var_k[q·k] with the KV head's own queries, the key-mean share,
  value error; the pair layout is recorded in the diagnostics and checked against the model.

Runtime (`cache.py`, `CommVQCache`): keys arrive post-RoPE; RoPE is inverted at the cache's own
absolute positions, the pre-RoPE key is coded (12-bit codes packed, one fp16 scale per token);
at fetch the codeword sums are decoded and RoPE is applied exactly at each token's position
(transient dequantization where nothing fuses; the fused path attends from the codes,
`kernels.py`: the CPU extension's kernel, by default where it is built; GPU kernels for a
decode query with VELOXQUANT_FUSED=1, not yet run on a GPU; elsewhere a piece of the coded
past decoded at a time under an online softmax). fp16 sinks and a recent
fp16 window stay exact, as in VecInfer. `nbytes` counts codes, scales, window, sinks, atoms (or
θ) with their scales, gains, μ and the value codebooks, i.e. every resident array. Only RoPE the
cache can re-apply exactly is accepted: full rotary, rope_scaling none/default/linear.

Knobs: KVCacheConfig.window (fp16 recent tokens, default 26, VecInfer's), KVCacheConfig.sinks
(default 4); options `key_bits` / `stages` (R = round(key_bits·D/12) unless stages is given;
D = 64: 2 bits → R = 11, 1 bit → R = 5), `atoms`, `share` ("head": per KV head; "layer": one atom
set or θ per layer), `atom_bits`, `value_sub_dim`, `value_bits`, `value_share`, `seed` shape the
uncalibrated variant and are checked against the artifact for the calibrated one. Calibration
hyperparameters: `train.DEFAULTS`.

Uncalibrated variant (`KVCacheConfig(method="commvq", uncalibrated=True)`, no bundle): the
data-free initialisation, no EM, no key mean. θ is i.i.d. Gaussian with stage r scaled for the
residual a unit-energy Gaussian source leaves after r stages at Shannon's distortion-rate bound
(`codebook.gaussian_theta`); in the shared form the atoms are that stage 0 and the gains the
real scales ρ^(r/2) of the later stages (`codebook.gaussian_shared`). Value codebooks are k-means
on N(0, 1) samples as in VecInfer's reference. Keys are still normalised per token and RoPE is
still exact.

Caveat: the paper ran prefill attention at full precision. Our eval feeds the prompt through the
cache: the first `prefill` tokens in one call (attention among them is exact, as in any cache that
returns the call's own tokens), then `chunk`-token calls, each of which attends to the coded past.
So everything after the first call IS compressed attention, prefill chunks included.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant import attention
from veloxquant.methods.base import Artifact, Method, ModelDims, TensorSpec
from veloxquant.methods.commvq import codebook, kernels
from veloxquant.methods.commvq.cache import (
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    CommVQCache,
    rope_params,
)
from veloxquant.methods.commvq.train import (
    DEFAULTS,
    calibrate,
    check_hyperparameters,
    min_tokens,
    resolve_stages,
)

# KVCacheConfig.options: None means "from the artifact" (calibrated) or DEFAULTS
# (uncalibrated); a value given for a calibrated cache must match the artifact.
OPTIONS: dict[str, Any] = {
    "key_bits": None,
    "stages": None,
    "share": None,
    "atoms": None,
    "atom_bits": None,
    "value_sub_dim": None,
    "value_share": None,
    "value_bits": None,
    "seed": None,
}


# What an artifact calibrated before these hyperparameters existed was: a free fp16 θ per stage
# and per-head value codebooks. Filled in for keys an artifact lacks, so older bundles load.
BEFORE_SHARED_ATOMS: dict[str, Any] = {"atoms": "stage", "atom_bits": 16, "value_share": "head"}


def artifact_hyperparameters(hp: dict[str, Any] | None) -> dict[str, Any]:
    """An artifact's hyperparameters with DEFAULTS and `BEFORE_SHARED_ATOMS` for absent keys."""
    return {**DEFAULTS, **BEFORE_SHARED_ATOMS, **(hp or {})}


def tensor_specs(dims: ModelDims, hp: dict[str, Any]) -> dict[str, TensorSpec]:
    hp = {**BEFORE_SHARED_ATOMS, **hp}
    r = resolve_stages(dims.D, hp)
    shared = hp["atoms"] == "shared"
    specs = {
        "key_theta": TensorSpec(
            (
                dims.L,
                dims.H_kv if hp["share"] == "head" else 1,
                1 if shared else r,
                dims.P,
                codebook.ATOMS,
                2,
            ),
            "float32",
        ),
        "value_codebook": TensorSpec(
            (
                dims.L,
                dims.H_kv if hp["value_share"] == "head" else 1,
                2 ** hp["value_bits"],
                hp["value_sub_dim"],
            ),
            "float32",
        ),
    }
    if shared:
        specs["key_gain"] = TensorSpec((dims.L, dims.H_kv, r, dims.P, 2), "float32")
    if hp["center"]:
        specs["key_mean"] = TensorSpec((dims.L, dims.H_kv, dims.D), "float32")
    return specs


def check_artifact(artifact: Artifact, dims: ModelDims) -> None:
    """Pair layout, stage count and finiteness of a commvq artifact against the model."""
    hp = artifact_hyperparameters(artifact.hyperparameters)
    want = codebook.layout_name(dims.rope_traditional)
    have = (artifact.diagnostics or {}).get("pair_layout")
    if have is None and hp.get("pair_layout") not in (None, "auto"):
        have = hp["pair_layout"]
    if have is None:
        raise ValueError("commvq artifact does not record its RoPE pair layout; recalibrate it")
    if have != want:
        raise ValueError(
            f"commvq: the artifact was trained with {have!r} RoPE pairs but the model pairs "
            f"{want!r} (rope_traditional={dims.rope_traditional}); its codebooks would pair the "
            "wrong channels. Calibrate on this model's capture."
        )
    r = resolve_stages(dims.D, hp)
    shared = hp["atoms"] == "shared"
    if shared != ("key_gain" in artifact.tensors):
        raise ValueError(
            f"commvq artifact says atoms={hp['atoms']!r} but "
            f"{'lacks' if shared else 'has'} key_gain; recalibrate it"
        )
    stages_tensor = artifact.tensors["key_gain" if shared else "key_theta"]
    if stages_tensor.shape[2] != r:
        raise ValueError(
            f"commvq: the artifact codes {stages_tensor.shape[2]} stages but its "
            f"hyperparameters say R={r}"
        )
    for name, x in artifact.tensors.items():
        if not bool(mx.all(mx.isfinite(mx.array(x))).item()):
            raise ValueError(f"commvq artifact tensor {name} contains NaN/inf; recalibrate")
    if hp["center"] and "key_mean" not in artifact.tensors:
        raise ValueError("commvq artifact was trained centred but has no key_mean")


def _options(config: Any) -> dict[str, Any]:
    options = {
        k: v for k, v in dict(getattr(config, "options", None) or {}).items() if v is not None
    }
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"commvq: unknown options {unknown}; known: {list(OPTIONS)}")
    return options


def make_caches(model: Any, config: Any, artifact: Artifact | None) -> list[CommVQCache]:
    """One CommVQCache per layer: from the artifact, or the uncalibrated variant when
    artifact is None (config.uncalibrated)."""
    dims = ModelDims.of(model)
    base, traditional, scale = rope_params(model)
    window = DEFAULT_WINDOW if getattr(config, "window", None) is None else int(config.window)
    sinks = DEFAULT_SINKS if getattr(config, "sinks", None) is None else int(config.sinks)
    options = _options(config)
    if artifact is None:
        hp = {**DEFAULTS, **{k: v for k, v in options.items()}}
        check_hyperparameters(hp)
        r = resolve_stages(dims.D, hp)
        h_share = dims.H_kv if hp["share"] == "head" else 1
        seed_key = mx.random.key(int(hp["seed"]))
        if hp["atoms"] == "shared":
            theta, gains = codebook.gaussian_shared(
                seed_key, dims.L * h_share, dims.L * dims.H_kv, r, dims.P
            )
            gains = gains.reshape(dims.L, dims.H_kv, *gains.shape[1:])
        else:
            theta, gains = codebook.gaussian_theta(seed_key, dims.L * h_share, r, dims.P), None
        theta = theta.reshape(dims.L, h_share, *theta.shape[1:])
        from veloxquant.methods.vecinfer import gaussian_codebook

        vbook = gaussian_codebook(hp["value_sub_dim"], hp["value_bits"], int(hp["seed"]))
        v_share = dims.H_kv if hp["value_share"] == "head" else 1
        vbooks = mx.broadcast_to(vbook[None, None], (dims.L, v_share, *vbook.shape))
        means = None
    else:
        check_artifact(artifact, dims)
        hp = artifact_hyperparameters(artifact.hyperparameters)
        theta, vbooks = artifact.tensors["key_theta"], artifact.tensors["value_codebook"]
        gains = artifact.tensors.get("key_gain")
        means = artifact.tensors.get("key_mean")
        r = int((theta if gains is None else gains).shape[2])
        for name, value in options.items():
            if name in ("key_bits", "stages"):
                asked_hp = {**hp, name: value}
                if name == "key_bits":
                    asked_hp["stages"] = None  # key_bits alone decides R
                asked = resolve_stages(dims.D, asked_hp)
                if asked != r:
                    raise ValueError(
                        f"commvq: options ask for {name}={value!r} (R={asked} stages) but the "
                        f"artifact has R={r} ({r * codebook.CODE_BITS / dims.D:.3g} key bits per "
                        "element); point artifact_dir at a bundle calibrated that way"
                    )
            elif hp.get(name) != value:
                raise ValueError(
                    f"commvq: options ask for {name}={value!r} but the artifact "
                    f"was calibrated with {name}={hp.get(name)!r}"
                )
        theta, vbooks = mx.array(theta), mx.array(vbooks)
        gains = None if gains is None else mx.array(gains)
        means = None if means is None else mx.array(means)
    caches = [
        CommVQCache(
            theta[i],
            vbooks[i],
            None if means is None else means[i],
            key_gain=None if gains is None else gains[i],
            atom_bits=int(hp["atom_bits"]),
            rope_base=base,
            rope_traditional=traditional,
            rope_scale=scale,
            value_bits=hp["value_bits"],
            value_sub_dim=hp["value_sub_dim"],
            window=window,
            sinks=sinks,
        )
        for i in range(dims.L)
    ]
    # the fused path by default (VELOXQUANT_FUSED=auto) where the CPU kernel runs; on a GPU only
    # when VELOXQUANT_FUSED=1: its GPU kernels have not yet run on a GPU
    cpu_kernel = kernels.cpu_kernel_here()
    attention.enable_for(model, caches, "commvq", auto=cpu_kernel, cpu_kernel=cpu_kernel)
    return caches


METHOD = Method(
    name="commvq",
    summary="CommVQ: RoPE-commutative pre-RoPE key codes trained by EM, k-means value codes",
    make_caches=make_caches,
    fields=("sinks", "window"),
    options=OPTIONS,
    cache_classes=(CommVQCache,),
    calibrated=True,
    capture_point="k_pre,v,q_post",
    defaults=DEFAULTS,
    calibrate=calibrate,
    tensor_specs=tensor_specs,
    check_hyperparameters=check_hyperparameters,
    check_artifact=check_artifact,
    min_tokens=min_tokens,
)

__all__ = ["METHOD", "CommVQCache", "calibrate", "check_artifact", "make_caches", "tensor_specs"]
