"""Sections 6-7 of the device check: thread scaling on the host CPU, llama.cpp on the GPU."""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import torch

from dc_common import THREAD_COUNTS, Ctx, random_experts, skipped, timed
from dc_model import gguf_from_checkpoint, make_model


LLAMA_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = Llama(model_path=path, n_ctx=256, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, verbose=False)
ids = list(range(10, 42))
m.eval(ids)
t0 = time.perf_counter()
for i in range(n):
    m.eval([100 + i])
print(json.dumps({"decode_s_per_token": (time.perf_counter() - t0) / n}))
"""


def llama_decode(gguf_path: pathlib.Path, threads: int, n: int, timeout: float) -> dict:
    """llama.cpp's CPU decode in a child process (a build for another CPU dies there, not here)."""
    try:
        r = subprocess.run([sys.executable, "-c", LLAMA_WORKER, str(gguf_path), str(threads), str(n)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return skipped(f"llama.cpp's decode did not finish in {timeout:.0f} s")
    if r.returncode != 0:
        return skipped(f"llama.cpp's worker exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def section_threads(ctx: Ctx) -> dict:
    from fiddler import hardware, kernels
    from fiddler.executors import torch_expert

    shape = ctx.shape
    cores = hardware.cpu_cores()
    counts = [t for t in THREAD_COUNTS if t <= cores]
    n_exp = min(16 if ctx.dry_run else 8, max(2, math.ceil(kernels.stream_working_set_bytes() / shape.expert_bytes)))
    dense = random_experts(ctx, n_exp, seed=4)
    x = torch.randn(1, shape.hidden).to(torch.bfloat16)
    packed = [kernels.PackedExpert(d.w1, d.w3, d.w2) for d in dense]
    bytes_all = n_exp * shape.expert_bytes
    try:
        import llama_cpp  # noqa: F401

        gguf_path = gguf_from_checkpoint(ctx, make_model(ctx))
        from fiddler.config import MoEConfig

        llama_bytes = MoEConfig.from_pretrained(gguf_path.parent).decode_bytes_per_token(40, torch.bfloat16)
        llama_note = None
    except Exception as e:  # noqa: BLE001 -- reported as the reason
        gguf_path, llama_bytes, llama_note = None, None, f"{type(e).__name__}: {e}"
    prev = torch.get_num_threads()
    rows = []
    try:
        for t in counts:
            limit = kernels.read_limit(threads=t, repeats=2)["gbps"]
            torch.set_num_threads(t)
            k_s = min(timed(lambda: [p.forward(x, threads=t) for p in packed], ctx, repeats=3))
            t_s = min(timed(lambda: [torch_expert(d, x) for d in dense], ctx, repeats=3))
            row = {"threads": t, "read_limit_gbps": limit,
                   "kernel": {"gbps": bytes_all / k_s / 1e9, "of_limit": bytes_all / k_s / 1e9 / limit},
                   "torch_bf16_expert": {"gbps": bytes_all / t_s / 1e9, "of_limit": bytes_all / t_s / 1e9 / limit}}
            if gguf_path is None:
                row["llama_cpp"] = skipped(f"llama-cpp-python or its GGUF is not available here: {llama_note}")
            else:
                r = llama_decode(gguf_path, t, 4, timeout=60)
                if "skipped" not in r:
                    gbps = llama_bytes / r["decode_s_per_token"] / 1e9
                    r = {**r, "tok_s": 1 / r["decode_s_per_token"], "gbps": gbps, "of_limit": gbps / limit}
                row["llama_cpp"] = r
            rows.append(row)
    finally:
        torch.set_num_threads(prev)
    return {"cores": cores, "experts_streamed": n_exp, "expert_bytes": shape.expert_bytes,
            "llama_cpp_bytes_per_token": llama_bytes, "rows": rows}


# --------------------------------------------------------------------------------------------- 7 llama.cpp GPU


def section_llama_gpu(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return {"status": "skipped", "reason": "no CUDA GPU: llama.cpp's --n-cpu-moe runs the experts' other half on one"}
    try:
        import llama_cpp
    except ImportError as e:
        return {"status": "skipped", "reason": f"llama-cpp-python is not installed here ({e})"}
    if not llama_cpp.llama_supports_gpu_offload():
        return {"status": "skipped",
                "reason": "the llama-cpp-python carried here is a CPU build (made on the CPU-only dev machine); a "
                          "CUDA build compiles llama.cpp with nvcc for 15+ minutes, past the 6-minute budget, and "
                          "the device machine reaches no package index for a prebuilt one"}
    return {"status": "skipped", "reason": "a CUDA llama-cpp-python is present, but this run has no measurement "
                                           "for it yet (n_cpu_moe needs llama.cpp's server or CLI arguments)"}
