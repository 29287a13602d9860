"""Fiddler's executor: runs one MoE layer's experts according to a plan (the CPU-GPU orchestration).

Per layer and step: count the tokens routed to each expert, ask the planner for a decision per expert
(a: resident on the GPU, b: copy weights in then run on the GPU, c: run on the CPU), then
- the CPU queue (kind c) runs on a worker thread: the routed rows are copied to host memory and each
  expert runs with the packed C++ kernel (bf16; it releases the GIL) or a torch fallback;
- meanwhile the calling thread runs the GPU queue: resident experts first, then copied-in experts
  through a double buffer (on CUDA the copy of the next expert overlaps the current one's compute);
- outputs are combined like transformers' Mixtral (routing.SlotOutputs).

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

from .. import hardware
from .. import quant as fquant
from ..gpu_side import GpuSide
from ..kernel_loader import load_kernels
from ..latency import LatencyModel, calibrate
from ..placement import COPY_BUFFERS, Placement, parse_placement, place
from ..planner import COPY, CPU, GPU, KINDS, LayerPlan, get_planner
from ..popularity import Popularity
from ..weights import ExpertWeights
from .contract import BuildContext, ExpertExecutor, StatsBase
from .copy_in import CopyIn
from .ffn import torch_expert
from .routing import ExpertGroups, SlotOutputs


def _host_memory_for(nbytes: int) -> bool:
    """Whether packing another `nbytes` leaves at least as much again free (psutil; True if unknown)."""
    try:
        import psutil

        return psutil.virtual_memory().available >= 2 * nbytes
    except Exception:  # noqa: BLE001 -- psutil missing: assume it fits
        return True


def empty_expert(config, dtype, device) -> ExpertWeights:
    F_, H = config.intermediate_size, config.hidden_size
    return ExpertWeights(torch.empty(F_, H, dtype=dtype, device=device), torch.empty(F_, H, dtype=dtype, device=device),
                         torch.empty(H, F_, dtype=dtype, device=device))


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
    bytes_h2d_weights: int = 0
    bytes_d2h_activations: int = 0
    bytes_h2d_activations: int = 0
    predicted_s: float = 0.0
    wall_s: float = 0.0
    cpu_queue_s: float = 0.0
    layers: list[LayerStats] = field(default_factory=list)

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
        for st in (self, ls):
            st.calls += 1
            for n, kind in zip(plan.counts, plan.decisions):
                if kind is not None:
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
                 take_ownership: bool = False, quant: str | None = None):
        self.config, self.gpu, self.dtype = config, gpu, dtype
        self.device = gpu.device
        self.cuda = gpu.is_cuda
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
        self._take_experts(experts, take_ownership)
        if self.kernel is not None and self.quant is None:
            # a per-CPU knob, measured here on these experts before calibration times them: from how many
            # tokens AMX tiles beat the vector path (a no-op without AMX or with too few bytes to stream)
            self.kernel.tune_amx([p for row in self.packed for p in row if p is not None], threads=threads.all)

        # Double buffer for copied-in experts (kind b), allocated once; its size is in the reservation.
        self.buffers: list[ExpertWeights] = []
        if gpu.has_gpu and placement.num_resident < L * E:
            self.buffers = [self._empty_expert() for _ in range(COPY_BUFFERS)]
        self.copy_in = CopyIn(self.device, COPY_BUFFERS)
        self._pool: ThreadPoolExecutor | None = None
        self.stats = FiddlerStats()
        self.reset_stats()

        if isinstance(latency_model, dict):
            latency_model = LatencyModel.from_dict(latency_model)
        if latency_model is None and gpu.has_gpu:
            latency_model = self.calibrate(max_tokens=calibration_tokens)
        self.latency_model = latency_model

    def _take_experts(self, experts, take_ownership: bool) -> None:
        """Host copies (kind b copies from them, kind c runs from them or from their packed copy), resident
        copies on the device (on a CPU device: the host tensors themselves) and packed copies for the CPU
        kernel. The packed copy duplicates the weights, so host copies nobody needs are dropped: resident
        ones on CUDA, and all of them without a GPU (no kind b). With take_ownership the caller's list
        entries are cleared too, so the memory is freed expert by expert instead of doubling at peak."""
        L, E, dtype, has_gpu = self.config.num_moe_layers, self.config.expert_slots, self.dtype, self.gpu.has_gpu
        self.host: list[list[ExpertWeights | None]] = [
            [ExpertWeights(*(w if (w.dtype == dtype or self.quant) else w.to(dtype) for w in (e.w1, e.w3, e.w2)))
             for e in layer]
            for layer in experts]
        self.resident: list[list[ExpertWeights | None]] = [[None] * E for _ in range(L)]
        self.packed: list[list[Any]] = [[None] * E for _ in range(L)]
        self.pack_skipped = 0  # experts left on the torch CPU path for lack of host memory
        for l in range(L):
            for e in range(E):
                h = self.host[l][e]
                if self.placement.resident[l][e]:
                    self.resident[l][e] = ExpertWeights(*(w.to(self.device) for w in (h.w1, h.w3, h.w2)))
                    if self.cuda:
                        self.host[l][e] = None
                elif self.kernel is not None:
                    if has_gpu and not _host_memory_for(self.expert_bytes):
                        self.pack_skipped += 1  # kind b needs the HF-layout copy: keep it, skip packing
                    else:
                        self.packed[l][e] = self._pack(h)
                        if not has_gpu:
                            self.host[l][e] = None
                if take_ownership:
                    experts[l][e] = None

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

    def _empty_expert(self) -> ExpertWeights:
        if self.quant is not None:
            return fquant.empty_expert_blocks(self.config, self.quant, self.device)
        return empty_expert(self.config, self.dtype, self.device)

    # ------------------------------------------------------------------ bookkeeping

    def reset_stats(self) -> None:
        self.stats = FiddlerStats(layers=[LayerStats() for _ in range(self.config.num_moe_layers)])

    def info(self) -> dict[str, Any]:
        k, th = self.kernel, self.threads
        return {
            "executor": f"{__name__}.FiddlerExecutor",
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "has_gpu": self.gpu.has_gpu,
            "gpu_side": self.gpu.describe(),
            "placement": self.placement.to_dict(),
            "planner": self.planner_name,
            "latency_model": self.latency_model.to_dict() if self.latency_model is not None else None,
            "cpu_expert_path": f"kernel:{k.isa()}" if k is not None else "torch",
            "packed_experts": sum(p is not None for row in self.packed for p in row),
            "pack_skipped_low_memory": self.pack_skipped,
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
        p = self.packed[layer][e]
        if p is not None:
            return p.forward(x, out=out, threads=threads)
        return out.copy_(torch_expert(self._dense(self.host[layer][e]), x.to(self.dtype)))

    def _run_cpu_queue(self, layer: int, experts: list[int], sizes: list[int], x_host: torch.Tensor,
                       ready: Any, threads: int) -> tuple[torch.Tensor, float]:
        """Kind-c experts one after another; the rows of x_host are grouped by expert in `experts` order."""
        t0 = time.perf_counter()
        if ready is not None:
            ready.synchronize()  # the device -> host copy of the rows has landed
        y = torch.empty(x_host.shape, dtype=self.dtype, pin_memory=self.cuda)
        start = 0
        for e, n in zip(experts, sizes):
            self._cpu_expert(layer, e, x_host[start:start + n], y[start:start + n], threads)
            start += n
        return y, time.perf_counter() - t0

    def _copy_in(self, layer: int, e: int, slot: int) -> ExpertWeights:
        """Copy expert (layer, e) into buffer `slot` (kind b); compute issued next sees the copy."""
        buf, h = self.buffers[slot], self.host[layer][e]
        self.copy_in.copy(slot, (buf.w1, buf.w3, buf.w2), (h.w1, h.w3, h.w2))
        self.copy_in.acquire(slot)
        self.stats.weight_copies += 1
        self.stats.bytes_h2d_weights += self.expert_bytes
        return buf

    def _to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Rows for the CPU queue in host memory, and the CUDA event their copy completes (None on the CPU)."""
        if x.device.type == "cpu":
            return x, None
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stats.bytes_d2h_activations += x.numel() * x.element_size()
        return host, ready

    # ------------------------------------------------------------------ forward

    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        t_start = time.perf_counter()
        T, K = topk_idx.shape
        self.begin_forward(layer, x, topk_idx)
        if (T == 1 and self.fused_decode and self.kernel is not None and x.device.type == "cpu" and x.is_contiguous()
                and topk_w.dtype == torch.bfloat16):
            out = self._decode_row_on_cpu(layer, x, topk_idx, topk_w, t_start)
            if out is not None:
                return out
        # fp32 x (quantized experts, fp32_inputs): the CPU kernel takes it as is, the GPU side computes in dtype
        x_cpu, x = x, x.to(self.dtype)
        groups = ExpertGroups(topk_idx, self.config.expert_slots, layer)
        plan: LayerPlan = self.planner(groups.counts, self.placement.resident[layer], self.latency_model)
        combined = SlotOutputs(x, K)

        # CPU queue first, so it overlaps everything below.
        cpu_experts = plan.experts(CPU)
        future = cpu_result = None
        if cpu_experts:
            t_c, s_c = groups.pairs_of(cpu_experts)
            x_c, ready = self._to_host(x_cpu.index_select(0, t_c))
            sizes = [groups.counts[e] for e in cpu_experts]
            if self.threads.overlap and len(cpu_experts) < sum(d is not None for d in plan.decisions):
                future = self._worker().submit(self._run_cpu_queue, layer, cpu_experts, sizes, x_c, ready,
                                               self.threads.cpu_queue)
            else:  # nothing to overlap with (or serial mode): run here with every core
                cpu_result = self._run_cpu_queue(layer, cpu_experts, sizes, x_c, ready, self.threads.all)

        # GPU queue: resident experts, then copied-in ones through the double buffer.
        prev_threads = None
        if future is not None and self.threads.gpu_side is not None:
            prev_threads = torch.get_num_threads()
            torch.set_num_threads(self.threads.gpu_side)
        try:
            queue = [(e, None) for e in plan.experts(GPU)] + [(e, i % COPY_BUFFERS)
                                                              for i, e in enumerate(plan.experts(COPY))]
            for e, buf_slot in queue:
                w = self.resident[layer][e] if buf_slot is None else self._copy_in(layer, e, buf_slot)
                t_e, s_e = groups.pairs(e)
                if x_cpu.dtype == torch.float32 and self.dtype != torch.float32:
                    # fp32 activations (fp32_inputs): fp32 compute on the dequantized weights, as the CPU kernel
                    y_e = torch_expert(self._dense(w, torch.float32), x_cpu.index_select(0, t_e)).to(self.dtype)
                else:
                    y_e = torch_expert(self._dense(w), x.index_select(0, t_e))
                combined.put(t_e, s_e, y_e, topk_w)
                if buf_slot is not None:
                    self.copy_in.release(buf_slot)
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
            combined.put(t_c, s_c, y_c, topk_w)
        out = combined.sum()
        self.stats.add_plan(layer, plan, T * K, time.perf_counter() - t_start, cpu_s)
        return out

    def _decode_row_on_cpu(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                           t_start: float) -> torch.Tensor | None:
        """One token whose plan puts every routed expert on the CPU (always so without a GPU): all of
        them in one kernel call (fiddler.kernels.moe_ffn: two pooled regions per layer, no Python
        between experts), with the same roundings as the general path. None: not this case."""
        ids = topk_idx[0].tolist()
        E = self.config.expert_slots
        counts = [0] * E
        for e in ids:
            if not 0 <= e < E:
                raise ValueError(f"expert ids must be in [0, {E}), got {e} (layer {layer})")
            counts[e] += 1
        if max(counts) > 1:
            return None  # a repeated id (not from top-k): the general path sums its slots
        plan: LayerPlan = self.planner(counts, self.placement.resident[layer], self.latency_model)
        packed = self.packed[layer]
        if any(d is not None and (d != CPU or packed[e] is None) for e, d in enumerate(plan.decisions)):
            return None
        moe_ffn = self.kernel.moe_ffn if self.quant is None else self.kernel.quant.moe_ffn
        out = moe_ffn([packed[e] for e in ids], topk_w[0].contiguous(), x, threads=self.threads.all)
        wall = time.perf_counter() - t_start
        self.stats.add_plan(layer, plan, len(ids), wall, wall)
        return out

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
        host_tmp = self.host[pl][pe] is None  # a resident expert whose host copy was dropped (CUDA)
        if host_tmp:
            r = self.resident[pl][pe]
            self.host[pl][pe] = ExpertWeights(*(w.to("cpu", copy=True).pin_memory() if self.cuda else w
                                                for w in (r.w1, r.w3, r.w2)))
        packed_tmp = self.packed[pl][pe] is None and self.kernel is not None
        if packed_tmp:
            h = self.host[pl][pe]
            self.packed[pl][pe] = self._pack(h)
        buffers_tmp = not self.buffers
        if buffers_tmp:  # everything resident: borrow buffers just to time a copy
            self.buffers = [self._empty_expert() for _ in range(COPY_BUFFERS)]
        gen = torch.Generator().manual_seed(0)
        xs = {s: torch.randn(s, H, generator=gen).to(self.dtype).to(self.device) for s in counts}
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)

        def cpu_fn(s):
            x, ready = xs[s], None
            if self.cuda:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                host.copy_(x, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                x = host
            if th.overlap:
                y, _ = self._worker().submit(self._run_cpu_queue, pl, [pe], [s], x, ready, th.cpu_queue).result()
            else:
                y, _ = self._run_cpu_queue(pl, [pe], [s], x, ready, th.all)
            y.to(self.device)
            sync()

        def gpu_fn(s):
            prev = torch.get_num_threads()
            if th.gpu_side is not None:
                torch.set_num_threads(th.gpu_side)
            try:
                torch_expert(self._dense(self.buffers[0]), xs[s])
            finally:
                torch.set_num_threads(prev)
            sync()

        def copy_fn():
            self._copy_in(pl, pe, 1 % COPY_BUFFERS)
            sync()

        key = (H, F_, str(self.dtype), str(self.device), th.cpu_queue, th.all, th.gpu_side, th.overlap,
               self.kernel is not None, tuple(counts), self.quant)
        try:
            self._copy_in(pl, pe, 0)
            sync()
            lm = calibrate(cpu_fn, gpu_fn, copy_fn, token_counts=counts, repeats=repeats, cache_key=key,
                           meta={"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                                 "cpu_threads": th.cpu_queue, "gpu_side_threads": th.gpu_side,
                                 "overlap": th.overlap, "expert_bytes": self.expert_bytes, "quant": self.quant,
                                 "cpu_expert_path": f"kernel:{self.kernel.isa()}" if self.kernel else "torch",
                                 "gpu_side": "cuda" if self.cuda else "cpu (emulated GPU)"})
        finally:
            if packed_tmp:
                self.packed[pl][pe] = None
            if host_tmp:
                self.host[pl][pe] = None
            if buffers_tmp:
                self.buffers = []
        self.reset_stats()  # calibration copies are not part of the workload
        return lm


# ---------------------------------------------------------------------------- building

def build_executor(config, experts: list[list[ExpertWeights]], *, gpu: GpuSide, max_seq_len: int, max_batch: int,
                   placement: str | Placement = "popularity", popularity=None, planner: str = "makespan",
                   latency_model=None, cpu_threads: int | None = None, seed: int = 0,
                   dtype: torch.dtype | None = None, overlap: bool | None = None,
                   take_ownership: bool = False, quant: str | None = None) -> FiddlerExecutor:
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
    """
    quant = fquant.check_quant(quant)
    if dtype is None and quant is not None:
        raise ValueError("build_executor: quantized experts need the model dtype")
    dtype = dtype or experts[0][0].w1.dtype
    if isinstance(placement, Placement):
        pl = placement
    else:
        strategy, kw = parse_placement(placement)
        pl = place(config, dtype, gpu.budget_bytes, max_seq_len=max_seq_len, max_batch=max_batch,
                   strategy=strategy, popularity=Popularity.for_config(config, popularity), seed=seed, quant=quant,
                   **kw)
    return FiddlerExecutor(config, experts, gpu=gpu, dtype=dtype, placement=pl, planner=planner,
                           latency_model=latency_model, threads=Threads.choose(gpu, dtype, cpu_threads, overlap),
                           calibration_tokens=min(128, max_seq_len * max_batch), take_ownership=take_ownership,
                           quant=quant)


@dataclass(frozen=True)
class FiddlerPolicy:
    """Factory of Fiddler's executor (fiddler.executors.ExecutorFactory), holding its options; see
    build_executor for their meaning."""

    placement: str | Placement = "popularity"
    popularity: Any = None
    planner: str = "makespan"
    latency_model: Any = None
    overlap: bool | None = None

    def __call__(self, ctx: BuildContext, experts: list[list[ExpertWeights]]) -> FiddlerExecutor:
        return build_executor(ctx.config, experts, gpu=ctx.gpu, max_seq_len=ctx.max_seq_len,
                              max_batch=ctx.max_batch, placement=self.placement, popularity=self.popularity,
                              planner=self.planner, latency_model=self.latency_model, cpu_threads=ctx.cpu_threads,
                              seed=ctx.seed, dtype=ctx.dtype, overlap=self.overlap, take_ownership=True,
                              quant=ctx.quant)
