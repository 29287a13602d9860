"""Timing one configuration: warmup, repetitions, metrics.

The clock is the runner's, identical for every system: perf_counter around `generate`, with the
system's device synchronisation before each reading; the system marks the first token.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from systems.base import GenerationRequest, SystemAdapter


class Clock:
    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.t0 = self.t_first = self.t_end = None

    def start(self) -> None:
        self.sync()
        self.t0 = time.perf_counter()

    def first_token(self) -> None:
        if self.t_first is not None:
            raise RuntimeError("on_first_token() called more than once")
        self.sync()
        self.t_first = time.perf_counter()

    def stop(self) -> None:
        self.sync()
        self.t_end = time.perf_counter()


@dataclass
class Sample:
    ttft_s: float
    decode_s: float
    tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


def time_once(adapter: SystemAdapter, request: GenerationRequest) -> Sample:
    clock = Clock(adapter.synchronize)
    clock.start()
    result = adapter.generate(request, clock.first_token)
    clock.stop()
    if clock.t_first is None:
        raise RuntimeError(f"{type(adapter).__name__}.generate never called on_first_token()")
    if len(result.tokens) != request.max_new_tokens:
        raise RuntimeError(f"{type(adapter).__name__} generated {len(result.tokens)} tokens, "
                           f"{request.max_new_tokens} requested")
    return Sample(clock.t_first - clock.t0, clock.t_end - clock.t_first, len(result.tokens), result.stats)


def metrics_of(samples: list[Sample], input_len: int, output_len: int, min_repetitions: int) -> dict[str, Any]:
    """Paper metrics per repetition, then mean, sd and best.

    e2e_tok_s = output tokens / (prefill + decode time) (the paper's definition); decode_tok_s counts
    the tokens after the first, over the time after the first token.
    """
    per_rep = {
        "ttft_s": [s.ttft_s for s in samples],
        "prefill_tok_s": [input_len / s.ttft_s for s in samples],
        "decode_tok_s": [(s.tokens - 1) / s.decode_s if s.tokens > 1 and s.decode_s > 0 else None
                         for s in samples],
        "e2e_tok_s": [s.tokens / (s.ttft_s + s.decode_s) for s in samples],
    }
    higher_is_better = {"ttft_s": False}
    metrics: dict[str, Any] = {"tokens": output_len, "repetitions": len(samples)}
    best: dict[str, Any] = {}
    for name, values in per_rep.items():
        vals = [v for v in values if v is not None]
        metrics[name] = statistics.fmean(vals) if vals else None
        metrics[f"{name}_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0 if vals else None
        if vals:
            best[name] = max(vals) if higher_is_better.get(name, True) else min(vals)
        else:
            best[name] = None
    metrics["best"] = best
    metrics["valid"] = (len(samples) >= min_repetitions
                        and all(s.tokens == output_len for s in samples))
    return metrics


def raw_of(samples: list[Sample]) -> dict[str, list]:
    return {"ttft_s": [s.ttft_s for s in samples], "decode_s": [s.decode_s for s in samples],
            "tokens": [s.tokens for s in samples]}
