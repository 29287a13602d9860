"""Continuous batching's gain (fiddler.batch): output tok/s of one batch engine at 16 concurrent requests over
the same engine at 1 (tiny_mixtral with --quick, small_mixtral otherwise), interleaved rounds, best of each.
scripts/bench_batch.py measures the same thing at more concurrencies for the note."""
from __future__ import annotations

import pytest

from runners.concurrency import prompts, timed_concurrent
from runners.models import synthetic_model

from .conftest import interleaved, record_ratio

MANY = 16
# The tiny model's steps are mostly per-call overhead, which moves with anything else running.
MARGIN = 0.3


@pytest.fixture(scope="module")
def batch_engine(quick):
    from fiddler.batch import BatchEngine

    name = "tiny_mixtral" if quick else "small_mixtral"
    prompt_len, tokens = (32, 16) if quick else (128, 64)
    be = BatchEngine.from_pretrained(synthetic_model(name), slots=MANY, max_seq_len=prompt_len + tokens)
    ps = prompts(MANY, prompt_len, be.engine.config.vocab_size)
    timed_concurrent(be, ps[:1], 2)  # first-call allocations, the kernel pool
    return name, be, ps, tokens


def test_batched_decode_16_vs_1(benchmark, batch_engine, rounds):
    name, be, ps, tokens = batch_engine

    def per_token(n):  # seconds per output token at n concurrent requests
        return lambda i: timed_concurrent(be, ps[:n], tokens)["wall_s"] / (n * tokens)

    best = interleaved(benchmark, {"one_s": per_token(1), "many_s": per_token(MANY)}, rounds)
    record_ratio(benchmark, "batch_decode16_vs_1", best["one_s"] / best["many_s"], "higher", best,
                 f"batch engine output tok/s at {MANY} concurrent requests / at 1, {name}, prompts "
                 f"{ps[0].shape[0]}, {tokens} tokens each", model=name, margin=MARGIN)
