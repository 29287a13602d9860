"""PyTorch's bf16 Mixtral-8x7B expert FFN on this CPU against the independent read limit: the source of the
CPU costs of `system=fiddler_original` (the released Fiddler runs its CPU experts in PyTorch,
efeslab/fiddler@227715b:src/fiddler/mixtral.py#L650-654).

    python scripts/bench_torch_expert.py --out results/measured/<date>-<cpu>-torch-bf16-expert/torch_expert.json

In one process: `fiddler.kernels.read_limit` (the project's probe, at every thread count and at one thread),
then torch's expert (w1, w3, SiLU, w2 as F.linear in bf16) at 1..128 tokens, best of --repeats. Then the same
torch expert in a child process with ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512 (AVX-512 without
BF16 or AMX: the paper's Skylake-SP), and the ratio of its times to the native ones. Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import torch

from fiddler.executors import ExpertWeights, torch_expert  # the library's SwiGLU in torch
from fiddler.latency import best_time

HIDDEN, FFN = 4096, 14336
TOKENS = (1, 4, 16, 128)


def expert_times(threads: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(FFN, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(2))
    w2 = torch.randn(HIDDEN, FFN, generator=g).to(torch.bfloat16)
    expert = ExpertWeights(w1, w3, w2)
    out = {}
    for t in TOKENS:
        x = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)

        def run():
            return torch_expert(expert, x)

        out[str(t)] = best_time(run, repeats=repeats)
    return out


def cpu_info() -> dict[str, str]:
    info = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("Model name", "CPU family", "Model", "Thread(s) per core", "CPU(s)"):
                info[k.strip()] = v.strip()
    except (OSError, subprocess.CalledProcessError):
        info["Model name"] = platform.processor()
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(expert_times(args.threads, args.repeats)))
        return 0
    import fiddler.kernels as fk

    limit = fk.read_limit(threads=args.threads, repeats=args.repeats)
    limit1 = fk.read_limit(threads=1, repeats=args.repeats)
    load_before = os.getloadavg()  # other processes on the host slow every reading: stored beside them
    native = expert_times(args.threads, args.repeats)
    native_1t = expert_times(1, args.repeats)  # one thread: per-core bound (half of 2 threads) or not
    torch.set_num_threads(args.threads)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"}
    child = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads), "--repeats",
                            str(args.repeats)], env=env, capture_output=True, text=True, check=True)
    avx512 = json.loads(child.stdout.strip().splitlines()[-1])
    nbytes = 3 * HIDDEN * FFN * 2
    res = {
        "what": "torch bf16 Mixtral-8x7B expert FFN (F.linear x3 + SiLU), best of repeats, vs fiddler.kernels.read_limit",
        "cpu": cpu_info(), "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
        "expert_bytes": nbytes, "read_limit_gbps": limit["gbps"], "read_limit_best": limit["best"],
        "read_limit_1t_gbps": limit1["gbps"],
        "native_s": native, "native_1t_s": native_1t, "avx512_core_s": avx512,
        "native_gbps_1tok_1t": nbytes / native_1t["1"] / 1e9,
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "native_gbps_1tok": nbytes / native["1"] / 1e9,
        "native_fraction_of_limit_1tok": nbytes / native["1"] / 1e9 / limit["gbps"],
        "avx512_over_native": {t: avx512[t] / native[t] for t in native},
    }
    # the simulator's sum model: t(n) = bytes / (limit x fraction) + 2 n params / (cores x GFLOP/s per core)
    frac = res["native_fraction_of_limit_1tok"]
    for name, times in (("native", native), ("avx512_core", avx512)):
        f = frac if name == "native" else nbytes / times["1"] / 1e9 / limit["gbps"]
        stream = nbytes / (limit["gbps"] * 1e9 * f)
        compute = max(times["128"] - stream, 1e-9)
        res[f"{name}_fraction_of_limit_1tok"] = f
        res[f"{name}_gflops_per_core_128tok"] = 2 * 128 * nbytes / 2 / compute / 1e9 / args.threads
    text = json.dumps(res, indent=1, sort_keys=True)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
