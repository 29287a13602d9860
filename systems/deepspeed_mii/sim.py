"""DeepSpeed's policies on the simulator's clock (mode=simulate).

ZeRO-Inference (engine=zero_offload, the paper's "DeepSpeed-MII" baseline): ZeRO stage 3 with every
parameter offloaded to host memory. Each forward gathers every layer's parameters to the GPU before the
layer runs (attention, router, norms and all of the layer's experts: the module's parameters, routed or
not), then releases them; the embedding and lm_head likewise. ZeRO-3's prefetch overlaps the copy of
the next layer with the current layer's compute: on the clock the copy engine streams layer after layer
(one layer ahead) while the GPU computes the layer whose parameters have landed, no faster than
transformers' per-layer host floor. Nothing stays resident,
so every routed expert counts as copied (kind b).

FastGen (engine=mii): the whole model in GPU memory; a budget that cannot hold it is `skipped`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fiddler.executors import COPY, GPU, kind_counter
from fiddler.placement import reservation
from fiddler.sim import SimContext, SimPolicy, Step

#: GPU kernels per layer of transformers' Mixtral under ZeRO-3 hooks (attention block + per-expert FFNs)
LAUNCHES_PER_LAYER = 30


class ZeroInferenceSimPolicy(SimPolicy):
    name = "deepspeed_zero_inference"

    def __init__(self, resident: bool = False):
        self.resident = resident  # FastGen: everything on the GPU, nothing streamed
        if resident:
            self.name = "deepspeed_fastgen"

    def setup(self, ctx: SimContext) -> None:
        if not ctx.has_gpu:
            raise ValueError("DeepSpeed's GPU inference needs a GPU: the environment has none")
        c = ctx.config
        self.layer_stream = ctx.costs.layer_bytes + c.num_experts * ctx.costs.expert_bytes
        if self.resident:
            need = sum(reservation(c, ctx.dtype, ctx.max_seq_len, ctx.max_batch).values()) \
                + c.num_layers * c.num_experts * ctx.costs.expert_bytes
            if need > ctx.gpu_budget_bytes:
                from systems.base import SystemUnavailable

                raise SystemUnavailable(f"DeepSpeed-MII FastGen keeps the whole model in GPU memory: "
                                        f"{need / 2**30:.1f} GiB needed, the GPU budget is "
                                        f"{ctx.gpu_budget_bytes / 2**30:.1f} GiB")
        self.reset()

    def reset(self) -> None:
        self.st = {"routed_tokens": 0, "token_hits": 0, "bytes_h2d_weights": 0, "layer_gathers": 0,
                   "tokens": kind_counter(), "experts": kind_counter()}
        self._ends = [0.0, 0.0]  # compute ends of the last modules: a module's buffer frees two modules on

    def _gather(self, clock, ctx, nbytes: float, ready: float) -> float:
        """Parameters of the next module copied in, one module ahead of the compute (prefetch)."""
        if self.resident:
            return ready
        self.st["bytes_h2d_weights"] += int(nbytes)
        self.st["layer_gathers"] += 1
        # one module ahead: the copy of module i starts once module i-2 has run (its parameters released)
        return clock.h2d.run(self._ends[-2], ctx.hw.h2d(nbytes))

    def _ran(self, t: float) -> float:
        self._ends = [self._ends[-1], t]
        return t

    def embed(self, clock, ctx: SimContext, step: Step, ready: float) -> float:
        emb = ctx.config.vocab_size * ctx.config.hidden_size * ctx.dtype.itemsize
        landed = self._gather(clock, ctx, emb, ready)
        return self._ran(clock.gpu.run(max(ready, landed), ctx.hw.gpu(step.tokens * ctx.costs.activation_row_bytes, 0.0)))

    def layer(self, clock, ctx: SimContext, step: Step, layer: int, routing, ready: float) -> float:
        hw, costs = ctx.hw, ctx.costs
        landed = self._gather(clock, ctx, self.layer_stream, ready)
        nbytes, flops = costs.attention(step)
        ids = routing.ids[layer]
        counts = np.bincount(ids.ravel(), minlength=ctx.config.num_experts)
        active = np.nonzero(counts)[0]
        nbytes += len(active) * costs.expert_bytes
        flops += costs.expert_flops_per_token * int(ids.size)
        t = self._ran(clock.gpu.run(max(ready, landed), max(hw.gpu(nbytes, flops, LAUNCHES_PER_LAYER),
                                                            hw.eff.gpu.hf_layer_overhead_s)))
        kind = GPU if self.resident else COPY
        self.st["routed_tokens"] += int(ids.size)
        self.st["tokens"][kind] += int(ids.size)
        self.st["experts"][kind] += len(active)
        if self.resident:
            self.st["token_hits"] += int(ids.size)
        return t

    def head(self, clock, ctx: SimContext, step: Step, ready: float) -> float:
        nbytes, flops = ctx.costs.head(step)
        landed = self._gather(clock, ctx, nbytes, ready)
        return self._ran(clock.gpu.run(max(ready, landed), ctx.hw.gpu(nbytes, flops, 2)))

    def stats(self) -> dict[str, Any]:
        st = dict(self.st)
        st["bytes_h2d"] = st["bytes_h2d_weights"]
        st["gpu_hit_rate"] = st["token_hits"] / st["routed_tokens"] if st["routed_tokens"] else None
        return st

    def info(self) -> dict[str, Any]:
        return {"policy": self.name, "streamed_bytes_per_layer": None if self.resident else self.layer_stream,
                "prefetch": "one module ahead on the copy engine"}
