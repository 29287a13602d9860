"""The device check's sections: what one short run on a lent GPU measures, each section in its own process.

`scripts/device_check.sh` runs every section of SECTIONS in order, each under its own timeout, and each
writes `<out>/<NN>_<name>.json` the moment it ends, so a run cut short keeps what it measured. The same
code runs with `--dry-run` on a machine without a GPU: an emulated GPU (the CPU device stands in, as
`fiddler.gpu_side.GpuSide.emulated`), a scaled-down model, fewer threads; the JSON has the same fields
and says `"mode": "dry-run"`. README.md beside this file says what every number means and how each
factor carries to the paper's machines.

Every section's JSON holds `section`, `status` (ok | failed | skipped | timeout), `mode`, `seconds`, and
a `reason` whenever the status is not ok; a part of a section that cannot run here is a dict with
`{"skipped": "<why>"}` in place of its numbers. `--check DIR` verifies a finished run's files.

This is a harness script: it imports `fiddler` (the library) and nothing of runners/hydra, so a device
machine needs only torch, transformers, safetensors and gguf (hydra is carried for `pytest -m cuda`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a file from anywhere: the library is the checkout's
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# --------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """A Mixtral-architecture model with fewer layers (device) or scaled down to fit a CI box (dry run)."""

    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    experts: int = 8
    top_k: int = 2
    vocab: int = 32000
    prefill: int = 512  # prompt tokens of the prefill measurement
    decode: int = 32  # new tokens of the decode measurement
    hf_decode: int = 8  # transformers' offload reloads every offloaded layer per step: fewer tokens

    def arch(self) -> dict:
        return {"hidden_size": self.hidden, "intermediate_size": self.ffn, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "num_local_experts": self.experts, "num_experts_per_tok": self.top_k, "vocab_size": self.vocab,
                "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "tie_word_embeddings": False}

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.ffn * 2  # w1, w3, w2 in bf16


# Mixtral-8x7B's dims with 4 of its 32 layers (about 12 GB of bf16 weights, 11.3 GB of them experts)
DEVICE_SHAPE = Shape("mixtral8x7b_4layers", 4096, 14336, 4, 32, 8)
# the same architecture at 1/8 of the width: 0.2 GB, a 512-token prefill in seconds on 2 cores
DRY_SHAPE = Shape("mixtral_dry_run", 512, 1792, 4, 8, 2, prefill=512, decode=16, hf_decode=4)

RESIDENT_SHARE = 0.25  # the budget holds about this share of the experts
POPULARITY_PROFILE = ROOT / "results/reference/mixtral-8x7b/expert-popularity/original/machine_learning.json"
ROUTER_SKEW = 8.0  # logit gap per unit of log-popularity along the stream's shared direction (see make_model)
THREAD_COUNTS = (1, 2, 4, 8, 16)


@dataclass
class Ctx:
    out: pathlib.Path
    dry_run: bool
    cache: pathlib.Path

    @property
    def shape(self) -> Shape:
        return DRY_SHAPE if self.dry_run else DEVICE_SHAPE

    @property
    def mode(self) -> str:
        return "dry-run (emulated GPU on the CPU, scaled-down model)" if self.dry_run else "device"

    @property
    def cuda(self) -> bool:
        return not self.dry_run and torch.cuda.is_available()

    def device(self) -> torch.device:
        return torch.device("cuda" if self.cuda else "cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def earlier(self, name: str) -> dict | None:
        """An earlier section's JSON of this run, if it finished ok."""
        for p in self.out.glob(f"*_{name}.json"):
            d = json.loads(p.read_text())
            return d if d.get("status") == "ok" else None
        return None


def skipped(why: str) -> dict:
    return {"skipped": why}


# --------------------------------------------------------------------------------------------- helpers


def timed(fn, ctx: Ctx, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Wall times of fn() between device syncs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        out.append(time.perf_counter() - t0)
    return out


def random_experts(ctx: Ctx, count: int, seed: int) -> list:
    """`count` bf16 experts of the shape in host memory (made on the GPU where there is one: faster)."""
    from fiddler.weights import ExpertWeights

    H, F = ctx.shape.hidden, ctx.shape.ffn
    dev = ctx.device()
    g = torch.Generator(device=dev).manual_seed(seed)

    def one(*dims):
        return torch.randn(*dims, generator=g, device=dev).mul_(dims[1] ** -0.5).to(torch.bfloat16).cpu()

    return [ExpertWeights(one(F, H), one(F, H), one(H, F)) for _ in range(count)]


def host_cpu() -> dict:
    from fiddler import hardware

    name = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return {"model_name": name, "cores": hardware.cpu_cores()}


PCIE_GT_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def pcie_link_gbps(gen: int, width: int) -> float:
    """One direction's raw rate after line coding, in GB/s (gen 1-2 8b/10b, gen 3-5 128b/130b, gen 6 FLIT)."""
    coding = 0.8 if gen <= 2 else (128 / 130 if gen <= 5 else 242 / 256)
    return PCIE_GT_S[gen] * coding * width / 8


def nvidia_smi(fields: str) -> list[str] | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return [v.strip() for v in r.stdout.splitlines()[0].split(",")]


def popularity_target(shape: Shape) -> list[list[float]]:
    """Each expert's expected share of a layer's tokens (times top_k) in the first layers of a published
    Mixtral-8x7B profile: what the generated router is skewed towards."""
    prof = json.loads(POPULARITY_PROFILE.read_text())["expert_popularity"]
    rows = []
    for layer in prof[: shape.layers]:
        total = sum(layer)
        rows.append([c / total * shape.top_k for c in layer[: shape.experts]])
    return rows


# --------------------------------------------------------------------------------------------- the model


def make_model(ctx: Ctx) -> pathlib.Path:
    """The shape's checkpoint, generated once per machine under ctx.cache (random weights, made on the GPU
    where there is one: nothing large travels to the device machine).

    Routing is skewed as the Mixtral profile: every embedding row carries a shared direction u (a constant
    offset that the residual stream keeps), and each router row adds skew * log(share) * u/|u|, so a
    token's router logits are shifted by that much times its stream's projection on u."""
    shape = ctx.shape
    path = ctx.cache / shape.name
    if (path / "done").exists():
        return path
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    dev = ctx.device()
    g = torch.Generator(device=dev).manual_seed(0)
    H, F, E, V = shape.hidden, shape.ffn, shape.experts, shape.vocab
    hd = H // shape.heads
    qd, kvd = shape.heads * hd, shape.kv_heads * hd

    def rand(*dims, std):
        return (torch.randn(*dims, generator=g, device=dev, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    u = torch.randn(H, generator=g, device=dev).cpu()
    u = u / u.norm()
    shares = popularity_target(shape)
    emb = torch.randn(V, H, generator=g, device=dev).cpu() * 0.5 + 2.0 * u  # offset 2 per unit-norm u
    tensors = {"model.embed_tokens.weight": emb.to(torch.bfloat16), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
               "lm_head.weight": rand(V, H, std=H ** -0.5)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        skew = torch.tensor([math.log(max(s, 1e-3)) for s in shares[i]]) * ROUTER_SKEW / math.sqrt(H)
        router = torch.randn(E, H, generator=g, device=dev).cpu() * H ** -0.5 + skew[:, None] * u[None, :]
        tensors |= {p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                    p + "self_attn.q_proj.weight": rand(qd, H, std=H ** -0.5),
                    p + "self_attn.k_proj.weight": rand(kvd, H, std=H ** -0.5),
                    p + "self_attn.v_proj.weight": rand(kvd, H, std=H ** -0.5),
                    p + "self_attn.o_proj.weight": rand(H, qd, std=qd ** -0.5),
                    p + "block_sparse_moe.gate.weight": router.to(torch.bfloat16)}
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors |= {q + "w1.weight": rand(F, H, std=H ** -0.5), q + "w3.weight": rand(F, H, std=H ** -0.5),
                        q + "w2.weight": rand(H, F, std=F ** -0.5)}
        save_file(tensors, str(tmp / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        tensors = {}
    index = {}
    from safetensors import safe_open

    for f in sorted(tmp.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            index |= {k: f.name for k in fh.keys()}
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    MixtralConfig(**shape.arch(), bos_token_id=1, eos_token_id=2, dtype="bfloat16",
                  sliding_window=None).save_pretrained(tmp)
    (tmp / "done").write_text("")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def prompt_ids(n: int, seed: int = 1, vocab: int = 32000) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def budget_bytes(ctx: Ctx, cfg, max_seq_len: int, overhead: dict) -> tuple[int, int]:
    """A GPU budget holding the reservation plus RESIDENT_SHARE of the experts, and that expert count."""
    from fiddler.placement import reservation

    fixed = sum(reservation(cfg, torch.bfloat16, max_seq_len, 1, overhead=overhead).values())
    n = round(RESIDENT_SHARE * cfg.num_moe_layers * cfg.expert_slots)
    return fixed + n * int(cfg.expert_bytes(torch.bfloat16)), n


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


# --------------------------------------------------------------------------------------------- 4 offload


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> dict:
    """How much of two sets of intervals (seconds) ran at the same time: |A and B| / min(|A|, |B|)."""
    def merged(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    ma, mb = merged(a), merged(b)
    tot_a, tot_b = sum(e - s for s, e in ma), sum(e - s for s, e in mb)
    both, i, j = 0.0, 0, 0
    while i < len(ma) and j < len(mb):
        both += max(0.0, min(ma[i][1], mb[j][1]) - max(ma[i][0], mb[j][0]))
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    small = min(tot_a, tot_b)
    return {"a_s": tot_a, "b_s": tot_b, "both_s": both, "fraction": both / small if small > 0 else None}


def profile_intervals(ctx: Ctx, engine, ids, new_tokens: int) -> dict:
    """One generate with the CPU queue's intervals (timed in whichever thread runs it), the GPU side's
    compute and its weight copies (on CUDA: device kernels and HtoD memcpys from torch.profiler, moved onto
    the host clock by a marker; on the emulated GPU: the executor's calls, timed), and their overlaps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ex = engine.executor
    iv: dict[str, list] = {"cpu_queue": [], "gpu_compute": [], "copy": []}
    wrapped = []

    def timed_calls(attr, kind):
        real = getattr(ex, attr)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                iv[kind].append((t0, time.perf_counter()))  # list.append is atomic: any thread may add

        setattr(ex, attr, call)
        wrapped.append(attr)

    timed_calls("_run_cpu_queue", "cpu_queue")
    timed_calls("_decode_row_on_cpu", "cpu_queue")
    if not ctx.cuda:
        timed_calls("_gpu_expert", "gpu_compute")
        timed_calls("_copy_in", "copy")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    try:
        with profile(activities=acts) as prof:
            mark = time.perf_counter()
            with record_function("dc.mark"):
                pass
            engine.generate(ids, max_new_tokens=new_tokens)
            ctx.sync()
    finally:
        for attr in wrapped:
            delattr(ex, attr)  # the instance attribute goes; the class's method shows again
    if ctx.cuda:
        evs = list(prof.events())
        m = next((e for e in evs if e.name == "dc.mark"), None)
        device = [e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA]
        if m is None or not device:
            return skipped(f"the profiler returned {'no marker' if m is None else 'no device events'}")
        shift = mark - m.time_range.start / 1e6  # profiler microseconds -> perf_counter seconds
        for ev in device:
            span = (ev.time_range.start / 1e6 + shift, ev.time_range.end / 1e6 + shift)
            iv["copy" if "HtoD" in ev.name else "gpu_compute"].append(span)
    return {"cpu_vs_gpu": overlap(iv["cpu_queue"], iv["gpu_compute"]),
            "copy_vs_compute": overlap(iv["copy"], iv["gpu_compute"]),
            "intervals": {k: len(v) for k, v in iv.items()}}


def makespans(ctx: Ctx, engine, ids, new_tokens: int) -> dict:
    """The planner's predicted makespan of each MoE call against its measured one (device synced around
    each call, so this pass is not the timed one)."""
    ex = engine.executor
    real = ex.forward
    calls = []

    def measured(layer, x, idx, w):
        before = ex.stats.predicted_s
        ctx.sync()
        t0 = time.perf_counter()
        out = real(layer, x, idx, w)
        ctx.sync()
        calls.append((int(idx.shape[0]), ex.stats.predicted_s - before, time.perf_counter() - t0))
        return out

    ex.forward = measured
    try:
        engine.generate(ids, max_new_tokens=new_tokens)
    finally:
        del ex.forward
    out = {}
    for name, sel in (("prefill", lambda t: t > 1), ("decode", lambda t: t == 1)):
        rows = [(p, m) for t, p, m in calls if sel(t)]
        if rows:
            out[name] = {"calls": len(rows), "predicted_s": sum(p for p, _ in rows),
                         "measured_s": sum(m for _, m in rows),
                         "measured_over_predicted": sum(m for _, m in rows) / max(1e-12, sum(p for p, _ in rows)),
                         "median_call_ratio": statistics.median(m / p for p, m in rows if p > 0)
                         if any(p > 0 for p, _ in rows) else None}
    return out


def sync_census(ctx: Ctx, engine, ids, new_tokens: int) -> dict:
    """Where the engine makes the host wait for the GPU: torch's sync debug mode warns at each syncing
    call; the warnings are counted by the Python line that made them."""
    if not ctx.cuda:
        return skipped("torch.cuda.set_sync_debug_mode needs CUDA")
    sites: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(ids, max_new_tokens=new_tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        key = f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"
        sites[key] = sites.get(key, 0) + 1
    steps = new_tokens
    return {"generate_new_tokens": steps, "syncs": sum(sites.values()),
            "syncs_per_token": sum(sites.values()) / max(1, steps),
            "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]))}


def load_fiddler(ctx: Ctx, path: pathlib.Path):
    from fiddler import Engine
    from fiddler.config import MoEConfig
    from fiddler.executors import FiddlerPolicy, GpuSide
    from fiddler.popularity import Popularity

    shape = ctx.shape
    cfg = MoEConfig.from_pretrained(path)
    max_seq_len = shape.prefill + 64
    probe = GpuSide.cuda(1 << 30) if ctx.cuda else GpuSide.emulated(1 << 30)
    budget, resident = budget_bytes(ctx, cfg, max_seq_len, probe.overhead_bytes())
    gpu = GpuSide.cuda(budget) if ctx.cuda else GpuSide.emulated(budget)
    engine = Engine.from_pretrained(path, gpu=gpu, dtype=torch.bfloat16, max_seq_len=max_seq_len, max_batch=1,
                                    executor=FiddlerPolicy(placement="popularity",
                                                           popularity=Popularity(popularity_target(shape),
                                                                                 top_k=shape.top_k)))
    return engine, budget, resident


def section_offload(ctx: Ctx) -> dict:
    shape = ctx.shape
    t0 = time.perf_counter()
    path = make_model(ctx)
    gen_s = time.perf_counter() - t0
    engine, budget, resident_target = load_fiddler(ctx, path)
    ex = engine.executor
    rec = ex.attach_recorder()
    prefill_ids, decode_ids = prompt_ids(shape.prefill), prompt_ids(32, seed=2)
    engine.generate(prompt_ids(16, seed=9), max_new_tokens=4)  # warm-up
    pre = engine.generate(prefill_ids, max_new_tokens=1).stats
    dec = engine.generate(decode_ids, max_new_tokens=shape.decode).stats
    ex.recorder = None
    shares = [[c / max(1e-9, sum(row)) * shape.top_k for c in row] for row in rec.popularity().counts]
    target = popularity_target(shape)
    info = engine.info()
    mem = ({"prefill": pre["cuda_memory"], "decode": dec["cuda_memory"]} if ctx.cuda
           else skipped("no CUDA: the emulated GPU's memory is host memory (engine.info host_bytes)"))
    result = {
        "model": {**shape.arch(), "path": str(path), "generated_s": gen_s, "load_s": info["load_s"]},
        "budget_bytes": budget, "resident_experts": info["executor_info"]["placement"].get("num_resident"),
        "resident_target": resident_target, "experts_total": shape.layers * shape.experts,
        "prefill": {"tokens": shape.prefill, "ttft_s": pre["ttft_s"], "prefill_tok_s": pre["prefill_tok_s"],
                    "decisions": pre["executor"]},
        "decode": {"prompt": 32, "new_tokens": shape.decode, "ttft_s": dec["ttft_s"],
                   "decode_tok_s": dec["decode_tok_s"], "decisions": dec["executor"]},
        "routing": {"target_shares": target, "measured_shares": shares,
                    "measured_max_over_min": [max(r) / max(1e-9, min(r)) for r in shares],
                    "target_max_over_min": [max(r) / min(r) for r in target]},
        "cuda_memory": mem, "host_bytes": info["host_bytes"],
        "overlap_decode": profile_intervals(ctx, engine, decode_ids, min(8, shape.decode)),
        "overlap_prefill": profile_intervals(ctx, engine, prefill_ids, 1),
        "makespan": makespans(ctx, engine, prefill_ids, 8),
        "sync_census": sync_census(ctx, engine, decode_ids, 8),
        "sync_census_prefill": sync_census(ctx, engine, prefill_ids, 1),
    }
    if ctx.cuda:  # each generate resets the peak: the larger of the timed prefill's and decode's
        result["max_memory_reserved"] = max(m["max_memory_reserved"] for m in mem.values())
    return result


# --------------------------------------------------------------------------------------------- 5 transformers


def section_hf_offload(ctx: Ctx) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shape = ctx.shape
    path = make_model(ctx)
    fid = ctx.earlier("offload")
    if ctx.cuda:
        # the GPU memory Fiddler actually used, so both systems are compared at the same footprint
        gpu_bytes = (fid or {}).get("max_memory_reserved") or budget_bytes(ctx, _cfg(path), shape.prefill + 64, {})[0]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        kw = {"device_map": "auto", "max_memory": {0: int(gpu_bytes), "cpu": 512 << 30}}
        placement = f"device_map='auto', max_memory GPU {gpu_bytes / 2**30:.2f} GiB (Fiddler's max_memory_reserved)"
    else:
        gpu_bytes, kw = None, {"device_map": {"": "cpu"}}
        placement = "no GPU: the whole model on the CPU (what transformers does without one)"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
    load_s = time.perf_counter() - t0
    dev = next(model.parameters()).device if not ctx.cuda else torch.device("cuda:0")
    where = {}
    for v in getattr(model, "hf_device_map", {"": "cpu"}).values():
        where[str(v)] = where.get(str(v), 0) + 1

    def gen(ids, n):
        with torch.inference_mode():
            model.generate(ids[None].to(dev), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)

    gen(prompt_ids(16, seed=9), 2)  # warm-up
    reps = 1  # a step of its offload reloads every offloaded layer: seconds each on the device
    ttft = statistics.median(timed(lambda: gen(prompt_ids(shape.prefill), 1), ctx, repeats=reps, warmup=0))
    decode_ids = prompt_ids(32, seed=2)
    one = statistics.median(timed(lambda: gen(decode_ids, 1), ctx, repeats=reps, warmup=0))
    full = timed(lambda: gen(decode_ids, shape.hf_decode), ctx, repeats=1, warmup=0)[0]
    out = {"placement": placement, "device_map_modules": where, "load_s": load_s,
           "prefill": {"tokens": shape.prefill, "ttft_s": ttft, "prefill_tok_s": shape.prefill / ttft},
           "decode": {"prompt": 32, "new_tokens": shape.hf_decode,
                      "decode_tok_s": (shape.hf_decode - 1) / max(1e-9, full - one)},
           "gpu_memory_given_bytes": gpu_bytes,
           "max_memory_reserved": int(torch.cuda.max_memory_reserved()) if ctx.cuda else
           skipped("no CUDA"),
           "fiddler_max_memory_reserved": (fid or {}).get("max_memory_reserved")}
    if fid:
        out["fiddler_over_transformers"] = {
            "decode_tok_s": fid["decode"]["decode_tok_s"] / out["decode"]["decode_tok_s"],
            "ttft": out["prefill"]["ttft_s"] / fid["prefill"]["ttft_s"]}
    return out


def _cfg(path):
    from fiddler.config import MoEConfig

    return MoEConfig.from_pretrained(path)


# --------------------------------------------------------------------------------------------- 6 threads


def gguf_from_checkpoint(ctx: Ctx, path: pathlib.Path) -> pathlib.Path:
    """llama.cpp's GGUF of the same tensors, written directly (no converter, no saved-model round trip):
    bf16 tensors in llama.cpp's names, q/k rows permuted to its rope layout, a byte-level SPM vocabulary."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    out = path / "model-bf16.gguf"
    if out.exists():
        return out
    shape = ctx.shape
    a = shape.arch()
    w = gguf.GGUFWriter(str(out) + ".partial", "llama")
    w.add_block_count(shape.layers)
    w.add_context_length(a["max_position_embeddings"])
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(a["rope_theta"])
    w.add_layer_norm_rms_eps(a["rms_norm_eps"])
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(shape.vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    files = sorted(path.glob("model-*.safetensors"))
    fhs = [safe_open(str(f), "pt") for f in files]
    where = {k: fh for fh in fhs for k in fh.keys()}

    def get(name):
        return where[name].get_tensor(name)

    def put(name, t):
        if t.dim() == 1 or name.endswith("ffn_gate_inp.weight"):  # norms and routers in f32, as llama.cpp's own
            w.add_tensor(name, t.float().numpy())
            return
        t = t.to(torch.bfloat16).contiguous()
        w.add_tensor(name, t.view(torch.int16).numpy().view(np.uint16), raw_shape=tuple(t.shape),
                     raw_dtype=gguf.GGMLQuantizationType.BF16)

    def rope_rows(t, heads):  # HF's rotate-half halves -> llama.cpp's interleaved pairs
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    put("token_embd.weight", get("model.embed_tokens.weight"))
    for i in range(shape.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", get(p + "input_layernorm.weight"))
        put(b + "attn_q.weight", rope_rows(get(p + "self_attn.q_proj.weight"), shape.heads))
        put(b + "attn_k.weight", rope_rows(get(p + "self_attn.k_proj.weight"), shape.kv_heads))
        put(b + "attn_v.weight", get(p + "self_attn.v_proj.weight"))
        put(b + "attn_output.weight", get(p + "self_attn.o_proj.weight"))
        put(b + "ffn_norm.weight", get(p + "post_attention_layernorm.weight"))
        put(b + "ffn_gate_inp.weight", get(p + "block_sparse_moe.gate.weight"))
        for mine, theirs in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
            put(b + mine + ".weight", torch.stack([get(f"{p}block_sparse_moe.experts.{e}.{theirs}.weight")
                                                   for e in range(shape.experts)]))
    put("output_norm.weight", get("model.norm.weight"))
    put("output.weight", get("lm_head.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".partial", out)
    return out


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


# --------------------------------------------------------------------------------------------- the table

# name, function, timeout (s), fields an ok JSON must hold. The timeouts are the device estimates of README.md
# with some room; scripts/device_check.sh also stops starting sections when the run's budget is spent.
SECTIONS = [
    ("env", section_env, 20, ("gpu", "pcie", "cpu", "versions", "kernel_loaded")),
    ("races", section_races, 80, ("cuda_tests", "stress", "sanitizer")),
    ("h2d", section_h2d, 25, ("link_gbps", "alone", "with_cpu_kernel", "fraction_of_link", "cpu_kernel")),
    ("offload", section_offload, 110, ("model", "budget_bytes", "resident_experts", "prefill", "decode", "routing",
                                       "cuda_memory", "overlap_decode", "overlap_prefill", "makespan",
                                       "sync_census")),
    ("hf_offload", section_hf_offload, 60, ("placement", "prefill", "decode", "max_memory_reserved")),
    ("threads", section_threads, 75, ("cores", "rows")),
    ("llama_gpu", section_llama_gpu, 10, ()),
]
COMMON = ("section", "status", "mode", "seconds")


def file_of(out: pathlib.Path, name: str) -> pathlib.Path:
    i = [s[0] for s in SECTIONS].index(name)
    return out / f"{i + 1:02d}_{name}.json"


def write(out: pathlib.Path, name: str, result: dict) -> None:
    p = file_of(out, name)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, p)


def run_section(ctx: Ctx, name: str) -> int:
    fn = {s[0]: s[1] for s in SECTIONS}[name]
    t0 = time.perf_counter()
    try:
        res = fn(ctx)
    except Exception as e:  # noqa: BLE001 -- the section's file says what broke; the next sections still run
        res = {"status": "failed", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    res = {"section": name, "status": res.pop("status", "ok"), "mode": ctx.mode,
           "seconds": time.perf_counter() - t0,
           "cpu_seconds": sum(r.ru_utime + r.ru_stime for r in ru),  # this process and its children, imports too
           **res}
    write(ctx.out, name, res)
    print(f"device_check: {name}: {res['status']} in {res['seconds']:.1f} s"
          + (f" ({res['reason']})" if res.get("reason") else ""), flush=True)
    return {"ok": 0, "skipped": 0}.get(res["status"], 1)


def record_stop(ctx: Ctx, name: str, status: str, reason: str) -> None:
    """The shell's note for a section whose process did not write its own file (timeout, crash)."""
    if file_of(ctx.out, name).exists():
        return
    write(ctx.out, name, {"section": name, "status": status, "mode": ctx.mode, "seconds": None, "reason": reason})


def check(out: pathlib.Path) -> list[str]:
    """Problems with a finished run's files: a missing section, a missing field, a non-ok one without why."""
    problems = []
    for name, _fn, _t, fields in SECTIONS:
        p = file_of(out, name)
        if not p.exists():
            problems.append(f"{p.name}: missing")
            continue
        d = json.loads(p.read_text())
        missing = [f for f in COMMON if f not in d]
        if d.get("status") not in ("ok", "failed", "skipped", "timeout"):
            problems.append(f"{p.name}: status {d.get('status')!r}")
        elif d["status"] != "ok":
            if not str(d.get("reason") or "").strip():
                problems.append(f"{p.name}: status {d['status']} without a reason")
        else:
            missing += [f for f in fields if f not in d]
            problems += [f"{p.name}: {where} is skipped without a reason" for where in _unexplained(d)]
        if missing:
            problems.append(f"{p.name}: missing {missing}")
    return problems


def _unexplained(d, where="") -> list[str]:
    """Paths of parts that are skipped with an empty reason."""
    if isinstance(d, dict):
        if "skipped" in d and not str(d["skipped"]).strip():
            return [where or "."]
        return [p for k, v in d.items() for p in _unexplained(v, f"{where}.{k}")]
    if isinstance(d, list):
        return [p for i, v in enumerate(d) for p in _unexplained(v, f"{where}[{i}]")]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "results/device_check")))
    ap.add_argument("--dry-run", action="store_true", help="emulated GPU, scaled-down model (any machine)")
    ap.add_argument("--cache", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("DEVICE_CHECK_CACHE", "/tmp/fiddler-device-check")))
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="print each section's name and timeout (s)")
    g.add_argument("--section", choices=[s[0] for s in SECTIONS])
    g.add_argument("--stopped", nargs=3, metavar=("SECTION", "STATUS", "REASON"),
                   help="record a section that ended without writing its file")
    g.add_argument("--check", action="store_true", help="check the files of a finished run in --out")
    a = ap.parse_args(argv)
    ctx = Ctx(a.out, a.dry_run, a.cache)
    if a.list:
        for name, _fn, timeout, _f in SECTIONS:
            print(name, timeout)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stopped:
        record_stop(ctx, *a.stopped)
        return 0
    if a.check:
        problems = check(a.out)
        for p in problems:
            print("device_check: check:", p)
        print(f"device_check: check: {len(SECTIONS) - len({p.split(':')[0] for p in problems})} of "
              f"{len(SECTIONS)} sections complete")
        return 1 if problems else 0
    return run_section(ctx, a.section)


if __name__ == "__main__":
    sys.exit(main())
