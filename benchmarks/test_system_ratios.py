"""The engine against the other systems on the same generated model (tiny_mixtral with --quick,
small_mixtral otherwise), each loaded through its harness adapter, in one process:
- one decode step: transformers' per-token decode time / the engine's;
- a 128-token prefill (time to first token): transformers' / the engine's;
- one decode step: llama.cpp's (bf16 GGUF of the same weights) / the engine's, where llama.cpp is
  installed.

Timing is the harness's: a clock around `adapter.generate`, the first token marked by the adapter's
callback; a decode step is (end - first token) / (new tokens - 1). All systems share the process and
its OMP_WAIT_POLICY (scripts/regress.py sets PASSIVE, the engine's setting), so these are regression
ratios, not the harness's comparison (which gives each system its own process and settings).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from baselines.base import GenerationRequest, ModelSpec, RunContext
from runners.models import synthetic_model

from .conftest import interleaved, record_ratio, skip_ratios

DECODE_PROMPT, DECODE_TOKENS, PREFILL = 32, 16, 128
# Whole-system steps of the tiny model take about a millisecond, mostly per-call overhead that moves
# with the CPU's single-thread speed and with anything else running: floors sit further below.
MARGIN = 0.3


@pytest.fixture(scope="module")
def model_name(quick) -> str:
    return "tiny_mixtral" if quick else "small_mixtral"


@pytest.fixture(scope="module")
def systems(model_name):
    path = synthetic_model(model_name)
    threads = len(os.sched_getaffinity(0))
    cache = Path(os.environ.get("FIDDLER_CACHE", Path.home() / ".cache" / "fiddler"))
    ctx = RunContext(threads=threads, gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(cache),
                     max_seq_len=PREFILL + DECODE_TOKENS + 8, max_batch=1)
    spec = ModelSpec(name=model_name, path=str(path), dtype="bfloat16")
    from baselines.fiddler_engine.adapter import FiddlerAdapter
    from baselines.fiddler_engine.config import FiddlerConfig
    from baselines.hf_transformers.adapter import HFTransformersAdapter
    from baselines.hf_transformers.config import HFTransformersConfig

    out = {"fiddler": FiddlerAdapter(FiddlerConfig.build(), spec, ctx),
           "hf_transformers": HFTransformersAdapter(HFTransformersConfig.build(), spec, ctx)}
    try:
        from baselines.llama_cpp.adapter import LlamaCppAdapter
        from baselines.llama_cpp.config import LlamaCppConfig

        out["llama_cpp"] = LlamaCppAdapter(LlamaCppConfig.build(), spec, ctx)
    except ImportError:
        pass
    loaded = {}
    for name, a in out.items():
        try:
            a.load()
            loaded[name] = a
        except Exception as exc:  # llama.cpp missing: its ratio is reported as skipped
            if name != "llama_cpp":
                raise
            loaded["llama_cpp_unavailable"] = f"{type(exc).__name__}: {exc}"
    yield loaded
    for a in loaded.values():
        if hasattr(a, "close"):
            a.close()


def prompt(n: int, vocab: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def timed(adapter, ids: list[int], new: int) -> tuple[float, float]:
    """(ttft seconds, decode seconds per token) of one generate call."""
    first = []
    t0 = time.perf_counter()
    adapter.generate(GenerationRequest(input_ids=ids, max_new_tokens=new),
                     lambda: first.append(time.perf_counter()))
    adapter.synchronize()
    end = time.perf_counter()
    return first[0] - t0, (end - first[0]) / max(1, new - 1)


def decode_side(adapter):
    ids = prompt(DECODE_PROMPT)
    return lambda i: timed(adapter, ids, DECODE_TOKENS)[1]


def prefill_side(adapter):
    ids = prompt(PREFILL)
    return lambda i: timed(adapter, ids, 1)[0]


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
    if "llama_cpp" not in systems:
        skip_ratios(["engine_decode_vs_llama_cpp"],
                    systems.get("llama_cpp_unavailable", "llama-cpp-python is not installed"))
    best = interleaved(benchmark, {"engine_s": decode_side(systems["fiddler"]),
                                   "llama_cpp_s": decode_side(systems["llama_cpp"])}, rounds)
    record_ratio(benchmark, "engine_decode_vs_llama_cpp", best["llama_cpp_s"] / best["engine_s"], "higher", best,
                 f"llama.cpp (bf16 GGUF) decode step / engine decode step, {model_name}", model=model_name,
                 margin=MARGIN)
