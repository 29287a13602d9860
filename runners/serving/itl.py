"""Inter-token latency (ITL): the gaps between consecutive streamed tokens of a request, vLLM's definition
(benchmarks/serve.py: one gap per streamed event after the first). guidellm 0.8.1 keeps only a request's first
and last token times and their count (it spaces the rest evenly: schemas/base/request_stats.py), so the
per-token times come from aiperf's raw export (runners/serving/aiperf.py), parsed here.

Beside them, the server's own view where it exports one: the difference of its ITL histogram on /metrics
(Prometheus text) before and after the load, with quantiles interpolated within buckets as Prometheus'
histogram_quantile does.

Pure functions of their inputs: tested on injected timestamps and histogram texts (tests/test_itl.py).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

PERCENTILES = (50, 90, 99)
# the servers' ITL histograms this reads, the first a server exports: Fiddler's, vLLM's (labelled per model and engine)
SERVER_HISTOGRAMS = ("fiddler_inter_token_latency_seconds", "vllm:inter_token_latency_seconds")


@dataclass(frozen=True)
class Streamed:
    """One request's stream: when each event with generated text arrived (seconds, one clock per request) and
    how many tokens the server says it generated (its usage; None where it sent none)."""

    times: tuple[float, ...]
    tokens: int | None


def client_itl(requests: Iterable[Streamed]) -> dict:
    """ITL p50/p90/p99 over every gap of every request, with N (the gaps) and what they come from: requests,
    events, and the tokens minus one summed (equal to N where each event carried one token; a server that
    holds back a partial character sends two tokens in one event, one gap)."""
    requests = list(requests)
    gaps = np.concatenate([np.diff(np.asarray(r.times, dtype=float)) for r in requests] or [np.empty(0)])
    if (gaps < 0).any():
        raise ValueError("token times go backwards within a request")
    out: dict = {f"itl_p{q}_s": float(np.percentile(gaps, q)) if len(gaps) else None for q in PERCENTILES}
    tokens = [r.tokens for r in requests]
    out.update(itl_n=int(len(gaps)), itl_requests=len(requests), itl_events=sum(len(r.times) for r in requests),
               itl_tokens_minus_one=sum(t - 1 for t in tokens if t) if all(t is not None for t in tokens) else None)
    return out


# ---------------------------------------------------------------------------------------------- aiperf's export
def _events(record: dict) -> tuple[list[float], int | None]:
    """(arrival times in s of the events that carry generated text, the usage's completion tokens) of one raw
    record: its `responses`, each a network read (perf_ns) of SSE packets."""
    times: list[float] = []
    tokens = None
    for resp in record.get("responses") or []:
        for packet in resp.get("packets") or []:
            if packet.get("name") != "data" or packet.get("value", "").strip() in ("", "[DONE]"):
                continue
            data = json.loads(packet["value"])
            if (data.get("usage") or {}).get("completion_tokens") is not None:
                tokens = int(data["usage"]["completion_tokens"])
            for choice in data.get("choices") or []:
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if text:
                    times.append(resp["perf_ns"] / 1e9)
                    break
    return times, tokens


def parse_aiperf_raw(lines: Iterable[str]) -> tuple[list[Streamed], int]:
    """The profiling phase's successful requests of aiperf's profile_export_raw.jsonl, and how many others
    (errored, cancelled, not 200) there were."""
    ok, failed = [], 0
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        meta = rec.get("metadata") or {}
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue  # warmup
        if rec.get("status") != 200 or meta.get("was_cancelled") or rec.get("error"):
            failed += 1
            continue
        times, tokens = _events(rec)
        if times:
            ok.append(Streamed(tuple(times), tokens))
        else:
            failed += 1
    return ok, failed


# --------------------------------------------------------------------------------------- the server's histogram
_BUCKET = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)_bucket\{(?:[^}]*,)?le="(?P<le>[^"]+)"(?:,[^}]*)?\}\s+(?P<v>\S+)')


def histogram(text: str | None, name: str) -> dict[float, float] | None:
    """Cumulative counts by upper bound (le; +Inf as math.inf) of histogram `name` in a /metrics text, summed
    over its label sets (Prometheus' sum by (le): vLLM labels each engine's series); None where the text has
    none."""
    if not text:
        return None
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m and m["name"] == name:
            le = math.inf if m["le"] == "+Inf" else float(m["le"])
            out[le] = out.get(le, 0.0) + float(m["v"])
    return out or None


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: the q-quantile (0..1) of a cumulative histogram, linear within the bucket
    it falls in (from 0 in the first); the highest finite bound where it falls in +Inf's; None when empty."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for b in bounds:
        if cumulative[b] >= rank:
            if math.isinf(b):
                return lower
            inside = cumulative[b] - below
            return lower + (b - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = b, cumulative[b]
    return lower


def exported_histogram(text: str | None) -> str | None:
    """The first of SERVER_HISTOGRAMS that a /metrics text has; None where it has none."""
    return next((name for name in SERVER_HISTOGRAMS if histogram(text, name) is not None), None)


def server_itl(before: str | None, after: str | None) -> dict | None:
    """The server's ITL over the load (its histogram after minus before): p50/p90/p99, bucket-interpolated, with
    N; None where the server exports none."""
    name = exported_histogram(after)
    if name is None:
        return None
    end, start = histogram(after, name), histogram(before, name) or {}
    delta = {b: v - start.get(b, 0.0) for b, v in end.items()}
    out = {f"itl_server_p{q}_s": quantile(q / 100, delta) for q in PERCENTILES}
    return {**out, "itl_server_n": int(delta.get(math.inf, 0))}
