"""Per-token latency (runners/serving/itl.py): ITL percentiles from injected per-event times, aiperf's raw export
parsed, the server's histogram differenced and interpolated as Prometheus does; and, over real HTTP on the tiny
model, workload=serving's ITL fields from aiperf beside Fiddler's /metrics histogram."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from runners import tables
from runners.serving import aiperf
from runners.serving.itl import Streamed, client_itl, histogram, parse_aiperf_raw, quantile, server_itl
from tests.test_cli import run_py


def test_itl_is_every_gap_between_events_of_each_request():
    reqs = [Streamed((0.0, 0.1, 0.3, 0.6), 4), Streamed((5.0, 5.2), 3)]  # the second sent 3 tokens in 2 events
    m = client_itl(reqs)
    gaps = [0.1, 0.2, 0.3, 0.2]  # never the gap between requests (0.6 -> 5.0)
    assert m["itl_n"] == 4 and m["itl_requests"] == 2 and m["itl_events"] == 6
    assert m["itl_tokens_minus_one"] == 3 + 2  # more than N: one event carried two tokens
    for q in (50, 90, 99):
        assert m[f"itl_p{q}_s"] == pytest.approx(np.percentile(gaps, q))
    assert m["itl_p50_s"] == pytest.approx(0.2) and m["itl_p50_s"] <= m["itl_p90_s"] <= m["itl_p99_s"]
    assert client_itl([Streamed((1.0, 2.0), None)])["itl_tokens_minus_one"] is None  # no usage: not guessed
    empty = client_itl([Streamed((1.0,), 1)])
    assert empty["itl_n"] == 0 and empty["itl_p50_s"] is None
    with pytest.raises(ValueError, match="backwards"):
        client_itl([Streamed((1.0, 0.5), 2)])


def _raw(times_ns, texts, status=200, usage=None, phase="profiling", chat=False):
    def chunk(text):
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return {"name": "data", "value": json.dumps({"choices": [choice]})}
    responses = [{"perf_ns": t, "packets": [chunk(x)]} for t, x in zip(times_ns, texts)]
    if usage is not None:  # the final chunk, then the usage chunk and [DONE], in one read
        responses.append({"perf_ns": times_ns[-1] + 10, "packets": [
            {"name": "data", "value": json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})},
            {"name": "data", "value": json.dumps({"choices": [], "usage": {"completion_tokens": usage}})},
            {"name": "data", "value": "[DONE]"}]})
    return json.dumps({"metadata": {"benchmark_phase": phase, "was_cancelled": False}, "status": status,
                       "responses": responses})


def test_aiperf_raw_export_gives_each_text_events_arrival():
    lines = [_raw([1_000_000_000, 1_250_000_000, 1_250_000_000, 2_000_000_000], ["a", "", "b", "c"], usage=4),
             _raw([3_000_000_000, 3_500_000_000], ["x", "y"], chat=True),
             _raw([1, 2], ["w", "w"], phase="warmup"),  # not measured
             _raw([1, 2], ["e", "e"], status=500), ""]
    streams, failed = parse_aiperf_raw(lines)
    assert failed == 1
    # the empty event carries no text (a held-back character, a final chunk): not a token's arrival
    assert streams == [Streamed((1.0, 1.25, 2.0), 4), Streamed((3.0, 3.5), None)]
    assert client_itl(streams)["itl_n"] == 3


METRICS_BEFORE = """# TYPE fiddler_inter_token_latency_seconds histogram
fiddler_inter_token_latency_seconds_bucket{le="0.01"} 5
fiddler_inter_token_latency_seconds_bucket{le="0.05"} 5
fiddler_inter_token_latency_seconds_bucket{le="0.1"} 5
fiddler_inter_token_latency_seconds_bucket{le="+Inf"} 5
fiddler_inter_token_latency_seconds_sum 0.01
fiddler_inter_token_latency_seconds_count 5
fiddler_time_to_first_token_seconds_bucket{le="0.01"} 99
"""


def test_the_servers_histogram_over_the_load_is_interpolated_as_prometheus_does():
    # the load added 0 below 10 ms, 40 in (10, 50] ms, 50 in (50, 100] ms, 10 above
    after = (METRICS_BEFORE.replace('"0.01"} 5', '"0.01"} 5').replace('"0.05"} 5', '"0.05"} 45')
             .replace('"0.1"} 5', '"0.1"} 95').replace('"+Inf"} 5', '"+Inf"} 105'))
    assert histogram(after, "fiddler_inter_token_latency_seconds") == {0.01: 5, 0.05: 45, 0.1: 95, math.inf: 105}
    assert histogram("nothing here", "fiddler_inter_token_latency_seconds") is None and histogram(None, "x") is None
    m = server_itl(METRICS_BEFORE, after)
    assert m["itl_server_n"] == 100
    # p50: rank 50, the 10th of 50 in (0.05, 0.1]: 0.05 + 0.05 * 10/50; p90: rank 90, the 50th of 50: 0.1
    assert m["itl_server_p50_s"] == pytest.approx(0.06) and m["itl_server_p90_s"] == pytest.approx(0.1)
    assert m["itl_server_p99_s"] == pytest.approx(0.1)  # in +Inf's bucket: the highest finite bound
    assert quantile(0.2, {0.01: 10, 0.02: 10, math.inf: 10}) == pytest.approx(0.002)  # the first from 0
    assert quantile(0.5, {0.1: 0, math.inf: 0}) is None
    assert server_itl(METRICS_BEFORE, None) is None and server_itl(None, "no histogram") is None
    assert server_itl(None, after)["itl_server_n"] == 105  # no reading before: since the server started


def test_vllms_histogram_is_read_summed_over_its_engines():
    """vLLM exports vllm:inter_token_latency_seconds with labels per model and engine (le not first): one
    histogram, summed by le as Prometheus does."""
    def text(counts):
        return "".join(f'vllm:inter_token_latency_seconds_bucket{{engine="{e}",le="{le}",model_name="m"}} {c}.0\n'
                       for e, per in enumerate(counts) for le, c in zip(("0.02", "0.1", "+Inf"), per))

    before, after = text([(0, 0, 0), (0, 0, 0)]), text([(10, 30, 30), (10, 50, 50)])
    assert histogram(after, "vllm:inter_token_latency_seconds") == {0.02: 20, 0.1: 80, math.inf: 80}
    m = server_itl(before, after)
    assert m["itl_server_n"] == 80 and m["itl_server_p50_s"] == pytest.approx(0.02 + 0.08 * 20 / 60)
    both = METRICS_BEFORE + after  # Fiddler's own comes first where a text has both
    assert server_itl(None, both)["itl_server_n"] == 5


def test_the_table_shows_itl_beside_the_servers():
    rec = {"system": "fiddler", "model": "m", "workload": "serving", "environment": "local", "mode": "execute",
           "status": "ok", "time": "t", "point": {"input_len": 8, "output_len": 4, "beam_width": 1, "concurrency": 2},
           "metrics": {"ttft_s": 0.1, "prefill_tok_s": 1.0, "e2e_tok_s": 1.0, "itl_p50_s": 0.02, "itl_p99_s": 0.05,
                       "itl_n": 30, "itl_server_p50_s": 0.025, "itl_server_n": 30}}
    shown = tables.display(tables.build([rec]))
    assert list(shown["ITL p50 ms"]) == ["20.0"] and list(shown["ITL p99 ms"]) == ["50.0"]
    assert list(shown["ITL N"]) == ["30"] and list(shown["server ITL p50 ms"]) == ["25.0"]


def test_aiperf_is_found_in_its_own_environment(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    monkeypatch.setenv("FIDDLER_AIPERF_VENV", str(venv))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert aiperf.command() is None  # neither there nor on PATH: the level says ITL was skipped
    exe = venv / "bin" / "aiperf"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (venv / "lib" / "python3.11" / "site-packages" / "aiperf-0.13.0.dist-info").mkdir(parents=True)
    assert aiperf.command() == [str(exe)] and aiperf.version(aiperf.command()) == "0.13.0"


def test_serving_itl_end_to_end_with_aiperf(tmp_path):
    """Real HTTP on 127.0.0.1: Fiddler's server on the tiny model, guidellm then aiperf at 2 streams."""
    pytest.importorskip("fastapi")
    if aiperf.command() is None:
        if os.environ.get("CI"):
            pytest.fail(f"aiperf is missing: .ci/run installs it ({aiperf.INSTALL_HINT})")
        pytest.skip(f"aiperf (the per-token latency load generator) is not installed: {aiperf.INSTALL_HINT}")
    d = tmp_path / "D"
    res = run_py("system=fiddler", "model=tiny_mixtral", "workload=serving", "workload.concurrency=[2]",
                 "workload.requests_per_stream=4", "workload.input_lens=[24]", "workload.output_lens=[8]",
                 "workload.rate_search=0", f"hydra.run.dir={d}", f"run.index_path={tmp_path / 'i.jsonl'}", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok", rec.get("reason")
    facts, m = rec["serving"]["itl"], rec["metrics"]
    assert facts["status"] == "ok", facts
    assert facts["load_generator"].startswith("aiperf ") and facts["server_histogram"]
    assert m["itl_requests"] == 8 and m["itl_failed_requests"] == 0
    # N: each request's events minus one; never more than its tokens minus one (8 tokens each)
    assert m["itl_n"] == m["itl_events"] - m["itl_requests"] > 0
    assert m["itl_tokens_minus_one"] == 8 * 7 and m["itl_n"] <= m["itl_tokens_minus_one"]
    assert m["itl_p50_s"] <= m["itl_p90_s"] <= m["itl_p99_s"]
    # the server counted the gaps between the tokens of the same 8 requests, nothing of guidellm's
    assert m["itl_server_n"] == 8 * 7
    assert m["itl_server_p50_s"] <= m["itl_server_p90_s"] <= m["itl_server_p99_s"]
    assert facts["server_during_guidellm"]["itl_server_n"] == 8 * 7  # and over guidellm's 8, apart
    assert "ITL p50 ms" in res.stdout
