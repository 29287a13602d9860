"""workload=serving: the system's server (started as mode=serve starts it, on a free port of 127.0.0.1), driven
by guidellm (the `serving` extra) at each number of concurrent streams; one record per level.

guidellm runs offline (HF_HUB_OFFLINE, the model's local tokenizer), with synthetic prompts of the point's
input length and output length (it sends ignore_eos), concurrency x requests_per_stream requests per level,
against /v1/completions. The metrics are computed here from guidellm's per-request timings, with vLLM's
definitions (benchmarks/serve.py): TTFT; TPOT = (e2e - TTFT) / (output tokens - 1) per request, which is
what guidellm calls "inter-token latency" (its "time per output token" divides the whole latency, TTFT
included, by the tokens; not used); e2e latency; request and output throughput over the level's duration;
goodput = requests meeting both SLOs per second. vLLM's ITL (the gaps between single tokens) needs
per-token times, which guidellm 0.8.1's records do not keep: with workload.itl, each concurrency level is run
a second time, the same load from aiperf (runners/serving/aiperf.py), whose per-event times give ITL
p50/p90/p99 with N, beside the server's own ITL histogram over that second run (runners/serving/itl.py). The
server's /metrics text at the end of each level is kept in the record.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from systems.base import ModelSpec, SystemUnavailable

from . import aiperf, itl, process
from . import rate_search
from .api_key import scrub as api_key_scrub
from ..session import Job, base_record, load_adapter_class

PERCENTILES = (50, 90, 99)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def guidellm_command() -> list[str] | None:
    """guidellm's command line: through runners/serving/guidellm_main.py (its Poisson schedule's origin set before
    its workers start) where this Python has guidellm; None where no guidellm is found."""
    if importlib.util.find_spec("guidellm") is not None:
        return [sys.executable, "-m", "runners.serving.guidellm_main"]
    exe = shutil.which("guidellm")  # another environment's: as it is (the arrival-rate check still guards)
    return [exe] if exe else None


def metrics_from_guidellm(report: dict, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """The record's metrics from one guidellm benchmark (its JSON report's benchmarks[0]): vLLM's
    definitions over the successful requests (see the module docstring). Times in seconds."""
    b = report["benchmarks"][0]
    ok = b["requests"]["successful"]
    failed = len(b["requests"].get("errored") or []) + len(b["requests"].get("incomplete") or [])
    if not ok:
        raise RuntimeError(f"guidellm completed no request ({failed} errored or incomplete)")
    ttft = np.array([r["time_to_first_token_ms"] / 1000 for r in ok])
    e2e = np.array([r["request_latency"] for r in ok])
    out = np.array([r["output_tokens"] for r in ok])
    prompt = np.array([r["prompt_tokens"] for r in ok])
    tpot = np.array([(e - t) / (n - 1) for e, t, n in zip(e2e, ttft, out) if n > 1])
    start = min(r["request_start_time"] for r in ok)
    end = max(r["request_end_time"] for r in ok)
    duration = end - start
    # the arrivals as sent (every request's start, failed ones too): whether the load generator kept the schedule
    sent = sorted(r["request_start_time"] for r in [*ok, *(b["requests"].get("errored") or []),
                                                    *(b["requests"].get("incomplete") or [])]
                  if r.get("request_start_time") is not None)
    good = sum(1 for t, e, n in zip(ttft, e2e, out) if t <= slo_ttft_s and (n <= 1 or (e - t) / (n - 1) <= slo_tpot_s))
    m: dict[str, Any] = {
        "requests": int(len(ok)), "failed_requests": int(failed), "duration_s": float(duration),
        "request_throughput": len(ok) / duration, "output_tok_s": float(out.sum()) / duration,
        "goodput": good / duration, "ttft_s": float(ttft.mean()), "tpot_s": float(tpot.mean()) if len(tpot) else None,
        "e2e_latency_s": float(e2e.mean()), "prompt_tokens_mean": float(prompt.mean()),
        "output_tokens_mean": float(out.mean()),
        # the metrics every ok record has: prefill and e2e rates of the mean request
        "prefill_tok_s": float(prompt.mean() / ttft.mean()), "e2e_tok_s": float(out.mean() / e2e.mean()),
        "repetitions": 1,
        "arrival_rate_req_s": (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else None,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e_latency", e2e)):
        for q in PERCENTILES:
            m[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if len(values) else None
    return m


def _scenario_file(tmp: Path, backend: dict) -> Path:
    """guidellm's backend spec in a file only this user can read: the API key stays off its command line."""
    path = tmp / "scenario.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"spec": {"backend": backend}}, f)
    return path


def run_guidellm(target: str, model_path: str, point: dict, requests: int, out: Path, timeout_s: float,
                 has_health: bool = True, *, rate: float | None = None, max_seconds: float | None = None,
                 shared_prefix_len: int = 0, seed: int = 0, api_key: str | None = None) -> tuple[dict, float]:
    """guidellm's JSON report of one level (point's concurrent streams, or Poisson arrivals at `rate`
    requests/s, seeded), and the CPU seconds guidellm and its workers used (it shares the machine)."""
    backend = {"kind": "openai_http", "target": target, "request_format": "/v1/completions"}
    # guidellm checks GET /health first; a server without one (llama_cpp.server) was already seen ready on its
    # own route (ServerProcess.wait_ready)
    if not has_health:
        backend["validate_backend"] = False
    profile = f"kind=poisson,rate={rate:g}" if rate else f"kind=concurrent,streams={point['concurrency']}"
    data = f"kind=synthetic_text,prompt_tokens={point['input_len']},output_tokens={point['output_len']}"
    if shared_prefix_len:  # one system prompt every request starts with
        data += f",prefix_tokens={shared_prefix_len},prefix_count=1"
    cmd = guidellm_command() + ["run", "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
                                "--tokenizer", f"kind=huggingface_auto,model={model_path}", "--data", data,
                                "--seed", f"kind=static,value={seed}", "--output", f"kind=json,path={out}",
                                "--disable-console-interactive"]
    if max_seconds:
        cmd += ["--constraint", f"kind=max_duration,seconds={max_seconds:g}"]
    # one worker process: the load generator takes what it needs of a small machine, not one process per core
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        if api_key:
            cmd += ["--scenario", str(_scenario_file(Path(tmp), {**backend, "api_key": api_key}))]
        else:
            cmd += ["--backend", ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                          for k, v in backend.items())]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        # its own process group, dying with this process (runners/serving/process.py): a timeout, SIGTERM or
        # Ctrl-C of the run stops guidellm with its fork, spawn workers and resource tracker
        proc = process.start(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        finally:
            process.stop(proc, grace_s=10)  # what is left of its group, however this ends
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # guidellm, reaped, with the workers it reaped
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {proc.returncode}: {api_key_scrub((stderr or stdout)[-1500:], api_key)}")
    return json.loads(out.read_text()), cpu_s


def unloaded_slo(w, unloaded: dict | None) -> "rate_search.Slo | None":
    """The scaled limits: workload.slo_scale x the system's unloaded (one stream) p50 TTFT and TPOT."""
    if not unloaded or unloaded.get("ttft_p50_s") is None or unloaded.get("tpot_p50_s") is None:
        return None
    return rate_search.Slo("scaled", w.slo_scale * unloaded["ttft_p50_s"], w.slo_scale * unloaded["tpot_p50_s"])


def slos(w, unloaded: dict | None) -> list["rate_search.Slo"]:
    """MLPerf's limits (workload.slo_*, as p99) and, where the unloaded latency is known, the scaled ones."""
    out = [rate_search.Slo("mlperf", w.slo_ttft_s, w.slo_tpot_s)]
    scaled = unloaded_slo(w, unloaded)
    return out + ([scaled] if scaled else [])


ARRIVAL_TOLERANCE = 1.5  # a rate level's arrivals within [target / this, target * this]: ~2.5 sigma at 26 requests


def arrivals_as_asked(metrics: dict, rate: float) -> bool:
    """Whether a rate level's requests went out at about the asked Poisson rate (True where it cannot be told)."""
    sent = metrics.get("arrival_rate_req_s")
    return sent is None or 1 / ARRIVAL_TOLERANCE <= sent / rate <= ARRIVAL_TOLERANCE


SLO_SOURCE = {"mlperf": "MLPerf Inference Server scenario, Mixtral-8x7B (mlcommons/inference loadgen/mlperf.conf: "
                        "p99 TTFT 2 s, p99 TPOT 200 ms; set for the real Mixtral, loose on a small model)",
              "scaled": "workload.slo_scale x this system's unloaded (one stream) p50 TTFT and TPOT"}


class _Levels:
    """Measures levels of load against one running server (guidellm), each as a record's metrics."""

    def __init__(self, job: Job, conf, target: str, has_health: bool, server):
        self.job, self.w, self.target, self.has_health, self.server = job, conf.workload, target, has_health, server
        self.timeout_s = conf.run.timeout_s or 3600
        self.api_key = conf.serve.api_key

    def measure(self, point: dict, rate: float | None = None) -> tuple[dict, dict]:
        """(metrics, facts) of one level: point's concurrency, or Poisson arrivals at rate (requests/s)."""
        w = self.w
        if rate:
            n, max_s = w.rate_requests, w.rate_max_s
            profile = f"Poisson arrivals at {rate:g} requests/s (seed {w.seed}), {n} requests or {max_s:g} s"
        else:
            n, max_s = point["concurrency"] * w.requests_per_stream, None
            profile = f"concurrent, {point['concurrency']} streams, {n} requests"
        # the server's ITL histogram over guidellm's run too: whether aiperf's run (whose ITL the record gives) saw
        # the same server speed, or a slower one for the CPU aiperf itself takes
        before = self.server.metrics_text() if w.itl and not rate else None
        with tempfile.TemporaryDirectory() as tmp:
            report, cpu_s = run_guidellm(self.target, self.job.model_path, point, n, Path(tmp) / "guidellm.json",
                                         timeout_s=self.timeout_s if not max_s else max(self.timeout_s, max_s + 300),
                                         has_health=self.has_health, rate=rate, max_seconds=max_s,
                                         shared_prefix_len=w.shared_prefix_len, seed=w.seed, api_key=self.api_key)
        metrics = metrics_from_guidellm(report, w.slo_ttft_s, w.slo_tpot_s)
        metrics["load_generator_cpu_s"] = cpu_s
        facts = {"load_generator": f"guidellm {report.get('metadata', {}).get('guidellm_version') or ''}".strip(),
                 "profile": profile}
        if w.itl and not rate:
            during_guidellm = itl.server_itl(before, self.server.metrics_text())
            itl_metrics, facts["itl"] = self.itl(point, n)
            metrics.update(itl_metrics)
            facts["itl"]["server_during_guidellm"] = during_guidellm
        return metrics, facts

    def warm_up(self, point: dict, progress) -> dict:
        """workload.warmup requests, one stream, the first level's lengths, before any level is measured (as `vllm
        bench serve` sends a first request): a server's first request pays for what it sets up on first use
        (transformers serve starts its continuous-batching manager, about half a minute on 2 cores), which would
        otherwise land in the first level's p99. What was sent and whether it worked, for the record."""
        n = self.w.warmup
        if not n:
            return {"requests": 0}
        progress.note(f"warm-up: {n} request{'s' if n > 1 else ''}, not measured")
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                report, _ = run_guidellm(self.target, self.job.model_path, {**point, "concurrency": 1}, n,
                                         Path(tmp) / "guidellm.json", timeout_s=self.timeout_s,
                                         has_health=self.has_health, shared_prefix_len=self.w.shared_prefix_len,
                                         seed=self.w.seed, api_key=self.api_key)
            done = metrics_from_guidellm(report, self.w.slo_ttft_s, self.w.slo_tpot_s)["requests"]
            status, reason = "ok", None
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            done, status, reason = 0, "error", api_key_scrub(f"{type(e).__name__}: {e}", self.api_key)[:2000]
        return {"requests": n, "completed": done, "status": status, "reason": reason,
                "wall_s": round(time.perf_counter() - t0, 3)}

    def itl(self, point: dict, n: int) -> tuple[dict, dict]:
        """The level's load again from aiperf: ITL from its per-event times, and the server's ITL histogram
        (/metrics) over the same requests. (metrics, facts); where it cannot run, no metrics and the reason."""
        cmd = aiperf.command()
        if cmd is None:
            return {}, {"status": "skipped", "reason": f"aiperf is not installed: {aiperf.INSTALL_HINT}"}
        if self.api_key:  # aiperf 0.13 takes the key only on its command line, which other users can read
            return {}, {"status": "skipped", "reason": "serve.api_key is set: aiperf would carry it on its command line"}
        before = self.server.metrics_text()
        try:
            streams, failed, cpu_s = aiperf.run(cmd, self.target, self.model_name(), self.job.model_path, point, n,
                                                timeout_s=self.timeout_s, seed=self.w.seed)
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            return {}, {"status": "error", "reason": api_key_scrub(f"{type(e).__name__}: {e}", self.api_key)[:2000]}
        metrics = {**itl.client_itl(streams), "itl_failed_requests": failed, "itl_load_generator_cpu_s": cpu_s}
        after = self.server.metrics_text()
        server = itl.server_itl(before, after)
        facts = {"status": "ok", "load_generator": f"aiperf {aiperf.version(cmd)}",
                 "profile": f"concurrent, {point['concurrency']} streams, {n} requests (the guidellm level's load, "
                            "again)",
                 "definition": "ITL: the gaps between consecutive streamed events carrying generated text, every "
                               "request's, vLLM's; itl_n gaps, itl_tokens_minus_one the tokens they span",
                 "server_histogram": (f"{itl.exported_histogram(after)} (after minus before the aiperf run, quantiles "
                                      "interpolated within buckets)") if server else None}
        return {**metrics, **(server or {})}, facts

    def model_name(self) -> str:
        """The name the server serves under (its /v1/models), which aiperf must send; the checkpoint's path else."""
        status, body = process.probe(self.server.host, self.server.port, "/v1/models")
        try:
            return json.loads(body)["data"][0]["id"] if status == 200 else self.job.model_path
        except (ValueError, KeyError, IndexError, TypeError):
            return self.job.model_path

    def trial(self, point: dict, rate: float) -> "rate_search.Trial":
        """One rate of the search. A level whose requests went out off its target rate by more than
        ARRIVAL_TOLERANCE says nothing about that rate, so it is measured again, once, and the record keeps the one
        set aside (guidellm 0.8.1 once completed a 0.071 requests/s level's 64 requests within 385 s, which its
        seeded schedule spreads over ~900 s: TTFT p99 96 s against 2.6 s at 0.1)."""
        m, _ = self.measure(point, rate)
        set_aside = []
        if not arrivals_as_asked(m, rate):
            set_aside.append({k: m.get(k) for k in ("arrival_rate_req_s", "requests", "ttft_p99_s", "tpot_p99_s")})
            m, _ = self.measure(point, rate)
        keep = ("request_throughput", "output_tok_s", "ttft_p50_s", "tpot_p50_s", "failed_requests",
                "load_generator_cpu_s", "arrival_rate_req_s")
        return rate_search.Trial(rate, m["ttft_p99_s"], m["tpot_p99_s"] if m["tpot_p99_s"] is not None else 0.0,
                                 m["requests"], extra={**{k: m.get(k) for k in keep},
                                                       "arrivals_as_asked": arrivals_as_asked(m, rate),
                                                       "set_aside": set_aside})


def _search_facts(trials, brackets, capacity: float, limits) -> dict[str, Any]:
    return {"capacity_req_s": capacity, "max_trials_note": "at most workload.rate_search rates",
            "slos": [{"name": s.name, "ttft_p99_s": s.ttft_s, "tpot_p99_s": s.tpot_s, "source": SLO_SOURCE[s.name]}
                     for s in limits],
            "trials": [{"rate": t.rate, "requests": t.requests, "ttft_p99_s": t.ttft_p99_s, "tpot_p99_s": t.tpot_p99_s,
                        "within": {s.name: s.met(t) for s in limits}, **t.extra} for t in trials],
            "highest_rate_within": {name: b.within for name, b in brackets.items()},
            "lowest_rate_beyond": {name: b.beyond for name, b in brackets.items()}}


def measure_all(job: Job, todo: list[int], conf, progress, current: list):
    """One record per serving point (concurrency levels, then rate levels); the server is started once for all
    of them. With workload.rate_search, the search runs after them and its answer goes into the record of the
    largest concurrency (whose throughput it starts from)."""
    w = conf.workload
    if guidellm_command() is None:
        for i in todo:
            yield base_record(job, i, "skipped", "guidellm is not installed: pip install -e '.[serving]'")
        return
    cfg = job.config
    points = [job.points[i] for i in todo]
    prompt_len = w.shared_prefix_len + max(p["input_len"] for p in points)
    slots = max(conf.serve.slots, *(w.concurrency or [1]))
    serve = replace(conf.serve, host="127.0.0.1", port=free_port(), slots=slots,
                    max_seq_len=prompt_len + max(p["output_len"] for p in points) + 8)
    serve = replace(serve, token_budget=max(serve.token_budget, serve.slots))
    ctx = process.server_context(cfg["environment"], cfg["cache_dir"], serve)
    try:
        cls = load_adapter_class(job.system["adapter"])
        adapter = cls(job.system_config, ModelSpec(cfg["model"]["name"], job.model_path, cfg["model"]["dtype"]), ctx)
        cmd = adapter.server_command(serve)
        server_env = process.server_environment(adapter, serve)
    except SystemUnavailable as e:
        for i in todo:
            yield base_record(job, i, "skipped", f"cannot serve here: {e}")
        return
    run_dir = Path(job.run_dir or tempfile.mkdtemp())
    progress.note("starting the server")
    try:
        server = process.ServerProcess(cmd, server_env, serve.host, serve.port, adapter.server_health_path,
                                              log=run_dir / "server.log")
    except process.PortUnavailable as e:  # free_port()'s port, taken since
        for i in todo:
            yield base_record(job, i, "error", f"the server did not start: {e}")
        return
    key = serve.api_key
    try:
        try:
            server.wait_ready(serve.ready_timeout_s)
        except process.ServerFailed as e:
            for i in todo:
                yield base_record(job, i, "error", api_key_scrub(f"the server did not start: {e}: {server.tail(1000)}",
                                                                 key))
            return
        levels = _Levels(job, conf, f"http://{serve.host}:{serve.port}", adapter.server_health_path == "/health",
                         server)
        current[0] = todo[0]  # the warm-up is the first level's: a run stopped during it records that level
        warmup = levels.warm_up(points[0], progress)  # interrupted, as a stop during the level itself does
        full = max((i for i in todo if job.points[i].get("concurrency")), default=None,
                   key=lambda i: job.points[i]["concurrency"])
        unloaded: dict | None = None
        held = None
        for i in todo:
            current[0] = i
            p = job.points[i]
            rate = p.get("rate")
            progress.note(f"guidellm: {rate:g} requests/s" if rate else f"guidellm: {p['concurrency']} streams")
            rec = base_record(job, i, "ok", None)
            facts: dict[str, Any] = {}
            try:
                rec["metrics"], facts = levels.measure(p, rate)
            except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                rec.update(status="error", reason=api_key_scrub(f"{type(e).__name__}: {e}", key)[:2000])
            if rec["status"] == "ok" and p.get("concurrency") == 1:
                unloaded = rec["metrics"]
            rec["serving"] = {"server_command": cmd, "server": adapter.server_notes(), **facts,
                              "definitions": "vLLM's (runners/serving/workload.py): TPOT = (e2e - TTFT) / (output - 1), "
                                             "guidellm's inter_token_latency; ITL (itl_*) from aiperf's per-event "
                                             "times (guidellm keeps none), itl_server_* from the server's histogram",
                              "slo": {"ttft_p99_s": w.slo_ttft_s, "tpot_p99_s": w.slo_tpot_s,
                                      "source": SLO_SOURCE["mlperf"], "slo_scale": w.slo_scale},
                              "shared_prefix_len": w.shared_prefix_len, "warmup": warmup,
                              "server_metrics": server.metrics_text()}
            current[0] = None
            if i == full and w.rate_search and rec["status"] == "ok":
                held = rec  # its search runs after the other levels
                continue
            yield rec
        if held is not None:
            yield _with_search(held, levels, job, w, unloaded, progress, current, full, run_dir / TRIALS_FILE)
    finally:
        rc = server.stop(serve.drain_timeout_s + 30)
        if rc not in (0, -signal.SIGTERM):
            print(f"warning: the server exited with {rc}; see {server.log}", file=sys.stderr)


TRIALS_FILE = "rate_search_trials.jsonl"  # in the run folder: each trial as it ends


def _with_search(rec: dict, levels: _Levels, job: Job, w, unloaded: dict | None, progress, current: list,
                 index: int, trials_file: Path) -> dict:
    """rec (the largest concurrency's) with the rate search's answer: per SLO the highest Poisson rate whose p99
    TTFT and TPOT stayed within it, starting from this level's request throughput. Each trial is also appended to
    trials_file as it ends (the search takes minutes a rate: a run stopped half-way keeps the trials it made)."""
    point = job.points[index]
    if unloaded is None:  # no one-stream level in this run: measure the unloaded latency for the scaled SLO
        progress.note("guidellm: 1 stream (unloaded latency)")
        unloaded, _ = levels.measure({**point, "concurrency": 1})
    limits = slos(w, unloaded)
    capacity = rec["metrics"]["request_throughput"]
    current[0] = index

    def measure(rate: float):
        progress.note(f"rate search: {rate:.3g} requests/s")
        trial = levels.trial(point, rate)
        line = {"system": job.system["name"], "point": point, "capacity_req_s": capacity, "rate": trial.rate,
                "requests": trial.requests, "ttft_p99_s": trial.ttft_p99_s, "tpot_p99_s": trial.tpot_p99_s,
                "within": {s.name: s.met(trial) for s in limits}, **trial.extra}
        with trials_file.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return trial

    try:
        trials, brackets = rate_search.search(measure, capacity, limits, max_trials=w.rate_search)
    except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
        rec["serving"]["rate_search"] = {"error": api_key_scrub(f"{type(e).__name__}: {e}", levels.api_key)[:2000]}
        current[0] = None
        return rec
    current[0] = None
    rec["serving"]["rate_search"] = _search_facts(trials, brackets, capacity, limits)
    rec["serving"]["unloaded"] = {k: unloaded.get(k) for k in ("ttft_p50_s", "tpot_p50_s", "requests")}
    rec["metrics"]["max_rate_mlperf_slo"] = brackets["mlperf"].within
    rec["metrics"]["max_rate_scaled_slo"] = brackets["scaled"].within if "scaled" in brackets else None
    rec["metrics"]["rate_search_trials"] = len(trials)
    return rec
