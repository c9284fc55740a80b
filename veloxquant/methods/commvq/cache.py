"""CommVQCache: pre-RoPE additive commutative codes for keys, product-VQ codes for values.

One cache per layer (DESIGN.md section 7). mlx-lm hands the cache post-RoPE keys at absolute
positions offset .. offset + T − 1. Resident:
- the first `sinks` tokens and the most recent `window` tokens, keys and values in fp16, exactly
  as attention produced them;
- every other token: its key as R 12-bit codes (packed: the high 8 bits of each code, then the low
  4 bits two per byte, R + ceil(R/2) bytes) plus one fp16 scale s = ‖k_pre − μ‖, and its value
  as product-VQ codes (`veloxquant.codes`);
- this layer's codebook: θ [H or 1, R, P, 64, 2], or the shared atoms [H or 1, 1, P, 64, 2]
  with gains [H, R, P, 2] in fp16; θ / atoms in fp16 or int8 with an fp16 scale per pair
  (`theta_scale`); the value codebooks in fp16; μ [H, D] in fp32 when the artifact was trained
  centred. `nbytes` counts exactly these arrays. Every stage's float θ is rebuilt from them per
  call (`stage_theta`) and not kept.

Encode (a token leaving the window): invert RoPE at the token's absolute position
(`mx.fast.rope` with a negated scale, DESIGN.md section 6), subtract μ, divide by the fp16 scale,
greedy separable encoding over the R stages (`codebook.encode_residual`).

Fused attention (`fused_attention`, kernels.py; by default where the CPU kernel runs, elsewhere
with VELOXQUANT_FUSED=1): the same tokens attended straight from the codes, nothing dequantized
kept: the CPU extension's one pass over the codes, GPU kernels for one decode query (not yet
run on a GPU), else the pure-MLX twin, the coded past decoded one piece at a time under an
online softmax.

Fetch (the transient path, the default): decode Σ_r c(a_r, b_r), multiply by s,
add μ, apply RoPE exactly at the coded tokens' positions (they are contiguous, from `sinks` on,
so one `mx.fast.rope` with that offset is the model's own rotation), then concatenate sinks,
coded tokens, window and the call's own tokens in full precision. The dequantized keys and values
are dropped after the call and are not counted.

Incoming keys with NaN/inf raise a ValueError (the check costs one host sync per call).
Batching, `to_quantized` and trimming: see `veloxquant.methods.base.CompressedCache`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx import nn
from mlx_lm.models.cache import create_attention_mask

from veloxquant import attention
from veloxquant.codes import pq_decode, pq_encode
from veloxquant.methods.base import CompressedCache, ModelDims, pack_state, take_sinks, unpack_state
from veloxquant.methods.commvq import codebook as cb
from veloxquant.rope import untapped

DEFAULT_WINDOW = 26
DEFAULT_SINKS = 4
SUPPORTED_ROPE_SCALING = ("default", "linear")


# ---------------------------------------------------------------------------------------------
# RoPE the cache can reproduce exactly


def rope_params(model_or_dims: Any) -> tuple[float, bool, float]:
    """(base, traditional, scale) of the model's RoPE, or a ValueError naming what the cache
    cannot apply exactly: an odd head_dim, partial rotary, or a rope_scaling type other than
    none/default/linear. With a live model whose attention has a `rope` module, that module
    must be a plain `nn.RoPE` over the whole head, and its own parameters are used."""
    dims = ModelDims.of(model_or_dims)
    if dims.D % 2:
        raise ValueError(f"commvq: head_dim {dims.D} is odd; RoPE pairs need an even head_dim")
    if dims.rope_dims is not None and dims.rope_dims != dims.D:
        raise ValueError(
            f"commvq: partial rotary embedding (RoPE on {dims.rope_dims} of {dims.D} head "
            "dims) is not supported: the codebook pairs every channel for RoPE"
        )
    scaling = dims.rope_scaling or {}
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(
            f"commvq: rope_scaling type {kind!r} is not supported (the cache re-applies RoPE "
            f"at decode and can do so exactly only for {list(SUPPORTED_ROPE_SCALING)})"
        )
    scale = 1.0 / float(scaling["factor"]) if kind == "linear" else 1.0
    base, traditional = float(dims.rope_theta), bool(dims.rope_traditional)
    layers = getattr(model_or_dims, "layers", None)
    rope = getattr(getattr(layers[0], "self_attn", None), "rope", None) if layers else None
    if rope is not None:
        rope = untapped(rope)  # a fused VecInfer cache of this model may have tapped it
        if type(rope) is not nn.RoPE:
            raise ValueError(
                f"commvq: the model's RoPE is {type(rope).__name__}, not a plain nn.RoPE; the "
                "cache cannot re-apply it exactly"
            )
        if rope.dims != dims.D:
            raise ValueError(
                f"commvq: partial rotary embedding (RoPE on {rope.dims} of {dims.D} head dims) "
                "is not supported"
            )
        base, traditional, scale = float(rope.base), bool(rope.traditional), float(rope.scale)
    return base, traditional, scale


# ---------------------------------------------------------------------------------------------
# 12-bit code packing for any R (odd R included)


def key_code_bytes(stages: int) -> int:
    """Bytes per token of R packed 12-bit codes: R high bytes + ceil(R/2) nibble bytes."""
    return stages + (stages + 1) // 2


def pack12(codes: mx.array) -> mx.array:
    """codes [..., R] (< 4096) → uint8 [..., key_code_bytes(R)]."""
    r = codes.shape[-1]
    c = codes.astype(mx.uint32)
    high = (c >> 4).astype(mx.uint8)
    low = c & 0xF
    if r % 2:
        low = mx.concatenate([low, mx.zeros((*low.shape[:-1], 1), mx.uint32)], axis=-1)
    nib = (low[..., 0::2] | (low[..., 1::2] << 4)).astype(mx.uint8)
    return mx.concatenate([high, nib], axis=-1)


def unpack12(packed: mx.array, stages: int) -> mx.array:
    """Inverse of `pack12` → uint32 [..., R]."""
    p = packed.astype(mx.uint32)
    high, nib = p[..., :stages], p[..., stages:]
    low = mx.stack([nib & 0xF, nib >> 4], axis=-1).reshape(*nib.shape[:-1], -1)[..., :stages]
    return (high << 4) | low


# ---------------------------------------------------------------------------------------------
# The cache


def _check_finite(x: mx.array, what: str) -> None:
    if not bool(mx.all(mx.isfinite(x)).item()):
        n_bad = int((~mx.isfinite(x)).sum().item())
        raise ValueError(
            f"commvq: {what} contain {n_bad} NaN/inf values; the cache cannot "
            "encode them (check the model weights and dtype)"
        )


class CommVQCache(CompressedCache):
    """CommVQ KV cache for one layer; see the module docstring for what is resident.

    No `bits` attribute (it would route mlx-lm attention to quantized_matmul); not a KVCache
    subclass; `merge` / `to_quantized` as every CompressedCache.
    """

    # Every array the cache holds (None until used): its state, and what nbytes counts.
    array_names = (
        "theta",
        "theta_scale",
        "key_gain",
        "key_mean",
        "value_codebook",
        "key_codes",
        "key_scales",
        "value_codes",
        "window_keys",
        "window_values",
        "sink_keys",
        "sink_values",
    )

    def __init__(
        self,
        theta: mx.array,
        value_codebook: mx.array,
        key_mean: mx.array | None = None,
        *,
        key_gain: mx.array | None = None,
        atom_bits: int = 16,
        rope_base: float,
        rope_traditional: bool,
        rope_scale: float = 1.0,
        value_bits: int,
        value_sub_dim: int,
        window: int = DEFAULT_WINDOW,
        sinks: int = DEFAULT_SINKS,
    ):
        if atom_bits not in (8, 16):
            raise ValueError(f"commvq: atom_bits must be 8 or 16, got {atom_bits!r}")
        self.theta_scale = None
        if theta is None or atom_bits == 16:
            self.theta = None if theta is None else theta.astype(mx.float16)
        else:
            self.theta, self.theta_scale = cb.quantize_atoms(theta.astype(mx.float32))
        self.key_gain = None if key_gain is None else key_gain.astype(mx.float16)
        self.value_codebook = value_codebook.astype(mx.float16)
        self.key_mean = None if key_mean is None else key_mean.astype(mx.float32)
        self.rope_base, self.rope_traditional = float(rope_base), bool(rope_traditional)
        self.rope_scale = float(rope_scale)
        self.value_bits, self.value_sub_dim = int(value_bits), int(value_sub_dim)
        self.window, self.sinks = int(window), int(sinks)
        self.offset = 0
        self.sink_keys = self.sink_values = None
        self.window_keys = self.window_values = None
        self.key_codes = self.key_scales = self.value_codes = None
        self.fused = False  # set by make_caches (veloxquant.attention.enable_for)
        self._route_probe: str | None = None  # set for a loaded state (attention.route_proven)
        self._pending: dict | None = None
        self.last_attention: str | None = None
        self._n_q_heads: int | None = None
        self._validate()

    def _validate(self) -> None:
        self._validate_keys()
        h, d = self.n_heads, self.head_dim
        want = (2**self.value_bits, self.value_sub_dim)
        vb = self.value_codebook
        if vb.ndim != 3 or tuple(vb.shape[1:]) != want or vb.shape[0] not in (1, h):
            raise ValueError(
                f"commvq: value codebook has shape {list(vb.shape)} but d{self.value_sub_dim}"
                f"b{self.value_bits} needs [{h} or 1, {want[0]}, {want[1]}]"
            )
        if d % self.value_sub_dim:
            raise ValueError(f"commvq: value_sub_dim {self.value_sub_dim} must divide head_dim {d}")
        if self.key_mean is not None and tuple(self.key_mean.shape) != (h, d):
            raise ValueError(
                f"commvq: key mean has shape {list(self.key_mean.shape)}, expected {[h, d]}"
            )
        if self.window < 0 or self.sinks < 0:
            raise ValueError(
                f"commvq: window and sinks must be >= 0, got {self.window}, {self.sinks}"
            )
        _check_finite(self.value_codebook, "value codebook")

    def _validate_keys(self) -> None:
        theta, gain = self.theta, self.key_gain
        if theta is None or theta.ndim != 5 or tuple(theta.shape[3:]) != (cb.ATOMS, 2):
            shape = None if self.theta is None else list(self.theta.shape)
            raise ValueError(
                f"commvq: θ has shape {shape}, expected [H or 1, R or 1, P, {cb.ATOMS}, 2]"
            )
        if gain is not None:
            p = int(theta.shape[2])
            if (
                gain.ndim != 4
                or tuple(gain.shape[2:]) != (p, 2)
                or theta.shape[1] != 1
                or gain.shape[0] % theta.shape[0]
            ):
                raise ValueError(
                    f"commvq: key gains have shape {list(gain.shape)} but shared atoms "
                    f"{list(theta.shape)} need [H, R, {p}, 2] with H a multiple of "
                    f"{theta.shape[0]} and one atom set per head or layer"
                )
            _check_finite(gain, "key gains")
        if self.theta_scale is not None:
            want = (*theta.shape[:3], 1, 1)
            if theta.dtype != mx.int8 or tuple(self.theta_scale.shape) != want:
                raise ValueError(
                    f"commvq: 8-bit atoms need int8 θ with scales {list(want)}, got "
                    f"{theta.dtype} θ and scales {list(self.theta_scale.shape)}"
                )
            _check_finite(self.theta_scale, "θ scales")
        else:
            _check_finite(self.theta, "θ")

    def stage_theta(self) -> mx.array:
        """Every stage's θ [H or 1, R, P, 64, 2] in float32, built from the shared atoms and
        gains when the cache has them (transient: only atoms and gains are resident)."""
        gain = None if self.key_gain is None else self.key_gain.astype(mx.float32)
        return cb.apply_gains(cb.dequantize_atoms(self.theta, self.theta_scale), gain)

    @property
    def stages(self) -> int:
        return int((self.theta if self.key_gain is None else self.key_gain).shape[1])

    @property
    def head_dim(self) -> int:
        return 2 * int(self.theta.shape[2])

    @property
    def n_heads(self) -> int:
        # θ and the value codebooks may be shared by the layer's heads ([1, ...]); μ never is.
        sizes = [int(self.theta.shape[0]), int(self.value_codebook.shape[0])]
        if self.key_gain is not None:
            sizes.append(int(self.key_gain.shape[0]))
        if self.key_mean is not None:
            sizes.append(int(self.key_mean.shape[0]))
        return max(sizes)

    # -- RoPE at the cache's absolute positions

    def _rope(self, x: mx.array, offset: int, inverse: bool = False) -> mx.array:
        scale = -self.rope_scale if inverse else self.rope_scale
        return mx.fast.rope(
            x,
            self.head_dim,
            traditional=self.rope_traditional,
            base=self.rope_base,
            scale=scale,
            offset=offset,
        )

    # -- keys: encode / decode (float32)

    def encode_keys(
        self, keys: mx.array, offset: int, theta: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """Post-RoPE keys [B, H, T, D] at positions offset.. → (packed codes
        [B, H, T, bytes] uint8, fp16 scales [B, H, T]). theta: `stage_theta()`, when the
        caller already built it."""
        b, h, t, d = keys.shape
        x = self._rope(keys.astype(mx.float32), offset, inverse=True)
        if self.key_mean is not None:
            x = x - self.key_mean[None, :, None, :]
        scales = mx.sqrt((x * x).sum(axis=-1)).astype(mx.float16)
        _check_finite(scales, "keys to encode")
        x = x / mx.maximum(scales.astype(mx.float32), 1e-30)[..., None]
        theta = self.stage_theta() if theta is None else theta
        g = int(theta.shape[0])  # h, or 1 when the layer's heads share θ
        pairs = cb.to_pairs(
            x.transpose(1, 0, 2, 3).reshape(g, h // g * b * t, d), self.rope_traditional
        )
        codes, _ = cb.encode_residual(pairs, theta)
        codes = codes.reshape(h, b, t, -1).transpose(1, 0, 2, 3)
        return pack12(codes), scales

    def decode_keys(
        self, packed: mx.array, scales: mx.array, offset: int, theta: mx.array | None = None
    ) -> mx.array:
        """Inverse of `encode_keys` up to the quantization: post-RoPE keys [B, H, T, D]."""
        b, h, t, _ = packed.shape
        r = self.stages
        theta = self.stage_theta() if theta is None else theta
        g = int(theta.shape[0])
        codes = unpack12(packed, r).transpose(1, 0, 2, 3).reshape(g, h // g * b * t, r)
        table = cb.gather_table(theta)
        pairs = cb.decode_pairs(codes, table, g, r)
        x = cb.from_pairs(pairs, self.rope_traditional).reshape(h, b, t, -1).transpose(1, 0, 2, 3)
        x = x * scales.astype(mx.float32)[..., None]
        if self.key_mean is not None:
            x = x + self.key_mean[None, :, None, :]
        return self._rope(x, offset)

    def encode_values(self, values: mx.array) -> mx.array:
        return pq_encode(
            values.astype(mx.float32), self.value_codebook, self.value_sub_dim, self.value_bits
        )

    def decode_values(self, packed: mx.array) -> mx.array:
        return pq_decode(
            packed, self.value_codebook, self.value_sub_dim, self.value_bits, self.head_dim
        )

    # -- mlx-lm cache protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.fused and attention.route_proven(self):
            return self._fused_update(keys, values)
        self._check_no_pending()
        self._check_keys(keys)
        self.last_attention = "transient"
        dtype = keys.dtype
        recent_k, recent_v = keys.astype(mx.float32), values.astype(mx.float32)
        recent_k, recent_v, out_sk, out_sv = take_sinks(self, recent_k, recent_v)
        if self.window_keys is not None:
            recent_k = mx.concatenate([self.window_keys.astype(mx.float32), recent_k], axis=2)
            recent_v = mx.concatenate([self.window_values.astype(mx.float32), recent_v], axis=2)
        n_coded = self.compressed_tokens
        n_old = recent_k.shape[2] - self.window
        # Every stage's θ, rebuilt once per call for the decode and the encode below.
        theta = self.stage_theta() if n_coded or n_old > 0 else None
        # Transient dequantization of the coded past; attention sees it, nothing keeps it.
        if n_coded:
            out_k = mx.concatenate(
                [self.decode_keys(self.key_codes, self.key_scales, self.sinks, theta), recent_k],
                axis=2,
            )
            out_v = mx.concatenate([self.decode_values(self.value_codes), recent_v], axis=2)
        else:
            out_k, out_v = recent_k, recent_v
        if out_sk is not None:
            out_k = mx.concatenate([out_sk, out_k], axis=2)
            out_v = mx.concatenate([out_sv, out_v], axis=2)
        self._keep_recent(recent_k, recent_v, theta)
        self.offset += keys.shape[2]
        return out_k.astype(dtype), out_v.astype(dtype)

    def _check_keys(self, keys: mx.array) -> None:
        if keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"commvq: keys have head_dim {keys.shape[-1]}, the codebook {self.head_dim}"
            )
        _check_finite(keys, "keys")

    def _keep_recent(self, recent_k: mx.array, recent_v: mx.array, theta: Any = None) -> None:
        """The window's tokens followed by the call's (float32): encode what falls out of the
        window (from position sinks + coded tokens on) and keep the rest as the window."""
        n_coded = self.compressed_tokens
        n_old = recent_k.shape[2] - self.window
        if n_old > 0:
            theta = self.stage_theta() if theta is None else theta
            # Coded tokens are contiguous from position `sinks`: these start at sinks + n_coded.
            new_kc, new_ks = self.encode_keys(recent_k[:, :, :n_old], self.sinks + n_coded, theta)
            new_vc = self.encode_values(recent_v[:, :, :n_old])
            if self.key_codes is None:
                self.key_codes, self.key_scales, self.value_codes = new_kc, new_ks, new_vc
            else:
                self.key_codes = mx.concatenate([self.key_codes, new_kc], axis=2)
                if new_ks is not None:
                    self.key_scales = mx.concatenate([self.key_scales, new_ks], axis=2)
                self.value_codes = mx.concatenate([self.value_codes, new_vc], axis=2)
            recent_k, recent_v = recent_k[:, :, n_old:], recent_v[:, :, n_old:]
        self.window_keys = recent_k.astype(mx.float16)
        self.window_values = recent_v.astype(mx.float16)

    # -- fused attention (opt-in, VELOXQUANT_FUSED=1): update_and_fetch only updates the cache
    # and returns its inputs; veloxquant.attention routes the model's attention call to
    # `fused_attention`, which decodes the coded past a piece at a time (kernels.py).

    @property
    def attention_path(self) -> str:
        """How decode attention runs: "kernel" (the fused GPU kernels), "cpu-kernel" (the CPU
        extension's one pass over the codes), "reference" (the kernels' algebra in MLX ops, a
        piece of the coded past at a time: a CPU without the extension, or a codebook form the
        kernels do not take, see `kernels.unsupported`) or "transient" (the whole coded past
        decoded, then mlx-lm's attention). `last_attention` says what the latest call
        used (on a GPU, prefill chunks take "reference" when fused)."""
        if not self.fused:
            return "transient"
        from veloxquant.methods.commvq import kernels

        n_q = self._n_q_heads or self.n_heads
        if kernels.kernels_take(self, n_q):
            return "kernel"
        if kernels.cpu_kernel_takes(self):
            return "cpu-kernel"
        return "reference"

    def _fused_update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._check_no_pending()
        self._check_keys(keys)
        # what this call's attention reads: the codes before this call's encode (replaced, never
        # written, by an append), the sinks, the window before the call and the call's tokens
        pending = {
            "n_coded": self.compressed_tokens,
            "codes": (self.key_codes, self.key_scales, self.value_codes),
            "win": None if self.window_keys is None else (self.window_keys, self.window_values),
        }
        own_sinks = self.offset < self.sinks
        recent_k, recent_v = keys.astype(mx.float32), values.astype(mx.float32)
        recent_k, recent_v, out_sk, out_sv = take_sinks(self, recent_k, recent_v)
        pending["sinks"] = (out_sk, out_sv) if own_sinks else None
        pending["new"] = (recent_k, recent_v)
        if self.window_keys is not None:
            recent_k = mx.concatenate([self.window_keys.astype(mx.float32), recent_k], axis=2)
            recent_v = mx.concatenate([self.window_values.astype(mx.float32), recent_v], axis=2)
        self._keep_recent(recent_k, recent_v)
        self.offset += keys.shape[2]
        self._pending = pending
        return keys, values

    def fused_attention(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of `queries` over everything the cache held for the latest update, in
        the model's dtype, without decoding the coded past whole: the GPU kernels for a single
        decode query, the CPU kernel where it runs (`kernels.cpu_kernel_takes`), the pure-MLX
        twin (a piece of the coded past at a time) otherwise."""
        from veloxquant.methods.commvq import kernels

        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("CommVQCache.fused_attention: no update to attend over")
        b, n_q, n, _ = queries.shape
        self._n_q_heads = n_q
        if b == 1 and n == 1 and mask is None and kernels.kernels_take(self, n_q):
            self.last_attention = "kernel"
            return kernels.decode_attention(self, queries, scale, pending)
        if kernels.cpu_kernel_takes(self, mask):
            self.last_attention = "cpu-kernel"
            return kernels.cpu_kernel_attention(self, queries, scale, mask, pending)
        self.last_attention = "reference"
        return kernels.reference_attention(self, queries, scale, mask, pending)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # Nothing is evicted, so the stored length is always the absolute offset.
        return create_attention_mask(N, self.offset, return_array, window_size)

    def _arrays(self) -> dict[str, mx.array | None]:
        return {name: getattr(self, name) for name in self.array_names}

    @property
    def compressed_tokens(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.shape[2]

    @property
    def nbytes(self) -> int:
        # Everything resident and nothing else: packed codes and fp16 scales, the fp16 window
        # and sinks, this layer's fp16 θ and value codebooks and f32 μ, and the copies of those
        # the GPU kernels read (once they exist). The dequantized keys and values built in
        # update_and_fetch are transient and not counted.
        from veloxquant.methods.commvq import kernels

        own = sum(a.nbytes for a in self._arrays().values() if a is not None)
        return int(own + kernels.kernel_bytes(self))

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "window": self.window,
            "sinks": self.sinks,
            "rope_base": self.rope_base,
            "rope_traditional": self.rope_traditional,
            "rope_scale": self.rope_scale,
            "value_bits": self.value_bits,
            "value_sub_dim": self.value_sub_dim,
        }

    @property
    def state(self) -> dict[str, Any]:
        return pack_state(self._arrays(), self.meta_state)

    @state.setter
    def state(self, v: Any) -> None:
        arrays, meta = unpack_state(type(self).__name__, v)
        for name in self.array_names:
            setattr(self, name, arrays.get(name))
        self._set_meta(meta)
        # from_state skips __init__. A loaded cache attends the way a fresh one would in this
        # process (make_caches: fused by default where the CPU kernel runs, elsewhere when
        # VELOXQUANT_FUSED=1), once its first update has shown the model's attention routed
        # (attention.route_proven)
        from veloxquant.methods.commvq import kernels

        cpu_kernel = kernels.cpu_kernel_here()
        self.fused = attention.wanted_for(cpu_kernel, cpu_kernel)
        self._route_probe = "loaded" if self.fused else None
        if self.fused:
            attention.install()
        self._pending, self.last_attention = None, None
        self._n_q_heads = None
        self.__dict__.pop("_kernel_memo", None)  # kernels.py's memo of the arrays just replaced
        self._validate()

    def _set_meta(self, meta: dict[str, Any]) -> None:
        self.offset, self.window, self.sinks = (
            int(meta["offset"]),
            int(meta["window"]),
            int(meta["sinks"]),
        )
        self.rope_base, self.rope_scale = float(meta["rope_base"]), float(meta["rope_scale"])
        self.rope_traditional = bool(meta["rope_traditional"])
        self.value_bits, self.value_sub_dim = int(meta["value_bits"]), int(meta["value_sub_dim"])


# load_prompt_cache resolves class names in mlx_lm.models.cache.
mlx_cache.CommVQCache = CommVQCache
