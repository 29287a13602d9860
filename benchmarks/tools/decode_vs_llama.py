#!/usr/bin/env python
"""The engine's decode step against llama.cpp's on one generated model, timed as the regression suite's
engine_decode_vs_llama_cpp times it (benchmarks/test_system_ratios.py: each system through its harness
adapter in its own process, a clock around adapter.generate, decode step = (end - first token) /
(new tokens - 1)), with many more rounds: the best and the median per token of each side, and the ratio of
the bests (the suite's reading) and of the medians. One JSON line last, for scripts/ab.py --key.

    python benchmarks/tools/decode_vs_llama.py [--model tiny_mixtral] [--quant q4_0] [--rounds 30]
                                               [--prompt 32] [--new 16]

--prompt/--new: prompt tokens and tokens generated a request (default: the suite's 32 and 16). Each side's
best step is also given as a fraction of the decode bound (runners.decode_bound's bytes a token over the
read limit of fiddler.kernels.read_limit, measured before and after the rounds: this VM's bandwidth moves,
so both readings are printed).

--quant: both sides at that type (system.quant=...; llama.cpp's pure GGUF of the same weights, its
default quant_policy, so the same tensors are quantized).

The engine and harness code are the ones PYTHONPATH finds first (scripts/ab.py sets it to each side's tree).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny_mixtral")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--quant", default=None, help="q8_0 | q4_0: both systems at that type (default bf16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: the suite's)")
    ap.add_argument("--new", type=int, default=None, help="tokens generated a request (default: the suite's)")
    a = ap.parse_args()
    from benchmarks.system_worker import SystemWorker
    from benchmarks.test_system_ratios import DECODE_PROMPT, DECODE_TOKENS, PREFILL, prompt
    from fiddler.kernels import read_limit
    from runners.decode_bound import decode_bound
    from runners.models import synthetic_model

    n_prompt, n_new = a.prompt or DECODE_PROMPT, a.new or DECODE_TOKENS
    limits = [read_limit(cached=False)]

    cache = Path(os.environ.get("FIDDLER_CACHE", Path.home() / ".cache" / "fiddler"))
    model = dict(name=a.model, path=str(synthetic_model(a.model)), dtype="bfloat16")
    ctx = dict(threads=len(os.sched_getaffinity(0)), gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(cache),
               max_seq_len=max(PREFILL, n_prompt) + n_new + 8, max_batch=1)
    options = {"quant": a.quant} if a.quant else {}
    workers = {n: SystemWorker(n, model, ctx, options) for n in ("fiddler", "llama_cpp")}
    try:
        for n, w in workers.items():
            if w.unavailable:
                raise SystemExit(f"{n} unavailable: {w.unavailable}")
        ids = prompt(n_prompt)
        times = {n: [] for n in workers}
        for r in range(a.rounds + 1):
            for n, w in (workers.items() if r % 2 else reversed(list(workers.items()))):
                t = w.timed(ids, n_new)[1]
                if r:  # the first round warms
                    times[n].append(t)
    finally:
        for w in workers.values():
            w.close()
    out = {}
    for n, ts in times.items():
        out[f"{n}_best_us"] = min(ts) * 1e6
        out[f"{n}_median_us"] = statistics.median(ts) * 1e6
    out["ratio_best"] = out["llama_cpp_best_us"] / out["fiddler_best_us"]
    out["ratio_median"] = out["llama_cpp_median_us"] / out["fiddler_median_us"]
    limits.append(read_limit(cached=False))
    for i, lim in enumerate(limits):
        b = decode_bound(model["path"], "bfloat16", n_prompt, n_new, 1,
                         {n: 1e6 / out[f"{n}_best_us"] for n in workers}, None, lim, quant=a.quant)
        out[f"limit{i}_gbps"] = lim["gbps"]
        for n in workers:
            out[f"{n}_bound_fraction_limit{i}"] = b["fraction"][n]
    out["loadavg"] = os.getloadavg()[0]
    print(f"model {a.model}  type {a.quant or 'bf16'}  {a.rounds} interleaved rounds")
    for k, v in out.items():
        print(f"{k:22s} {v:10.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
