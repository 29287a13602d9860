"""Measuring configurations of one job in the current process: load the system once, then for each
workload point warm up, repeat, and turn the samples (or the failure) into a record.

Used directly for `run.isolation=inline` and inside the child process for `run.isolation=process`.
"""
from __future__ import annotations

import errno
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from systems.base import (GenerationRequest, ModelSpec, RunContext, SystemAdapter, SystemConfig,
                            SystemUnavailable, one_line)
from systems.registry import adapter_class
from runners import measure, provenance, records
from runners.decode_bound import decode_bound, environment_limit
from runners.workloads import Point, prompt_for


@dataclass
class Job:
    """Everything a (possibly separate) process needs to measure a job's points; plain data."""

    config: dict[str, Any]  # resolved config (enums as strings)
    model_path: str
    run_id: str
    points: list[dict[str, int]]
    hashes: list[str]
    isolation: str
    process_env: dict[str, str] = field(default_factory=dict)  # set before the system's process imports torch
    system_config: SystemConfig | None = None  # the typed system options handed to the adapter
    memory_limit_gb: float | None = None  # RLIMIT_AS of the measuring child process (named in `oom` reasons)
    detected: dict[str, Any] = field(default_factory=dict)  # environment keys measured at this start
    run_dir: str | None = None  # where the records go (routing traces are written beside them)

    @property
    def system(self) -> dict[str, Any]:
        return self.config["system"]


# the adapter class a system's `adapter` names (ConfigError where it names none); one rule, in systems/registry.py
load_adapter_class = adapter_class


def make_adapter(job: Job) -> SystemAdapter:
    cfg = job.config
    env = cfg["environment"]
    import torch

    ctx = RunContext(threads=job.system_config.thread_count(env["cpu"]["threads"]),
                     gpu_memory_gb=float(env["gpu"]["memory_gb"]),
                     has_cuda=torch.cuda.is_available(), cache_dir=str(Path(cfg["cache_dir"])),
                     environment=env,
                     max_seq_len=max(p["input_len"] + p["output_len"] for p in job.points),
                     max_batch=max(p["beam_width"] for p in job.points))
    model = ModelSpec(name=cfg["model"]["name"], path=job.model_path, dtype=cfg["model"]["dtype"])
    return load_adapter_class(job.system["adapter"])(job.system_config, model, ctx)


# how allocation failures read when they surface as other exceptions: CUDA/torch, errno ENOMEM, a
# shared library that cannot be mapped under RLIMIT_AS (ImportError), C++ new
OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to map segment",
             "bad_alloc")


def memory_limit_text(memory_limit_gb: float | None) -> str:
    return f"run.memory_limit_gb={memory_limit_gb:g}" if memory_limit_gb else "no run.memory_limit_gb set"


def classify_failure(exc: BaseException, memory_limit_gb: float | None = None) -> tuple[str, str]:
    """(status, reason): `oom` naming the memory limit for allocation failures, `error` otherwise."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM) \
            or any(t in text for t in OOM_TEXT):
        return "oom", f"out of memory ({memory_limit_text(memory_limit_gb)}): {one_line(exc)}"
    return "error", one_line(exc)


def base_record(job: Job, index: int, status: str, reason: str | None) -> dict[str, Any]:
    cfg = job.config
    env = cfg["environment"]
    point = job.points[index]
    from runners.hardware import host_facts

    return {
        "schema_version": records.SCHEMA_VERSION,
        "run_id": job.run_id,
        "time": records.now_iso(),
        "status": status,
        "reason": reason,
        "system": job.system["name"],
        "workload": cfg["workload"]["name"],
        "environment": env["name"],
        "model": cfg["model"]["name"],
        "mode": cfg["mode"],
        "point": point,
        "config_hash": job.hashes[index],
        "config": cfg,
        "code": records.code_version(),
        "host": host_facts(),
        "versions": records.library_versions(),
        "environment_info": provenance.environment_info(cfg, job.detected),
        "method": {"timer": "time.perf_counter", "sync": "adapter.synchronize() before each reading",
                   "warmup": cfg["workload"]["warmup"], "repetitions": cfg["workload"]["repetitions"],
                   "isolation": job.isolation, "process_env": job.process_env},
        "seeds": {"workload": cfg["workload"]["seed"], "model": cfg["model"]["seed"]},
    }


class Session:
    """Loads the job's system once and measures points on demand."""

    def __init__(self, job: Job, on_progress: Callable[[str], None] | None = None):
        self.job = job
        self.adapter: SystemAdapter | None = None
        self.unavailable: str | None = None
        self.failed: tuple[str, str] | None = None  # (status, reason) when loading failed
        self.on_progress = on_progress or (lambda msg: None)
        self.load_s: float | None = None
        model_config = json.loads((Path(job.model_path) / "config.json").read_text())
        self._vocab = model_config["vocab_size"]
        self._context = model_config.get("max_position_embeddings")

    def load(self) -> None:
        start = time.perf_counter()
        try:
            self.adapter = make_adapter(self.job)
            self.adapter.load()
        except SystemUnavailable as exc:
            self.unavailable = str(exc)
        except Exception as exc:  # every configuration of the job then records the load failure
            self.failed = classify_failure(exc, self.job.memory_limit_gb)
        finally:
            self.load_s = time.perf_counter() - start

    def measure(self, index: int) -> dict[str, Any]:
        start = time.perf_counter()
        rec = self._measure(index)
        # the load is timed apart from the configuration (a record never counts one in the other)
        rec["timing"] = timing(self.load_s, time.perf_counter() - start if rec["status"] != "skipped" else None)
        return rec

    def _measure(self, index: int) -> dict[str, Any]:
        job = self.job
        if self.unavailable is not None:
            return base_record(job, index, "skipped", self.unavailable)
        if self.failed is not None:
            status, reason = self.failed
            return base_record(job, index, status, load_failed(job, reason))
        assert self.adapter is not None
        wl = job.config["workload"]
        point = Point(**job.points[index])
        rec = base_record(job, index, "ok", None)
        try:
            if self._context and point.input_len + point.output_len > self._context:
                raise ValueError(f"prompt of {point.input_len} tokens + {point.output_len} new tokens exceeds the "
                                 f"model's context of {self._context} tokens (max_position_embeddings)")
            ids = prompt_for(_Workload(wl), point, self._vocab, job.model_path)
            request = GenerationRequest(input_ids=ids, max_new_tokens=point.output_len,
                                        beam_width=point.beam_width, seed=int(wl["seed"]))
            for i in range(int(wl["warmup"])):
                self.on_progress(f"warmup {i + 1}/{wl['warmup']}")
                measure.time_once(self.adapter, request)
            samples = []
            for i in range(int(wl["repetitions"])):
                self.on_progress(f"rep {i + 1}/{wl['repetitions']}")
                samples.append(measure.time_once(self.adapter, request))
        except SystemUnavailable as exc:
            rec.update(status="skipped", reason=str(exc))
            return rec
        except Exception as exc:  # any failure after the configuration started is an error record
            status, reason = classify_failure(exc, job.memory_limit_gb)
            rec.update(status=status, reason=reason, traceback=traceback.format_exc(limit=8))
            return rec
        rec["method"]["token_accounting"] = getattr(self.adapter, "token_accounting", "returned_sequence")
        rec["metrics"] = measure.metrics_of(samples, point.input_len, point.output_len, int(wl["repetitions"]))
        rec["raw"] = measure.raw_of(samples)
        rec["stats"] = samples[-1].stats
        rec["system_info"] = self.adapter.info()
        trace = getattr(self.adapter, "routing_trace", None)
        if trace is not None and job.run_dir:
            path = Path(job.run_dir) / "routing" / f"{job.system['name']}-{point.key()}.json"
            rec["routing_trace"] = str(trace.save(path))
        if not self.adapter.ctx.has_cuda:  # every weight byte comes from host memory: the decode bound applies
            m = rec["metrics"]
            try:
                rec["decode_bound"] = decode_bound(
                    job.model_path, job.config["model"]["dtype"], point.input_len, point.output_len, point.beam_width,
                    {"mean": m["decode_tok_s"], "best": m["best"]["decode_tok_s"]},
                    rec["stats"].get("decode_experts_per_layer"),
                    environment_limit(float(job.config["environment"]["cpu"]["mem_bandwidth_gbps"] or 0)),
                    quant=getattr(self.adapter, "weight_quant", None))
            except Exception as exc:  # an analysis: it never turns a measured record into an error
                rec["decode_bound"] = {"unavailable": one_line(exc)}
        return rec

    def close(self) -> None:
        if self.adapter is not None:
            self.adapter.close()


def load_failed(job: Job, reason: str) -> str:
    return f"loading {job.system['name']} failed: {reason}"


def timing(load_s: float | None, measure_s: float | None) -> dict[str, float | None]:
    """Seconds the system took to load in the measuring process, and the configuration took after it."""
    return {"load_s": None if load_s is None else round(load_s, 3),
            "measure_s": None if measure_s is None else round(measure_s, 3)}


class _Workload:
    """Attribute view of the workload dict for runners.workloads."""

    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)
