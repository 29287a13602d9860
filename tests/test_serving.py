"""workload=serving (runners/serving/workload.py): metrics by vLLM's definitions from guidellm's per-request timings
(checked on a report of known timings), the table's serving columns, the keys refused before anything runs,
and `python run.py workload=serving` end to end with guidellm against the engine's server on the tiny model."""

from __future__ import annotations

import json
import re

import pytest

from runners import tables
from runners.serving.workload import guidellm_command, metrics_from_guidellm
from runners.workloads import Point, expand
from tests.server_helpers import kill_all  # noqa: E402
from tests.test_cli import run_py


def _request(start, ttft, e2e, out, prompt=32):
    return {"request_start_time": start, "request_end_time": start + e2e, "time_to_first_token_ms": ttft * 1000,
            "request_latency": e2e, "output_tokens": out, "prompt_tokens": prompt}


def test_metrics_follow_vllms_definitions():
    ok = [_request(0.0, 0.1, 1.1, 11), _request(0.5, 0.3, 2.3, 21), _request(1.0, 3.0, 4.0, 11)]
    report = {"benchmarks": [{"requests": {"successful": ok, "errored": [{}], "incomplete": []}}]}
    m = metrics_from_guidellm(report, slo_ttft_s=2.0, slo_tpot_s=0.15)
    assert m["requests"] == 3 and m["failed_requests"] == 1
    assert m["duration_s"] == pytest.approx(5.0)  # first start to last end
    assert m["request_throughput"] == pytest.approx(3 / 5) and m["output_tok_s"] == pytest.approx(43 / 5)
    # TPOT = (e2e - TTFT) / (out - 1): 0.1, 0.1, 0.1
    assert m["tpot_s"] == pytest.approx(0.1) and m["tpot_p99_s"] == pytest.approx(0.1)
    assert m["ttft_p50_s"] == pytest.approx(0.3) and m["ttft_s"] == pytest.approx(3.4 / 3)
    assert m["goodput"] == pytest.approx(2 / 5)  # the third misses the TTFT SLO
    assert m["e2e_tok_s"] == pytest.approx((43 / 3) / (7.4 / 3))
    assert m["arrival_rate_req_s"] == pytest.approx(2 / 1.0)  # 3 sent in 1 s (the errored one has no start)
    with pytest.raises(RuntimeError, match="completed no request"):
        metrics_from_guidellm({"benchmarks": [{"requests": {"successful": [], "errored": [{}]}}]}, 1, 1)


def test_a_rate_level_sent_off_its_schedule_is_measured_again():
    from runners.serving import workload

    levels = object.__new__(workload._Levels)
    sent = iter([0.25, 0.11])  # a burst at 2.5x the asked 0.1 requests/s, then as asked

    def measure(point, rate):
        return {"arrival_rate_req_s": next(sent), "requests": 64, "ttft_p99_s": 1.0, "tpot_p99_s": 0.1,
                "request_throughput": 0.1, "output_tok_s": 6.4, "ttft_p50_s": 0.5, "tpot_p50_s": 0.05,
                "failed_requests": 0, "load_generator_cpu_s": 1.0}, {}

    levels.measure = measure
    t = levels.trial({"concurrency": 16}, 0.1)
    assert t.extra["arrival_rate_req_s"] == 0.11 and t.extra["arrivals_as_asked"]
    assert [x["arrival_rate_req_s"] for x in t.extra["set_aside"]] == [0.25]
    levels.measure = lambda point, rate: ({**measure(point, rate)[0], "arrival_rate_req_s": 0.3}, {})
    sent = iter([0.3, 0.3])
    t = levels.trial({"concurrency": 16}, 0.1)  # off twice: the second stands, marked
    assert not t.extra["arrivals_as_asked"] and len(t.extra["set_aside"]) == 1
    assert workload.arrivals_as_asked({"arrival_rate_req_s": None}, 0.1)
    assert workload.arrivals_as_asked({"arrival_rate_req_s": 0.1 / 1.4}, 0.1)


def test_serving_points_carry_their_concurrency_and_other_points_do_not():
    class W:
        input_lens, output_lens, beam_widths, concurrency = [128], [64], [1], [1, 8]

    pts = expand(W)
    assert [p.as_dict() for p in pts] == [{"input_len": 128, "output_len": 64, "beam_width": 1, "concurrency": c}
                                          for c in (1, 8)]
    assert Point(32, 4, 2).as_dict() == {"input_len": 32, "output_len": 4, "beam_width": 2}

    class R(W):
        rates = [0.5]

    assert [p.as_dict() for p in expand(R)][-1] == {"input_len": 128, "output_len": 64, "beam_width": 1, "rate": 0.5}
    assert [p.key() for p in expand(R)] == ["in128_out64_beam1_c1", "in128_out64_beam1_c8", "in128_out64_beam1_r0.5"]


def test_the_table_shows_serving_columns_per_stream_count():
    def rec(c, tok_s):
        return {"system": "fiddler", "model": "m", "workload": "serving", "environment": "local", "mode": "execute",
                "status": "ok", "time": f"t{c}", "point": {"input_len": 128, "output_len": 64, "beam_width": 1,
                                                          "concurrency": c},
                "metrics": {"ttft_s": 0.1, "prefill_tok_s": 1.0, "e2e_tok_s": 1.0, "output_tok_s": tok_s,
                            "tpot_p50_s": 0.05, "request_throughput": 1.0}}
    df = tables.build([rec(8, 40.0), rec(1, 10.0)])
    shown = tables.display(df)
    assert list(shown["streams"]) == ["1", "8"] and list(shown["out tok/s"]) == ["10.0", "40.0"]
    assert list(shown["TPOT p50 ms"]) == ["50.0", "50.0"]


@pytest.mark.parametrize("args,message", [
    (("mode=simulate", "environment=rtx4090", "model=mixtral_8x7b"), "measured against a running server"),
    (("workload.ignore_eos=false",), "workload.ignore_eos=false is not measured"),
    (("workload.concurrency=[0]",), "workload.concurrency"),
    (("workload.requests_per_stream=2",), "workload.requests_per_stream=2 is invalid"),
    (("workload.rates=[0]",), "workload.rates"),
    (("workload.rate_search=6",), "workload.rate_search=6 is invalid"),
    (("workload.rate_requests=10",), "workload.rate_requests=10 is invalid"),
    (("workload.concurrency=[]", "workload.rates=[1]", "workload.rate_search=2"), "workload.rate_search=2 is invalid"),
])
def test_bad_serving_configs_are_refused(tmp_path, args, message):
    res = run_py("system=fiddler", "workload=serving", *args, f"hydra.run.dir={tmp_path / 'D'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


@pytest.mark.skipif(guidellm_command() is None, reason="guidellm (the serving extra) is not installed")
def test_serving_run_end_to_end_with_guidellm(tmp_path):
    pytest.importorskip("fastapi")
    d = tmp_path / "D"
    res = run_py("system=fiddler", "model=tiny_mixtral", "workload=serving", "workload.concurrency=[1,3]",
                 "workload.requests_per_stream=4", "workload.input_lens=[24]", "workload.output_lens=[8]",
                 "workload.rates=[8]", "workload.rate_search=1", "workload.shared_prefix_len=16",
                 "workload.itl=false",  # aiperf's second run of each level: tests/test_itl.py's
                 f"hydra.run.dir={d}", f"run.index_path={tmp_path / 'i.jsonl'}", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
    # the largest concurrency's record comes last: it waits for the rate search
    assert [(r["point"].get("concurrency"), r["point"].get("rate")) for r in recs] == [(1, None), (None, 8), (3, None)]
    assert all(r["status"] == "ok" for r in recs)
    for r, n in zip(recs, (4, 64, 12)):
        m = r["metrics"]
        assert m["requests"] == n and m["failed_requests"] == 0
        # the shared prefix, then its own (guidellm joins their texts: a word across the seam may be one token)
        assert 16 + 24 - 1 <= m["prompt_tokens_mean"] <= 16 + 24 and m["output_tokens_mean"] == 8
        assert m["ttft_p50_s"] <= m["ttft_p99_s"] and m["output_tok_s"] > 0
        assert m["load_generator_cpu_s"] >= 0
        assert "fiddler_generation_tokens_total" in r["serving"]["server_metrics"]
        assert r["serving"]["load_generator"].startswith("guidellm ")
    assert "Poisson arrivals at 8 requests/s" in recs[1]["serving"]["profile"]
    search = recs[2]["serving"]["rate_search"]
    assert search["capacity_req_s"] == recs[2]["metrics"]["request_throughput"]
    # one rate, the capacity: where the search goes from there is tests/test_rate_search.py's (injected p99s);
    # a second 64-request trial here ran the same code again for about a third of this test's time
    assert [t["rate"] for t in search["trials"]] == [search["capacity_req_s"]]
    assert all(t["requests"] == 64 for t in search["trials"])
    assert [s["name"] for s in search["slos"]] == ["mlperf", "scaled"]
    # each trial also went to the run folder as it ended (a run stopped during the search keeps them)
    kept = [json.loads(line) for line in (d / "rate_search_trials.jsonl").read_text().splitlines()]
    assert [(k["rate"], k["ttft_p99_s"], k["within"]) for k in kept] == [
        (t["rate"], t["ttft_p99_s"], t["within"]) for t in search["trials"]]
    assert search["slos"][1]["ttft_p99_s"] == pytest.approx(3.0 * recs[0]["metrics"]["ttft_p50_s"])
    for name in ("mlperf", "scaled"):  # the headline is the highest rate measured within the limits, or none
        best = recs[2]["metrics"][f"max_rate_{name}_slo"]
        within = [t["rate"] for t in search["trials"] if t["within"][name]]
        assert best == (max(within) if within else None)
    # workload=serving's one warm-up request reached the server before the levels and is in no level's count
    assert all(r["serving"]["warmup"] == {**r["serving"]["warmup"], "requests": 1, "completed": 1, "status": "ok"}
               for r in recs)
    # the server's count at the last level's end: every level's requests and the warm-up's (the search's come later)
    pattern = r'fiddler_requests_total\{route="completions",outcome="ok"\} (\d+)'
    served = max(int(re.search(pattern, r["serving"]["server_metrics"]).group(1)) for r in recs)
    assert served == 1 + sum(r["metrics"]["requests"] for r in recs)
    assert "| streams" in res.stdout or "streams |" in res.stdout
    assert (d / "server.log").exists()


# ---------------------------------------------------------------- issue 55 bug 9: a run leaves nothing behind

def _procs(pids):
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_load_generator_that_times_out_leaves_no_process_behind(tmp_path, monkeypatch):
    """On run.timeout_s the load generator was killed alone; its workers lived on under PID 1."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    from runners.serving import workload

    pids_file = tmp_path / "pids"
    monkeypatch.setenv("FAKE_LOADGEN_PIDS", str(pids_file))
    monkeypatch.setattr(workload, "guidellm_command", lambda: [sys.executable, str(Path(__file__).parent / "fake_loadgen.py")])
    point = {"concurrency": 1, "input_len": 8, "output_len": 4}
    procs = []
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            workload.run_guidellm("http://127.0.0.1:9", "m", point, 1, tmp_path / "out.json", timeout_s=5)
        deadline = time.monotonic() + 30
        while not pids_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs = _procs(map(int, pids_file.read_text().split()))
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        kill_all(procs)


def _cmdline(proc) -> str:
    """A process's command line, or "" once it has exited: the warm-up's guidellm and its workers end while the
    test looks (a race that failed CI once)."""
    import psutil

    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


@pytest.mark.skipif(guidellm_command() is None, reason="guidellm (the serving extra) is not installed")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stopped_serving_run_leaves_no_process_behind(tmp_path, sig):
    """SIGTERM of a `workload=serving` run left five guidellm processes (a fork, three spawn workers, a resource
    tracker) alive under PID 1. Every process the run started is now gone when it exits, even of SIGKILL
    (runners/serving/process.py: parent-death signal, and a guard per process group)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    pytest.importorskip("fastapi")
    from tests.test_cli import ROOT

    d = tmp_path / "D"
    run = subprocess.Popen([sys.executable, "run.py", "system=fiddler", "model=tiny_mixtral", "workload=serving",
                            "workload.concurrency=[2]", "workload.rate_search=0", "workload.requests_per_stream=1000",
                            "workload.input_lens=[16]",
                            "workload.output_lens=[200]", f"hydra.run.dir={d}", f"run.index_path={tmp_path / 'i.jsonl'}"],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    started = []
    try:
        deadline = time.monotonic() + 400
        while True:  # until guidellm runs with its spawn workers
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:] if run.poll() else ""
            started = psutil.Process(run.pid).children(recursive=True)
            if any("spawn_main" in _cmdline(p) for p in started):
                break
            time.sleep(1)
        time.sleep(3)  # the workers are all up
        started = psutil.Process(run.pid).children(recursive=True)
        run.send_signal(getattr(signal, sig))
        run.wait(120)
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [(p.pid, _cmdline(p)[:200]) for p in alive]
        if sig == "SIGKILL":  # nothing to record: no handler runs
            assert run.returncode == -signal.SIGKILL
            return
        assert run.returncode == 128 + getattr(signal, sig)
        recs = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
        assert [r["status"] for r in recs] == ["interrupted"]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        kill_all(started)
