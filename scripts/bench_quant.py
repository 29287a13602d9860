#!/usr/bin/env python
"""Which quantized mode wins on this CPU: the a8 path (Q8_0 activations, integer dot products) against
the w path (weights dequantized in registers, fp32 sums), for Q8_0 and Q4_0 experts and the bf16
kernel, each as a fraction of the independent read limit (fiddler.kernels.read_limit).

Measured side by side in one process, best of --reps interleaved rounds; like the engine, the experts
are cycled through more memory than the caches hold, so every call streams from DRAM.

    python scripts/bench_quant.py --hidden 2048 --ffn 5632 --tokens 1 4 16
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import fiddler.kernels as fk
from fiddler.kernels import quant as fq


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=1024, help="memory the expert copies are cycled through")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    H, Fd = a.hidden, a.ffn
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(Fd, H, generator=g) / H**0.5).bfloat16()
    w3 = (torch.randn(Fd, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(H, Fd, generator=g) / Fd**0.5).bfloat16()
    lim = fk.read_limit()
    kinds: dict[str, list] = {}
    bf = fk.PackedExpert(w1, w3, w2)
    kinds["bf16"] = [bf] + [fk.PackedExpert(w1.clone(), w3.clone(), w2.clone())
                            for _ in range(max(1, (a.mib << 20) // bf.nbytes))]
    for fmt in ("q8_0", "q4_0"):
        e = fq.QuantExpert.from_float(w1, w3, w2, fmt)
        w13, w2p = e.packed()
        kinds[fmt] = [e] + [fq.QuantExpert.from_packed(fmt, H, Fd, w13, w2p)
                            for _ in range(max(1, (a.mib << 20) // e.nbytes))]
    rows = []
    for T in a.tokens:
        x = torch.randn(T, H, generator=g).bfloat16()
        cases = [("bf16", None)] + [(f, m) for f in ("q8_0", "q4_0") for m in ("a8", "w")]
        best = {c: float("inf") for c in cases}
        i = 0
        for _ in range(a.reps):
            for c in cases:
                fmt, mode = c
                if mode:
                    fq.set_mode(mode)
                es = kinds[fmt]
                e = es[i % len(es)]
                i += 1
                t = time.perf_counter()
                e(x)
                best[c] = min(best[c], time.perf_counter() - t)
        fq.set_mode("auto")
        for (fmt, mode), s in best.items():
            nb = kinds[fmt][0].nbytes
            rows.append({"tokens": T, "format": fmt, "mode": mode or "-", "ms": s * 1e3, "gbps": nb / s / 1e9,
                         "of_limit": nb / s / 1e9 / lim["gbps"], "bytes": nb})
    print(f"CPU: {platform.processor() or platform.machine()}; threads {fk.get_num_threads()}; limit "
          f"{lim['gbps']:.1f} GB/s ({lim['best']}); expert {H}x{Fd}; default mode {fq.mode()}")
    print(f"{'tokens':>6} {'format':>6} {'mode':>4} {'ms':>8} {'GB/s':>7} {'of limit':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['format']:>6} {r['mode']:>4} {r['ms']:>8.3f} {r['gbps']:>7.1f} {r['of_limit']:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"limit": lim, "rows": rows, "mode_default": fq.mode()}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
