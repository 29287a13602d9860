#!/usr/bin/env python
"""Benchmark the CPU expert kernel against PyTorch and against this machine's memory bandwidth.

For each token count, in one process and side by side: the packed kernel (PackedExpert.forward),
torch's bf16 F.linear expert on the same tensors, and the independent read limit
(fiddler.kernels.read_limit: the best of plain/T0/T1/NTA streaming reads and an fp32 GEMV; `limit_by`
names the winner). Every figure is the best of --reps interleaved rounds; the limit is re-measured
for each row so that a row is self-consistent when other processes load the machine.

Like the engine, which streams each expert from DRAM, the kernel, torch and the GEMV each cycle
through enough copies of their weights to exceed `fiddler.kernels.stream_working_set_bytes()`, so no
cache holds the weights between calls (on some VMs a 352 MB expert called twice in a row comes back
from a cache at twice the DRAM rate).

    python scripts/bench_kernel.py                       # Mixtral-8x7B expert, 1..128 tokens
    python scripts/bench_kernel.py --hidden 1024 --ffn 3584 --tokens 1 8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import fiddler.kernels as fk
from fiddler.executors import ExpertWeights, torch_expert  # the library's SwiGLU in torch
from fiddler import latency


def best_time(fn, reps: int) -> float:
    return latency.best_time(fn, repeats=reps, warmup=0)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--threads", type=int, default=None, help="kernel and torch threads (default: all CPUs)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--isa", default=None, help="force a kernel path (auto, amx, avx512_bf16, avx2, generic)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)

    if not fk.is_available():
        raise SystemExit(f"kernel library not available: {fk.load_error()}")
    if args.isa:
        fk.set_isa(args.isa)
    threads = args.threads or fk.get_num_threads()
    torch.set_num_threads(threads)

    g = torch.Generator().manual_seed(0)
    H, FF = args.hidden, args.ffn
    weight_bytes = 3 * H * FF * 2
    copies = max(1, min(64, -(-fk.stream_working_set_bytes() // weight_bytes)))
    w1 = (torch.randn(FF, H, generator=g) * H**-0.5).to(torch.bfloat16)
    w3 = (torch.randn(FF, H, generator=g) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(H, FF, generator=g) * FF**-0.5).to(torch.bfloat16)
    torch_w = [(w1, w3, w2)] + [(w1.clone(), w3.clone(), w2.clone()) for _ in range(copies - 1)]
    t0 = time.perf_counter()
    experts = [fk.PackedExpert(*ws) for ws in torch_w]
    torch_w_objs = [ExpertWeights(*ws) for ws in torch_w]
    pack_s = (time.perf_counter() - t0) / copies
    limit_buf = fk.limit_buffer()

    feats = fk.features()
    print(f"# {platform.processor() or platform.machine()}, {threads} threads, kernel path {feats['isa']}"
          f"{' + AMX' if feats['amx_active'] else ''}, torch {torch.__version__}; "
          f"expert {H}x{FF} ({weight_bytes / 1e6:.0f} MB bf16, {copies} copies cycled), packed in {pack_s:.2f} s, "
          f"best of {args.reps}")
    cols = ["tokens", "kernel_ms", "torch_ms", "speedup", "kernel_gbps", "limit_gbps", "of_limit", "limit_by",
            "max_rel_diff"]
    print(" ".join(f"{c:>14}" for c in cols))
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        out = torch.empty(tokens, H, dtype=torch.bfloat16)
        # Interleaved rounds (limit, kernel, torch, limit, ...) so that every figure of a row gets the
        # same chances of a quiet moment on a shared machine; best of the rounds each. Round i uses
        # weight copy i % copies everywhere.
        for i in range(min(2, copies)):
            experts[i].forward(x, out=out, threads=threads)
            torch_expert(ExpertWeights(*torch_w[i]), x)
        limit, k_s, t_s = {"gbps": 0.0}, float("inf"), float("inf")
        for r in range(args.reps):
            c = r % copies
            lim = fk.read_limit(threads=threads, repeats=1, buffer=limit_buf)
            limit = max(limit, lim, key=lambda d: d["gbps"])
            # the kernel runs after the limit's reads, not right after a torch op: torch's OpenMP
            # threads busy-wait after a parallel region and would share the cores with it (see API.md)
            k_s = min(k_s, best_time(lambda: experts[c].forward(x, out=out, threads=threads), 1))
            t_s = min(t_s, best_time(lambda: torch_expert(torch_w_objs[c], x), 1))
        experts[0].forward(x, out=out, threads=threads)
        ref = torch_expert(ExpertWeights(*torch_w[0]), x).float()
        diff = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        row = {
            "tokens": tokens,
            "kernel_ms": k_s * 1e3,
            "torch_ms": t_s * 1e3,
            "speedup": t_s / k_s,
            "kernel_gbps": weight_bytes / k_s / 1e9,
            "limit_gbps": limit["gbps"],
            "of_limit": weight_bytes / k_s / 1e9 / limit["gbps"],
            "limit_by": limit["best"],
            "limit_strategies": limit["strategies"],
            "max_rel_diff": diff,
            "loadavg_1m": os.getloadavg()[0],
        }
        rows.append(row)
        print(" ".join(f"{row[c]:>14.4g}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in cols), flush=True)
    if args.json:
        meta = {"hidden": H, "ffn": FF, "threads": threads, "features": feats, "torch": torch.__version__,
                "reps": args.reps, "pack_s": pack_s, "cpu_count": os.cpu_count(), "copies": copies,
                "platform": platform.platform()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
