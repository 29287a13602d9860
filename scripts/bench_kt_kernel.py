#!/usr/bin/env python
"""Fiddler's bf16 expert kernel against kTransformers' CPU MoE kernel (kt-kernel) on the same expert
weights, 1 to 512 tokens, in one process, the two sides interleaved round by round, each keeping its best
time (a busy shared machine slows both alike).

Each side cycles through `--copies` copies of one expert (Mixtral-8x7B's 4096 x 14336 by default, 352 MB
in bf16), so every call streams its weights from DRAM as an engine's experts do: Fiddler's
`PackedExpert.forward`, and kt-kernel's MoE operator (`AMXBF16_MOE`, the class its "BF16" method builds
where AVX512-BF16 is present; on a CPU without AMX its avx512_bf16 build runs it on AVX-512) given the
copies as the experts of one layer, top-1 routing to the copy of the round with weight 1.0, so both
compute y = W2 (silu(W1 x) * (W3 x)) over the same bytes. Both outputs are checked against torch's bf16
expert before timing.

kt-kernel lives in its own virtual environment so the project's stays as it is; its wheel asks for
torch and triton from the index (a CUDA torch), so it is installed without dependencies and runs on the
project's CPU torch:

    python -m venv /tmp/ktvenv && /tmp/ktvenv/bin/pip install --no-deps kt-kernel==0.7.2
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/ktvenv/lib/python3.11/site-packages/project.pth
    PYTHONPATH=$PWD /tmp/ktvenv/bin/python scripts/bench_kt_kernel.py [--json out.json]

Prints one row per token count: each side's best ms and GB/s (weight bytes / time), and fiddler / kt
(kt's time over Fiddler's: above 1, Fiddler is faster).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from fiddler.executors import ExpertWeights, torch_expert  # the library's SwiGLU in torch: the reference

TOKENS = (1, 4, 16, 64, 256, 512)


def cpu_name() -> str:
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or "unknown"
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


class KtExperts:
    """kt-kernel's MoE operator over `weights` (a list of (w1, w3, w2) bf16), all on the CPU."""

    def __init__(self, weights, hidden: int, ffn: int, threads: int, max_tokens: int):
        import kt_kernel  # noqa: F401 -- loads the extension variant for this CPU and registers kt_kernel_ext
        from kt_kernel_ext import CPUInfer, WorkerPoolConfig
        from kt_kernel_ext.moe import AMXBF16_MOE, MOEConfig

        self.variant = kt_kernel.__cpu_variant__
        cfg = WorkerPoolConfig()
        cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [threads]
        self.infer = CPUInfer(cfg)
        n = len(weights)
        self._keep = weights  # the operator reads these at load; kept alive in case it keeps pointers
        self._on_gpu = torch.zeros(n, dtype=torch.bool)  # every expert on the CPU
        mc = MOEConfig(n, 1, hidden, ffn, self._on_gpu.data_ptr())
        mc.layer_idx, mc.pool, mc.max_len = 0, self.infer.backend_, max_tokens
        mc.gate_projs = [[w[0].data_ptr() for w in weights]]
        mc.up_projs = [[w[1].data_ptr() for w in weights]]
        mc.down_projs = [[w[2].data_ptr() for w in weights]]
        mc.gate_scales = mc.up_scales = mc.down_scales = [[0] * n]  # bf16: no scales
        self.moe = AMXBF16_MOE(mc)
        self._ids_map = torch.arange(n, dtype=torch.long)
        self.infer.submit(self.moe.load_weights_task(self._ids_map.data_ptr()))
        self.infer.sync()
        self._args: dict = {}

    def forward(self, e: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        key = (e, t)
        if key not in self._args:  # per (expert, tokens): the routing buffers, made once
            self._args[key] = (torch.tensor([t], dtype=torch.int32), torch.full((t, 1), e, dtype=torch.long),
                               torch.ones(t, 1, dtype=torch.float32))
        bsz, ids, w = self._args[key]
        self.infer.submit(self.moe.forward_task(bsz.data_ptr(), 1, ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                                out.data_ptr(), False))
        self.infer.sync()
        return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--copies", type=int, default=4, help="expert copies each side cycles through (> the LLC)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: the kernel's (all CPUs)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    import fiddler.kernels as fk

    if not fk.is_available():
        print(f"bench_kt_kernel: fiddler's kernel is not available: {fk.load_error()}", file=sys.stderr)
        return 2
    threads = args.threads or fk.get_num_threads()
    try:
        import kt_kernel  # noqa: F401
    except Exception as e:  # not installed, or its extension does not load here: say why, measure nothing
        print(f"bench_kt_kernel: kt-kernel does not import here: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    h, f = args.hidden, args.ffn
    weights = [((torch.randn(f, h, generator=g) * h**-0.5).to(torch.bfloat16),
                (torch.randn(f, h, generator=g) * h**-0.5).to(torch.bfloat16),
                (torch.randn(h, f, generator=g) * f**-0.5).to(torch.bfloat16)) for _ in range(args.copies)]
    ours = [fk.PackedExpert(*w) for w in weights]
    fk.tune_blocking(ours)  # as the engine does at load
    kt = KtExperts(weights, h, f, threads, max(args.tokens))
    weight_bytes = ours[0].nbytes
    n = args.copies
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        out_ours, out_kt = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16)
        ref = torch_expert(ExpertWeights(*weights[0]), x)
        errs = {"fiddler": rel_err(ours[0].forward(x, out=out_ours), ref),
                "kt": rel_err(kt.forward(0, x, out_kt), ref)}
        best = {"fiddler": float("inf"), "kt": float("inf")}
        for r in range(args.rounds + 1):  # round 0 warms up
            sides = (("fiddler", lambda i: ours[i].forward(x, out=out_ours)), ("kt", lambda i: kt.forward(i, x, out_kt)))
            for name, fn in (sides if r % 2 == 0 else sides[::-1]):  # alternated: neither side always first
                t0 = time.perf_counter()
                fn((r + (name == "kt")) % n)  # the two sides read different copies in one round
                dt = time.perf_counter() - t0
                if r:
                    best[name] = min(best[name], dt)
        row = {"tokens": t, "fiddler_ms": best["fiddler"] * 1e3, "kt_ms": best["kt"] * 1e3,
               "fiddler_gbps": weight_bytes / best["fiddler"] / 1e9, "kt_gbps": weight_bytes / best["kt"] / 1e9,
               "fiddler_vs_kt": best["kt"] / best["fiddler"], "rel_err_vs_torch": errs}
        rows.append(row)
        print(f"{t:>4} tokens  fiddler {row['fiddler_ms']:8.2f} ms {row['fiddler_gbps']:6.1f} GB/s   "
              f"kt {row['kt_ms']:8.2f} ms {row['kt_gbps']:6.1f} GB/s   fiddler/kt {row['fiddler_vs_kt']:.2f}   "
              f"max rel err vs torch: fiddler {errs['fiddler']:.1e}, kt {errs['kt']:.1e}", flush=True)
    meta = {"cpu": cpu_name(), "threads": threads, "fiddler_path": fk.features()["isa"], "kt_variant": kt.variant,
            "kt_class": "AMXBF16_MOE", "hidden": h, "ffn": f, "copies": n, "rounds": args.rounds,
            "weight_bytes": weight_bytes}
    print(f"on {meta['cpu']}, {threads} threads; fiddler path {meta['fiddler_path']}, kt-kernel variant "
          f"{meta['kt_variant']} ({meta['kt_class']}); best of {args.rounds} interleaved rounds")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
