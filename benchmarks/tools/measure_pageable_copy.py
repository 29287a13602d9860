#!/usr/bin/env python
"""Host-to-GPU copy of one expert from pageable against pinned memory, and the released Fiddler's way of
copying one (`expert_placeholder.load_state_dict(experts[i].state_dict())` from pageable host tensors,
efeslab/fiddler@227715b:src/fiddler/mixtral.py#L610-616): the source of `pageable_fraction_of_pinned` in
systems/fiddler/original_sim.py.

    python benchmarks/tools/measure_pageable_copy.py --out copy.json                 # a Mixtral-8x7B expert, CUDA
    python benchmarks/tools/measure_pageable_copy.py --device cpu --tiny --out t.json  # a structure check on a CPU

Each figure is the median (and min) of --reps timed copies after a warm-up, each between two device syncs;
GB/s = the expert's bytes / time. Prints one line per way and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn


class Expert(nn.Module):
    """The shape of transformers' MixtralBlockSparseTop2MLP: w1, w3 [ffn, hidden], w2 [hidden, ffn], no bias."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn, sync, reps: int) -> list[float]:
    fn()
    sync()
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--tiny", action="store_true", help="hidden 64, ffn 128 (a structure check)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    hidden, ffn = (64, 128) if args.tiny else (args.hidden, args.ffn)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    with torch.no_grad():
        host = Expert(hidden, ffn).to(torch.bfloat16)  # pageable host tensors, as the release keeps its experts
        placeholder = Expert(hidden, ffn).to(torch.bfloat16).to(dev)
        nbytes = sum(p.numel() * p.element_size() for p in host.parameters())
        flat_pageable = torch.empty(nbytes // 2, dtype=torch.bfloat16)
        flat_pageable.fill_(1.0)
        pin_ok = dev.type == "cuda"
        flat_pinned = flat_pageable.pin_memory() if pin_ok else flat_pageable.clone()
        flat_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        ways = {
            "pinned_copy": lambda: flat_dev.copy_(flat_pinned, non_blocking=True),
            "pageable_copy": lambda: flat_dev.copy_(flat_pageable),
            "release_load_state_dict": lambda: placeholder.load_state_dict(host.state_dict()),
        }
        res: dict = {"script": "benchmarks/tools/measure_pageable_copy.py", "torch": torch.__version__, "device": str(dev),
                     "gpu_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                     "host_cpu": _cpu_name(), "expert": {"hidden": hidden, "ffn": ffn, "bytes": nbytes},
                     "pinned": pin_ok, "reps": args.reps,
                     "protocol": "each copy between two device syncs after one warm-up; median and min of reps",
                     "ways": {}}
        for name, fn in ways.items():
            ts = timed(fn, sync, args.reps)
            med, best = statistics.median(ts), min(ts)
            res["ways"][name] = {"median_s": med, "min_s": best, "gbps_median": nbytes / med / 1e9,
                                 "gbps_best": nbytes / best / 1e9}
            print(f"{name:24s} {nbytes / 1e6:8.1f} MB  median {med * 1e3:8.2f} ms = {nbytes / med / 1e9:6.2f} GB/s"
                  f"  (best {nbytes / best / 1e9:6.2f})", flush=True)
        w = res["ways"]
        res["pageable_fraction_of_pinned"] = w["pageable_copy"]["gbps_median"] / w["pinned_copy"]["gbps_median"]
        res["release_fraction_of_pinned"] = (w["release_load_state_dict"]["gbps_median"]
                                             / w["pinned_copy"]["gbps_median"])
        print(f"pageable / pinned {res['pageable_fraction_of_pinned']:.3f}; the release's load_state_dict / pinned "
              f"{res['release_fraction_of_pinned']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
