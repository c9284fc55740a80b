"""Batched generation with our caches (veloxquant/batch.py): mlx_lm.batch_generate over
ragged prompts, a chunked prefill and sequences that finish at different steps gives every
sequence the greedy tokens and log-probs it gets alone, and the caches it hands back stay ours.

On the tiny random llama of test_contract (calibrated bundles of it included), where it is
fast enough to run for every method; the server test runs the real model batched.
"""

from __future__ import annotations

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import batch_generate
from mlx_lm.generate import generate_step

from tests import test_contract as contract
from tests.test_contract import VOCAB, build, knobs
from veloxquant.batch import BatchedCache
from veloxquant.methods import METHODS

tiny = contract.tiny  # the tiny llama and its bundle (a module fixture here as well)

OURS = [name for name, m in METHODS.items() if m.cache_classes]
MAX_TOKENS = [8, 4, 8]  # the middle sequence leaves the batch early (filter)
PREFILL_STEP = 16  # several ragged prefill chunks (right padding across chunks)
LENGTHS = [45, 30, 9]  # the first two evict / encode during prefill with knobs()


class Tokenizer:
    """What batch_generate reads from a tokenizer; the random model has no EOS."""

    eos_token_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def single(model, prompt, caches, max_tokens) -> tuple[list[int], list[float]]:
    steps = generate_step(
        mx.array(prompt),
        model,
        prompt_cache=caches,
        max_tokens=max_tokens,
        prefill_step_size=PREFILL_STEP,
    )
    toks, logps = [], []
    for tok, logprobs in steps:
        toks.append(tok)
        logps.append(logprobs[tok].item())
    return toks, logps


@pytest.mark.parametrize("method", OURS)
def test_batch_generate_equals_one_at_a_time(method, tiny):
    model = tiny["model"]
    fields = {"method": method, **knobs(method)}
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in LENGTHS]
    want = [
        single(model, p, build(tiny, fields), n) for p, n in zip(prompts, MAX_TOKENS, strict=True)
    ]
    caches = [build(tiny, fields) for _ in prompts]
    merged = type(caches[0][0]).merge([c[0] for c in caches])
    assert isinstance(merged, BatchedCache)
    assert merged.nbytes == sum(c[0].nbytes for c in caches)

    res = batch_generate(
        model,
        Tokenizer(),
        prompts,
        prompt_caches=caches,
        max_tokens=MAX_TOKENS,
        return_token_ids=True,
        return_logprobs=True,
        return_prompt_caches=True,
        prefill_step_size=PREFILL_STEP,
    )
    assert res.token_ids == [t for t, _ in want]
    for got, (_, logps) in zip(res.logprobs, want, strict=True):
        np.testing.assert_allclose(got, logps, rtol=1e-4, atol=1e-4)
    ours = METHODS[method].cache_classes
    for prompt, got, n in zip(prompts, res.caches, MAX_TOKENS, strict=True):
        assert all(type(c) in ours for c in got)  # never swapped for an uncompressed cache
        assert got[0].offset == len(prompt) + n  # the last token is fed too
        if len(prompt) == max(LENGTHS):  # it compressed: evicted or coded (KIVI in blocks of G)
            assert got[0].compressed_tokens > 0
    assert all(c[0].offset == 0 for c in caches)  # the batch worked on copies


def test_batched_cache_refuses_what_it_cannot_do(tiny):
    a = build(tiny, {"method": OURS[0], **knobs(OURS[0])})[0]
    batch = type(a).merge([a, a])
    with pytest.raises(NotImplementedError, match="right-padded"):
        batch.prepare(left_padding=[1, 0])
    with pytest.raises(NotImplementedError, match="QuantizedKVCache"):
        batch.to_quantized()
    assert not hasattr(batch, "bits") and not batch.is_trimmable()
