"""Runs one MoE layer's experts according to a plan: the Fiddler orchestration.

Per layer and step: count the tokens routed to each expert, ask the planner for a decision per expert
(a: resident on the GPU, b: copy weights in then run on the GPU, c: run on the CPU), then
- the CPU queue (kind c) runs on a worker thread: the routed rows are copied to host memory and each
  expert runs with the packed C++ kernel (bf16; it releases the GIL) or a torch fallback;
- meanwhile the calling thread runs the GPU queue: resident experts first, then copied-in experts
  through a double buffer (on CUDA the copy of the next expert overlaps the current one's compute);
- outputs are combined like transformers' Mixtral (grouped_mm / batched_mm experts, the 5.x default):
  each (token, slot) output is y * w in the model dtype, then summed over the top-k slots.

Without CUDA the "GPU side" is the CPU device, so placement, plans, buffer copies and combination run
the same code (the copy is a real memcpy); the two queues then either split the cores between them or
run one after the other with all cores (`overlap`), never both on all cores at once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from . import hardware
from .latency import LatencyModel, calibrate
from .placement import COPY_BUFFERS, Placement, parse_placement, place
from .planner import COPY, CPU, GPU, KINDS, LayerPlan, get_planner
from .popularity import Popularity, PopularityRecorder
from .weights import ExpertWeights


def _kernels():
    try:
        from . import kernels
    except Exception:  # noqa: BLE001 -- a broken build leaves the torch path working
        return None
    return kernels if getattr(kernels, "is_available", lambda: False)() else None


def torch_expert(w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert, op for op as transformers' Mixtral experts: (silu(x W1^T) * (x W3^T)) W2^T."""
    return F.linear(F.silu(F.linear(x, w.w1)) * F.linear(x, w.w3), w.w2)


def _host_memory_for(nbytes: int) -> bool:
    """Whether packing another `nbytes` leaves at least as much again free (psutil; True if unknown)."""
    try:
        import psutil

        return psutil.virtual_memory().available >= 2 * nbytes
    except Exception:  # noqa: BLE001 -- psutil missing: assume it fits
        return True


def _empty_expert(config, dtype, device) -> ExpertWeights:
    F_, H = config.intermediate_size, config.hidden_size
    return ExpertWeights(torch.empty(F_, H, dtype=dtype, device=device), torch.empty(F_, H, dtype=dtype, device=device),
                         torch.empty(H, F_, dtype=dtype, device=device))


# ---------------------------------------------------------------------------- stats

def _kind_counter() -> dict[str, int]:
    return {k: 0 for k in KINDS}


@dataclass
class LayerStats:
    calls: int = 0
    tokens: dict[str, int] = field(default_factory=_kind_counter)
    experts: dict[str, int] = field(default_factory=_kind_counter)
    predicted_s: float = 0.0
    wall_s: float = 0.0
    cpu_queue_s: float = 0.0
    last_decisions: tuple = ()

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "tokens": dict(self.tokens), "experts": dict(self.experts),
                "predicted_s": self.predicted_s, "wall_s": self.wall_s, "cpu_queue_s": self.cpu_queue_s,
                "last_decisions": list(self.last_decisions)}


@dataclass
class ExecutorStats:
    """Counters since the last reset. `tokens` counts routed (token, expert) pairs and `experts` expert
    invocations, per decision kind; gpu_hit_rate = share of routed pairs served by resident experts.
    predicted_s sums the planner's predicted makespans, wall_s the measured (host) time in forward,
    cpu_queue_s the time the CPU queue ran."""

    calls: int = 0
    routed_tokens: int = 0
    tokens: dict[str, int] = field(default_factory=_kind_counter)
    experts: dict[str, int] = field(default_factory=_kind_counter)
    weight_copies: int = 0
    bytes_h2d_weights: int = 0
    bytes_d2h_activations: int = 0
    bytes_h2d_activations: int = 0
    predicted_s: float = 0.0
    wall_s: float = 0.0
    cpu_queue_s: float = 0.0
    layers: list[LayerStats] = field(default_factory=list)

    @property
    def gpu_hit_rate(self) -> float | None:
        return self.tokens[GPU] / self.routed_tokens if self.routed_tokens else None

    @property
    def bytes_h2d(self) -> int:
        return self.bytes_h2d_weights + self.bytes_h2d_activations

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls, "routed_tokens": self.routed_tokens, "gpu_hit_rate": self.gpu_hit_rate,
            "tokens": dict(self.tokens), "experts": dict(self.experts), "weight_copies": self.weight_copies,
            "bytes_h2d": self.bytes_h2d, "bytes_h2d_weights": self.bytes_h2d_weights,
            "bytes_h2d_activations": self.bytes_h2d_activations, "bytes_d2h_activations": self.bytes_d2h_activations,
            "predicted_s": self.predicted_s, "wall_s": self.wall_s, "cpu_queue_s": self.cpu_queue_s,
            "layers": [ls.to_dict() for ls in self.layers],
        }

    # mapping-style access, so callers that expect a stats dict (engine, records) work unchanged
    def items(self):
        return self.to_dict().items()

    def __getitem__(self, key: str):
        return self.to_dict()[key]


# ---------------------------------------------------------------------------- executor

def expert_counts(flat_idx: torch.Tensor, num_experts: int, layer: int) -> list[int]:
    """Routed (token, slot) pairs per expert: the one host sync per layer. Rejects bad expert ids."""
    counts = torch.bincount(flat_idx, minlength=num_experts).tolist()
    if len(counts) != num_experts:
        raise ValueError(f"expert ids must be in [0, {num_experts}), got {len(counts) - 1} (layer {layer})")
    return counts


def begin_forward(executor, layer: int, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
    """What every executor's forward does first: check the activations' dtype, record the routing."""
    if x.dtype != executor.dtype:
        raise TypeError(f"x has dtype {x.dtype} but the executor runs in {executor.dtype}")
    if executor.recorder is not None:
        executor.recorder.record(layer, topk_idx)


class MoEExecutor:
    def __init__(self, config, experts: list[list[ExpertWeights]], *, device: torch.device, dtype: torch.dtype,
                 placement: Placement, planner: str, latency_model: LatencyModel | dict | None, has_gpu: bool,
                 cpu_threads: int | None = None, overlap: bool | None = None, use_kernel: bool | None = None,
                 calibration_tokens: int = 128, take_ownership: bool = False):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.placement, self.has_gpu = placement, has_gpu
        L, E = config.num_layers, config.num_experts
        if len(experts) != L or any(len(layer) != E for layer in experts):
            raise ValueError(f"experts must be [{L} layers][{E} experts], got "
                             f"[{len(experts)}][{sorted({len(layer) for layer in experts})}]")
        if len(placement.resident) != L or any(len(r) != E for r in placement.resident):
            raise ValueError(f"placement is not {L} x {E}")
        if not has_gpu and placement.num_resident:
            raise ValueError("a placement with resident experts needs a GPU budget")
        self.cuda = self.device.type == "cuda"
        self.planner_name = planner if has_gpu else "cpu"
        self._planner = get_planner(self.planner_name)
        self.expert_bytes = int(config.expert_bytes(dtype))

        # Threads. On CUDA the CPU queue gets every core (the calling thread only launches GPU work).
        # Without CUDA both queues run on the CPU: with overlap they run concurrently on disjoint halves
        # of the cores, without it one after the other with all cores. Measured on the 2-core dev VM
        # (scripts/bench_executor_overlap.py; shared and loaded, so noisy): overlap took 0.1-0.6x the serial
        # time in bf16 in two runs (all-core kernel/OpenMP regions stall when another process holds a core);
        # in fp32 0.14-0.8x in one run and 1.1-1.4x at 1-4 tokens in another. fp32 is the exactness mode and
        # MKL's fp32 GEMM rounding depends on the thread count, so the CPU default is overlap for bf16/fp16
        # and serial with all cores (bit-exact against a plain computation) for fp32.
        cores = hardware.cpu_cores()
        if overlap is None:
            overlap = self.cuda or dtype != torch.float32
        self.overlap = bool(overlap) and has_gpu
        self.all_threads = cpu_threads or cores
        if self.overlap and not self.cuda:
            self.cpu_threads = cpu_threads or max(1, cores // 2)
            self.gpu_side_threads: int | None = max(1, cores - self.cpu_threads)
        else:
            self.cpu_threads = self.all_threads
            self.gpu_side_threads = None

        # Host experts: kind b copies from here, kind c runs from here (or from its packed copy).
        self.host: list[list[ExpertWeights | None]] = [
            [ExpertWeights(*(w if w.dtype == dtype else w.to(dtype) for w in (e.w1, e.w3, e.w2))) for e in layer]
            for layer in experts]
        k = _kernels()
        if use_kernel is None:
            use_kernel = True
        self.kernel = k if (use_kernel and k is not None and dtype == torch.bfloat16) else None
        # Resident experts on the device (on a CPU device: the host tensors themselves, no copy). Every
        # expert the CPU may run is packed once for the kernel. The packed copy duplicates the weights,
        # so host copies nobody needs are dropped: resident ones on CUDA, and all of them without a GPU
        # (no kind b). With take_ownership the caller's list entries are cleared too, so the memory is
        # freed expert by expert instead of doubling at peak.
        self.resident: list[list[ExpertWeights | None]] = [[None] * E for _ in range(L)]
        self.packed: list[list[Any]] = [[None] * E for _ in range(L)]
        self.pack_skipped = 0  # experts left on the torch CPU path for lack of host memory
        for l in range(L):
            for e in range(E):
                h = self.host[l][e]
                if placement.resident[l][e]:
                    self.resident[l][e] = ExpertWeights(*(w.to(self.device) for w in (h.w1, h.w3, h.w2)))
                    if self.cuda:
                        self.host[l][e] = None
                elif self.kernel is not None:
                    if has_gpu and not _host_memory_for(self.expert_bytes):
                        self.pack_skipped += 1  # kind b needs the HF-layout copy: keep it, skip packing
                    else:
                        self.packed[l][e] = self.kernel.PackedExpert(h.w1, h.w3, h.w2)
                        if not has_gpu:
                            self.host[l][e] = None
                if take_ownership:
                    experts[l][e] = None

        # Double buffer for copied-in experts (kind b), allocated once; its size is in the reservation.
        self.buffers: list[ExpertWeights] = []
        if has_gpu and placement.num_resident < L * E:
            self.buffers = [_empty_expert(config, dtype, self.device) for _ in range(COPY_BUFFERS)]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self._buf_ready = [torch.cuda.Event() for _ in range(COPY_BUFFERS)]
            self._buf_free = [torch.cuda.Event() for _ in range(COPY_BUFFERS)]
        self._pool: ThreadPoolExecutor | None = None
        self.recorder: PopularityRecorder | None = None
        self.stats = ExecutorStats()
        self.reset_stats()

        if isinstance(latency_model, dict):
            latency_model = LatencyModel.from_dict(latency_model)
        if latency_model is None and has_gpu:
            latency_model = self.calibrate(max_tokens=calibration_tokens)
        self.latency_model = latency_model

    # ------------------------------------------------------------------ bookkeeping

    def reset_stats(self) -> None:
        self.stats = ExecutorStats(layers=[LayerStats() for _ in range(self.config.num_layers)])

    def attach_recorder(self, recorder: PopularityRecorder | None = None) -> PopularityRecorder:
        """Record every layer's routing from now on (scripts/profile_popularity.py)."""
        self.recorder = recorder or PopularityRecorder.for_config(self.config)
        return self.recorder

    def info(self) -> dict[str, Any]:
        k = self.kernel
        return {
            "executor": "fiddler.executor.MoEExecutor",
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "has_gpu": self.has_gpu,
            "gpu_side": "cuda" if self.cuda else ("cpu (emulated GPU)" if self.has_gpu else None),
            "placement": self.placement.to_dict(),
            "planner": self.planner_name,
            "latency_model": self.latency_model.to_dict() if self.latency_model is not None else None,
            "cpu_expert_path": f"kernel:{k.isa()}" if k is not None else "torch",
            "packed_experts": sum(p is not None for row in self.packed for p in row),
            "pack_skipped_low_memory": self.pack_skipped,
            "overlap": self.overlap, "cpu_threads": self.cpu_threads, "gpu_side_threads": self.gpu_side_threads,
            "all_threads": self.all_threads, "copy_buffers": len(self.buffers), "expert_bytes": self.expert_bytes,
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
            threads = self.cpu_threads
            # torch.set_num_threads is per OS thread (OpenMP ICV, MKL thread-local), so only the worker changes.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fiddler-cpu",
                                            initializer=lambda: torch.set_num_threads(threads))
        return self._pool

    # ------------------------------------------------------------------ expert paths

    def _cpu_expert(self, layer: int, e: int, x: torch.Tensor, out: torch.Tensor, threads: int) -> torch.Tensor:
        """One expert on the CPU, x in host memory. The torch fallback uses the calling thread's torch
        thread count (the worker's is cpu_threads)."""
        p = self.packed[layer][e]
        if p is not None:
            return p.forward(x, out=out, threads=threads)
        return out.copy_(torch_expert(self.host[layer][e], x))

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
        """Copy expert (layer, e) into buffer `slot` (kind b). On CUDA: asynchronous on the copy stream,
        after the compute that last read this buffer; the compute stream waits for the copy."""
        buf, h = self.buffers[slot], self.host[layer][e]
        if self.cuda:
            self.copy_stream.wait_event(self._buf_free[slot])
            with torch.cuda.stream(self.copy_stream):
                for dst, src in zip((buf.w1, buf.w3, buf.w2), (h.w1, h.w3, h.w2)):
                    dst.copy_(src, non_blocking=True)
                self._buf_ready[slot].record(self.copy_stream)
            torch.cuda.current_stream(self.device).wait_event(self._buf_ready[slot])
        else:
            for dst, src in zip((buf.w1, buf.w3, buf.w2), (h.w1, h.w3, h.w2)):
                dst.copy_(src)
        self.stats.weight_copies += 1
        self.stats.bytes_h2d_weights += self.expert_bytes
        return buf

    # ------------------------------------------------------------------ forward

    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x[t]) for every token t; x [T, H], topk_* [T, K]."""
        t_start = time.perf_counter()
        T, K = topk_idx.shape
        E = self.config.num_experts
        begin_forward(self, layer, x, topk_idx)
        if (T == 1 and self.kernel is not None and x.device.type == "cpu" and x.is_contiguous()
                and topk_w.dtype == torch.bfloat16):
            out = self._decode_row_on_cpu(layer, x, topk_idx, topk_w, t_start)
            if out is not None:
                return out
        flat = topk_idx.reshape(-1)
        counts = expert_counts(flat, E, layer)  # plans need counts
        plan: LayerPlan = self._planner(counts, self.placement.resident[layer], self.latency_model)

        # Group (token, slot) pairs by expert, tokens in order within an expert (a stable sort, as
        # transformers' grouped path orders them).
        order = torch.argsort(flat, stable=True)
        offs = [0]
        for n in counts:
            offs.append(offs[-1] + n)
        slots = torch.empty(T, K, x.shape[1], dtype=x.dtype, device=x.device)

        # CPU queue first, so it overlaps everything below.
        cpu_experts = plan.experts(CPU)
        future = cpu_result = None
        if cpu_experts:
            sel = torch.cat([order[offs[e]:offs[e + 1]] for e in cpu_experts])
            t_c, s_c = sel // K, sel % K
            x_c = x.index_select(0, t_c)
            ready = None
            if x_c.device.type != "cpu":
                host = torch.empty(x_c.shape, dtype=x_c.dtype, pin_memory=True)
                host.copy_(x_c, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                self.stats.bytes_d2h_activations += x_c.numel() * x_c.element_size()
                x_c = host
            sizes = [counts[e] for e in cpu_experts]
            if self.overlap and len(cpu_experts) < sum(d is not None for d in plan.decisions):
                future = self._worker().submit(self._run_cpu_queue, layer, cpu_experts, sizes, x_c, ready,
                                               self.cpu_threads)
            else:  # nothing to overlap with (or serial mode): run here with every core
                cpu_result = self._run_cpu_queue(layer, cpu_experts, sizes, x_c, ready, self.all_threads)

        # GPU queue: resident experts, then copied-in ones through the double buffer.
        prev_threads = None
        if future is not None and self.gpu_side_threads is not None:
            prev_threads = torch.get_num_threads()
            torch.set_num_threads(self.gpu_side_threads)
        try:
            queue = [(e, None) for e in plan.experts(GPU)] + [(e, i % COPY_BUFFERS)
                                                              for i, e in enumerate(plan.experts(COPY))]
            for e, buf_slot in queue:
                w = self.resident[layer][e] if buf_slot is None else self._copy_in(layer, e, buf_slot)
                sel = order[offs[e]:offs[e + 1]]
                t_e, s_e = sel // K, sel % K
                y = torch_expert(w, x.index_select(0, t_e))
                slots[t_e, s_e] = y * topk_w[t_e, s_e].unsqueeze(-1)
                if self.cuda and buf_slot is not None:
                    self._buf_free[buf_slot].record(torch.cuda.current_stream(self.device))
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
            slots[t_c, s_c] = y_c * topk_w[t_c, s_c].unsqueeze(-1)
        out = slots.sum(dim=1)
        self._account(layer, plan, T * K, time.perf_counter() - t_start, cpu_s)
        return out

    def _decode_row_on_cpu(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                           t_start: float) -> torch.Tensor | None:
        """One token whose plan puts every routed expert on the CPU (always so without a GPU): all of
        them in one kernel call (fiddler.kernels.moe_ffn: two pooled regions per layer, no Python
        between experts), with the same roundings as the general path below. None: not this case."""
        ids = topk_idx[0].tolist()
        E = self.config.num_experts
        counts = [0] * E
        for e in ids:
            if not 0 <= e < E:
                raise ValueError(f"expert ids must be in [0, {E}), got {e} (layer {layer})")
            counts[e] += 1
        if max(counts) > 1:
            return None  # a repeated id (not from top-k): the general path sums its slots
        plan: LayerPlan = self._planner(counts, self.placement.resident[layer], self.latency_model)
        packed = self.packed[layer]
        if any(d is not None and (d != CPU or packed[e] is None) for e, d in enumerate(plan.decisions)):
            return None
        out = self.kernel.moe_ffn([packed[e] for e in ids], topk_w[0].contiguous(), x, threads=self.all_threads)
        wall = time.perf_counter() - t_start
        self._account(layer, plan, len(ids), wall, wall)
        return out

    def _account(self, layer: int, plan: LayerPlan, routed: int, wall: float, cpu_s: float) -> None:
        st, ls = self.stats, self.stats.layers[layer]
        st.calls += 1
        ls.calls += 1
        st.routed_tokens += routed
        for n, kind in zip(plan.counts, plan.decisions):
            if kind is not None:
                st.tokens[kind] += n
                st.experts[kind] += 1
                ls.tokens[kind] += n
                ls.experts[kind] += 1
        span = plan.makespan
        st.predicted_s += span
        ls.predicted_s += span
        st.wall_s += wall
        ls.wall_s += wall
        st.cpu_queue_s += cpu_s
        ls.cpu_queue_s += cpu_s
        ls.last_decisions = plan.decisions

    # ------------------------------------------------------------------ calibration

    def calibrate(self, max_tokens: int = 128, repeats: int = 3) -> LatencyModel:
        """Time this executor's own paths on one expert: the CPU queue (activation copies, worker thread
        and thread count included), the GPU-side expert and a weight copy into a copy buffer. Cached per
        (shape, dtype, device, threads) for the process."""
        H, F_ = self.config.hidden_size, self.config.intermediate_size
        counts = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s <= max(1, max_tokens)]
        # Probe expert: a non-resident one if any (it is pre-packed), else layer 0 expert 0.
        pl, pe = next(((l, e) for l in range(self.config.num_layers) for e in range(self.config.num_experts)
                       if not self.placement.resident[l][e]), (0, 0))
        host_tmp = self.host[pl][pe] is None  # a resident expert whose host copy was dropped (CUDA)
        if host_tmp:
            r = self.resident[pl][pe]
            self.host[pl][pe] = ExpertWeights(*(w.to("cpu", copy=True).pin_memory() if self.cuda else w
                                                for w in (r.w1, r.w3, r.w2)))
        packed_tmp = self.packed[pl][pe] is None and self.kernel is not None
        if packed_tmp:
            h = self.host[pl][pe]
            self.packed[pl][pe] = self.kernel.PackedExpert(h.w1, h.w3, h.w2)
        buffers_tmp = not self.buffers
        if buffers_tmp:  # everything resident: borrow buffers just to time a copy
            self.buffers = [_empty_expert(self.config, self.dtype, self.device) for _ in range(COPY_BUFFERS)]
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
            if self.overlap:
                y, _ = self._worker().submit(self._run_cpu_queue, pl, [pe], [s], x, ready, self.cpu_threads).result()
            else:
                y, _ = self._run_cpu_queue(pl, [pe], [s], x, ready, self.all_threads)
            y.to(self.device)
            sync()

        def gpu_fn(s):
            prev = torch.get_num_threads()
            if self.gpu_side_threads is not None:
                torch.set_num_threads(self.gpu_side_threads)
            try:
                torch_expert(self.buffers[0], xs[s])
            finally:
                torch.set_num_threads(prev)
            sync()

        def copy_fn():
            self._copy_in(pl, pe, 1 % COPY_BUFFERS)
            sync()

        key = (H, F_, str(self.dtype), str(self.device), self.cpu_threads, self.all_threads,
               self.gpu_side_threads, self.overlap, self.kernel is not None, tuple(counts))
        try:
            self._copy_in(pl, pe, 0)
            sync()
            lm = calibrate(cpu_fn, gpu_fn, copy_fn, token_counts=counts, repeats=repeats, cache_key=key,
                           meta={"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                                 "cpu_threads": self.cpu_threads, "gpu_side_threads": self.gpu_side_threads,
                                 "overlap": self.overlap, "expert_bytes": self.expert_bytes,
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


def build_executor(config, experts: list[list[ExpertWeights]], *, device: torch.device, gpu_budget_bytes: int | None,
                   max_seq_len: int, max_batch: int, placement: str | Placement = "popularity", popularity=None,
                   planner: str = "makespan", latency_model=None, cpu_threads: int | None = None, seed: int = 0,
                   dtype: torch.dtype | None = None, overlap: bool | None = None,
                   take_ownership: bool = False) -> MoEExecutor:
    """The engine's expert executor.

    gpu_budget_bytes: None = no GPU, every expert runs on the CPU (kind c). On a CPU device a budget makes
      the CPU stand in for the GPU (emulation: same placement, plans, copies and combination).
    placement: "popularity" | "random" (seeded) | "all" | "none" | "fraction:<0..1>" | a Placement.
    popularity: a Popularity, a JSON path or None (uniform).
    latency_model: a LatencyModel, its dict, or None (calibrated now by timing this executor's own paths).
    dtype: the model dtype (default: the experts' dtype).
    overlap: run the CPU queue on a worker thread concurrently with the GPU side. Default: on CUDA; on
      a CPU device for bf16/fp16 (cores split between the queues), while fp32 runs the queues serially
      with all cores, bit-identical to a plain computation (MKL's fp32 rounding depends on thread count).
    take_ownership: clear the entries of `experts` as they are taken over, so host memory is freed expert
      by expert instead of doubling at peak (the engine passes True; the list is unusable afterwards).
    """
    device = torch.device(device)
    dtype = dtype or experts[0][0].w1.dtype
    if isinstance(placement, Placement):
        pl = placement
    else:
        strategy, kw = parse_placement(placement)
        pl = place(config, dtype, gpu_budget_bytes, max_seq_len=max_seq_len, max_batch=max_batch,
                   strategy=strategy, popularity=Popularity.for_config(config, popularity), seed=seed, **kw)
    return MoEExecutor(config, experts, device=device, dtype=dtype, placement=pl, planner=planner,
                       latency_model=latency_model, has_gpu=gpu_budget_bytes is not None, cpu_threads=cpu_threads,
                       overlap=overlap, calibration_tokens=min(128, max_seq_len * max_batch),
                       take_ownership=take_ownership)
