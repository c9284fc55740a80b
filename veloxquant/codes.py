"""Product-VQ codes: packing into bytes, encoding to the nearest codeword, decoding.

Shared by every method that stores vector-quantized keys or values (VecInfer; CommVQ's values).
A D-vector is cut into M = D / d sub-vectors; each sub-vector stores the index of its nearest
codeword in a [K = 2^bits, d] codebook. Codes are packed as tightly as the bit width allows
(`code_bytes`), and a cache's `nbytes` counts the packed bytes.
"""

from __future__ import annotations

import math

import mlx.core as mx

from veloxquant.kmeans import nearest


def code_bytes(bits: int, n_codes: int) -> int:
    """Bytes per vector of n_codes codes of `bits` bits, packed back to back into whole bytes:
    ceil(n_codes · bits / 8)."""
    return -(-n_codes * bits // 8)


def _word_groups(bits: int, n_codes: int) -> tuple[int, int, mx.Dtype] | None:
    """How whole bytes and whole codes line up: lcm(bits, 8) bits hold `per` codes in `n_bytes`
    bytes. (n_bytes, per, word dtype) when that group fits a 64-bit word and the codes fill whole
    groups, else None."""
    group = math.lcm(bits, 8)
    if group > 64 or (n_codes * bits) % group:
        return None
    return group // 8, group // bits, mx.uint32 if group <= 32 else mx.uint64


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes [..., M] (< 2**bits) -> packed uint8 [..., code_bytes(bits, M)], little-endian bit
    order. Widths whose codes and bytes line up within 64 bits (1-8, 10, 12, 14, 16 bits, when
    the codes fill whole groups) go through one integer word per group; every other width through
    a bit expansion."""
    m = codes.shape[-1]
    lead = codes.shape[:-1]
    if bits == 8:
        return codes.astype(mx.uint8)
    words = _word_groups(bits, m)
    if words is not None:
        n_bytes, per, word = words
        c = codes.astype(word).reshape(*lead, m // per, per)
        w = (c << (mx.arange(per, dtype=word) * bits)).sum(axis=-1)  # disjoint bits: sum = or
        packed = (w[..., None] >> (mx.arange(n_bytes, dtype=word) * 8)) & 0xFF
        return packed.reshape(*lead, m // per * n_bytes).astype(mx.uint8)
    c = codes.astype(mx.uint32)
    n_bytes = code_bytes(bits, m)
    bit = (c[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1  # [..., M, bits]
    bit = bit.reshape(*lead, m * bits)
    pad = n_bytes * 8 - m * bits
    if pad:
        bit = mx.concatenate([bit, mx.zeros((*lead, pad), dtype=mx.uint32)], axis=-1)
    bit = bit.reshape(*lead, n_bytes, 8)
    return (bit << mx.arange(8, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint8)


def unpack_codes(packed: mx.array, bits: int, n_codes: int) -> mx.array:
    """Inverse of `pack_codes` -> [..., n_codes] uint32."""
    m = n_codes
    lead = packed.shape[:-1]
    if bits == 8:
        return packed.astype(mx.uint32)
    words = _word_groups(bits, m)
    if words is not None:
        n_bytes, per, word = words
        p = packed.astype(word).reshape(*lead, m // per, n_bytes)
        w = (p << (mx.arange(n_bytes, dtype=word) * 8)).sum(axis=-1)
        c = (w[..., None] >> (mx.arange(per, dtype=word) * bits)) & ((1 << bits) - 1)
        return c.reshape(*lead, m).astype(mx.uint32)
    p = packed.astype(mx.uint32)
    bit = (p[..., None] >> mx.arange(8, dtype=mx.uint32)) & 1  # [..., n_bytes, 8]
    bit = bit.reshape(*lead, -1)[..., : m * bits].reshape(*lead, m, bits)
    return (bit << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1)


def pq_encode(x: mx.array, codebook: mx.array, sub_dim: int, bits: int) -> mx.array:
    """x [B, H, T, D] float32, codebook [H or 1, K, d] -> packed codes [B, H, T, bytes]."""
    b, h, t, d = x.shape
    m = d // sub_dim
    sub = x.transpose(1, 0, 2, 3).reshape(h, b * t * m, sub_dim)
    codes, _ = nearest(sub, codebook.astype(mx.float32))
    return pack_codes(codes.reshape(h, b, t, m).transpose(1, 0, 2, 3), bits)


# Codes of up to this many bits are gathered two at a time from a table of codeword pairs
# (K² rows: 4096 for 6 bits, 64 KiB at d = 2).
PAIR_BITS = 6


def pq_decode(packed: mx.array, codebook: mx.array, sub_dim: int, bits: int, dim: int) -> mx.array:
    """packed [B, H, T, bytes], codebook [H or 1, K, d] -> float32 vectors [B, H, T, dim].

    Decoding is a gather, and on the CPU `mx.take` costs about the same per index whatever the
    row's width: two codes read as one 2·bits-bit index into a table of codeword pairs halve the
    indices (benchmarks/results/bench_vecinfer-default-layout-cpu.txt). The packed bit stream
    reads the same either way, and the result is the same copies of the same codewords, bit for
    bit. Spans shorter than the table decode one code at a time."""
    b, h, t, _ = packed.shape
    m = dim // sub_dim
    n_books, k, _ = codebook.shape
    book = codebook.astype(mx.float32)
    if bits <= PAIR_BITS and m % 2 == 0 and b * h * t * m // 2 >= n_books * k * k:
        # row i = (codeword i mod K, codeword i div K): the low code comes first in the stream
        book = mx.concatenate([mx.tile(book, (1, k, 1)), mx.repeat(book, k, axis=1)], axis=-1)
        bits, m, k, sub_dim = 2 * bits, m // 2, k * k, 2 * sub_dim
    codes = unpack_codes(packed, bits, m)
    if n_books > 1:
        codes = codes + (mx.arange(h, dtype=mx.uint32) * k)[None, :, None, None]
    words = mx.take(book.reshape(n_books * k, sub_dim), codes, axis=0)
    return words.reshape(b, h, t, m * sub_dim)
