#!/usr/bin/env python
"""Fiddler's expert kernels against kTransformers' CPU MoE kernel (kt-kernel) on the same expert weights,
1 to 512 tokens, in one process, the two sides interleaved round by round, each keeping its best time (a
busy shared machine slows both alike). `--format` picks the weight format of both sides:

    bf16  Fiddler's `PackedExpert`                  kt-kernel's `AMXBF16_MOE`
    int8  Fiddler's Q8_0 `QuantExpert` (fiddler.quant) kt-kernel's `AMXInt8_MOE` (its method "AMXINT8")
    int4  Fiddler's Q4_0 `QuantExpert`               kt-kernel's `AMXInt4_MOE` (its method "AMXINT4")
    q8_0  Fiddler's Q8_0 `QuantExpert`               kt-kernel's `MOE` (its method "LLAMAFILE") on the same blocks
    q4_0  Fiddler's Q4_0 `QuantExpert`               kt-kernel's `MOE` on the same blocks

The AMX* classes keep their names in kt's avx512_* builds, where they run on AVX-512 (BF16 with vdpbf16ps,
int8/int4 with VNNI); its avx2 build has AVX2BF16_MOE for bf16 and no int8/int4 operator of these.
kt's int formats are quantized online from the same bf16 weights (one scale per output row; Fiddler's
Q8_0/Q4_0 keep one per 32 weights), written as files under a temporary weight path that goes when they are
loaded; its llamafile operator (every build) reads GGUF blocks and is given Fiddler's own llama.cpp blocks,
so for q8_0/q4_0 both sides read the same bytes. Each side's GB/s counts its own bytes (kt's int formats:
the sizes of the files it wrote for one expert).

Each side cycles through `--copies` copies of one expert (Mixtral-8x7B's 4096 x 14336 by default, 352 MB
in bf16), so every call streams its weights from DRAM as an engine's experts do; kt-kernel gets the copies
as the experts of one layer, top-1 routing to the copy of the round with weight 1.0, so both compute
y = W2 (silu(W1 x) * (W3 x)). Both outputs are checked against torch's bf16 expert before timing (max abs
error over max abs value; a side above the format's bound, e.g. a misread layout, stops the run).

kt-kernel lives in its own virtual environment so the project's stays as it is; its wheel asks for
torch and triton from the index (a CUDA torch), so it is installed without dependencies and runs on the
project's CPU torch:

    python -m venv /tmp/ktvenv && /tmp/ktvenv/bin/pip install --no-deps kt-kernel==0.7.2
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/ktvenv/lib/python3.11/site-packages/project.pth
    PYTHONPATH=$PWD /tmp/ktvenv/bin/python scripts/bench_kt_kernel.py [--format q4_0] [--json out.json]

Prints one row per token count: each side's best ms and GB/s, and fiddler / kt (kt's time over Fiddler's:
above 1, Fiddler is faster). Exit 2: nothing to compare (Fiddler's kernel or kt-kernel does not load);
exit 3: kt-kernel's build here cannot run this format (the reason is printed, and written to --json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import torch

from fiddler.executors import ExpertWeights, torch_expert  # the library's SwiGLU in torch: the reference

TOKENS = (1, 4, 16, 64, 256, 512)


class Format(NamedTuple):
    quant: str | None  # Fiddler's: None (bf16 PackedExpert) or its quant format (QuantExpert)
    kt_weights: str    # what kt is given: "bf16", "online" (bf16, it quantizes them) or "ggml" (Fiddler's blocks)
    kt_classes: tuple  # kt_kernel_ext.moe's operators for it, the first one the loaded build has runs
    max_err: float     # bound on the error against torch's bf16 expert: well above each side's rounding
                       # (bf16 ~5e-3, 8-bit ~3e-2, 4-bit ~0.3 on random weights), below a misread layout's (~1)


# kt's avx512_* and amx builds have the AMX* classes (AVX-512 code where the CPU has no AMX); its avx2 build has
# only AVX2BF16_MOE of these (and int4 classes for GPTQ / raw checkpoints, not quantized from bf16). Its
# llamafile operator (`MOE`, method "LLAMAFILE", in every build) reads GGUF blocks: given Fiddler's own
# Q8_0 / Q4_0 blocks (bit for bit llama.cpp's), both sides read the same bytes.
FORMATS = {"bf16": Format(None, "bf16", ("AMXBF16_MOE", "AVX2BF16_MOE"), 0.05),
           "int8": Format("q8_0", "online", ("AMXInt8_MOE",), 0.15),
           "int4": Format("q4_0", "online", ("AMXInt4_MOE",), 0.6),
           "q8_0": Format("q8_0", "ggml", ("MOE",), 0.15), "q4_0": Format("q4_0", "ggml", ("MOE",), 0.6)}


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


def kt_operator(moe_module, fmt: str) -> str | None:
    """The name of the operator that runs `fmt` in this kt-kernel build (None: it has none)."""
    return next((name for name in FORMATS[fmt].kt_classes if getattr(moe_module, name, None) is not None), None)


def missing_operator(moe_module, fmt: str, variant: str) -> str | None:
    """Why kt-kernel's `variant` build has no operator for `fmt` (None: it has one)."""
    if kt_operator(moe_module, fmt) is None:
        return f"its {variant} build has no {' or '.join(FORMATS[fmt].kt_classes)}"
    return None


def probe_failure(returncode: int, stderr: str) -> str | None:
    """Why a child that ran the operator on a tiny expert failed (None: it ran), e.g. SIGILL where the build
    uses an instruction this CPU lacks, which would kill the measuring process with no reason given."""
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            how = f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"died of signal {-returncode}"
    else:
        how = f"failed (exit {returncode})"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    return f"{how} running a tiny expert: {last}"


def kt_expert_bytes(path: str, expert: int = 0) -> int:
    """Bytes kt-kernel wrote for one expert under its weight path (quantized weights and scales of its gate,
    up and down projections: files named like INT8_gate_0_131072Byte_quant_.kt)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            parts = name.split("_")
            if len(parts) > 2 and parts[1] in ("gate", "up", "down") and parts[2] == str(expert):
                total += os.path.getsize(os.path.join(root, name))
    return total


def error_problems(errs: dict[str, float], max_err: float) -> list[str]:
    """The sides whose error against torch's bf16 expert is above the format's bound (or not a number)."""
    return [f"{side} {e:.3g} > {max_err}" for side, e in errs.items() if not e <= max_err]


class KtExperts:
    """kt-kernel's MoE operator for `fmt` over the experts w1, w3 [n, ffn, hidden], w2 [n, hidden, ffn] (bf16,
    contiguous), all on the CPU. The int formats quantize online into files under `workdir`; the GGML ones take
    `blocks` (`ggml_blocks`)."""

    def __init__(self, fmt: str, w1, w3, w2, threads: int, max_tokens: int, workdir: str, blocks=None):
        import kt_kernel  # noqa: F401 -- loads the extension variant for this CPU and registers kt_kernel_ext
        import kt_kernel_ext.moe as moe_mod
        from kt_kernel_ext import CPUInfer, WorkerPoolConfig

        self.variant = kt_kernel.__cpu_variant__
        self.kt_class = kt_operator(moe_mod, fmt)
        if self.kt_class is None:
            raise RuntimeError(missing_operator(moe_mod, fmt, self.variant))
        n, ffn, hidden = w1.shape
        cfg = WorkerPoolConfig()
        cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [threads]
        self.infer = CPUInfer(cfg)
        self._keep = (w1, w3, w2, blocks)  # the operator reads these at load; kept alive in case it keeps pointers
        self._on_gpu = torch.zeros(n, dtype=torch.bool)  # every expert on the CPU
        mc = moe_mod.MOEConfig(n, 1, hidden, ffn, self._on_gpu.data_ptr())
        # its buffers hold max_len tokens, a multiple of its row step (the int formats refuse others; its wrapper
        # passes chunked_prefill_size, e.g. 512)
        mc.layer_idx, mc.pool, mc.max_len = 0, self.infer.backend_, -(-max_tokens // 64) * 64
        kind = FORMATS[fmt].kt_weights
        if kind == "bf16":  # used as they are, one pointer per expert
            mc.gate_projs, mc.up_projs, mc.down_projs = ([[t[e].data_ptr() for e in range(n)]] for t in (w1, w3, w2))
            mc.gate_scales = mc.up_scales = mc.down_scales = [[0] * n]
        elif kind == "ggml":  # GGUF blocks, as its LlamafileMoEWrapper sets them up from a GGUF file
            from kt_kernel_ext.kvcache import ggml_type

            mc.gate_proj, mc.up_proj, mc.down_proj = (b.data_ptr() for b in blocks)
            mc.gate_type = mc.up_type = mc.down_type = getattr(ggml_type, FORMATS[fmt].quant.upper())
            mc.hidden_type = ggml_type.BF16
            mc.m_block, mc.group_min_len, mc.group_max_len = 32, 10, mc.max_len  # the wrapper's
        else:  # quantized online from the stacked bf16 experts and saved under the weight path (as KTMoEWrapper's
            mc.save, mc.load, mc.path = True, False, workdir  # load_weights_from_tensors does)
            mc.gate_proj, mc.up_proj, mc.down_proj = w1.data_ptr(), w3.data_ptr(), w2.data_ptr()
        self.moe = getattr(moe_mod, self.kt_class)(mc)
        self._ids_map = torch.arange(n, dtype=torch.long)
        self.infer.submit(self.moe.load_weights_task(self._ids_map.data_ptr()))
        self.infer.sync()
        if kind == "bf16":  # the bytes one expert's call reads
            self.nbytes = 3 * hidden * ffn * w1.element_size()
        elif kind == "ggml":
            self.nbytes = sum(b[0].numel() for b in blocks)
        else:
            self.nbytes = kt_expert_bytes(workdir)
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


def ggml_blocks(quant: str, w1, w3, w2) -> tuple:
    """The experts' llama.cpp blocks (uint8 [n, rows, row bytes] each of w1, w3, w2), as the engine quantizes."""
    from fiddler.quant import quantize_blocks

    return tuple(torch.stack([quantize_blocks(t[e], quant) for e in range(t.shape[0])]) for t in (w1, w3, w2))


def fiddler_experts(fmt: str, w1, w3, w2, blocks=None) -> list:
    """Fiddler's packed copies of the experts, as the engine makes them at load (quantized: from `blocks`,
    else ggml_blocks)."""
    import fiddler.kernels as fk

    quant = FORMATS[fmt].quant
    if quant is None:
        ours = [fk.PackedExpert(w1[e], w3[e], w2[e]) for e in range(w1.shape[0])]
        fk.tune_blocking(ours)
        return ours
    from fiddler.quant import pack_expert  # the engine's path: llama.cpp blocks, then packed

    b1, b3, b2 = blocks if blocks is not None else ggml_blocks(quant, w1, w3, w2)
    ffn, hidden = w1.shape[1:]
    return [pack_expert(ExpertWeights(b1[e], b3[e], b2[e]), quant, hidden, ffn) for e in range(w1.shape[0])]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def probe_kt(fmt: str, threads: int) -> str | None:
    """Runs kt's operator for `fmt` on a tiny expert in a child process: the reason it cannot run here, or None."""
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", "--format", fmt, "--threads",
                            str(threads)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "did not finish a tiny expert in 300 s"
    return probe_failure(r.returncode, r.stderr)


def random_experts(n: int, hidden: int, ffn: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, ffn, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16),
            (torch.randn(n, ffn, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16),
            (torch.randn(n, hidden, ffn, generator=g) * ffn**-0.5).to(torch.bfloat16))


def run_probe(fmt: str, threads: int) -> int:
    h, f = 256, 512  # ffn: a multiple of 256 (the llamafile operator's super-block)
    w = random_experts(1, h, f)
    blocks = ggml_blocks(FORMATS[fmt].quant, *w) if FORMATS[fmt].kt_weights == "ggml" else None
    with tempfile.TemporaryDirectory(prefix="kt_probe_") as d:
        kt = KtExperts(fmt, *w, threads, 1, d, blocks)
        x = torch.randn(1, h).to(torch.bfloat16)
        kt.forward(0, x, torch.empty(1, h, dtype=torch.bfloat16))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=list(FORMATS), default="bf16")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--copies", type=int, default=4, help="expert copies each side cycles through (> the LLC)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="threads of each side; default: the kernel's (all CPUs)")
    ap.add_argument("--kt-threads", type=int, default=None,
                    help="kt-kernel's worker threads, if not --threads (its caller thread waits beside them)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the child of probe_kt
    args = ap.parse_args(argv)
    fmt, spec = args.format, FORMATS[args.format]

    import fiddler.kernels as fk

    if not fk.is_available():
        print(f"bench_kt_kernel: fiddler's kernel is not available: {fk.load_error()}", file=sys.stderr)
        return 2
    threads = args.threads or fk.get_num_threads()
    try:
        import kt_kernel
        import kt_kernel_ext.moe as kt_moe  # kt_kernel registers it
    except Exception as e:  # not installed, or its extension does not load here: say why, measure nothing
        print(f"bench_kt_kernel: kt-kernel does not import here: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    kt_threads = args.kt_threads or threads
    if args.probe:
        return run_probe(fmt, kt_threads)
    meta = {"format": fmt, "cpu": cpu_name(), "threads": threads, "kt_threads": kt_threads,
            "fiddler_path": fk.features()["isa"] if spec.quant is None else fk.quant.path(1, spec.quant),
            "fiddler_kernel": "PackedExpert" if spec.quant is None else f"QuantExpert {spec.quant}",
            "kt_version": getattr(kt_kernel, "__version__", "?"), "kt_variant": kt_kernel.__cpu_variant__,
            "kt_class": kt_operator(kt_moe, fmt) or " or ".join(spec.kt_classes), "hidden": args.hidden,
            "ffn": args.ffn, "copies": args.copies, "rounds": args.rounds}
    why = missing_operator(kt_moe, fmt, meta["kt_variant"]) or probe_kt(fmt, kt_threads)  # the probe: a child
    if why:
        why = f"kt-kernel {meta['kt_version']} ({meta['kt_variant']} build) cannot run {fmt} here: {why}"
        print(f"bench_kt_kernel: skipped: {why}", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({**meta, "skipped": why, "rows": []}, fh, indent=1)
        return 3
    h, f, n = args.hidden, args.ffn, args.copies
    w1, w3, w2 = random_experts(n, h, f)
    blocks = ggml_blocks(spec.quant, w1, w3, w2) if spec.quant else None  # Fiddler's, and kt's for q8_0/q4_0
    ours = fiddler_experts(fmt, w1, w3, w2, blocks)
    with tempfile.TemporaryDirectory(prefix="kt_weights_") as workdir:  # kt's quantized files: read at load
        kt = KtExperts(fmt, w1, w3, w2, kt_threads, max(args.tokens), workdir,
                       blocks if spec.kt_weights == "ggml" else None)
    meta.update(fiddler_bytes=ours[0].nbytes, kt_bytes=kt.nbytes)
    ref_w = ExpertWeights(w1[0], w3[0], w2[0])
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        out_ours, out_kt = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16)
        ref = torch_expert(ref_w, x)
        errs = {"fiddler": rel_err(ours[0].forward(x, out=out_ours, threads=threads), ref),
                "kt": rel_err(kt.forward(0, x, out_kt), ref)}
        bad = error_problems(errs, spec.max_err)
        if bad:
            print(f"bench_kt_kernel: {fmt} at {t} tokens is off torch's bf16 expert ({'; '.join(bad)}): "
                  "not timed", file=sys.stderr)
            return 1
        best = {"fiddler": float("inf"), "kt": float("inf")}
        for r in range(args.rounds + 1):  # round 0 warms up
            sides = (("fiddler", lambda i: ours[i].forward(x, out=out_ours, threads=threads)),
                     ("kt", lambda i: kt.forward(i, x, out_kt)))
            for name, fn in (sides if r % 2 == 0 else sides[::-1]):  # alternated: neither side always first
                t0 = time.perf_counter()
                fn((r + (name == "kt")) % n)  # the two sides read different copies in one round
                dt = time.perf_counter() - t0
                if r:
                    best[name] = min(best[name], dt)
        row = {"tokens": t, "fiddler_ms": best["fiddler"] * 1e3, "kt_ms": best["kt"] * 1e3,
               "fiddler_gbps": ours[0].nbytes / best["fiddler"] / 1e9, "kt_gbps": kt.nbytes / best["kt"] / 1e9,
               "fiddler_vs_kt": best["kt"] / best["fiddler"], "rel_err_vs_torch": errs}
        rows.append(row)
        print(f"{t:>4} tokens  fiddler {row['fiddler_ms']:8.2f} ms {row['fiddler_gbps']:6.1f} GB/s   "
              f"kt {row['kt_ms']:8.2f} ms {row['kt_gbps']:6.1f} GB/s   fiddler/kt {row['fiddler_vs_kt']:.2f}   "
              f"max rel err vs torch: fiddler {errs['fiddler']:.1e}, kt {errs['kt']:.1e}", flush=True)
    print(f"{fmt} on {meta['cpu']}, threads: fiddler {threads}, kt {kt_threads}; fiddler {meta['fiddler_kernel']} "
          f"on {meta['fiddler_path']} ({ours[0].nbytes / 1e6:.0f} MB an expert), kt-kernel {meta['kt_version']} "
          f"{meta['kt_variant']} {meta['kt_class']} ({kt.nbytes / 1e6:.0f} MB); best of {args.rounds} interleaved "
          "rounds")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
