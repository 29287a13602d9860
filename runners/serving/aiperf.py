"""aiperf (NVIDIA's load generator, on PyPI) as the second load generator of workload=serving: it keeps every
streamed event's arrival time (its raw export), which guidellm 0.8.1 does not, so the per-token latency (ITL)
comes from it (runners/serving/itl.py parses the export).

It lives in a virtual environment of its own, .venv-aiperf in the checkout (or $FIDDLER_AIPERF_VENV), made by
`scripts/install.sh` (unless `--no-aiperf`): aiperf 0.13 pins pandas < 3 and huggingface_hub < 2, below this project's. It runs
as a child process (runners/serving/process.py) with one worker and one record processor (it shares a small
machine with the server), no /metrics scraping of its own (the harness reads /metrics before and after) and no
GPU telemetry. The tokenizer is the checkpoint's folder; HF_HUB_OFFLINE is not set, because aiperf 0.13 then
looks a local folder up as a hub cache entry and fails, while a path it sees as local never reaches the hub.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import itl, process

PIN = "aiperf==0.13.0"
INSTALL_HINT = "scripts/install.sh (it sets up aiperf in its own virtual environment, .venv-aiperf; --no-aiperf skips it)"


def venv() -> Path:
    """$FIDDLER_AIPERF_VENV, else .venv-aiperf in the checkout (in the working directory for an installed copy)."""
    if os.environ.get("FIDDLER_AIPERF_VENV"):
        return Path(os.environ["FIDDLER_AIPERF_VENV"]).expanduser()
    from systems.paths import CHECKOUT, in_checkout

    return (CHECKOUT if in_checkout() else Path.cwd()) / ".venv-aiperf"


def command() -> list[str] | None:
    """aiperf's console script: the environment's, else one on PATH; None where neither is."""
    exe = venv() / "bin" / "aiperf"
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    found = shutil.which("aiperf")
    return [found] if found else None


def version(cmd: list[str]) -> str:
    root = Path(cmd[0]).resolve().parent.parent
    for meta in root.glob("lib/python*/site-packages/aiperf-*.dist-info"):
        return meta.name[len("aiperf-"):-len(".dist-info")]
    return "unknown"


def run(cmd: list[str], target: str, model: str, tokenizer: str, point: dict, requests: int, timeout_s: float,
        seed: int = 0) -> tuple[list[itl.Streamed], int, float]:
    """Point's concurrent streams of synthetic prompts (input_len tokens, output_len out, ignore_eos) until
    `requests` are done, streamed from /v1/completions: (the successful requests' streams, how many failed, the
    CPU seconds aiperf and its services used)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        args = cmd + ["profile", "--model-names", model, "--url", target, "--endpoint-type", "completions",
                      "--streaming", "--tokenizer", tokenizer,
                      "--synthetic-input-tokens-mean", str(point["input_len"]), "--synthetic-input-tokens-stddev", "0",
                      "--output-tokens-mean", str(point["output_len"]), "--output-tokens-stddev", "0",
                      "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
                      "--concurrency", str(point["concurrency"]), "--request-count", str(requests),
                      "--random-seed", str(seed), "--request-timeout-seconds", f"{timeout_s:g}",
                      "--artifact-dir", str(out), "--export-level", "raw", "--ui-type", "none",
                      "--workers-max", "1", "--record-processor-service-count", "1",
                      "--no-server-metrics", "--no-gpu-telemetry"]
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env["HF_HUB_DISABLE_TELEMETRY"] = "1"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = process.start(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        finally:
            process.stop(proc, grace_s=10)  # its services (its own process group), however this ends
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        raw = out / "profile_export_raw.jsonl"
        if proc.returncode != 0 or not raw.exists():
            raise RuntimeError(f"aiperf exited with {proc.returncode}: {(output or '')[-1500:]}")
        with raw.open() as f:
            streams, failed = itl.parse_aiperf_raw(f)
    if not streams:
        raise RuntimeError(f"aiperf completed no request ({failed} failed)")
    return streams, failed, cpu_s
