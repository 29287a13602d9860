"""The engine against the other systems on the same generated model (tiny_mixtral with --quick,
small_mixtral otherwise), each loaded through its harness adapter, in one process:
- one decode step: transformers' per-token decode time / the engine's;
- a 128-token prefill (time to first token): transformers' / the engine's;
- one decode step: llama.cpp's (bf16 GGUF of the same weights) / the engine's, where llama.cpp is
  installed.

Timing is the harness's: a clock around `adapter.generate`, the first token marked by the adapter's
callback; a decode step is (end - first token) / (new tokens - 1). As in the harness, each system runs
in its own process with the environment it declares (benchmarks/system_worker.py); the benchmark
alternates requests between them.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from runners.models import synthetic_model

from .conftest import interleaved, record_ratio, skip_ratios
from .system_worker import SystemWorker

DECODE_PROMPT, DECODE_TOKENS, PREFILL = 32, 16, 128
# Whole-system steps of the tiny model take about a millisecond, mostly per-call overhead that moves
# with the CPU's single-thread speed and with anything else running: floors sit further below.
MARGIN = 0.3


@pytest.fixture(scope="module")
def model_name(quick) -> str:
    return "tiny_mixtral" if quick else "small_mixtral"


@pytest.fixture(scope="module")
def systems(model_name):
    """Each system loaded in its own process with its own environment (benchmarks/system_worker.py)."""
    path = synthetic_model(model_name)
    cache = Path(os.environ.get("FIDDLER_CACHE", Path.home() / ".cache" / "fiddler"))
    model = dict(name=model_name, path=str(path), dtype="bfloat16")
    ctx = dict(threads=len(os.sched_getaffinity(0)), gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(cache),
               max_seq_len=PREFILL + DECODE_TOKENS + 8, max_batch=1)
    workers = {name: SystemWorker(name, model, ctx) for name in ("fiddler", "hf_transformers", "llama_cpp")}
    for name in ("fiddler", "hf_transformers"):
        if workers[name].unavailable:
            raise RuntimeError(f"{name} did not load: {workers[name].unavailable}")
    yield workers
    for w in workers.values():
        w.close()


def prompt(n: int, vocab: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def decode_side(worker):
    ids = prompt(DECODE_PROMPT)
    return lambda i: worker.timed(ids, DECODE_TOKENS)[1]


def prefill_side(worker):
    ids = prompt(PREFILL)
    return lambda i: worker.timed(ids, 1)[0]


def test_engine_decode_vs_transformers(benchmark, systems, rounds, model_name):
    best = interleaved(benchmark, {"engine_s": decode_side(systems["fiddler"]),
                                   "transformers_s": decode_side(systems["hf_transformers"])}, rounds)
    record_ratio(benchmark, "engine_decode_vs_transformers", best["transformers_s"] / best["engine_s"], "higher",
                 best, f"transformers decode step / engine decode step, {model_name}", model=model_name,
                 margin=MARGIN)


def test_engine_prefill_vs_transformers(benchmark, systems, rounds, model_name):
    best = interleaved(benchmark, {"engine_s": prefill_side(systems["fiddler"]),
                                   "transformers_s": prefill_side(systems["hf_transformers"])}, rounds)
    record_ratio(benchmark, "engine_prefill128_vs_transformers", best["transformers_s"] / best["engine_s"],
                 "higher", best, f"transformers TTFT / engine TTFT, {PREFILL}-token prompt, {model_name}",
                 model=model_name, margin=MARGIN)


def test_engine_decode_vs_llama_cpp(benchmark, systems, rounds, model_name):
    if systems["llama_cpp"].unavailable:
        skip_ratios(["engine_decode_vs_llama_cpp"], systems["llama_cpp"].unavailable)
    best = interleaved(benchmark, {"engine_s": decode_side(systems["fiddler"]),
                                   "llama_cpp_s": decode_side(systems["llama_cpp"])}, rounds)
    record_ratio(benchmark, "engine_decode_vs_llama_cpp", best["llama_cpp_s"] / best["engine_s"], "higher", best,
                 f"llama.cpp (bf16 GGUF) decode step / engine decode step, {model_name}", model=model_name,
                 margin=MARGIN)
