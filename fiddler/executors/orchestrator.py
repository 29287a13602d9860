"""Fiddler's executor: runs one MoE layer's experts according to a plan (the CPU-GPU orchestration).

Per layer and step: count the tokens routed to each expert, ask the planner for a decision per expert
(a: resident on the GPU, b: copy weights in then run on the GPU, c: run on the CPU), then
- the CPU queue (kind c) runs on a worker thread: the routed rows are copied to host memory and each
  expert runs with the packed C++ kernel (bf16; it releases the GIL) or a torch fallback;
- meanwhile the calling thread runs the GPU queue: the copies into both buffers are issued first, then
  the resident experts run, then the copied-in ones through the double buffer (on CUDA the copy of the
  next expert overlaps the current one's compute);
- when the call's tokens make copying in cheaper than the CPU (a long prompt), the next MoE layer's first
  non-resident experts are copied into the buffers as this call's last uses of them end (look-ahead,
  fiddler.streaming), so its copies run under this layer's experts and the next layer's attention;
- outputs are combined like transformers' Mixtral (routing.SlotOutputs).

Each expert has one host copy: the packed one the CPU kernel runs from (kind c), which kind b copies as
it is and unpacks on the GPU side (fiddler.kernels.layout); a resident expert has only its GPU-side copy,
unless the resident set adapts (fiddler.residency: an evicted expert must still be somewhere). Then, as a
layer call is planned, the cache's fill goes on in the copy engine's predicted idle time (into the last copy
buffer, idle in a call that copies no expert in), and a finished fill is unpacked into the evicted expert's
slot at the end of the call.

Without CUDA the "GPU side" is the CPU device (GpuSide "emulated"), so placement, plans, buffer copies and
combination run the same code (the copy is a real memcpy); the two queues then either split the cores
between them or run one after the other with all cores (`overlap`), never both on all cores at once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import hardware, hostmem
from .. import quant as fquant
from ..gpu_side import GpuSide
from ..kernel_loader import load_kernels
from ..kernels import layout
from ..latency import LatencyModel, calibrate
from ..placement import COPY_BUFFERS, EXPERT_ROW_CHUNK, Placement, place_spec, row_chunks
from ..planner import COPY, CPU, GPU, KINDS, LayerPlan, get_planner
from ..popularity import Popularity
from ..residency import Chunk, ExpertCache, Promote, make_policy
from ..streaming import Pipeline, lookahead, pipeline, staged_plan
from ..threads import small_call_threads
from ..weights import ExpertWeights
from .contract import BuildContext, ExpertExecutor, StatsBase, add_residual
from .copy_in import CopyIn
from .ffn import torch_expert, torch_experts_row
from .readback import Readback
from .routing import ExpertGroups, Scratch, SlotOutputs, row_counts, weighted_slot_sum


def empty_expert(config, dtype, device) -> ExpertWeights:
    """An uninitialised expert on the GPU side, w1 and w3 stacked (one GEMM: ExpertWeights.stacked)."""
    F_, H = config.intermediate_size, config.hidden_size
    w13 = torch.empty(2 * F_, H, dtype=dtype, device=device)
    return ExpertWeights(w13[:F_], w13[F_:], torch.empty(H, F_, dtype=dtype, device=device), w13)


# ---------------------------------------------------------------------------- stats

def kind_counter() -> dict[str, int]:
    """Zero per decision kind (a, b, c)."""
    return {k: 0 for k in KINDS}


@dataclass
class LayerStats(StatsBase):
    calls: int = 0
    tokens: dict[str, int] = field(default_factory=kind_counter)
    experts: dict[str, int] = field(default_factory=kind_counter)
    predicted_s: float = 0.0
    wall_s: float = 0.0
    cpu_queue_s: float = 0.0
    last_decisions: tuple = ()


@dataclass
class FiddlerStats(StatsBase):
    """Counters since the last reset. `tokens` counts routed (token, expert) pairs and `experts` expert
    invocations, per decision kind; gpu_hit_rate = share of routed pairs served by resident experts.
    predicted_s sums the planner's predicted makespans, wall_s the measured (host) time in forward,
    cpu_queue_s the time the CPU queue ran."""

    calls: int = 0
    routed_tokens: int = 0
    tokens: dict[str, int] = field(default_factory=kind_counter)
    experts: dict[str, int] = field(default_factory=kind_counter)
    weight_copies: int = 0
    copies_ahead: int = 0  # of weight_copies: the next layer's, staged during a layer call (fiddler.streaming)
    copies_ahead_unused: int = 0  # of copies_ahead: experts the next layer's plan did not copy in after all
    bytes_h2d_weights: int = 0
    bytes_d2h_activations: int = 0
    bytes_h2d_activations: int = 0
    predicted_s: float = 0.0
    wall_s: float = 0.0
    cpu_queue_s: float = 0.0
    layers: list[LayerStats] = field(default_factory=list)
    residency: dict = field(default_factory=dict)  # fiddler.residency.ExpertCache.describe(): policy, fills

    derived = ("gpu_hit_rate", "bytes_h2d")

    @property
    def gpu_hit_rate(self) -> float | None:
        return self.tokens[GPU] / self.routed_tokens if self.routed_tokens else None

    @property
    def bytes_h2d(self) -> int:
        return self.bytes_h2d_weights + self.bytes_h2d_activations

    def add_plan(self, layer: int, plan: LayerPlan, routed: int, wall: float = 0.0, cpu_s: float = 0.0) -> None:
        """Count one MoE call of `layer`: its plan's decisions, predicted makespan and (when measured) its
        wall and CPU-queue time (the executor and the simulator's Fiddler policy count alike)."""
        ls = self.layers[layer]
        used = [(kind, n) for n, kind in zip(plan.counts, plan.decisions) if kind is not None]
        for st in (self, ls):
            st.calls += 1
            for kind, n in used:
                st.tokens[kind] += n
                st.experts[kind] += 1
            st.predicted_s += plan.makespan
            st.wall_s += wall
            st.cpu_queue_s += cpu_s
        self.routed_tokens += routed
        ls.last_decisions = plan.decisions


# ---------------------------------------------------------------------------- threads

@dataclass(frozen=True)
class Threads:
    """How the cores are shared. On CUDA the CPU queue gets every core (the calling thread only launches
    GPU work). Without CUDA both queues run on the CPU: with overlap they run concurrently on disjoint
    halves of the cores, without it one after the other with all cores."""

    overlap: bool
    all: int  # serial mode, and a CPU queue with nothing to overlap
    cpu_queue: int
    gpu_side: int | None  # torch threads of the calling thread while the CPU queue runs (None: unchanged)

    @classmethod
    def choose(cls, gpu: GpuSide, dtype: torch.dtype, cpu_threads: int | None, overlap: bool | None) -> Threads:
        # fp32 is the exactness mode and MKL's fp32 GEMM rounding depends on the thread count, so on a CPU
        # device fp32 runs the queues serially with all cores (bit-exact against a plain computation);
        # bf16/fp16 overlap them (measure with scripts/bench_executor_overlap.py).
        cores = hardware.cpu_cores()
        if overlap is None:
            overlap = gpu.is_cuda or dtype != torch.float32
        overlap = bool(overlap) and gpu.has_gpu
        all_threads = cpu_threads or cores
        if overlap and not gpu.is_cuda:
            cpu_queue = cpu_threads or max(1, cores // 2)
            return cls(True, all_threads, cpu_queue, max(1, cores - cpu_queue))
        return cls(overlap, all_threads, all_threads, None)


# ---------------------------------------------------------------------------- executor

class FiddlerExecutor(ExpertExecutor):
    def __init__(self, config, experts: list[list[ExpertWeights | None]], *, gpu: GpuSide, dtype: torch.dtype,
                 placement: Placement, planner: str, latency_model: LatencyModel | dict | None,
                 threads: Threads, use_kernel: bool = True, calibration_tokens: int = 128,
                 take_ownership: bool = False, quant: str | None = None, residency: str = "static",
                 popularity=None, lookahead: bool = True):
        """residency: fiddler.residency's policy (static, lru, lfu), seeded from `popularity` (its shares; None:
        uniform). Without a GPU side there is nothing resident and the policy is static. lookahead: stage the
        next layer's copies during a long prompt's layer call (fiddler.streaming; False: the ablation)."""
        self.config, self.gpu, self.dtype = config, gpu, dtype
        self.device = gpu.device
        self._on_cpu = self.device.type == "cpu"
        self.cuda = gpu.is_cuda
        self._tables: dict[int, Any] = {}  # layer -> kernels.ExpertTable (_table)
        self.placement, self.threads = placement, threads
        L, E = config.num_moe_layers, config.expert_slots
        if len(experts) != L or any(len(layer) != E for layer in experts):
            raise ValueError(f"experts must be [{L} layers][{E} experts], got "
                             f"[{len(experts)}][{sorted({len(layer) for layer in experts})}]")
        if len(placement.resident) != L or any(len(r) != E for r in placement.resident):
            raise ValueError(f"placement is not {L} x {E}")
        if not gpu.has_gpu and placement.num_resident:
            raise ValueError("a placement with resident experts needs a GPU budget")
        self.planner_name = planner if gpu.has_gpu else "cpu"
        self.planner = get_planner(self.planner_name)
        self.quant = fquant.check_quant(quant)
        self.fp32_inputs = self.quant is not None  # see ExpertExecutor.fp32_inputs
        self.expert_bytes = int(config.expert_bytes(dtype, self.quant))
        k = load_kernels()
        self.kernel = k if (use_kernel and k is not None and dtype == torch.bfloat16) else None
        # A decode row whose experts all run on the CPU goes to the kernel in one call (False: the general
        # path, for comparisons)
        self.fused_decode = True
        # The host copies are packed for the CPU kernel when it serves this dtype; kind b copies those same
        # bytes and unpacks them on the GPU side (fiddler.kernels.layout).
        self.packed_host = self.kernel is not None
        shares = Popularity.for_config(config, popularity).shares()
        self.cache = ExpertCache(placement.resident, make_policy(residency if gpu.has_gpu else "static",
                                                                 placement.resident, shares),
                                 self._host_expert_bytes())
        self.buffers: list[list[torch.Tensor]] = []  # copy-in double buffer (kind b), in the reservation
        self.scratch: ExpertWeights | None = None  # the dense expert bf16 packed bytes are unpacked into
        self._check_host_memory(experts, take_ownership)
        self._take_experts(experts, take_ownership)
        if self.kernel is not None and self.quant is None:
            # a per-CPU knob, measured here on these experts before calibration times them: from how many
            # tokens AMX tiles beat the vector path (a no-op without AMX or with too few bytes to stream)
            self.kernel.tune_amx(self._host_copies(), threads=threads.all)
            # and how many weight blocks a many-token product walks K with (prefill, beams)
            self.kernel.tune_blocking(self._host_copies(), threads=threads.all)
        elif self.kernel is not None:
            # the quantized experts' own crossover to AMX-INT8 tiles (a no-op without them)
            self.kernel.quant.tune_amx(self._host_copies(), threads=threads.all)
        if gpu.has_gpu and placement.num_resident < L * E:
            self._allocate_buffers()
        self.copy_in = CopyIn(self.device, COPY_BUFFERS)
        self.readback = Readback(self.device, gpu.has_gpu)  # a layer call's one device-to-host wait
        self._off_gpu = [not all(r) for r in placement.resident]  # layers with experts the CPU may run
        self._scratch = Scratch()  # a layer call's gathered rows (routing.Scratch)
        self._promotions: dict[int, Promote] = {}  # this call's copied-in experts that stay (fiddler.residency)
        self.lookahead = bool(lookahead) and gpu.has_gpu
        self._staged: tuple[int | None, dict[int, int]] = (None, {})  # (layer, {expert: buffer}) copied ahead
        self._pool: ThreadPoolExecutor | None = None
        self.stats = FiddlerStats()
        self.reset_stats()

        if isinstance(latency_model, dict):
            latency_model = LatencyModel.from_dict(latency_model)
        if latency_model is None and gpu.has_gpu:
            latency_model = self.calibrate(max_tokens=calibration_tokens)
        self.latency_model = latency_model

    def _check_host_memory(self, experts, take_ownership: bool) -> None:
        """What this executor will hold in host memory must fit (an error naming the numbers, at load): the
        host copies of non-resident experts and, where the GPU side is the CPU, the resident copies and the
        copy buffers too. Experts taken over are freed one by one as they are copied (one at a time extra)."""
        L, E = self.config.num_moe_layers, self.config.expert_slots
        resident = self.placement.num_resident
        host_side = not self.cuda and self.gpu.has_gpu  # the emulated GPU's memory is host memory
        need = {"experts": (L * E - (0 if self.cache.adaptive else resident)) * self._host_expert_bytes()}
        if host_side:
            need["resident_experts"] = resident * self.expert_bytes
            if resident < L * E:
                need["buffers"] = self._buffer_bytes()
        given = sum(hostmem.nbytes(e.w1, e.w3, e.w2) for layer in experts for e in layer if e is not None)
        released = given - max(self._host_expert_bytes(), self.expert_bytes) if take_ownership else 0
        hostmem.check_fits(f"{type(self).__name__} ({L} x {E} experts, {resident} resident)", need, released)

    def _host_expert_bytes(self) -> int:
        """Bytes of one expert's host copy (packed for the kernel, else as given)."""
        H, F_ = self.config.hidden_size, self.config.intermediate_size
        if self.packed_host:
            return sum(layout.expert_packed_bytes(H, F_, self.quant))
        return self.expert_bytes

    def _buffer_bytes(self) -> int:
        scratch = self.config.expert_bytes(self.dtype) if self.packed_host else 0
        return COPY_BUFFERS * self._host_expert_bytes() + int(scratch)

    def _take_experts(self, experts, take_ownership: bool) -> None:
        """One host copy per non-resident expert (in `packed` for the CPU kernel, else in `host`: the weights
        as given, in the model dtype; pinned at the byte on CUDA) and one GPU-side copy per resident expert
        (`resident`: a separate allocation, on an emulated GPU too, as CUDA memory is). With take_ownership
        the caller's entries are cleared as they are copied, so memory is freed expert by expert."""
        L, E = self.config.num_moe_layers, self.config.expert_slots
        self.host: list[list[ExpertWeights | None]] = [[None] * E for _ in range(L)]
        self.packed: list[list[Any]] = [[None] * E for _ in range(L)]
        self.resident: list[list[ExpertWeights | None]] = [[None] * E for _ in range(L)]
        copies = self.packed if self.packed_host else self.host
        for l in range(L):
            for e in range(E):
                w = experts[l][e]
                if self.placement.resident[l][e]:
                    self.resident[l][e] = self._device_copy(w)
                if not self.placement.resident[l][e] or self.cache.adaptive:
                    copies[l][e] = self._host_copy(w)
                if take_ownership:
                    experts[l][e] = None
        if self.cuda:
            hostmem.require_pinned("FiddlerExecutor host experts",
                                   [t for h in self._host_copies() for t in self._host_tensors(h)])

    def _host_copies(self) -> list:
        return [h for row in (self.packed if self.packed_host else self.host) for h in row if h is not None]

    def _holding(self, layer: int, e: int):
        """The one host copy of expert (layer, e) (None: resident)."""
        return (self.packed if self.packed_host else self.host)[layer][e]

    def _set_holding(self, layer: int, e: int, h) -> None:
        (self.packed if self.packed_host else self.host)[layer][e] = h
        self._tables.pop(layer, None)

    def _table(self, layer: int):
        """The layer's packed bf16 host copies as the fused call's pointers (kernels.ExpertTable), gathered on
        first use and again after a host copy changed (_set_holding)."""
        t = self._tables.get(layer)
        if t is None:
            t = self._tables[layer] = self.kernel.ExpertTable(self.packed[layer])
        return t

    def _device_copy(self, w: ExpertWeights) -> ExpertWeights:
        """A resident expert's GPU-side copy: w1 and w3 stacked (one GEMM), or the block bytes (quantized)."""
        if self.quant:
            return ExpertWeights(*(t.to(self.device, copy=True) for t in (w.w1, w.w3, w.w2)))
        return ExpertWeights.stacked(w.w1.to(self.device, self.dtype), w.w3, w.w2.to(self.device, self.dtype, copy=True))

    def _host_copy(self, w: ExpertWeights):
        """The host copy of an expert: packed (pinned at the byte on CUDA), else the given weights in dtype."""
        if self.packed_host:
            p = self._pack(w)
            if not self.cuda:
                return p
            w13, w2 = (hostmem.pinned_copy(t) for t in p.packed())
            if self.quant is not None:
                return self.kernel.quant.QuantExpert.from_packed(self.quant, p.hidden, p.ffn, w13, w2)
            return self.kernel.PackedExpert.from_packed(p.hidden, p.ffn, w13, w2)
        ts = (t if (t.dtype == self.dtype or self.quant) else t.to(self.dtype) for t in (w.w1, w.w3, w.w2))
        return ExpertWeights(*(hostmem.pinned_copy(t) if self.cuda else t for t in ts))

    def _host_tensors(self, h) -> list[torch.Tensor]:
        """The tensors of a host copy, as kind b copies them."""
        return list(h.packed()) if self.packed_host else [h.w1, h.w3, h.w2]

    def _allocate_buffers(self) -> None:
        """COPY_BUFFERS slots shaped like a host copy, on the GPU side, and the unpack scratch (bf16 packed)."""
        h = self._host_copies()[0]
        self.buffers = [[torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in self._host_tensors(h)]
                        for _ in range(COPY_BUFFERS)]  # contiguous: a fill copies byte ranges into the last one
        if self.packed_host and self.quant is None:
            self.scratch = empty_expert(self.config, self.dtype, self.device)

    def host_bytes(self) -> dict[str, int]:
        """Bytes this executor holds in host memory: expert copies (on an emulated GPU the resident ones too)
        and copy buffers (where the GPU side is the CPU)."""
        experts = sum(hostmem.nbytes(*self._host_tensors(h)) for h in self._host_copies())
        buffers = 0
        if not self.cuda:
            experts += sum(hostmem.nbytes(r.w1, r.w3, r.w2) for row in self.resident for r in row if r is not None)
            buffers = sum(hostmem.nbytes(*b) for b in self.buffers)
            if self.scratch is not None:
                buffers += hostmem.nbytes(self.scratch.w1, self.scratch.w3, self.scratch.w2)
        return {"experts": experts, "buffers": buffers}

    # ------------------------------------------------------------------ dense or quantized experts

    def _pack(self, h: ExpertWeights):
        """The CPU kernel's copy of a host expert (bf16 packed, or quantized blocks packed)."""
        if self.quant is not None:
            return fquant.pack_expert(h, self.quant, self.config.hidden_size, self.config.intermediate_size)
        return self.kernel.PackedExpert(h.w1, h.w3, h.w2)

    def _dense(self, w: ExpertWeights, dtype: torch.dtype | None = None) -> ExpertWeights:
        """Weights torch computes with: quantized experts (resident or copied in as block bytes) are
        dequantized where they are, i.e. on the GPU side (in `dtype`, default the model's)."""
        if self.quant is None:
            return w
        return fquant.dequantize_expert(w, self.quant, self.config.hidden_size, self.config.intermediate_size,
                                        dtype or self.dtype)

    # ------------------------------------------------------------------ bookkeeping

    def reset_stats(self) -> None:
        """Fresh counters; the resident set itself carries on (what it learnt is the point of adapting)."""
        self.stats = FiddlerStats(layers=[LayerStats() for _ in range(self.config.num_moe_layers)])
        self.cache.reset_stats()
        self.stats.residency = self.cache.describe()

    def info(self) -> dict[str, Any]:
        k, th = self.kernel, self.threads
        return {
            "executor": f"{__name__}.FiddlerExecutor",
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "has_gpu": self.gpu.has_gpu,
            "gpu_side": self.gpu.describe(),
            "placement": self.placement.to_dict(),
            "residency": self.cache.policy.describe(),
            "planner": self.planner_name,
            "latency_model": self.latency_model.to_dict() if self.latency_model is not None else None,
            "cpu_expert_path": f"kernel:{k.isa()}" if k is not None else "torch",
            "packed_experts": sum(p is not None for row in self.packed for p in row),
            "host_bytes": self.host_bytes(),
            "overlap": th.overlap, "cpu_threads": th.cpu_queue, "gpu_side_threads": th.gpu_side,
            "all_threads": th.all, "copy_buffers": len(self.buffers), "expert_bytes": self.expert_bytes,
            "quant": self.quant,
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            threads = self.threads.cpu_queue
            # torch.set_num_threads is per OS thread (OpenMP ICV, MKL thread-local), so only the worker changes.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fiddler-cpu",
                                            initializer=lambda: torch.set_num_threads(threads))
        return self._pool

    # ------------------------------------------------------------------ expert paths

    def _cpu_expert(self, layer: int, e: int, x: torch.Tensor, out: torch.Tensor, threads: int) -> torch.Tensor:
        """One expert on the CPU, x in host memory. The torch fallback uses the calling thread's torch
        thread count (the worker's is the CPU queue's)."""
        h = self._holding(layer, e)
        if self.packed_host:
            return h.forward(x, out=out, threads=threads)
        return out.copy_(torch_expert(self._dense(h), x.to(self.dtype)))

    def _run_cpu_queue(self, layer: int, experts: list[int], sizes: list[int], x_host: torch.Tensor,
                       threads: int) -> tuple[torch.Tensor, float]:
        """Kind-c experts one after another; the rows of x_host are grouped by expert in `experts` order."""
        t0 = time.perf_counter()
        y = torch.empty(x_host.shape, dtype=self.dtype, pin_memory=self.cuda)
        start = 0
        for e, n in zip(experts, sizes):
            self._cpu_expert(layer, e, x_host[start:start + n], y[start:start + n], threads)
            start += n
        return y, time.perf_counter() - t0

    def _copy_in(self, layer: int, e: int, slot: int) -> None:
        """Issue the copy of expert (layer, e)'s host bytes into buffer `slot` (kind b)."""
        srcs = self._host_tensors(self._holding(layer, e))
        self.copy_in.copy(slot, self.buffers[slot], srcs)
        self.stats.weight_copies += 1
        self.stats.bytes_h2d_weights += hostmem.nbytes(*srcs)

    def _copied(self, slot: int) -> ExpertWeights:
        """The expert copied into `slot`, for compute issued next: unpacked on the GPU side (bf16 into the
        scratch, quantized into block bytes the compute dequantizes), or the buffer itself. The slot is
        released here once unpacked, else by the caller after its compute."""
        self.copy_in.acquire(slot)
        w = self._unpack(self.buffers[slot])
        if self.packed_host:
            self.copy_in.release(slot)
        return w

    def _unpack(self, bufs: list[torch.Tensor], into: ExpertWeights | None = None) -> ExpertWeights:
        """A host copy's bytes on the GPU side (`bufs`, as _host_tensors lists them) as weights the GPU side
        computes with: written into `into` (a resident slot) where given, else the scratch (bf16 packed), new
        block tensors (quantized packed) or the buffers themselves (not packed)."""
        H, F_, q = self.config.hidden_size, self.config.intermediate_size, self.quant
        if self.packed_host and q is None:
            s = into if into is not None else self.scratch
            layout.unpack_into([s.w1, s.w3], bufs[0], F_, H)
            layout.unpack_into([s.w2], bufs[1], H, F_)
            return s
        if self.packed_host:
            w = ExpertWeights(*layout.unpack(bufs[0], F_, H, 2, q), *layout.unpack(bufs[1], H, F_, 1, q))
        else:
            w = ExpertWeights(*bufs)
        if into is None:
            return w
        for dst, src in zip((into.w1, into.w3, into.w2), (w.w1, w.w3, w.w2)):
            dst.copy_(src)
        return into

    # ------------------------------------------------------------------ forward

    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The contract's forward (a decode row on the GPU side adds the residual in its weighted sum: one op)."""
        t_start = time.perf_counter()
        T, K = topk_idx.shape
        E = self.config.expert_slots
        self.begin_forward(layer, x, topk_idx)
        if T == 1 and not self.gpu.has_gpu:  # the CPU alone: no readback, staging or copies to plan around
            out = self._cpu_only_row(layer, x, topk_idx, topk_w, residual, t_start)
            if out is not None:
                return out
        # The call's one device-to-host wait (readback.Readback): the routing, and where this layer has experts
        # off the GPU, the CPU queue's rows and weights (all rows: which ones the CPU takes is decided after).
        # (a resident set that adapts can move a fully resident layer's slot elsewhere)
        off_gpu = self._off_gpu[layer] if not self.cache.adaptive else not all(self.cache.resident[layer])
        host = self.readback(topk_idx, E, layer, x if off_gpu else None, topk_w if off_gpu else None)
        if self.cuda and off_gpu:
            self.stats.bytes_d2h_activations += x.numel() * x.element_size()
        # One plan per layer call, whichever path runs it: a decode row whose plan puts every routed expert on
        # the CPU goes to the fused kernel call, anything else to the general path with the same plan.
        staged = self._take_staged(layer)
        plan: LayerPlan = staged_plan(self.planner, host.counts, self.cache.resident[layer], self.latency_model, staged)
        ahead = self._ahead(layer, host.counts, plan)
        installs = self._fill(layer, host.counts, plan, bool(ahead)) if self.cache.adaptive else ()
        if ahead and self.cache.adaptive:  # the step may have moved a staged expert into a slot
            ahead = [e for e in ahead if not self.cache.resident[layer + 1][e]]
        if (T == 1 and self.fused_decode and self.packed_host and off_gpu and host.x.is_contiguous()
                and host.w.dtype == torch.bfloat16 and max(host.counts) == 1
                and all(d is None or d == CPU for d in plan.decisions)):
            self.stats.copies_ahead_unused += len(staged)
            return self._install(installs, self._decode_row_on_cpu(layer, host.x, host.row_ids, host.w, plan, t_start,
                                                                   residual))
        # fp32 x (quantized experts, fp32_inputs): the CPU kernel takes it as is, the GPU side computes in dtype
        x_in, x = x, x.to(self.dtype)
        cpu_experts = plan.experts(CPU)
        if T == 1 and not cpu_experts:
            return self._install(installs, self._row_on_gpu_side(layer, x, x_in, host.row_ids, topk_w, plan, t_start,
                                                                 staged, ahead, residual))
        groups = ExpertGroups(topk_idx, E, layer, host.counts)  # where the combination is: the GPU side
        combined = SlotOutputs(x, K, self._scratch, gpu_side=self.gpu.has_gpu)

        # CPU queue first, so it overlaps everything below; its rows are in host memory already.
        future = cpu_result = None
        if cpu_experts:
            host_groups = ExpertGroups(host.ids, E, layer, host.counts) if self.gpu.has_gpu else groups
            x_c = self._scratch.gather("cpu_rows", host.x, host_groups.tokens_of(cpu_experts))
            flat_c = groups.flat_of(cpu_experts)
            sizes = [host.counts[e] for e in cpu_experts]
            if self.threads.overlap and len(cpu_experts) < sum(d is not None for d in plan.decisions):
                future = self._worker().submit(self._run_cpu_queue, layer, cpu_experts, sizes, x_c,
                                               self.threads.cpu_queue)
            else:  # nothing to overlap with (or serial mode): run here with every core
                cpu_result = self._run_cpu_queue(layer, cpu_experts, sizes, x_c, self.threads.all)

        # GPU queue: resident experts, then copied-in ones through the double buffer.
        prev_threads = None
        if future is not None and self.threads.gpu_side is not None:
            prev_threads = torch.get_num_threads()
            torch.set_num_threads(self.threads.gpu_side)
        try:
            self._gpu_queue(layer, plan, lambda w, e: self._gpu_expert(w, groups, e, x, x_in, topk_w, combined),
                            staged, ahead)
        finally:
            if prev_threads is not None:
                torch.set_num_threads(prev_threads)

        cpu_s = 0.0
        if future is not None:
            cpu_result = future.result()
        if cpu_result is not None:
            y_c, cpu_s = cpu_result
            if self.device.type != "cpu":
                self.stats.bytes_h2d_activations += y_c.numel() * y_c.element_size()
                y_c = y_c.to(self.device, non_blocking=True)
            combined.put_flat(flat_c, y_c, topk_w)
        out = combined.sum()
        self.stats.add_plan(layer, plan, T * K, time.perf_counter() - t_start, cpu_s)
        return self._install(installs, add_residual(residual, out))

    # ------------------------------------------------------------------ the resident set adapting

    def _fill(self, layer: int, counts, plan: LayerPlan, streams: bool = False) -> list:
        """The cache's step for this call (fiddler.residency.ExpertCache), as the call is planned: its chunk of
        the fill goes to the copy engine now (the cache sized it to the engine's predicted idle time in this
        call; none where this call stages the next layer's copies: they take the buffers); the installs it
        returns wait for the end of the call (`_install`)."""
        installs = []
        for a in self.cache.step(layer, counts, plan, self.latency_model, streams):
            if isinstance(a, Chunk):
                srcs = self._host_tensors(self._holding(a.layer, a.expert))
                self.copy_in.copy(FILL, *_byte_range(self.buffers[FILL], srcs, a.start, a.end))
                self.stats.bytes_h2d_weights += a.end - a.start
            elif isinstance(a, Promote):
                self._promotions[a.expert] = a  # _gpu_queue keeps it once it has run
            else:
                installs.append(a)
        self.stats.residency = self.cache.describe()
        return installs

    def _install(self, installs, out: torch.Tensor) -> torch.Tensor:
        """Finished fills, after the call's own work is issued (so on CUDA waiting for the fill's copy holds up
        nothing of it, and an evicted expert this call ran is overwritten after it ran): the fill buffer unpacked
        into the evicted expert's slot, which becomes the new expert's."""
        for a in installs:
            self.copy_in.acquire(FILL)
            self._into_slot(a, self._unpack(self.buffers[FILL], into=self.resident[a.victim_layer][a.victim]))
            self.copy_in.release(FILL)
        return out

    def _into_slot(self, a, w: ExpertWeights) -> None:
        """Weights on the GPU side (a finished fill, or a copied-in expert that has run) into the slot of the expert
        `a` evicts, which becomes a.expert's."""
        slot = self.resident[a.victim_layer][a.victim]
        if w is not slot:
            for dst, src in zip((slot.w1, slot.w3, slot.w2), (w.w1, w.w3, w.w2)):
                dst.copy_(src)
        self.resident[a.layer][a.expert], self.resident[a.victim_layer][a.victim] = slot, None

    def _take_staged(self, layer: int) -> dict[int, int]:
        """The copies the previous layer call staged for this one ({expert: buffer}; none if it was another
        layer's call, e.g. a forward that ended there): taken, so a later call cannot reuse them."""
        at, staged = self._staged
        self._staged = (None, {})
        if at is not None and at != layer:
            self.stats.copies_ahead_unused += len(staged)
            return {}
        return staged

    def _ahead(self, layer: int, counts, plan: LayerPlan) -> list[int]:
        """The next layer's experts this call stages (fiddler.streaming.lookahead)."""
        if not self.lookahead or layer + 1 >= self.config.num_moe_layers:
            return []
        return lookahead(counts, self.cache.resident[layer + 1], self.latency_model, self.planner_name, plan)

    def _gpu_queue(self, layer: int, plan: LayerPlan, run, staged: dict[int, int] | None = None,
                   ahead: list[int] = (), run_resident=None) -> None:
        """The GPU side's experts of a plan, run(weights, e) each: resident ones (all in one
        run_resident([(weights, e), ...]) where given), then copied-in ones through the
        double buffer (fiddler.streaming.pipeline: the buffer of each, and which were staged by the previous
        layer call). The first buffers' copies are issued first, so they overlap the resident experts (as
        planned); on CUDA the copy of the next expert overlaps the current one's compute. The next layer's
        `ahead` experts are copied in as soon as this call's last use of a buffer is issued (at the start for
        a buffer it does not use), before this layer's later experts run."""
        staged = staged or {}
        p = pipeline(plan.experts(COPY), staged, ahead)
        self.stats.copies_ahead_unused += len(staged) - len(p.staged)
        for e, slot in zip(p.order[:COPY_BUFFERS], p.slots):
            if e not in p.staged:
                self._copy_in(layer, e, slot)
        self._stage(layer, p, -1)
        resident = [(self.resident[layer][e], e) for e in plan.experts(GPU)]
        if run_resident is not None:
            run_resident(resident)
        else:
            for w, e in resident:
                run(w, e)
        for i, e in enumerate(p.order):
            slot = p.slots[i]
            w = self._copied(slot)
            run(w, e)
            if self._promotions:
                p_ = self._promotions.pop(e, None)
                if p_ is not None:
                    self._into_slot(p_, w)
            if not self.packed_host:
                self.copy_in.release(slot)
            if i + COPY_BUFFERS < len(p.order):
                self._copy_in(layer, p.order[i + COPY_BUFFERS], p.slots[i + COPY_BUFFERS])
            self._stage(layer, p, i)

    def _stage(self, layer: int, p: Pipeline, i: int) -> None:
        """Issue the next layer's copies whose buffer's last use in this call is order[i] (i = -1: unused). They go
        into the same COPY_BUFFERS buffers (the placement's reservation pays for them: `expert_copy_buffers`, on
        pinned host copies on CUDA), so look-ahead costs no GPU memory."""
        for e, slot in p.ahead_after(i):
            self._copy_in(layer + 1, e, slot)
            self.stats.copies_ahead += 1
            at, staged = self._staged
            self._staged = (layer + 1, {**(staged if at == layer + 1 else {}), e: slot})

    def _row_on_gpu_side(self, layer: int, x: torch.Tensor, x_in: torch.Tensor, ids: list[int],
                         topk_w: torch.Tensor, plan: LayerPlan, t_start: float, staged, ahead,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
        """One token whose routed experts all run on the GPU side (decode): each expert writes its output
        straight into its slot's row, so there is nothing to group, gather or scatter; the resident experts
        share one silu and one product (torch_experts_row). The layer call launches the experts' GEMMs, those
        two, the readback and one op for the weighted sum plus the residual (addmm), or the two of
        SlotOutputs' weighted sum (the same bits) without a residual."""
        K = len(ids)
        slots = self._scratch.take("slots", (K, x.shape[1]), self.dtype, x.device)
        slot_of = {e: k for k, e in enumerate(ids)}
        fp32_in = x_in.dtype == torch.float32 and self.dtype != torch.float32  # fp32_inputs, as _gpu_expert

        def run(w: ExpertWeights, e: int) -> None:
            out = slots[slot_of[e]:slot_of[e] + 1]
            if fp32_in:
                out.copy_(torch_expert(self._dense(w, torch.float32), x_in))
            else:
                torch_expert(self._dense(w), x, out=out)

        def run_resident(resident: list[tuple[ExpertWeights, int]]) -> None:
            ws = [self._dense(w) for w, _ in resident]
            if fp32_in or len(ws) < 2 or any(w.w13 is None or w.w1.shape != ws[0].w1.shape for w in ws):
                for w, e in resident:
                    run(w, e)
                return
            rows = self._scratch.take("w13_rows", (len(ws), ws[0].w13.shape[0]), self.dtype, x.device)
            torch_experts_row(ws, x, [slots[slot_of[e]:slot_of[e] + 1] for _, e in resident], rows)

        self._gpu_queue(layer, plan, run, staged, ahead, run_resident)
        if residual is not None and topk_w.dtype == slots.dtype == residual.dtype:
            out = torch.addmm(residual, topk_w.reshape(1, K), slots)  # residual + sum_k w_k * slot_k, one op
        else:
            out = add_residual(residual, weighted_slot_sum(slots, topk_w, 1, K, one_op_sum=True))
        self.stats.add_plan(layer, plan, K, time.perf_counter() - t_start, 0.0)
        return out

    def _gpu_expert(self, w: ExpertWeights, groups: ExpertGroups, e: int, x, x_in, topk_w,
                    combined: SlotOutputs) -> None:
        """Expert e's routed rows on the GPU side, at most EXPERT_ROW_CHUNK at a time (fiddler.placement.row_chunks:
        the placement reserves one chunk's intermediates)."""
        tok, flat, n = groups.tokens(e), groups.flat(e), groups.counts[e]
        # fp32 activations (fp32_inputs): fp32 compute on the dequantized weights, as the CPU kernel
        fp32_in = x_in.dtype == torch.float32 and self.dtype != torch.float32
        dense = self._dense(w, torch.float32) if fp32_in else self._dense(w)
        for a, b in row_chunks(n, EXPERT_ROW_CHUNK) if n > EXPERT_ROW_CHUNK else ((0, n),):
            if n > EXPERT_ROW_CHUNK:
                tok, flat = groups.tokens(e)[a:b], groups.flat(e)[a:b]
            if fp32_in:
                y_e = torch_expert(dense, x_in.index_select(0, tok)).to(self.dtype)
            else:  # a lone row routed here needs no gather (decode: one launch fewer per expert)
                y_e = torch_expert(dense, x if x.shape[0] == 1 else x.index_select(0, tok))
            combined.put_flat(flat, y_e, topk_w)

    def _cpu_only_row(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                      residual: torch.Tensor | None, t_start: float) -> torch.Tensor | None:
        """forward's decode row without a GPU side, by the steps forward takes for it (readback's counts, the
        plan, the fused kernel call) less those that do nothing there; None where forward's general path
        serves it (an expert twice, no packed kernel)."""
        if not (self.fused_decode and self.packed_host and x.is_contiguous() and topk_w.dtype == torch.bfloat16):
            return None
        ids = topk_idx.tolist()[0]  # (the whole [1, K] tensor to a list: no row view made first)
        counts = row_counts(ids, self.config.expert_slots, layer)
        if max(counts) != 1:
            return None
        plan = self.planner(counts, self.cache.resident[layer], self.latency_model)
        if not _cpu_or_idle(plan.decisions):
            return None
        return self._decode_row_on_cpu(layer, x, ids, topk_w, plan, t_start, residual)

    def _decode_row_on_cpu(self, layer: int, x: torch.Tensor, ids: list[int], topk_w: torch.Tensor,
                           plan: LayerPlan, t_start: float, residual: torch.Tensor | None = None
                           ) -> torch.Tensor:
        """One token whose plan puts every routed expert (distinct ids) on the CPU (always so without a GPU):
        all of them in one kernel call (fiddler.kernels.moe_ffn: two pooled regions per layer, no Python
        between experts), with the same roundings as the general path. x and topk_w are in host memory."""
        threads = small_call_threads(len(ids) * self.expert_bytes, self.threads.all)
        if residual is not None and self.quant is None and self._on_cpu and residual.is_contiguous() \
                and topk_w.is_contiguous():
            # with the residual add in the same call: the bits of moe_ffn's result + residual; the layer's
            # experts as pointers gathered once (kernels.ExpertTable), the row's weights as they are
            out = self._table(layer).residual_row(ids, topk_w, x, residual, threads=threads)
            residual = None
        else:
            packed = self.packed[layer]
            experts = [packed[e] for e in ids]
            moe_ffn = self.kernel.moe_ffn if self.quant is None else self.kernel.quant.moe_ffn
            out = moe_ffn(experts, topk_w[0].contiguous(), x, threads=threads)
        if not self._on_cpu:
            out = out.to(self.device, non_blocking=True)
        wall = time.perf_counter() - t_start
        self.stats.add_plan(layer, plan, len(ids), wall, wall)
        return add_residual(residual, out)

    # ------------------------------------------------------------------ calibration

    def calibrate(self, max_tokens: int = 128, repeats: int = 3) -> LatencyModel:
        """Time this executor's own paths on one expert: the CPU queue (activation copies, worker thread
        and thread count included), the GPU-side expert and a weight copy into a copy buffer. Cached per
        (shape, dtype, device, threads) for the process."""
        H, F_ = self.config.hidden_size, self.config.intermediate_size
        th = self.threads
        counts = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s <= max(1, max_tokens)]
        # Probe expert: a non-resident one if any (it is pre-packed), else layer 0 expert 0.
        pl, pe = next(((l, e) for l in range(self.config.num_moe_layers) for e in range(self.config.expert_slots)
                       if not self.placement.resident[l][e]), (0, 0))
        host_tmp = self._holding(pl, pe) is None  # every expert resident: a host copy to time kinds b and c
        if host_tmp:
            r = self.resident[pl][pe]
            host = ExpertWeights(*(w.to("cpu", copy=True) for w in (r.w1, r.w3, r.w2)))
            self._set_holding(pl, pe, self._host_copy(host))
        buffers_tmp = not self.buffers
        if buffers_tmp:  # everything resident: borrow buffers just to time a copy
            self._allocate_buffers()
        gen = torch.Generator().manual_seed(0)
        xs = {s: torch.randn(s, H, generator=gen).to(self.dtype).to(self.device) for s in counts}
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)

        def cpu_fn(s):
            x = xs[s]
            if self.cuda:  # the rows come back as a layer call's readback brings them
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                host.copy_(x, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
                x = host
            if th.overlap:
                y, _ = self._worker().submit(self._run_cpu_queue, pl, [pe], [s], x, th.cpu_queue).result()
            else:
                y, _ = self._run_cpu_queue(pl, [pe], [s], x, th.all)
            y.to(self.device)
            sync()

        def gpu_fn(s):
            prev = torch.get_num_threads()
            if th.gpu_side is not None:
                torch.set_num_threads(th.gpu_side)
            try:
                torch_expert(self._dense(w_gpu), xs[s])
            finally:
                torch.set_num_threads(prev)
            sync()

        def copy_fn():  # what kind b adds to a resident expert: the copy and the unpack on the GPU side
            slot = 1 % COPY_BUFFERS
            self._copy_in(pl, pe, slot)
            self._copied(slot)
            if not self.packed_host:
                self.copy_in.release(slot)
            sync()

        key = (H, F_, str(self.dtype), str(self.device), th.cpu_queue, th.all, th.gpu_side, th.overlap,
               self.kernel is not None, tuple(counts), self.quant)
        try:
            self._copy_in(pl, pe, 0)
            w_gpu = self._copied(0)
            sync()
            lm = calibrate(cpu_fn, gpu_fn, copy_fn, token_counts=counts, repeats=repeats, cache_key=key,
                           meta={"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                                 "cpu_threads": th.cpu_queue, "gpu_side_threads": th.gpu_side,
                                 "overlap": th.overlap, "expert_bytes": self.expert_bytes, "quant": self.quant,
                                 "cpu_expert_path": f"kernel:{self.kernel.isa()}" if self.kernel else "torch",
                                 "gpu_side": "cuda" if self.cuda else "cpu (emulated GPU)"})
        finally:
            if host_tmp:
                self._set_holding(pl, pe, None)
            if buffers_tmp:
                self.buffers, self.scratch = [], None
        self.reset_stats()  # calibration copies are not part of the workload
        return lm


_CPU_OR_IDLE = frozenset((CPU, None))


def _cpu_or_idle(decisions: tuple) -> bool:
    """Every decision of a plan is the CPU's (c) or None (no tokens routed)."""
    return _CPU_OR_IDLE.issuperset(decisions)


FILL = COPY_BUFFERS - 1  # the copy buffer a fill of the resident set uses (fiddler.residency)


def _byte_range(dsts: list[torch.Tensor], srcs: list[torch.Tensor], start: int, end: int):
    """Bytes [start, end) of `srcs` laid end to end (each in its logical order), and the same bytes of `dsts`
    (contiguous, shaped alike): (dst pieces, src pieces) for CopyIn.copy."""
    out_d, out_s, off = [], [], 0
    for d, s in zip(dsts, srcs):
        n = s.numel() * s.element_size()
        a, b = max(start, off), min(end, off + n)
        if a < b:
            assert d.is_contiguous()
            out_d.append(d.view(-1).view(torch.uint8)[a - off:b - off])
            out_s.append(s.reshape(-1).view(torch.uint8)[a - off:b - off])
        off += n
    return out_d, out_s


# ---------------------------------------------------------------------------- building

def build_executor(config, experts: list[list[ExpertWeights]], *, gpu: GpuSide, max_seq_len: int, max_batch: int,
                   placement: str | Placement = "popularity", popularity=None, planner: str = "makespan",
                   latency_model=None, cpu_threads: int | None = None, seed: int = 0,
                   dtype: torch.dtype | None = None, overlap: bool | None = None,
                   take_ownership: bool = False, quant: str | None = None,
                   residency: str = "static", lookahead: bool = True) -> FiddlerExecutor:
    """Fiddler's executor for `experts` [layer][expert].

    gpu: where the GPU side is and its budget (GpuSide). Without a GPU every expert runs on the CPU (kind
      c); an emulated GPU side is the CPU device standing in for a GPU (same placement, plans, copies).
    placement: "popularity" | "random" (seeded) | "all" | "none" | "fraction:<0..1>" | a Placement.
    popularity: a Popularity, a JSON path or None (uniform).
    latency_model: a LatencyModel, its dict, or None (calibrated now by timing this executor's own paths).
    dtype: the model dtype (default: the experts' dtype).
    overlap: run the CPU queue on a worker thread concurrently with the GPU side (see Threads.choose).
    take_ownership: clear the entries of `experts` as they are taken over (the list is unusable afterwards).
    quant: None, or "q8_0" / "q4_0" when `experts` hold llama.cpp block bytes (fiddler.quant): the CPU
      kernel computes on them, the GPU side stores/copies them and dequantizes, placement counts them.
    residency: how the resident set changes while it runs (fiddler.residency: "static", "lru", "lfu"); an
      adaptive one fills through the last copy buffer and seeds itself from `popularity`.
    lookahead: stage the next layer's copies during a long prompt's layer call (fiddler.streaming).
    """
    quant = fquant.check_quant(quant)
    if dtype is None and quant is not None:
        raise ValueError("build_executor: quantized experts need the model dtype")
    dtype = dtype or experts[0][0].w1.dtype
    pl = place_spec(placement, config, dtype, gpu.budget_bytes, popularity=popularity, max_seq_len=max_seq_len,
                    max_batch=max_batch, seed=seed, quant=quant, overhead=gpu.overhead_bytes())
    return FiddlerExecutor(config, experts, gpu=gpu, dtype=dtype, placement=pl, planner=planner,
                           latency_model=latency_model, threads=Threads.choose(gpu, dtype, cpu_threads, overlap),
                           calibration_tokens=min(128, max_seq_len * max_batch), take_ownership=take_ownership,
                           quant=quant, residency=residency, popularity=popularity, lookahead=lookahead)


@dataclass(frozen=True)
class FiddlerPolicy:
    """Factory of Fiddler's executor (fiddler.executors.ExecutorFactory), holding its options; see
    build_executor for their meaning."""

    placement: str | Placement = "popularity"
    popularity: Any = None
    planner: str = "makespan"
    latency_model: Any = None
    overlap: bool | None = None
    residency: str = "static"
    lookahead: bool = True

    def __call__(self, ctx: BuildContext, experts: list[list[ExpertWeights]]) -> FiddlerExecutor:
        return build_executor(ctx.config, experts, gpu=ctx.gpu, max_seq_len=ctx.max_seq_len,
                              max_batch=ctx.max_batch, placement=self.placement, popularity=self.popularity,
                              planner=self.planner, latency_model=self.latency_model, cpu_threads=ctx.cpu_threads,
                              seed=ctx.seed, dtype=ctx.dtype, overlap=self.overlap, take_ownership=True,
                              quant=ctx.quant, residency=self.residency, lookahead=self.lookahead)
