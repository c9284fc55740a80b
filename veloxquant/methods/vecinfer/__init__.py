"""VecInfer: smoothed + Hadamard-rotated product-VQ KV cache, codebooks calibrated on real keys.

Paper: "VecInfer: Efficient LLM Inference with Low-Bit KV Cache via Outlier-Suppressed Vector
Quantization", arXiv 2510.06175 (no public code). DESIGN.md section 8.

- transform.py  smooth scales λ and the Walsh-Hadamard rotation k̃ = H·(k ⊘ λ)
- calibrate.py  key/value means, smooth scales λ, product k-means codebooks per (layer, KV head)
                or per layer (keys on the smoothed, rotated residual; values on theirs),
                held-out diagnostics; the Gaussian codebooks of the uncalibrated variant
- cache.py      `VecInferCache`: packed codes + fp16 window and sinks; transient dequantisation

Configs are named d{sub_dim}b{bits}: d2b6 = 3 bits/element, d4b8 = 2, d8b12 = 1.5. The default
codes keys d2b6 (codebooks per KV head) and values d4b8 (one codebook per layer).

Knobs: KVCacheConfig.window (fp16 recent tokens, default DEFAULT_WINDOW), KVCacheConfig.sinks
(default 4); options (the shape hyperparameters: key_sub_dim, key_bits, value_sub_dim,
value_bits, share, value_share, hadamard) choose the uncalibrated variant's shape, or are
checked against the artifact.
Ablations (no smoothing, no Hadamard, per-layer codebooks, d8b12) are separate bundles of the
same method whose recorded hyperparameters say what they are: point artifact_dir at them.

Uncalibrated reference (`KVCacheConfig(method="vecinfer", uncalibrated=True)`, no bundle):
codebooks trained by the same k-means on N(0, 1) samples, λ = 1, Hadamard on: what upstream
ships.
"""

from veloxquant.methods.base import Method
from veloxquant.methods.vecinfer.cache import (
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    VecInferCache,
    make_caches,
)
from veloxquant.methods.vecinfer.calibrate import (
    DEFAULTS,
    SHAPE_KEYS,
    calibrate,
    calibrate_vecinfer,
    check_artifact,
    check_hyperparameters,
    gaussian_codebook,
    min_tokens,
    tensor_specs,
)
from veloxquant.methods.vecinfer.transform import (
    check_hadamard_dim,
    inverse_smooth_transform,
    query_transform,
    smooth_scales,
    smooth_transform,
)

METHOD = Method(
    name="vecinfer",
    summary="VecInfer product VQ (3-bit d2b6 keys, 2-bit d4b8 values by default): smoothed + "
    "Hadamard-rotated, mean-removed keys, codebooks k-means-trained on captured keys/values, "
    "fp16 window and sinks",
    make_caches=make_caches,
    fields=("sinks", "window"),
    options={k: DEFAULTS[k] for k in SHAPE_KEYS},
    cache_classes=(VecInferCache,),
    calibrated=True,
    capture_point="k_post,v",
    defaults=DEFAULTS,
    calibrate=calibrate,
    tensor_specs=tensor_specs,
    check_hyperparameters=check_hyperparameters,
    check_artifact=check_artifact,
    min_tokens=min_tokens,
)

__all__ = [
    "METHOD",
    "VecInferCache",
    "DEFAULTS",
    "DEFAULT_SINKS",
    "DEFAULT_WINDOW",
    "SHAPE_KEYS",
    "calibrate_vecinfer",
    "gaussian_codebook",
    "check_hadamard_dim",
    "smooth_scales",
    "smooth_transform",
    "inverse_smooth_transform",
    "query_transform",
]
