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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fiddler.executor import begin_forward, expert_counts, torch_expert
from fiddler.model import rms_norm
from fiddler.placement import reservation
from fiddler.planner import COPY, GPU, KINDS
from fiddler.weights import ExpertWeights

#: cache_size per layer when there is neither an explicit option nor a GPU budget: the original's demo
#: offloads 4-6 of Mixtral's 8 experts per layer; 2 resident of 8 is the "offload 6" setting.
DEFAULT_CACHE_SIZE = 2
PREFETCH_INPUTS = ("residual", "moe_input")


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

    def info(self) -> dict[str, Any]:
        return {"experts": "unquantized", "dtype": str(self.dtype).replace("torch.", "")}


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------- cache size

def derive_cache_size(config, dtype: torch.dtype, budget_bytes: int, *, max_seq_len: int, max_batch: int,
                      expert_bytes: int | None = None) -> tuple[int, dict[str, Any]]:
    """Experts per layer that fit in `budget_bytes`: (budget - non-expert weights - KV cache - activations)
    / (layers * expert bytes), clamped to [1, num_experts]. Misses are copied straight into the evicted
    slot, so there are no separate copy buffers to reserve (fiddler's reservation counts two)."""
    res = reservation(config, dtype, max_seq_len, max_batch)
    res.pop("expert_copy_buffers", None)
    eb = int(expert_bytes if expert_bytes is not None else config.expert_bytes(dtype))
    free = budget_bytes - sum(res.values())
    per_layer = free // (config.num_layers * eb) if free > 0 else 0
    size = int(max(1, min(config.num_experts, per_layer)))
    return size, {"budget_bytes": int(budget_bytes), "reserved_bytes": res, "expert_bytes": eb,
                  "fits_per_layer": int(per_layer), "clamped": size != per_layer}


# ---------------------------------------------------------------------------- stats

def _kinds() -> dict[str, int]:
    return {k: 0 for k in KINDS}


@dataclass
class LayerCacheStats:
    calls: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_copies: int = 0
    prefetch_hits: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class OffloadStats:
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
    tokens: dict[str, int] = field(default_factory=_kinds)
    experts: dict[str, int] = field(default_factory=_kinds)
    layers: list[LayerCacheStats] = field(default_factory=list)

    @property
    def bytes_copied(self) -> int:
        return self.bytes_copied_demand + self.bytes_copied_prefetch

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

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("tokens", "experts", "layers")}
        d.update(bytes_copied=self.bytes_copied, bytes_h2d=self.bytes_copied, hit_rate=self.hit_rate,
                 gpu_hit_rate=self.gpu_hit_rate, prefetch_accuracy=self.prefetch_accuracy,
                 tokens=dict(self.tokens), experts=dict(self.experts), layers=[l.to_dict() for l in self.layers])
        return d

    # mapping-style access, like fiddler's ExecutorStats (the engine turns stats into plain dicts)
    def items(self):
        return self.to_dict().items()

    def __getitem__(self, key: str):
        return self.to_dict()[key]


# ---------------------------------------------------------------------------- executor

class OffloadingExecutor:
    """LRU expert cache on the GPU side + speculative prefetch. Same contract as fiddler's MoEExecutor:
    forward(layer, x, topk_idx, topk_w) -> Tensor, .stats, .reset_stats(), .info()."""

    def __init__(self, config, experts: list[list[ExpertWeights]], *, device, dtype: torch.dtype, cache_size: int,
                 cache_size_source: str, prefetch: bool = True, prefetch_k: int | None = None,
                 prefetch_input: str = "residual", codec=None, cache_size_detail: dict | None = None):
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
        self.lru: list[OrderedDict[int, int]] = []
        for l in range(L):
            od: OrderedDict[int, int] = OrderedDict()
            for s, e in enumerate(range(E - cache_size, E)):
                for dst, src in zip(self.slots[l][s], self.host[l][e]):
                    dst.copy_(src)
                od[e] = s
            self.lru.append(od)
        self.prefetched: list[set[int]] = [set() for _ in range(L)]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self._ready = [[torch.cuda.Event() for _ in range(cache_size)] for _ in range(L)]
            self._free = [[torch.cuda.Event() for _ in range(cache_size)] for _ in range(L)]
            torch.cuda.synchronize(self.device)

        # Router of every layer, bound from the model after it is built (bind_model).
        self._router: list[tuple[torch.Tensor, Callable]] | None = None
        self._eps = float(getattr(config, "rms_norm_eps", 1e-5))
        self.trace: list[dict[str, Any]] | None = None
        self.trace_start: list[list[int]] | None = None
        self.recorder = None
        self.stats = OffloadStats()
        self.reset_stats()

    # ------------------------------------------------------------------ wiring

    def bind_model(self, model) -> None:
        """Give the prefetcher the model's per-layer post-attention RMSNorm and router (gate). Called by
        `load_engine` right after the engine is built; prefetch is impossible without it."""
        # fiddler.model layers are tuples (input_norm, <attention projections>..., post_norm, gate)
        self._router = [(layer[-2], layer[-1]) for layer in model.layers]
        self._eps = float(model.cfg.rms_norm_eps)
        if len(self._router) != self.config.num_layers:
            raise ValueError(f"model has {len(self._router)} layers, the executor {self.config.num_layers}")

    def reset_stats(self) -> None:
        self.stats = OffloadStats(layers=[LayerCacheStats() for _ in range(self.config.num_layers)])

    def attach_recorder(self, recorder=None):
        """Record every layer's routing into a fiddler.popularity.PopularityRecorder (profile scripts)."""
        from fiddler.popularity import PopularityRecorder

        self.recorder = recorder or PopularityRecorder.for_config(self.config)
        return self.recorder

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
        }

    # ------------------------------------------------------------------ cache mechanics

    def _evict(self, layer: int) -> int:
        """Free the least recently used slot of `layer` and return it."""
        e, slot = self.lru[layer].popitem(last=False)
        if e in self.prefetched[layer]:
            self.prefetched[layer].discard(e)
            self.stats.prefetch_evicted_unused += 1
        return slot

    def _copy_in(self, layer: int, e: int, slot: int) -> None:
        """Copy expert (layer, e) from host memory into `slot`. On CUDA asynchronous on the copy stream,
        after the last compute that read the slot; the compute that uses it waits for the copy."""
        dsts, srcs = self.slots[layer][slot], self.host[layer][e]
        if self.cuda:
            self.copy_stream.wait_event(self._free[layer][slot])
            with torch.cuda.stream(self.copy_stream):
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src, non_blocking=True)
                self._ready[layer][slot].record(self.copy_stream)
        else:
            t0 = time.perf_counter()
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)
            self.stats.copy_s += time.perf_counter() - t0

    def _compute(self, layer: int, slot: int, x: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[layer][slot])
        y = self.codec.forward(self.slots[layer][slot], x)
        if self.cuda:
            self._free[layer][slot].record(torch.cuda.current_stream(self.device))
        return y

    # ------------------------------------------------------------------ forward

    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x[t]) for every token t; x [T, H], topk_* [T, K]."""
        t_start = time.perf_counter()
        T, K = topk_idx.shape
        E = self.config.num_experts
        begin_forward(self, layer, x, topk_idx)
        flat = topk_idx.reshape(-1)
        counts = expert_counts(flat, E, layer)
        active = [e for e in range(E) if counts[e]]
        cache, st, ls = self.lru[layer], self.stats, self.stats.layers[layer]
        hits = [e for e in active if e in cache]
        misses = [e for e in active if e not in cache]

        # Group (token, slot) pairs by expert, tokens in order within an expert.
        order = torch.argsort(flat, stable=True)
        offs = [0]
        for n in counts:
            offs.append(offs[-1] + n)
        out_slots = torch.empty(T, K, x.shape[1], dtype=x.dtype, device=x.device)

        def run(e: int, slot: int) -> None:
            sel = order[offs[e]:offs[e + 1]]
            t_e, s_e = sel // K, sel % K
            y = self._compute(layer, slot, x.index_select(0, t_e))
            out_slots[t_e, s_e] = y * topk_w[t_e, s_e].unsqueeze(-1)

        # Hits first (marked most recently used), then each miss evicts the LRU slot and is copied in.
        for e in hits:
            cache.move_to_end(e)
            if e in self.prefetched[layer]:
                self.prefetched[layer].discard(e)
                st.prefetch_hits += 1
                ls.prefetch_hits += 1
        for e in hits:
            run(e, cache[e])
        for e in misses:
            slot = self._evict(layer)
            self._copy_in(layer, e, slot)
            cache[e] = slot
            run(e, slot)
        out = out_slots.sum(dim=1)

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
        return out

    def after_moe(self, layer: int, x: torch.Tensor) -> None:
        """Engine hook (fiddler.model): the residual stream right after layer `layer`'s MoE output was added."""
        if self.prefetch and self.prefetch_input == "residual":
            self._prefetch_next(layer, x, normed=False)

    # ------------------------------------------------------------------ speculative prefetch

    def guess_next(self, layer: int, x: torch.Tensor, normed: bool) -> list[int]:
        """The next layer's likely experts: its router applied to this layer's hidden state; over several
        tokens, the experts with the largest summed routing probability. Most likely first."""
        if self._router is None:
            raise RuntimeError("prefetch needs the model's routers: build the engine with "
                               "baselines.mixtral_offloading.load_engine (or call executor.bind_model(model))")
        norm, gate = self._router[layer + 1]
        h = x if normed else rms_norm(x, norm, self._eps)
        probs = torch.softmax(gate(h).float(), dim=-1)
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
        for e in guesses:  # guessed experts already cached become most recently used (kept)
            if e in cache:
                cache.move_to_end(e)
        copied = []
        for e in guesses:
            if e in cache:
                continue
            slot = self._evict(nxt)
            self._copy_in(nxt, e, slot)
            cache[e] = slot
            self.prefetched[nxt].add(e)
            copied.append(e)
        st.prefetch_calls += 1
        st.prefetch_copies += len(copied)
        ls.prefetch_copies += len(copied)
        st.bytes_copied_prefetch += len(copied) * self.expert_bytes
        if self.trace is not None:
            self.trace.append({"layer": nxt, "prefetch_from": layer, "guesses": guesses, "prefetched": copied})
        st.prefetch_s += time.perf_counter() - t0

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- factory + engine

def choose_cache_size(config, dtype: torch.dtype, *, cache_size: int | None, gpu_budget_bytes: int | None,
                      budget_source: str, max_seq_len: int, max_batch: int, expert_bytes: int,
                      default: int = DEFAULT_CACHE_SIZE) -> tuple[int, str, dict]:
    """cache_size option > derived from the GPU budget > `default`; returns (size, how chosen, detail)."""
    E = config.num_experts
    if cache_size is not None:
        if not 1 <= int(cache_size) <= E:
            raise ValueError(f"cache_size={cache_size} is invalid: experts per layer in [1, {E}]")
        return int(cache_size), "option cache_size", {}
    if gpu_budget_bytes is not None:
        size, detail = derive_cache_size(config, dtype, gpu_budget_bytes, max_seq_len=max_seq_len,
                                         max_batch=max_batch, expert_bytes=expert_bytes)
        return size, f"derived from the GPU budget ({budget_source})", detail
    return min(int(default), E), f"default {default} per layer (no cache_size option and no GPU budget)", {}


def make_executor_factory(*, cache_size: int | None = None, prefetch: bool = True, prefetch_k: int | None = None,
                          prefetch_input: str = "residual", quantize: bool = False,
                          default_cache_size: int = DEFAULT_CACHE_SIZE, budget_source: str = "gpu_budget_bytes",
                          codec_factory: Callable | None = None) -> Callable:
    """An executor factory with fiddler.executor.build_executor's signature, for
    Engine.from_pretrained(..., executor_factory=...). Placement, planner and latency-model arguments
    are accepted and ignored: this policy has none. quantize=True stores experts HQQ 2-bit (group 16)."""

    def factory(config, experts, *, device, gpu_budget_bytes=None, max_seq_len, max_batch, dtype=None,
                **_ignored) -> OffloadingExecutor:
        dtype = dtype or experts[0][0].w1.dtype
        if codec_factory is not None:
            codec = codec_factory(dtype, torch.device(device))
        elif quantize:
            from .quant import HQQExpertCodec

            codec = HQQExpertCodec(dtype, torch.device(device))
        else:
            codec = DenseExpertCodec(dtype)
        eb = codec.nbytes(config) if hasattr(codec, "nbytes") else int(config.expert_bytes(dtype))
        size, source, detail = choose_cache_size(config, dtype, cache_size=cache_size,
                                                 gpu_budget_bytes=gpu_budget_bytes, budget_source=budget_source,
                                                 max_seq_len=max_seq_len, max_batch=max_batch, expert_bytes=eb,
                                                 default=default_cache_size)
        return OffloadingExecutor(config, experts, device=device, dtype=dtype, cache_size=size,
                                  cache_size_source=source, cache_size_detail=detail, prefetch=prefetch,
                                  prefetch_k=prefetch_k, prefetch_input=prefetch_input, codec=codec)

    return factory


def load_engine(path, *, cache_size: int | None = None, prefetch: bool = True, prefetch_k: int | None = None,
                prefetch_input: str = "residual", quantize: bool = False,
                default_cache_size: int = DEFAULT_CACHE_SIZE, budget_source: str = "gpu_budget_bytes",
                **engine_kwargs):
    """fiddler.Engine running the Mixtral-Offloading policy: builds the executor through the engine's
    executor_factory, binds the routers for prefetch and (quantize=True) HQQ-quantizes attention."""
    from fiddler.engine import Engine

    factory = make_executor_factory(cache_size=cache_size, prefetch=prefetch, prefetch_k=prefetch_k,
                                    prefetch_input=prefetch_input, quantize=quantize,
                                    default_cache_size=default_cache_size, budget_source=budget_source)
    engine = Engine.from_pretrained(path, executor_factory=factory, **engine_kwargs)
    engine.executor.bind_model(engine.model)
    if quantize:
        from .quant import quantize_attention

        engine._info["attention_quantization"] = quantize_attention(engine.model)
    return engine
