"""workload=serving: the system's server (started as mode=serve starts it, on a free port of 127.0.0.1), driven
by guidellm (the `serving` extra) at each number of concurrent streams; one record per level.

guidellm runs offline (HF_HUB_OFFLINE, the model's local tokenizer), with synthetic prompts of the point's
input length and output length (it sends ignore_eos), concurrency x requests_per_stream requests per level,
against /v1/completions. The metrics are computed here from guidellm's per-request timings, with vLLM's
definitions (benchmarks/serve.py): TTFT; TPOT = (e2e - TTFT) / (output tokens - 1) per request, which is
what guidellm calls "inter-token latency" (its "time per output token" divides the whole latency, TTFT
included, by the tokens; not used); e2e latency; request and output throughput over the level's duration;
goodput = requests meeting both SLOs per second. vLLM's ITL (the gaps between single tokens) needs
per-token times, which guidellm's records do not keep: it is not reported. The server's /metrics text at
the end of each level is kept in the record.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from systems.base import ModelSpec, RunContext, SystemUnavailable

from . import server_process
from .session import Job, base_record, load_adapter_class

PERCENTILES = (50, 90, 99)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def guidellm_command() -> list[str] | None:
    exe = shutil.which("guidellm", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
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
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e_latency", e2e)):
        for q in PERCENTILES:
            m[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if len(values) else None
    return m


def run_guidellm(target: str, model_path: str, point: dict, requests: int, out: Path, timeout_s: float,
                 has_health: bool = True) -> dict:
    # guidellm checks GET /health first; a server without one (llama_cpp.server) was already seen ready on its
    # own route (ServerProcess.wait_ready)
    check = "" if has_health else ",validate_backend=false"
    cmd = guidellm_command() + [
        "run", "--backend", f"kind=openai_http,target={target},request_format=/v1/completions{check}",
        "--profile", f"kind=concurrent,streams={point['concurrency']}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--tokenizer", f"kind=huggingface_auto,model={model_path}",
        "--data", f"kind=synthetic_text,prompt_tokens={point['input_len']},output_tokens={point['output_len']}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # its own process group, dying with this process (runners/server_process.py): a timeout, SIGTERM or Ctrl-C
    # of the run stops guidellm with its fork, spawn workers and resource tracker
    proc = server_process.start(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        server_process.stop(proc, grace_s=10)  # what is left of its group, however this ends
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {proc.returncode}: {(stderr or stdout)[-1500:]}")
    return json.loads(out.read_text())


def measure_all(job: Job, todo: list[int], conf, progress, current: list):
    """One record per serving point; the server is started once for all of them."""
    w = conf.workload
    if guidellm_command() is None:
        for i in todo:
            yield base_record(job, i, "skipped", "guidellm is not installed: pip install -e '.[serving]'")
        return
    cfg = job.config
    env = cfg["environment"]
    import torch

    points = [job.points[i] for i in todo]
    serve = replace(conf.serve, host="127.0.0.1", port=free_port(), slots=max(conf.serve.slots, *w.concurrency),
                    max_seq_len=max(p["input_len"] + p["output_len"] for p in points) + 8)
    serve = replace(serve, token_budget=max(serve.token_budget, serve.slots))
    ctx = RunContext(threads=int(env["cpu"]["threads"]), gpu_memory_gb=float(env["gpu"]["memory_gb"]),
                     has_cuda=torch.cuda.is_available(), cache_dir=str(Path(cfg["cache_dir"]).expanduser()),
                     environment=env, max_seq_len=serve.max_seq_len, max_batch=serve.slots)
    try:
        cls = load_adapter_class(job.system["adapter"])
        adapter = cls(job.system_config, ModelSpec(cfg["model"]["name"], job.model_path, cfg["model"]["dtype"]), ctx)
        cmd = adapter.server_command(serve)
    except SystemUnavailable as e:
        for i in todo:
            yield base_record(job, i, "skipped", f"cannot serve here: {e}")
        return
    run_dir = Path(job.run_dir or tempfile.mkdtemp())
    progress.note("starting the server")
    try:
        server = server_process.ServerProcess(cmd, {**os.environ, **cls.process_env}, serve.host, serve.port,
                                              adapter.server_health_path, log=run_dir / "server.log")
    except server_process.PortUnavailable as e:  # free_port()'s port, taken since
        for i in todo:
            yield base_record(job, i, "error", f"the server did not start: {e}")
        return
    try:
        try:
            server.wait_ready(serve.ready_timeout_s)
        except server_process.ServerFailed as e:
            for i in todo:
                yield base_record(job, i, "error", f"the server did not start: {e}: {server.tail(1000)}")
            return
        target = f"http://{serve.host}:{serve.port}"
        for i in todo:
            current[0] = i
            p = job.points[i]
            progress.note(f"guidellm: {p['concurrency']} streams")
            rec = base_record(job, i, "ok", None)
            n = p["concurrency"] * w.requests_per_stream
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    report = run_guidellm(target, job.model_path, p, n, Path(tmp) / "guidellm.json",
                                          timeout_s=(conf.run.timeout_s or 3600),
                                          has_health=adapter.server_health_path == "/health")
                rec["metrics"] = metrics_from_guidellm(report, w.slo_ttft_s, w.slo_tpot_s)
            except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                rec.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000])
            rec["serving"] = {"server_command": cmd, "server": adapter.server_notes(), "load_generator":
                              f"guidellm {report.get('metadata', {}).get('guidellm_version') if rec['status'] == 'ok' else ''}".strip(),
                              "profile": f"concurrent, {p['concurrency']} streams, {n} requests",
                              "definitions": "vLLM's (runners/serving.py): TPOT = (e2e - TTFT) / (output - 1), "
                                             "guidellm's inter_token_latency; ITL not available",
                              "slo": {"ttft_s": w.slo_ttft_s, "tpot_s": w.slo_tpot_s},
                              "server_metrics": server.metrics_text()}
            current[0] = None
            yield rec
    finally:
        rc = server.stop(serve.drain_timeout_s + 30)
        if rc not in (0, -signal.SIGTERM):
            print(f"warning: the server exited with {rc}; see {server.log}", file=sys.stderr)
