"""Sections 1-3 of the device check: the environment, races in the copy buffers, host-to-device copies."""
from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import torch

from dc_common import ROOT, Ctx, host_cpu, nvidia_smi, pcie_link_gbps, random_experts, skipped, timed


# --------------------------------------------------------------------------------------------- 1 env


def section_env(ctx: Ctx) -> dict:
    from fiddler.kernel_loader import load_kernels

    k = load_kernels()
    if k is None:
        from fiddler import kernels

        return {"status": "failed", "reason": f"the CPU kernel library did not load: {kernels.load_error()}"}
    import transformers

    gpu = {"name": None, "memory_bytes": None}
    pcie = skipped("no CUDA GPU here: the GPU side is emulated on the CPU") if not ctx.cuda else None
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        gpu = {"name": p.name, "memory_bytes": int(p.total_memory), "multiprocessors": p.multi_processor_count,
               "driver": (nvidia_smi("driver_version") or [None])[0]}
        v = nvidia_smi("pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max")
        try:
            gen, width, gen_max, width_max = (int(x) for x in v or ())
        except ValueError:  # "[N/A]" on some virtual machines
            v = None
        if v is None:
            pcie = skipped("nvidia-smi did not answer the PCIe query with numbers")
        else:
            # an idle link trains down to save power: the rate that counts is the one it trains up to
            pcie = {"gen_current": gen, "width_current": width, "gen_max": gen_max, "width_max": width_max,
                    "link_gbps": pcie_link_gbps(gen_max, width_max)}
    return {"gpu": gpu, "pcie": pcie, "cpu": {**host_cpu(), "kernel_isa": k.isa(), "features": k.features()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "transformers": transformers.__version__},
            "kernel_loaded": True}


# --------------------------------------------------------------------------------------------- 2 races

CUDA_TEST_FILES = ["tests/test_executor.py", "tests/test_host_memory.py", "tests/test_model_numerics.py",
                   "tests/test_dense_on_cpu.py", "tests/test_quant_engine.py", "tests/test_mixtral_offloading.py"]


def run_cuda_tests(timeout: float) -> dict:
    """`TORCH_CUDA_SANITIZER=1 pytest -m cuda` over the files that hold CUDA tests; counts and the tail."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider", *CUDA_TEST_FILES]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    import re

    for line in out.splitlines()[-5:]:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", line):
            counts["errors" if word.startswith("error") else word] = int(n)
    return {"command": "TORCH_CUDA_SANITIZER=1 " + " ".join(cmd[1:]), "rc": rc, **counts,
            "tail": out.strip().splitlines()[-15:]}


def stress_copy_buffers(ctx: Ctx, dtype: torch.dtype, delay_s: float, layers: int = 3, seeds: int = 2) -> dict:
    """Kind b through the two copy buffers, each reused within a layer (every expert copied in), with the
    copy stream made slow (slow producer) and the compute made slow after each acquire (slow consumer):
    its output must equal kind a's (the same experts resident) bit for bit, and kind c's within the tolerance
    of the numerics tests. A missing wait between the streams shows as a wrong output."""
    from fiddler.config import MoEConfig
    from fiddler.executors import GpuSide, build_executor
    from fiddler.executors.copy_in import CopyIn
    from fiddler.planner import COPY, CPU, GPU, LayerPlan
    from fiddler.weights import ExpertWeights

    H, F, E, K = 256, 512, 8, 2
    cfg = MoEConfig(hidden_size=H, intermediate_size=F, num_layers=layers, num_experts=E, top_k=K, num_heads=4,
                    num_kv_heads=2, head_dim=64, vocab_size=64)
    g = torch.Generator().manual_seed(7)
    experts = [[ExpertWeights(*(torch.randn(*s, generator=g).mul(0.1).to(dtype) for s in ((F, H), (F, H), (H, F))))
                for _ in range(E)] for _ in range(layers)]
    gpu = GpuSide.cuda(8 << 30) if ctx.cuda else GpuSide.emulated(8 << 30)
    dev = gpu.device
    sleeper = (lambda: torch.cuda._sleep(int(delay_s * 1.5e9))) if ctx.cuda else (lambda: time.sleep(delay_s))

    def executor(kind: str):
        clone = [[ExpertWeights(w.w1.clone(), w.w3.clone(), w.w2.clone()) for w in row] for row in experts]
        ex = build_executor(cfg, clone, gpu=gpu, max_seq_len=64, max_batch=1, dtype=dtype,
                            placement="all" if kind == GPU else "none", planner="paper",
                            latency_model={"cpu_a": 1e-4, "cpu_b": 1e-3, "gpu_a": 1e-5, "gpu_b": 1e-4,
                                           "transfer_s": 1e-3})
        ex.planner = lambda counts, resident, lm: LayerPlan(tuple(kind if n else None for n in counts),
                                                            tuple(counts), 0.0, 0.0)
        return ex

    copies = {"producer_delays": 0, "consumer_delays": 0}
    real_copy, real_acquire = CopyIn.copy, CopyIn.acquire

    def slow_copy(self, slot, dsts, srcs):
        if self.cuda:
            with torch.cuda.stream(self.stream):
                sleeper()
        else:
            sleeper()
        copies["producer_delays"] += 1
        return real_copy(self, slot, dsts, srcs)

    def slow_acquire(self, slot):
        real_acquire(self, slot)
        sleeper()  # on the compute stream, after the wait: the next copy into this slot must wait for us
        copies["consumer_delays"] += 1

    exs = {k: executor(k) for k in (GPU, COPY, CPU)}
    worst_b, worst_c, cases = 0.0, 0.0, 0
    tol = 1e-4 if dtype == torch.float32 else 0.02
    CopyIn.copy, CopyIn.acquire = slow_copy, slow_acquire
    try:
        for seed in range(seeds):
            gs = torch.Generator().manual_seed(100 + seed)
            for layer in range(layers):
                T = 24
                x = torch.randn(T, H, generator=gs).to(dtype)
                idx = torch.stack([torch.randperm(E, generator=gs)[:K] for _ in range(T)])
                w = torch.softmax(torch.randn(T, K, generator=gs), -1).to(dtype)
                outs = {k: ex.forward(layer, x.to(dev), idx.to(dev), w.to(dev)).float().cpu() for k, ex in exs.items()}
                ctx.sync()
                worst_b = max(worst_b, float((outs[COPY] - outs[GPU]).abs().max()))
                scale = float(outs[GPU].abs().max())
                worst_c = max(worst_c, float((outs[CPU] - outs[GPU]).abs().max()) / scale)
                cases += 1
    finally:
        CopyIn.copy, CopyIn.acquire = real_copy, real_acquire
    st = exs[COPY].stats
    return {"dtype": str(dtype).replace("torch.", ""), "cases": cases, "weight_copies": st.weight_copies,
            "copies_per_layer_call": st.weight_copies / max(1, st.calls), "copy_buffers": len(exs[COPY].buffers),
            **copies, "delay_s": delay_s, "b_equals_a_bitwise": worst_b == 0.0, "max_abs_b_minus_a": worst_b,
            "c_vs_a_max_rel": worst_c, "c_tolerance": tol, "c_within_tolerance": worst_c <= tol}


def section_races(ctx: Ctx) -> dict:
    tests = run_cuda_tests(timeout=60)
    if not ctx.cuda:
        tests["note"] = "no CUDA here: every CUDA test skips (pytest exit 5 when all are deselected)"
    stress = [stress_copy_buffers(ctx, dt, delay_s=2e-3 if ctx.cuda else 2e-4) for dt in (torch.float32, torch.bfloat16)]
    failed = [s["dtype"] for s in stress if not (s["b_equals_a_bitwise"] and s["c_within_tolerance"])]
    out = {"cuda_tests": tests, "stress": stress, "sanitizer": "TORCH_CUDA_SANITIZER=1 (pytest)" if ctx.cuda
           else skipped("no CUDA: the stream sanitizer has nothing to watch")}
    if tests["failed"] or tests["errors"] or tests["rc"] == 124 or failed:
        return {"status": "failed", "reason": f"cuda tests failed={tests['failed']} errors={tests['errors']} "
                                              f"rc={tests['rc']}; stress failed for {failed}", **out}
    return out


# --------------------------------------------------------------------------------------------- 3 copies


class KernelStreamer:
    """The CPU kernel streaming experts from host memory, 1 token at a time, in a background thread, the way
    kind c reads them during decode; counts the bytes it read."""

    def __init__(self, experts, threads: int):
        self.experts, self.threads = experts, threads
        self.bytes, self.seconds = 0, 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        x = torch.randn(1, self.experts[0].hidden).to(torch.bfloat16)
        t0 = time.perf_counter()
        while not self._stop.is_set():
            for e in self.experts:
                e.forward(x, threads=self.threads)
                self.bytes += e.nbytes
        self.seconds = time.perf_counter() - t0

    def __enter__(self):
        self._t.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def section_h2d(ctx: Ctx) -> dict:
    from fiddler import hardware, kernels

    shape = ctx.shape
    n = shape.expert_bytes
    dev = ctx.device()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=ctx.cuda).fill_(1)
    pageable = torch.empty(n, dtype=torch.uint8).fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=dev).fill_(0)  # touched: no page faults in the timing
    reps = 7

    def rate(src) -> float:
        copy = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        return n / statistics.median(timed(copy, ctx, repeats=reps, warmup=2)) / 1e9

    # the CPU kernel's experts: enough of them that they stream from DRAM (the read limit's working set)
    count = min(8, max(2, math.ceil(kernels.stream_working_set_bytes() / n)))
    host = [kernels.PackedExpert(w.w1, w.w3, w.w2) for w in random_experts(ctx, count, seed=3)]
    threads = max(1, hardware.cpu_cores() - 1)  # one core is the copy's and the launching thread's
    alone = {"pinned_gbps": rate(pinned), "pageable_gbps": rate(pageable)}
    with KernelStreamer(host, threads) as ks0:
        time.sleep(0.5)
    with KernelStreamer(host, threads) as ks:
        busy = {"pinned_gbps": rate(pinned), "pageable_gbps": rate(pageable)}
    env = ctx.earlier("env") or {}
    link = (env.get("pcie") or {}).get("link_gbps")
    fractions = skipped("no PCIe link: the copies are host memcpys into the emulated GPU's (host) memory")
    if link:
        fractions = {f"{k}_{w}": v[w] / link for k, v in (("alone", alone), ("with_cpu_kernel", busy))
                     for w in ("pinned_gbps", "pageable_gbps")}
    return {"copy_bytes": n, "copies_per_reading": reps, "link_gbps": link, "alone": alone,
            "with_cpu_kernel": busy, "fraction_of_link": fractions,
            "cpu_kernel": {"threads": threads, "experts": len(host), "gbps_alone": ks0.gbps,
                           "gbps_during_copies": ks.gbps,
                           "read_limit_gbps": kernels.read_limit(threads=threads)["gbps"]}}
