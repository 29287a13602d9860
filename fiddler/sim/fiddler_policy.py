"""Fiddler's orchestration on the virtual clock, deciding with the engine's own code.

Decisions: `fiddler.placement.place` (popularity or random under the GPU budget, the same reservation),
`fiddler.planner.get_planner` (paper or makespan) with the latency model the engine builds from a
hardware spec (`LatencyModel.from_hardware_spec`). Execution mirrors fiddler/executors/orchestrator.py:

- attention, norms and router of every layer on the GPU (no GPU: on the CPU); where the dense parts do
  not fit the budget (`Placement.gpu_layers`, fiddler.placement.dense_placement), the first layers' on
  the CPU, with the residual stream crossing PCIe as the model moves it (to the CPU for the layer, back
  to the GPU side for the executor, and the MoE output back to the CPU); dense layers' MLPs with their
  layer's attention;
- the CPU queue (kind c): the routed rows copied device -> host, the experts one after another on all
  CPU threads, the results copied back; concurrently (overlap=True) with
- the GPU queue: resident experts (a), then copied-in experts (b) through the executor's two copy
  buffers: the copy of the next expert runs on the copy engine while the current one computes, and a
  buffer is refilled only after the expert in it has run; where the call's tokens make copying cheaper
  than the CPU (a long prompt), the next layer's first copies go out as the buffers' last uses end and
  the next layer runs them from there (look-ahead: fiddler.streaming, the executor's own buffer plan);
- without overlap the CPU queue runs first, then the GPU queue.

Stats carry the executor's own field names (fiddler.executors.FiddlerStats).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..executors.orchestrator import FiddlerStats, LayerStats
from ..latency import LatencyModel
from ..placement import COPY_BUFFERS, Placement, place, place_spec, row_chunks
from ..planner import COPY, CPU, GPU, get_planner
from ..popularity import Popularity
from ..residency import Chunk, ExpertCache, Install, Promote, make_policy
from ..streaming import lookahead, pipeline, staged_plan
from .clock import Clock
from .simulator import SimContext, SimPolicy, Step

# fiddler's executor issues about this many GPU kernels for a layer's attention block (norms, q/k/v/o,
# rope, SDPA, router, top-k): the launch floor of the block
ATTENTION_LAUNCHES = 12


class FiddlerSimPolicy(SimPolicy):
    name = "fiddler"

    def __init__(self, planner: str = "makespan", placement: str | Placement = "popularity",
                 overlap: bool = True, quant: str | None = None, residency: str = "static",
                 lookahead: bool = True):
        self.weight_quant = quant  # the engine's quant=: experts and attention projections as llama.cpp blocks
        self.residency = residency  # fiddler.residency: static, or a resident set that adapts while it runs
        self.latency_model_override: dict | None = None  # decide with this LatencyModel dict, not the spec's
        self.planner_name = planner
        self.placement_spec = placement
        self.overlap = bool(overlap)
        self.lookahead = bool(lookahead)  # the executor's look-ahead streaming (fiddler.streaming)

    def setup(self, ctx: SimContext) -> None:
        cfg = ctx.config
        if ctx.has_gpu:
            self.placement = place_spec(self.placement_spec, cfg, ctx.dtype, ctx.gpu_budget_bytes,
                                        popularity=ctx.popularity, max_seq_len=ctx.max_seq_len,
                                        max_batch=ctx.max_batch, seed=ctx.seed, quant=ctx.quant)
        else:
            self.placement = place(cfg, ctx.dtype, None, max_seq_len=ctx.max_seq_len, max_batch=ctx.max_batch,
                                   quant=ctx.quant)
        self.lm = ctx.hw.latency_model(cfg, ctx.dtype, ctx.quant)
        if self.latency_model_override is not None:  # a recorded engine's own (sim.latency_model=trace)
            self.lm = LatencyModel.from_dict(self.latency_model_override)
        self.active_planner = self.planner_name if ctx.has_gpu else "cpu"
        self.planner = get_planner(self.active_planner)
        self._plans: dict[tuple, Any] = {}
        self._ctx = ctx
        self.reset()

    def reset(self) -> None:
        """A fresh run: counters, and the resident set back to the placement's (the engine builds its executor,
        and with it the cache, once per run too)."""
        layers = len(self.placement.resident) if hasattr(self, "placement") else 0
        self.st = FiddlerStats(layers=[LayerStats() for _ in range(layers)])
        self._x_on_gpu = False
        self._staged: tuple[int | None, dict[int, tuple[int, float]]] = (None, {})  # layer, {expert: (buffer, in at)}
        if hasattr(self, "placement"):
            ctx = self._ctx
            shares = Popularity.for_config(ctx.config, ctx.popularity).shares()  # as the executor seeds it
            policy = make_policy(self.residency if ctx.has_gpu else "static", self.placement.resident, shares)
            self.cache = ExpertCache(self.placement.resident, policy, ctx.costs.expert_bytes)

    def _dense_on_gpu(self, ctx: SimContext, layer: int) -> bool:
        g = getattr(self, "placement", None) and self.placement.gpu_layers
        return ctx.has_gpu and (not g or g[layer])

    def main_lane(self, clock: Clock, ctx: SimContext, layer: int | None = None):
        if not ctx.has_gpu:
            return clock.cpu
        return clock.gpu if layer is None or self._dense_on_gpu(ctx, layer) else clock.cpu

    def embed(self, clock: Clock, ctx: SimContext, step: Step, ready: float) -> float:
        self._x_on_gpu = ctx.has_gpu  # the embeddings live on the GPU side
        return self.run_dense(clock, ctx, self.main_lane(clock, ctx), step.tokens * ctx.costs.activation_row_bytes,
                              0.0, ready)

    def head(self, clock: Clock, ctx: SimContext, step: Step, ready: float) -> float:
        t = self._move(clock, ctx, step.rows, True, ready) if ctx.has_gpu else ready
        return self.run_dense(clock, ctx, self.main_lane(clock, ctx), *ctx.costs.head(step), t, launches=2)

    def _move(self, clock: Clock, ctx: SimContext, rows: int, to_gpu: bool, ready: float) -> float:
        """The residual stream to the GPU side or to the CPU, if it is not there yet."""
        if self._x_on_gpu == to_gpu:
            return ready
        self._x_on_gpu = to_gpu
        nbytes = rows * ctx.costs.activation_row_bytes
        if to_gpu:
            self.st.bytes_h2d_activations += nbytes
            return clock.h2d.run(ready, ctx.hw.h2d(nbytes))
        self.st.bytes_d2h_activations += nbytes
        return clock.d2h.run(ready, ctx.hw.d2h(nbytes))

    def _attention(self, clock: Clock, ctx: SimContext, step: Step, layer: int, ready: float,
                   mlp: bool = False) -> float:
        """A layer's attention block (+ a dense layer's MLP) where its dense part lives; returns when its
        output is on the GPU side (where the executor takes it) -- or on the CPU without a GPU."""
        nbytes, flops = ctx.costs.attention(step)
        if mlp:
            mb, mf = ctx.costs.dense_mlp(step)
            nbytes, flops = nbytes + mb, flops + mf
        if not ctx.has_gpu:
            return clock.cpu.run(ready, ctx.hw.cpu(nbytes, flops))
        if self._dense_on_gpu(ctx, layer):
            t = self._move(clock, ctx, step.tokens, True, ready)
            # no faster than the engine's per-layer host floor
            return clock.gpu.run(t, max(ctx.hw.gpu(nbytes, flops, ATTENTION_LAUNCHES),
                                        ctx.hw.eff.gpu.engine_layer_overhead_s))
        t = self._move(clock, ctx, step.tokens, False, ready)
        t = clock.cpu.run(t, ctx.hw.cpu(nbytes, flops))
        return t if mlp else self._move(clock, ctx, step.tokens, True, t)  # the executor's input

    def dense_layer(self, clock: Clock, ctx: SimContext, step: Step, layer: int, ready: float) -> float:
        return self._attention(clock, ctx, step, layer, ready, mlp=True)

    def _plan(self, layer: int, counts: tuple, staged=()):
        resident = self.cache.resident[layer]
        key = (layer, counts, tuple(resident), tuple(sorted(staged)))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = staged_plan(self.planner, list(counts), resident, self.lm, staged)
        return plan

    def _fill(self, clock: Clock, ctx: SimContext, layer: int, counts: tuple, plan, start: float,
              streams: bool = False) -> list:
        """The resident set's step for this layer call (fiddler.residency.ExpertCache), as the executor runs it:
        the fill's chunk on the copy engine as the call is planned (`start`); returns the installs, each with
        when its copy is in (the executor unpacks them on the GPU after the call's own work), and the copied-in
        experts kept in a slot once they have run (promotions)."""
        copied, installs, promoted = start, [], set()
        for a in self.cache.step(layer, counts, plan, self.lm, streams):
            if isinstance(a, Chunk):
                copied = clock.h2d.run(start, ctx.hw.h2d(a.end - a.start))
                self.st.bytes_h2d_weights += a.end - a.start
            elif isinstance(a, Install):
                installs.append(copied)
            elif isinstance(a, Promote):
                promoted.add(a.expert)
        return installs, promoted

    def layer(self, clock: Clock, ctx: SimContext, step: Step, layer: int, routing, ready: float) -> float:
        hw, costs = ctx.hw, ctx.costs
        ids = routing.ids[layer]
        decoder_layer, layer = layer, ctx.moe_index(layer)  # placement, plans and stats are per MoE layer
        counts = tuple(np.bincount(ids.ravel(), minlength=ctx.config.expert_slots).tolist())
        at, staged = self._staged  # the copies the previous layer call issued for this one, and when they are in
        self._staged = (None, {})
        if at != layer:
            self.st.copies_ahead_unused += len(staged)
            staged = {}
        plan = self._plan(layer, counts, staged)
        eb, fpt = costs.expert_bytes, costs.expert_flops_per_token
        t_attn = self._attention(clock, ctx, step, decoder_layer, ready)
        ahead = []
        if ctx.has_gpu and self.lookahead and layer + 1 < len(self.cache.resident):
            ahead = lookahead(counts, self.cache.resident[layer + 1], self.lm, self.active_planner, plan)
        installs, promoted = (self._fill(clock, ctx, layer, counts, plan, t_attn, bool(ahead)) if ctx.has_gpu
                              else ([], ()))
        if not ctx.has_gpu:
            t = t_attn
            for e in plan.experts(CPU):
                t = clock.cpu.run(t, hw.cpu(eb, fpt * counts[e]))
            self.st.add_plan(layer, plan, ids.size)
            return t
        ahead = [e for e in ahead if not self.cache.resident[layer + 1][e]]  # as the executor: after the step

        row = costs.activation_row_bytes
        cpu_experts = plan.experts(CPU)
        cpu_rows = sum(counts[e] for e in cpu_experts)

        def cpu_queue(start: float) -> float:
            x_ready = clock.d2h.run(start, hw.d2h(cpu_rows * row))
            c = x_ready
            for e in cpu_experts:
                c = clock.cpu.run(c, hw.cpu(eb, fpt * counts[e]))
            return clock.h2d.run(c, hw.h2d(cpu_rows * row))

        c_done = t_attn
        if cpu_experts and not self.overlap:  # serial: the executor runs the CPU queue before it issues copies
            c_done = cpu_queue(t_attn)
        # the executor's copy pipeline (fiddler.streaming.pipeline), its copies issued in the executor's order:
        # the first buffers' copies, the next layer's into buffers this call leaves unused, then per copied-in
        # expert its run, the copy into its buffer two later, the next layer's copy into its buffer if it was
        # the buffer's last use here
        p = pipeline(plan.experts(COPY), {e: slot for e, (slot, _) in staged.items()}, ahead)
        self.st.copies_ahead_unused += len(staged) - len(p.staged)
        copies = 0
        in_at: list[float] = []  # when each copied-in expert's weights are in its buffer
        for e in p.order[:COPY_BUFFERS]:
            if e in p.staged:
                in_at.append(staged[e][1])
            else:
                in_at.append(clock.h2d.run(t_attn, hw.h2d(eb)))
                copies += 1
        staged_next: dict[int, tuple[int, float]] = {}

        def stage(i: int, free: float) -> None:
            for e, slot in p.ahead_after(i):
                staged_next[e] = (slot, clock.h2d.run(free, hw.h2d(eb)))

        stage(-1, t_attn)
        g = c_done if not self.overlap else t_attn
        for e in plan.experts(GPU):
            g = clock.gpu.run(g, _expert_on_gpu(hw, eb, fpt, counts[e]))
        for i, e in enumerate(p.order):
            g = clock.gpu.run(max(g, in_at[i]), _expert_on_gpu(hw, eb, fpt, counts[e]))
            if e in promoted:  # its weights from the buffer into an evicted slot
                g = clock.gpu.run(g, hw.gpu(2 * eb, 0.0))
            if i + COPY_BUFFERS < len(p.order):  # its buffer is free again: the copy two later goes in
                in_at.append(clock.h2d.run(g, hw.h2d(eb)))
                copies += 1
            stage(i, g)
        if staged_next:
            self._staged = (layer + 1, staged_next)
        if cpu_experts and self.overlap:
            c_done = cpu_queue(t_attn)
        for copied in installs:  # unpack the fill buffer into the evicted expert's slot
            g = clock.gpu.run(max(g, copied), hw.gpu(2 * eb, 0.0))
        n_copies = copies + len(staged_next)
        self.st.copies_ahead += len(staged_next)
        self.st.weight_copies += n_copies
        self.st.bytes_h2d_weights += n_copies * eb
        self.st.bytes_d2h_activations += cpu_rows * row
        self.st.bytes_h2d_activations += cpu_rows * row
        self.st.add_plan(layer, plan, ids.size)
        done = max(g, c_done)
        if not self._dense_on_gpu(ctx, decoder_layer):  # the model moves the MoE output back to the CPU layer
            done = self._move(clock, ctx, step.tokens, False, done)
        return done

    def stats(self) -> dict[str, Any]:
        d = self.st.to_dict()
        d["residency"] = self.cache.describe()
        d.pop("layers")  # per-layer detail stays out of records (as in execute mode's summary)
        d.pop("wall_s")
        d.pop("cpu_queue_s")
        return d

    def info(self) -> dict[str, Any]:
        return {"policy": self.name, "planner": self.active_planner, "overlap": self.overlap,
                "placement": {k: v for k, v in self.placement.to_dict().items() if k != "resident"},
                "latency_model": _finite({k: v for k, v in self.lm.to_dict().items() if k not in ("meta", "samples")})}


def _expert_on_gpu(hw, expert_bytes: float, flops_per_token: float, rows: int) -> float:
    """An expert's rows on the GPU side as the executor runs them: in row_chunks(rows) chunks, each reading the
    weights and launching its own ops (fiddler.placement.EXPERT_ROW_CHUNK)."""
    chunks = len(row_chunks(rows))
    return hw.gpu(expert_bytes * chunks, flops_per_token * rows, chunks)


def _finite(lm: dict[str, Any]) -> dict[str, Any]:
    """The latency model for a record: a machine without a GPU has GPU and copy costs of inf (never chosen),
    which JSON cannot hold and an `ok` record must not; null there, and the record says why."""
    never = sorted(k for k, v in lm.items() if isinstance(v, float) and math.isinf(v))
    if not never:
        return lm
    return {**{k: None if k in never else v for k, v in lm.items()}, "null": "no GPU: never chosen (inf)"}
