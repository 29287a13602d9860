"""The simulator: one generate() on the virtual clock, with a policy deciding where every layer's work runs.

`simulate(policy, ctx, routing, input_len, output_len, beam_width)` walks the same steps as
fiddler/generate.py: a prefill forward over the prompt (its end plus the lm_head is the first token),
then output_len - 1 decode forwards of beam_width rows, the KV cache growing by one position per step.
Each forward is embeddings, then per layer the policy's `layer` (attention with the KV cache, norms,
router, the MoE block) or, for a dense layer (DeepSeek's first_k_dense_replace), its `dense_layer`
(attention and the dense MLP), then the final norm and lm_head of the last position of every row.
Routing is per MoE layer over the expert slots (routed experts, then the shared-expert chunks every
token runs); a policy sees it indexed by decoder layer (`RoutingStep` view) and maps a decoder layer to
its MoE layer with `SimContext.moe_index`.

Sizes come from `fiddler.config.MoEConfig`'s own methods (expert_bytes, layer_non_expert_params,
kv_cache_bytes), so model families and quantized experts added there flow in.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import MoEConfig
from ..popularity import Popularity
from .clock import Clock, Lane
from .hardware import SimHardware
from .routing import Routing


@dataclass(frozen=True)
class Step:
    index: int  # 0 = prefill
    tokens: int  # rows x new positions in this forward
    rows: int  # sequences (1, or the beam width)
    kv_len: int  # cached positions each row attends to after this step
    prefill: bool


class ModelCosts:
    """Bytes and FLOPs of the non-expert work and of one expert, per step."""

    def __init__(self, config: MoEConfig, dtype: torch.dtype, quant: str | None = None):
        self.config, self.dtype, self.quant = config, dtype, quant
        s = dtype.itemsize
        self.itemsize = s
        self.layer_params = config.layer_non_expert_params()  # a MoE layer's attention, norms, router
        # quant (fiddler.quant): the attention projections and experts as llama.cpp blocks
        self.layer_bytes = (self.layer_params * s - config.attention_params() * s
                            + config.attention_bytes(dtype, quant))
        self.expert_bytes = int(config.expert_bytes(dtype, quant))
        self.expert_flops_per_token = 2 * config.expert_params()
        self.dense_mlp_params = 3 * config.hidden_size * config.dense_intermediate_size  # a dense layer's MLP
        self.kv_bytes_per_position = config.kv_cache_bytes(1, 1, dtype) / config.num_layers  # one layer, one row
        # final norm + lm_head: the embedding parameters beyond the input embedding
        emb = config.vocab_size * config.hidden_size * s
        self.head_bytes = config.embedding_params() * s - emb
        if config.tie_word_embeddings:  # the lm_head matmul reads the embedding matrix
            self.head_bytes += emb
        self.head_params = self.head_bytes // s
        self.activation_row_bytes = config.hidden_size * s

    def attention(self, step: Step) -> tuple[float, float]:
        """(bytes, FLOPs) of one layer's attention block, norms and router for `step`."""
        c = self.config
        flops = 2 * step.tokens * self.layer_params
        if step.prefill:  # causal: token i attends to i + 1 positions
            attended = step.kv_len * (step.kv_len + 1) / 2 * step.rows
            kv_read = 0.0  # computed from the fresh k/v, which stay in cache-sized tiles
        else:
            attended = step.kv_len * step.tokens
            kv_read = self.kv_bytes_per_position * step.kv_len * step.rows
        flops += 2 * attended * c.num_heads * (c.qk_head_dim + c.attn_v_dim)
        if c.attention == "mla":  # keys and values expanded from the cached latents (kv_b_proj) every step
            expanded = step.kv_len * step.rows
            flops += 2 * expanded * c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
        kv_write = self.kv_bytes_per_position * step.tokens
        return self.layer_bytes + kv_read + kv_write, flops

    def dense_mlp(self, step: Step) -> tuple[float, float]:
        """(bytes, FLOPs) of a dense layer's MLP for `step`."""
        return self.dense_mlp_params * self.itemsize, 2 * step.tokens * self.dense_mlp_params

    def head(self, step: Step) -> tuple[float, float]:
        return self.head_bytes, 2 * step.rows * self.head_params


@dataclass
class SimContext:
    """What a policy knows about the run (the simulator's counterpart of executors.BuildContext)."""

    config: MoEConfig
    dtype: torch.dtype
    hw: SimHardware
    gpu_budget_bytes: int | None  # None: no GPU side
    max_seq_len: int
    max_batch: int
    seed: int = 0
    popularity: Popularity | None = None  # for placement; None = uniform
    quant: str | None = None  # expert/attention weights as llama.cpp blocks (fiddler.quant); None = dtype
    costs: ModelCosts = field(init=False)

    def __post_init__(self):
        self.costs = ModelCosts(self.config, self.dtype, self.quant)
        self._moe_index = {layer: j for j, layer in enumerate(self.config.moe_layers)}

    def moe_index(self, layer: int) -> int:
        """The MoE layer (placement, routing, expert-slot grid) of decoder layer `layer`."""
        return self._moe_index[layer]

    @property
    def has_gpu(self) -> bool:
        return self.gpu_budget_bytes is not None and self.hw.has_gpu


class SimPolicy(abc.ABC):
    """Where a system runs each layer's work. Subclasses implement `setup` and `layer`; the default
    `embed`/`head` run on the GPU when there is one, else on the CPU."""

    name: str = "policy"
    # the weight type whose bytes the run's costs count (SimContext.quant); None = the model dtype
    weight_quant: str | None = None

    @abc.abstractmethod
    def setup(self, ctx: SimContext) -> None:
        """Decide what the system decides at load time (placement, cache sizes); may raise ValueError
        for a configuration the system cannot run (e.g. the budget is below its reservation)."""

    def reset(self) -> None:
        """Counters (and per-generate state) afresh; called at the start of every simulated generate."""

    @abc.abstractmethod
    def layer(self, clock: Clock, ctx: SimContext, step: Step, layer: int, routing, ready: float) -> float:
        """Schedule layer `layer` of `step` on the clock, starting when its input is `ready`; returns when
        its output is ready. `routing` is the step's RoutingStep."""

    def main_lane(self, clock: Clock, ctx: SimContext, layer: int | None = None) -> Lane:
        return clock.gpu if ctx.has_gpu else clock.cpu

    def dense_layer(self, clock: Clock, ctx: SimContext, step: Step, layer: int, ready: float) -> float:
        """A dense layer (no experts): attention, norms and the dense MLP on the layer's main lane."""
        nbytes, flops = ctx.costs.attention(step)
        mb, mf = ctx.costs.dense_mlp(step)
        return self.run_dense(clock, ctx, self.main_lane(clock, ctx, layer), nbytes + mb, flops + mf, ready,
                              launches=2)

    def run_dense(self, clock: Clock, ctx: SimContext, lane: Lane, nbytes: float, flops: float, ready: float,
                  launches: int = 1) -> float:
        if lane is clock.gpu:
            return lane.run(ready, ctx.hw.gpu(nbytes, flops, launches))
        return lane.run(ready, ctx.hw.cpu(nbytes, flops))

    def embed(self, clock: Clock, ctx: SimContext, step: Step, ready: float) -> float:
        lane = self.main_lane(clock, ctx, 0)
        return self.run_dense(clock, ctx, lane, step.tokens * ctx.costs.activation_row_bytes, 0.0, ready)

    def head(self, clock: Clock, ctx: SimContext, step: Step, ready: float) -> float:
        lane = self.main_lane(clock, ctx, ctx.config.num_layers - 1)
        return self.run_dense(clock, ctx, lane, *ctx.costs.head(step), ready, launches=2)

    def prefill_rows(self, beam_width: int) -> int:
        """Rows the prompt is prefilled as: 1 (the engine's beam search prefills once), or the beam width for
        a system that replicates the prompt per beam."""
        return 1

    def forwards(self, step: Step, routing) -> list[tuple[Step, Any]]:
        """The model forwards that make up `step` with their routing: one by default; a system whose beam
        search decodes beams one call at a time returns several."""
        return [(step, routing)]

    def stats(self) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {"policy": self.name}


@dataclass
class SimResult:
    ttft_s: float
    decode_s: float
    tokens: int
    stats: dict[str, Any]
    lanes_busy_s: dict[str, float]
    decode_latencies_s: list[float]


def simulate(policy: SimPolicy, ctx: SimContext, routing: Routing, input_len: int, output_len: int,
             beam_width: int = 1) -> SimResult:
    """One generate on the virtual clock (policy.setup must have run)."""
    if input_len < 1 or output_len < 1 or beam_width < 1:
        raise ValueError(f"input_len, output_len and beam_width must be >= 1, got {input_len}, {output_len}, "
                         f"{beam_width}")
    c = ctx.config
    if (routing.num_layers, routing.num_experts, routing.top_k) != (c.num_moe_layers, c.expert_slots, c.active_slots):
        raise ValueError(f"routing is {routing.num_layers} layers x {routing.num_experts} experts top-{routing.top_k}"
                         f", the model {c.num_moe_layers} x {c.expert_slots} top-{c.active_slots}")
    policy.reset()
    clock = Clock()
    t = 0.0
    ttft = None
    marks = []
    for i, r in enumerate(routing.steps(input_len, output_len, beam_width)):
        rows = policy.prefill_rows(beam_width) if r.prefill else beam_width
        if r.prefill and rows > 1:  # the prompt replicated per beam: each copy routes like the prompt
            import dataclasses

            r = dataclasses.replace(r, ids=np.concatenate([r.ids] * rows, axis=1),
                                    guess=np.concatenate([r.guess] * rows, axis=1))
        step = Step(i, r.tokens, rows, input_len + (0 if r.prefill else i), r.prefill)
        for fstep, fr in policy.forwards(step, r):
            t = policy.embed(clock, ctx, fstep, t)
            view = _by_decoder_layer(fr, c) if c.dense_layers else fr
            for layer in range(c.num_layers):
                if c.is_dense_layer(layer):
                    t = policy.dense_layer(clock, ctx, fstep, layer, t)
                else:
                    t = policy.layer(clock, ctx, fstep, layer, view, t)
            t = policy.head(clock, ctx, fstep, t)
        t = max(t, *(lane.free_at for lane in clock.lanes()))  # the step's token is chosen when all work ended
        if r.prefill:
            ttft = t
        marks.append(t)
    lat = list(np.diff(marks)) if len(marks) > 1 else []
    return SimResult(ttft_s=float(ttft), decode_s=float(t - ttft), tokens=output_len, stats=policy.stats(),
                     lanes_busy_s=clock.busy(), decode_latencies_s=[float(x) for x in lat])


class _LayerIndexed:
    """ids/guess of a RoutingStep indexed by decoder layer (None for a dense layer)."""

    def __init__(self, arr: np.ndarray, moe_layers: list[int], num_layers: int):
        self._rows: list = [None] * num_layers
        for j, layer in enumerate(moe_layers):
            self._rows[layer] = arr[j]
        self.shape = arr.shape

    def __getitem__(self, layer):
        if isinstance(layer, tuple):
            return self._rows[layer[0]][layer[1:]]
        return self._rows[layer]


def _by_decoder_layer(r, config: MoEConfig):
    """The routing step as policies index it: by decoder layer."""
    import dataclasses

    return dataclasses.replace(r, ids=_LayerIndexed(r.ids, config.moe_layers, config.num_layers),
                               guess=_LayerIndexed(r.guess, config.moe_layers, config.num_layers))
