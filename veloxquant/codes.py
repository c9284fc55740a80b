"""Product-VQ codes: packing into bytes, encoding to the nearest codeword, decoding.

Shared by every method that stores vector-quantized keys or values (VecInfer; CommVQ's values).
A D-vector is cut into M = D / d sub-vectors; each sub-vector stores the index of its nearest
codeword in a [K = 2^bits, d] codebook. Codes are packed as tightly as the bit width allows
(`code_bytes`), and a cache's `nbytes` counts the packed bytes.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant.kmeans import nearest


def code_bytes(bits: int, n_codes: int) -> int:
    """Bytes per vector of n_codes codes of `bits` bits, packed back to back into whole bytes:
    ceil(n_codes · bits / 8)."""
    return -(-n_codes * bits // 8)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes [..., M] (< 2**bits) -> packed uint8 [..., code_bytes(bits, M)], little-endian bit
    order. Byte-aligned widths (8, and 1/2/4 when they fill whole bytes) and 12 bits (two codes
    per 3 bytes) take fast paths; every other width goes through a bit expansion."""
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
    n_bytes = code_bytes(bits, m)
    bit = (c[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1  # [..., M, bits]
    bit = bit.reshape(*c.shape[:-1], m * bits)
    pad = n_bytes * 8 - m * bits
    if pad:
        bit = mx.concatenate([bit, mx.zeros((*c.shape[:-1], pad), dtype=mx.uint32)], axis=-1)
    bit = bit.reshape(*c.shape[:-1], n_bytes, 8)
    return (bit << mx.arange(8, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint8)


def unpack_codes(packed: mx.array, bits: int, n_codes: int) -> mx.array:
    """Inverse of `pack_codes` -> [..., n_codes] uint32."""
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
    bit = (p[..., None] >> mx.arange(8, dtype=mx.uint32)) & 1  # [..., n_bytes, 8]
    bit = bit.reshape(*p.shape[:-1], -1)[..., : m * bits].reshape(*p.shape[:-1], m, bits)
    return (bit << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1)


def pq_encode(x: mx.array, codebook: mx.array, sub_dim: int, bits: int) -> mx.array:
    """x [B, H, T, D] float32, codebook [H or 1, K, d] -> packed codes [B, H, T, bytes]."""
    b, h, t, d = x.shape
    m = d // sub_dim
    sub = x.transpose(1, 0, 2, 3).reshape(h, b * t * m, sub_dim)
    codes, _ = nearest(sub, codebook.astype(mx.float32))
    return pack_codes(codes.reshape(h, b, t, m).transpose(1, 0, 2, 3), bits)


def pq_decode(packed: mx.array, codebook: mx.array, sub_dim: int, bits: int, dim: int) -> mx.array:
    """packed [B, H, T, bytes], codebook [H or 1, K, d] -> float32 vectors [B, H, T, dim]."""
    b, h, t, _ = packed.shape
    m = dim // sub_dim
    codes = unpack_codes(packed, bits, m)
    n_books, k, _ = codebook.shape
    if n_books > 1:
        codes = codes + (mx.arange(h, dtype=mx.uint32) * k)[None, :, None, None]
    words = mx.take(codebook.astype(mx.float32).reshape(n_books * k, sub_dim), codes, axis=0)
    return words.reshape(b, h, t, m * sub_dim)
