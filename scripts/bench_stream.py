#!/usr/bin/env python
"""The weight stream's prefetch candidates on this CPU: a packed expert (Mixtral-8x7B's shape by
default) at each token count, with every prefetch hint and distance, against the independent read
limit (fiddler.kernels.read_limit), all interleaved in rounds (best of the rounds each). This is the
measurement behind the per-vendor table in fiddler/kernels/csrc/fk_tuning.cpp.

    python scripts/bench_stream.py                           # 1 and 4 tokens, 10 rounds
    python scripts/bench_stream.py --tokens 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import fiddler.kernels as fk

CANDIDATES = ["none", "t0:512", "t0:1024", "t0:2048", "t0:4096", "t1:1024", "t1:2048", "t1:4096", "nta:1024",
              "nta:4096", "t0:512/4096", "t0:1024/4096", "t0:2048/4096", "t0:1024/8192", "t0:2048/8192",
              "nta:1024/4096"]


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not fk.is_available():
        raise SystemExit(f"kernel library not available: {fk.load_error()}")
    g = torch.Generator().manual_seed(0)
    H, FF = args.hidden, args.ffn
    copies = max(2, -(-fk.stream_working_set_bytes() // (3 * H * FF * 2)))
    experts = []
    for _ in range(copies):
        w1, w3 = ((torch.randn(FF, H, generator=g) * H**-0.5).bfloat16() for _ in range(2))
        experts.append(fk.PackedExpert(w1, w3, (torch.randn(H, FF, generator=g) * FF**-0.5).bfloat16()))
    limit_buf = fk.limit_buffer(1 << 30)
    default = fk.set_stream("auto")
    out = {"cpu": cpu_name(), "features": fk.features(), "default": default, "hidden": H, "ffn": FF,
           "copies": copies, "rounds": args.rounds, "rows": []}
    print(f"# {out['cpu']}, default {default['spec']} ({default['source']}), "
          f"expert {H}x{FF}, {copies} copies, best of {args.rounds} interleaved rounds")
    for tokens in args.tokens:
        x = torch.randn(tokens, H, generator=g).bfloat16()
        y = torch.empty(tokens, H, dtype=torch.bfloat16)
        best = {c: float("inf") for c in CANDIDATES}
        limit = 0.0
        i = 0
        try:
            for _ in range(args.rounds):
                limit = max(limit, fk.read_limit(repeats=1, buffer=limit_buf)["gbps"])
                for c in CANDIDATES:
                    fk.set_stream(c)
                    e = experts[i % copies]
                    i += 1
                    t = time.perf_counter()
                    e(x, out=y)
                    best[c] = min(best[c], time.perf_counter() - t)
        finally:
            fk.set_stream("auto")
        nb = experts[0].nbytes
        print(f"\n{tokens} token(s): read limit {limit:.1f} GB/s")
        print(f"{'prefetch':>14} {'GB/s':>7} {'of limit':>9}")
        for c in CANDIDATES:
            gbps = nb / best[c] / 1e9
            out["rows"].append({"tokens": tokens, "prefetch": c, "gbps": gbps, "limit_gbps": limit,
                                "fraction": gbps / limit})
            print(f"{c:>14} {gbps:>7.1f} {gbps / limit:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
