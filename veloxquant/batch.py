"""Batched generation with veloxquant caches: `BatchedCache`, what their `merge` returns.

mlx-lm batches generation (`mlx_lm.batch_generate`, `BatchGenerator`, the batching path of
`mlx_lm.server`) by merging each layer's per-sequence caches with `merge`, then driving the
merged cache with `update_and_fetch`, `make_mask`, `prepare`/`finalize` (right-padded prefill),
`filter`, `extend` and `extract`. mlx-lm's own `BatchKVCache` is uncompressed, so a
compressing cache cannot hand its sequences to it.

`BatchedCache` keeps one of our single-sequence caches per row instead. Each row is updated
with exactly its own tokens (the right padding of a ragged prefill never reaches a cache), so
each sequence evicts, encodes and keeps exactly what it would alone; `nbytes` is the sum of the
rows' `nbytes`. The model's projections and MLP run batched; the caches' own work runs
row by row, and the rows' keys/values are padded on the left to a common length only for the
attention call (transient, like VecInfer's dequantized keys):

    row i, S = max_i size_i + N:   [ pad (max - size_i) | past (size_i) | chunk (N) ]

`make_mask` masks each row's left pad and is causal over the chunk; padded chunk positions of a
ragged prefill sit after every real query of their row, so causality hides them. `offset` is
each row's absolute position (an array, as in `BatchKVCache`), so RoPE phases are exact.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


class BatchedCache(_BaseCache):
    """One layer's cache for a batch of sequences: a list of single-sequence caches."""

    def __init__(self, caches: list):
        if not caches:
            raise ValueError("BatchedCache needs at least one sequence's cache.")
        self.caches = list(caches)
        # The batch is attended by mlx-lm's attention on the concatenated rows, so no row may
        # take a fused path (veloxquant.attention) that leaves attention to the cache itself.
        for row in self.caches:
            if getattr(row, "fused", False):
                row.fused = False
        # Real tokens each row still expects in a right-padded prefill (None: no padding).
        self._remaining: list[int] | None = None

    # -- building and reshaping the batch (what BatchGenerator calls) -----------------------

    @classmethod
    def merge(cls, caches: list) -> BatchedCache:
        """Batch single-sequence caches (or batches of them). The rows are shallow copies: our
        caches replace their arrays on update and never write into them, so the inputs (e.g.
        mlx-lm's prompt-cache entries) stay as they were."""
        rows = []
        for c in caches:
            rows += c.caches if isinstance(c, BatchedCache) else [c]
        kinds = {type(r).__name__ for r in rows}
        if len(kinds) != 1:
            raise ValueError(f"Cannot batch different cache classes in one layer: {kinds}.")
        return cls([copy.copy(r) for r in rows])

    def filter(self, batch_indices: Any) -> None:
        idx = _ints(batch_indices)
        self.caches = [self.caches[i] for i in idx]
        if self._remaining is not None:
            self._remaining = [self._remaining[i] for i in idx]

    def extend(self, other: BatchedCache) -> None:
        if self._remaining is not None or other._remaining is not None:
            raise ValueError("Cannot extend a batch in the middle of a padded prefill.")
        self.caches += other.caches

    def extract(self, idx: int) -> Any:
        """Row `idx` as a single-sequence cache (a snapshot: later batch steps do not change
        it), e.g. for mlx-lm's prompt cache."""
        return copy.copy(self.caches[idx])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None and max(_ints(left_padding)) > 0:
            raise NotImplementedError(
                "BatchedCache takes right-padded prompts only (as mlx-lm's BatchGenerator "
                "feeds them); left padding would put pad tokens into compressed caches."
            )
        if right_padding is not None and max(_ints(right_padding)) > 0:
            if lengths is None:
                raise ValueError("prepare(right_padding=...) needs lengths= as well.")
            self._remaining = _ints(lengths)

    def finalize(self) -> None:
        if self._remaining is not None and any(self._remaining):
            raise ValueError(f"Prefill ended with real tokens still expected: {self._remaining}")
        self._remaining = None

    # -- the cache protocol ------------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches])

    def _sizes(self) -> list[int]:
        return [c.size() for c in self.caches]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError(
                "veloxquant caches do not support sliding-window attention layers."
            )
        sizes = self._sizes()
        longest = max(sizes)
        if all(s == longest for s in sizes):
            # no left pad anywhere: the usual bottom-right causal mask
            if N == 1:
                return None
            if not return_array:
                return "causal"
        pad = mx.array([longest - s for s in sizes])[:, None, None, None]
        k = mx.arange(longest + N)[None, None, None, :]
        q = mx.arange(longest, longest + N)[None, None, :, None]
        return (k <= q) & (k >= pad)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, _, N, _ = keys.shape
        if B != len(self.caches):
            raise ValueError(f"Batch of {B} sequences for a cache of {len(self.caches)}.")
        sizes = self._sizes()
        longest = max(sizes)
        out_k, out_v = [], []
        for i, c in enumerate(self.caches):
            real = N
            if self._remaining is not None:
                real = min(N, self._remaining[i])
                self._remaining[i] -= real
            if real > 0:
                k, v = c.update_and_fetch(keys[i : i + 1, :, :real], values[i : i + 1, :, :real])
            else:
                # This row's prompt ended in an earlier chunk, so all its queries here are
                # padding whose outputs are dropped: zeros stand in for its past.
                k = mx.zeros((1, keys.shape[1], sizes[i], keys.shape[3]), keys.dtype)
                v = mx.zeros((1, values.shape[1], sizes[i], values.shape[3]), values.dtype)
            left, right = longest - sizes[i], N - real
            out_k.append(_pad_seq(k.astype(keys.dtype), left, right))
            out_v.append(_pad_seq(v.astype(values.dtype), left, right))
        return mx.concatenate(out_k, axis=0), mx.concatenate(out_v, axis=0)

    def size(self) -> int:
        return max(self._sizes())

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    @property
    def nbytes(self) -> int:
        # Every row's own nbytes: its compressed state, plus the per-layer constants it counts
        # (filters, codebooks), which rows of one layer share; counting them per row may
        # overstate the batch's bytes, never understate them. The padded copies are transient.
        return sum(c.nbytes for c in self.caches)

    @property
    def state(self) -> list:
        # For mx.eval only (mlx-lm evaluates `c.state` after every prefill chunk); a batch is
        # saved as its rows (extract), never as a whole.
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v: Any) -> None:
        raise NotImplementedError("A BatchedCache is not saved or loaded; extract its rows.")

    def is_trimmable(self) -> bool:
        return False

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError(
            "veloxquant caches cannot be converted to a QuantizedKVCache (kv_bits=)."
        )


def _ints(x: Any) -> list[int]:
    return [int(i) for i in (x.tolist() if hasattr(x, "tolist") else x)]


def _pad_seq(x: mx.array, left: int, right: int) -> mx.array:
    if left == 0 and right == 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)])
