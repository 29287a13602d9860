"""Throughput of the batch engine at a concurrency: the same engine, the same prompts, timed from the first
submit to the last token (scripts/bench_batch.py and the regression suite's batched-decode ratio)."""

from __future__ import annotations

import time

import torch


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """n distinct deterministic prompts of `length` ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g) for _ in range(n)]


def timed_concurrent(batch_engine, prompt_ids: list[torch.Tensor], max_tokens: int) -> dict:
    """Submit every prompt at once (ignore_eos: each must return exactly max_tokens), run to the end. Output
    tok/s counts every request's tokens over the wall time; experts by decision kind summed over the run's
    steps."""
    from fiddler.batch import SamplingParams

    first_step = batch_engine.n_steps
    t0 = time.perf_counter()
    reqs = [batch_engine.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompt_ids]
    batch_engine.run()
    wall = time.perf_counter() - t0
    bad = [(r.id, len(r.tokens), r.finish_reason) for r in reqs if len(r.tokens) != max_tokens]
    if bad:
        raise RuntimeError(f"requests did not return {max_tokens} tokens: {bad}")
    steps = list(batch_engine.steps)[-(batch_engine.n_steps - first_step):]
    kinds = {k: sum(s.experts.get(k, 0) for s in steps) for k in "abc"}
    decode = [s for s in steps if s.prefill_tokens == 0]
    return {"concurrency": len(reqs), "wall_s": wall, "output_tokens": len(reqs) * max_tokens,
            "output_tok_s": len(reqs) * max_tokens / wall, "steps": len(steps), "experts_by_kind": kinds,
            "ttft_s_mean": sum(r.first_token_at - r.submitted_at for r in reqs) / len(reqs),
            "decode_step_s_best": min((s.seconds for s in decode), default=None)}
