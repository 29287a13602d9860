"""The Mixtral-Offloading policy (Eliseev & Mazur, arXiv 2312.17238) as an executor of fiddler's engine.

Re-implemented from the paper's description (the original is a research repository, not a package):

- every expert lives in host memory (pinned on CUDA); the GPU holds, per layer, an LRU cache of
  `cache_size` experts. The cache starts with the layer's last `cache_size` experts (the original
  offloads experts 0..offload_per_layer-1 and keeps the rest on the GPU at load time), least recently
  used = lowest id; that initial fill is part of loading, not of the counted copies;
- for each layer call, the distinct routed experts are looked up: hits are marked most recently used and
  computed first (the original's `unordered=True`: resident experts first); each miss evicts the least
  recently used expert of that layer, is copied over into the freed slot and computed there. Experts
  never run on the CPU;
- speculative prefetch: after layer i, the next layer's router (its post-attention RMSNorm and gate) is
  applied to the current hidden state and its `prefetch_k` most likely experts are copied into layer
  i+1's cache ahead of time (on CUDA on a side stream, overlapping layer i+1's attention; on the CPU
  synchronously, with its own counters). Which hidden state: `prefetch_input="residual"` (default) is
  the residual stream after layer i's MoE output is added; `"moe_input"` is the (normed) input of layer
  i's experts, the paper's "same hidden states that are used by previous MoE layer's experts".

Without CUDA the "GPU side" is the CPU device, exactly as in fiddler's executor: cache slots are
separate tensors and a copy is a real memcpy, so the same copy/compute code runs and is tested.

Outputs are combined like fiddler's executor and transformers' Mixtral (per (token, slot) output
y * w in the model dtype, summed over the top-k slots), so the unquantized policy is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fiddler.executors import (COPY, GPU, BuildContext, CopyIn, ExpertExecutor, ExpertGroups, ExpertWeights, GpuSide,
                               SlotOutputs, StatsBase, add_residual, kind_counter, torch_expert)
from fiddler.model import rms_norm
from fiddler.residency import ExpertLRU

from .cache import DEFAULT_CACHE_SIZE, choose_cache_size, initial_residents
from .config import PrefetchInput

PREFETCH_INPUTS = tuple(p.value for p in PrefetchInput)


# ---------------------------------------------------------------------------- expert storage

class DenseExpertCodec:
    """Experts stored as their plain w1, w3, w2 tensors (the default: no quantization)."""

    name = "none"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def encode(self, e: ExpertWeights) -> tuple[torch.Tensor, ...]:
        return tuple(w if w.dtype == self.dtype else w.to(self.dtype) for w in (e.w1, e.w3, e.w2))

    def forward(self, tensors: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch_expert(ExpertWeights(*tensors), x)

    def nbytes(self, config) -> int:
        return int(config.expert_bytes(self.dtype))

    def info(self) -> dict[str, Any]:
        return {"experts": "unquantized", "dtype": str(self.dtype).replace("torch.", "")}


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------- stats

@dataclass
class LayerCacheStats(StatsBase):
    calls: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_copies: int = 0
    prefetch_hits: int = 0


@dataclass
class OffloadStats(StatsBase):
    """Counters since the last reset. hits/misses count (layer call, distinct routed expert) lookups
    (the original's per-group counters); token_hits counts routed (token, expert) pairs served by a cached
    expert. prefetch_hits: prefetched experts later used while still cached (once per prefetch);
    prefetch_evicted_unused: prefetched experts evicted before any use. bytes_copied = (misses +
    prefetch_copies) x expert bytes. tokens/experts by kind use fiddler's letters: a = cache hit,
    b = copied in on a miss, c = CPU (always 0: this policy never runs experts on the CPU)."""

    calls: int = 0
    routed_tokens: int = 0
    token_hits: int = 0
    experts_routed: int = 0
    experts_computed: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_calls: int = 0
    prefetch_copies: int = 0
    prefetch_hits: int = 0
    prefetch_evicted_unused: int = 0
    bytes_copied_demand: int = 0
    bytes_copied_prefetch: int = 0
    copy_s: float = 0.0  # host-measured time of synchronous copies (CPU device only; on CUDA they are async)
    prefetch_s: float = 0.0  # host time in the prefetch hook (guess + copies on the CPU device)
    wall_s: float = 0.0  # host time in forward
    tokens: dict[str, int] = field(default_factory=kind_counter)
    experts: dict[str, int] = field(default_factory=kind_counter)
    layers: list[LayerCacheStats] = field(default_factory=list)

    derived = ("bytes_copied", "bytes_h2d", "hit_rate", "gpu_hit_rate", "prefetch_accuracy")

    @property
    def bytes_copied(self) -> int:
        return self.bytes_copied_demand + self.bytes_copied_prefetch

    @property
    def bytes_h2d(self) -> int:
        return self.bytes_copied

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

    @property
    def gpu_hit_rate(self) -> float | None:
        """Share of routed (token, expert) pairs whose expert was already in GPU memory (fiddler's definition)."""
        return self.token_hits / self.routed_tokens if self.routed_tokens else None

    @property
    def prefetch_accuracy(self) -> float | None:
        return self.prefetch_hits / self.prefetch_copies if self.prefetch_copies else None


# ---------------------------------------------------------------------------- executor

class OffloadingExecutor(ExpertExecutor):
    """LRU expert cache on the GPU side + speculative prefetch (fiddler.executors.ExpertExecutor)."""

    def __init__(self, config, experts: list[list[ExpertWeights]], *, device, dtype: torch.dtype, cache_size: int,
                 cache_size_source: str, prefetch: bool = True, prefetch_k: int | None = None,
                 prefetch_input: str = "residual", codec=None, cache_size_detail: dict | None = None,
                 quantize_attention: bool = False):
        unsupported = ([f"dense layers {list(config.dense_layers)}"] if config.dense_layers else []) + \
            (["shared experts"] if config.shared_slots else []) + \
            ([f"{config.scoring_func}/{config.topk_method} routing"]
             if (config.scoring_func, config.topk_method) != ("softmax", "greedy") else [])
        if unsupported:  # its prefetch guesses the next layer's experts with a plain softmax router
            raise ValueError(f"mixtral_offloading does not support {config.model_type}'s "
                             f"{', '.join(unsupported)} (Mixtral-style MoE layers only)")
        L, E = config.num_layers, config.num_experts
        if len(experts) != L or any(len(layer) != E for layer in experts):
            raise ValueError(f"experts must be [{L} layers][{E} experts], got "
                             f"[{len(experts)}][{sorted({len(layer) for layer in experts})}]")
        if not 1 <= cache_size <= E:
            raise ValueError(f"cache_size must be in [1, {E}] (experts per layer), got {cache_size}")
        if prefetch_input not in PREFETCH_INPUTS:
            raise ValueError(f"prefetch_input must be one of {PREFETCH_INPUTS}, got {prefetch_input!r}")
        if prefetch_k is not None and prefetch_k < 1:
            raise ValueError(f"prefetch_k must be >= 1 or None (= top_k), got {prefetch_k}")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.cache_size, self.cache_size_source = int(cache_size), cache_size_source
        self.cache_size_detail = cache_size_detail or {}
        self.prefetch, self.prefetch_input = bool(prefetch), prefetch_input
        self.prefetch_k = int(prefetch_k or config.top_k)
        self.codec = codec or DenseExpertCodec(dtype)

        # Host copies of every expert (pinned on CUDA, so copies are asynchronous DMA).
        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            return t.pin_memory() if self.cuda and not t.is_pinned() else t

        self.host = [[tuple(host(t) for t in self.codec.encode(e)) for e in layer] for layer in experts]
        self.expert_bytes = _nbytes(self.host[0][0])
        # Device cache: cache_size slots per layer, allocated once; lru[l]: expert -> slot, LRU first.
        self.slots = [[tuple(torch.empty_like(t, device=self.device) for t in self.host[l][0])
                       for _ in range(cache_size)] for l in range(L)]
        self.lru: list[ExpertLRU] = []
        for l in range(L):
            od = ExpertLRU()
            for s, e in enumerate(initial_residents(E, cache_size)):
                for dst, src in zip(self.slots[l][s], self.host[l][e]):
                    dst.copy_(src)
                od.add(e, s)
            self.lru.append(od)
        self.copy_in = CopyIn(self.device, L * cache_size)  # slot s of layer l is copy slot l * cache_size + s
        if self.cuda:
            torch.cuda.synchronize(self.device)

        # Every layer's post-attention norm and router, bound from the model (bind_model).
        self.layers = None
        self.quantizes_attention = quantize_attention
        self.attention_quantization: dict[str, Any] | None = None
        self.trace: list[dict[str, Any]] | None = None
        self.trace_start: list[list[int]] | None = None
        self.stats = OffloadStats()
        self.reset_stats()

    # ------------------------------------------------------------------ wiring

    def bind_model(self, model) -> None:
        """Engine hook: keep the model's decoder layers (the prefetcher applies the next layer's post-attention
        RMSNorm and router) and, with quantize_attention, replace their attention projections by HQQ ones
        (the engine calls this before it drops the dense weight copies the CPU kernel does not need)."""
        if len(model.layers) != self.config.num_layers:
            raise ValueError(f"model has {len(model.layers)} layers, the executor {self.config.num_layers}")
        self.layers = model.layers
        if self.quantizes_attention:
            from .quant import quantize_attention

            self.attention_quantization = quantize_attention(model)

    def reset_stats(self) -> None:
        self.stats = OffloadStats(layers=[LayerCacheStats() for _ in range(self.config.num_layers)])

    def start_trace(self) -> None:
        """Record every layer call from now on (routing, hits, misses, computed experts, prefetches), with
        the cache contents (LRU first) at this moment, so a test can replay the run independently."""
        self.trace = []
        self.trace_start = [list(od) for od in self.lru]

    def cache_contents(self) -> list[list[int]]:
        """Cached experts per layer, least recently used first."""
        return [list(od) for od in self.lru]

    def info(self) -> dict[str, Any]:
        return {
            "executor": f"{__name__}.OffloadingExecutor",
            "policy": "Mixtral-Offloading (arXiv 2312.17238): per-layer LRU expert cache on the GPU, "
                      "misses copied in (never run on the CPU), speculative prefetch with the next layer's router",
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "gpu_side": "cuda" if self.cuda else "cpu (emulated GPU)",
            "cache_size": self.cache_size, "cache_size_source": self.cache_size_source,
            "cache_size_detail": self.cache_size_detail,
            "cache_bytes": self.cache_size * self.config.num_layers * self.expert_bytes,
            "expert_bytes": self.expert_bytes,
            "initial_cache": f"experts {self.config.num_experts - self.cache_size}..{self.config.num_experts - 1} "
                             "of every layer (the original keeps the last experts on the GPU at load)",
            "prefetch": self.prefetch, "prefetch_k": self.prefetch_k,
            "prefetch_k_effective": min(self.prefetch_k, self.cache_size), "prefetch_input": self.prefetch_input,
            "prefetch_copies_on": ("side CUDA stream" if self.cuda else "calling thread, synchronous (CPU device)"),
            "quantization": self.codec.info(),
            "attention_quantization": self.attention_quantization,
        }

    # ------------------------------------------------------------------ cache mechanics

    def _evict(self, layer: int) -> int:
        """Free the least recently used slot of `layer` and return it."""
        slot, unused = self.lru[layer].evict()
        self.stats.prefetch_evicted_unused += unused
        return slot

    def _copy_in(self, layer: int, e: int, slot: int) -> None:
        """Copy expert (layer, e) from host memory into `slot` (asynchronous on CUDA, see CopyIn)."""
        t0 = time.perf_counter()
        self.copy_in.copy(layer * self.cache_size + slot, self.slots[layer][slot], self.host[layer][e])
        if not self.cuda:
            self.stats.copy_s += time.perf_counter() - t0

    def _compute(self, layer: int, slot: int, x: torch.Tensor) -> torch.Tensor:
        s = layer * self.cache_size + slot
        self.copy_in.acquire(s)
        y = self.codec.forward(self.slots[layer][slot], x)
        self.copy_in.release(s)
        return y

    # ------------------------------------------------------------------ forward

    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x[t]) for every token t (+ residual: the contract's)."""
        t_start = time.perf_counter()
        T, K = topk_idx.shape
        self.begin_forward(layer, x, topk_idx)
        groups = ExpertGroups(topk_idx, self.config.num_experts, layer)
        counts, active = groups.counts, groups.active()
        cache, st, ls = self.lru[layer], self.stats, self.stats.layers[layer]
        hits, misses = cache.split(active)
        combined = SlotOutputs(x, K)

        def run(e: int, slot: int) -> None:
            t_e, s_e = groups.pairs(e)
            combined.put(t_e, s_e, self._compute(layer, slot, x.index_select(0, t_e)), topk_w)

        # Hits first (marked most recently used), then each miss evicts the LRU slot and is copied in.
        for e in hits:
            if cache.use(e):  # the first use of a prefetched expert
                st.prefetch_hits += 1
                ls.prefetch_hits += 1
        for e in hits:
            run(e, cache[e])
        for e in misses:
            slot = self._evict(layer)
            self._copy_in(layer, e, slot)
            cache.add(e, slot)
            run(e, slot)
        out = combined.sum()

        n_hit_tok = sum(counts[e] for e in hits)
        st.calls += 1
        ls.calls += 1
        st.routed_tokens += T * K
        st.token_hits += n_hit_tok
        st.experts_routed += len(active)
        st.experts_computed += len(hits) + len(misses)
        st.hits += len(hits)
        st.misses += len(misses)
        ls.hits += len(hits)
        ls.misses += len(misses)
        st.bytes_copied_demand += len(misses) * self.expert_bytes
        st.tokens[GPU] += n_hit_tok
        st.tokens[COPY] += T * K - n_hit_tok
        st.experts[GPU] += len(hits)
        st.experts[COPY] += len(misses)
        if self.trace is not None:
            self.trace.append({"layer": layer, "topk_idx": topk_idx.detach().to("cpu").clone(), "hits": hits,
                               "misses": misses, "computed": hits + misses, "prefetched": []})
        st.wall_s += time.perf_counter() - t_start
        if self.prefetch and self.prefetch_input == "moe_input":
            self._prefetch_next(layer, x, normed=True)
        return add_residual(residual, out)

    def after_moe(self, layer: int, x: torch.Tensor) -> None:
        """Model hook: the residual stream right after layer `layer`'s MoE output was added."""
        if self.prefetch and self.prefetch_input == "residual":
            self._prefetch_next(layer, x, normed=False)

    # ------------------------------------------------------------------ speculative prefetch

    def guess_next(self, layer: int, x: torch.Tensor, normed: bool) -> list[int]:
        """The next layer's likely experts: its router applied to this layer's hidden state; over several
        tokens, the experts with the largest summed routing probability. Most likely first."""
        if self.layers is None:
            raise RuntimeError("prefetch needs the model's routers: the engine calls executor.bind_model(model)")
        nxt = self.layers[layer + 1]
        h = x if normed else rms_norm(x, nxt.post_norm, self.config.rms_norm_eps)
        probs = torch.softmax(nxt.router_logits(h).float(), dim=-1)
        score = probs.sum(dim=0)
        k = min(self.prefetch_k, self.cache_size, self.config.num_experts)
        return torch.topk(score, k).indices.tolist()

    def _prefetch_next(self, layer: int, x: torch.Tensor, normed: bool) -> None:
        nxt = layer + 1
        if nxt >= self.config.num_layers:
            return
        t0 = time.perf_counter()
        guesses = self.guess_next(layer, x, normed)
        cache, st, ls = self.lru[nxt], self.stats, self.stats.layers[nxt]
        copied = cache.to_prefetch(guesses)  # guessed experts already cached become most recently used (kept)
        for e in copied:
            slot = self._evict(nxt)
            self._copy_in(nxt, e, slot)
            cache.add(e, slot, prefetched=True)
        st.prefetch_calls += 1
        st.prefetch_copies += len(copied)
        ls.prefetch_copies += len(copied)
        st.bytes_copied_prefetch += len(copied) * self.expert_bytes
        if self.trace is not None:
            self.trace.append({"layer": nxt, "prefetch_from": layer, "guesses": guesses, "prefetched": copied})
        st.prefetch_s += time.perf_counter() - t0


# ---------------------------------------------------------------------------- factory + engine

@dataclass(frozen=True)
class MixtralOffloadingPolicy:
    """Factory of the policy's executor (fiddler.executors.ExecutorFactory) for
    Engine.from_pretrained(..., executor=...). The cache size is the `cache_size` option, else derived from
    the GPU side's budget, else `default_cache_size`. quantize=True stores experts HQQ 2-bit (group 16) and
    quantizes attention 4-bit (group 64) when the engine binds the model. `budget_source` says in info()
    where the GPU budget came from."""

    cache_size: int | None = None
    prefetch: bool = True
    prefetch_k: int | None = None
    prefetch_input: str = "residual"
    quantize: bool = False
    default_cache_size: int = DEFAULT_CACHE_SIZE
    budget_source: str = "GpuSide.budget_bytes"
    codec_factory: Callable | None = None  # (dtype, device) -> codec; overrides `quantize` for experts

    def __call__(self, ctx: BuildContext, experts: list[list[ExpertWeights]]) -> OffloadingExecutor:
        device = ctx.gpu.device
        if self.codec_factory is not None:
            codec = self.codec_factory(ctx.dtype, device)
        elif self.quantize:
            from .quant import HQQExpertCodec

            codec = HQQExpertCodec(ctx.dtype, device)
        else:
            codec = DenseExpertCodec(ctx.dtype)
        size, source, detail = choose_cache_size(ctx.config, ctx.dtype, cache_size=self.cache_size,
                                                 gpu_budget_bytes=ctx.gpu.budget_bytes,
                                                 budget_source=self.budget_source, max_seq_len=ctx.max_seq_len,
                                                 max_batch=ctx.max_batch, expert_bytes=codec.nbytes(ctx.config),
                                                 default=self.default_cache_size)
        return OffloadingExecutor(ctx.config, experts, device=device, dtype=ctx.dtype, cache_size=size,
                                  cache_size_source=source, cache_size_detail=detail, prefetch=self.prefetch,
                                  prefetch_k=self.prefetch_k, prefetch_input=self.prefetch_input, codec=codec,
                                  quantize_attention=self.quantize)


def load_engine(path, *, gpu: GpuSide | None = None, **options_and_engine_kwargs):
    """fiddler.Engine running the Mixtral-Offloading policy. Keyword arguments that are fields of
    MixtralOffloadingPolicy configure the policy; the others go to Engine.from_pretrained."""
    from dataclasses import fields

    from fiddler.engine import Engine

    names = {f.name for f in fields(MixtralOffloadingPolicy)}
    policy = MixtralOffloadingPolicy(**{k: v for k, v in options_and_engine_kwargs.items() if k in names})
    engine_kwargs = {k: v for k, v in options_and_engine_kwargs.items() if k not in names}
    return Engine.from_pretrained(path, gpu=gpu, executor=policy, **engine_kwargs)
