#!/usr/bin/env python
"""TTFT side by side: AMX tiles from 16 tokens (the old fixed default) vs from the crossover the engine
measured at load (fiddler.kernels.tune_amx), on one loaded engine, interleaved, best of --reps.

    python scripts/bench_amx_crossover.py [--model PATH] [--prompts 8 32 64 128] [--reps 5]

Without AMX there is nothing to compare and it says so. The default model is small_mixtral from the
project's cache (run `python run.py system=fiddler model=small_mixtral` once to generate it).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import fiddler.kernels as fk
from fiddler.engine import Engine
from runners.synthetic import default_cache_root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: small_mixtral in the cache)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    path = args.model or next(iter(sorted(default_cache_root().glob("small_mixtral-*"))), None)
    if path is None:
        ap.error("no --model and no small_mixtral in the cache")
    eng = Engine.from_pretrained(path)
    tuned = fk.amx_choice()
    if tuned["min_tokens"] is None:
        print(f"nothing to compare: {tuned['source']}")
        return 0
    print(f"# {path}; tuned crossover {tuned['min_tokens']} ({tuned['source']}); ms (amx, vector) per "
          f"candidate: {tuned.get('ms')}")
    gen = torch.Generator().manual_seed(0)
    modes = sorted({16, tuned["min_tokens"]}, reverse=True)
    for n in args.prompts:
        ids = torch.randint(0, eng.config.vocab_size, (1, n), generator=gen)
        best = {m: float("inf") for m in modes}
        for _ in range(args.reps):
            for m in modes:
                fk.set_amx("on", m, source="bench_amx_crossover")
                t = time.perf_counter()
                eng.generate(ids, max_new_tokens=1)
                best[m] = min(best[m], time.perf_counter() - t)
        old, new = best[16], best[tuned["min_tokens"]]
        print(f"prompt {n:5d}: TTFT AMX from 16 {old * 1e3:8.1f} ms, from {tuned['min_tokens']} {new * 1e3:8.1f} ms, "
              f"{old / new:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
