#!/usr/bin/env python
"""Per-token decode time of the engine's generate loop, for A/B runs (scripts/ab.py) on any tree: one JSON
line {"<model>_<quant>_us": median step of a generate, best of --rounds}, each model loaded in turn.

    python benchmarks/tools/decode_step_time.py --models tiny_mixtral:bf16 small_mixtral:bf16 small_mixtral:q4_0
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny_mixtral:bf16"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from fiddler import Engine
    from runners.models import synthetic_model

    ids = torch.randint(3, 1000, (a.prompt,), generator=torch.Generator().manual_seed(a.prompt)).tolist()
    out = {}
    for spec in a.models:
        name, quant = spec.split(":")
        e = Engine.from_pretrained(synthetic_model(name), cpu_threads=a.threads, quant=None if quant == "bf16" else quant)
        e.generate(ids, max_new_tokens=4)
        steps = [statistics.median(e.generate(ids, max_new_tokens=a.tokens).stats["decode_latencies_s"])
                 for _ in range(a.rounds)]
        out[f"{name}_{quant}_us"] = min(steps) * 1e6
        del e
        gc.collect()
    out["loadavg"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
