"""Mixtral-Offloading's policy on the simulator's clock (mode=simulate), step for step the executor in
executor.py: a per-layer LRU cache of `cache_size` experts on the GPU (the same `choose_cache_size` from
the budget; initially the layer's last experts), every layer call looks up its distinct routed experts,
hits run first, each miss evicts the least recently used expert and is copied in on the copy engine,
then runs; experts never run on the CPU. Speculative prefetch after each layer: the next layer's
`prefetch_k` most likely experts (the routing's speculative guess, summed over rows) are made most
recently used or copied in on the copy engine while the next layer's attention runs; a prefetched expert
is used when its copy has landed. Attention, norms and routers run on the GPU (fiddler's engine).

`original_swap=True` models the original repository's released code instead of this project's executor
(read from github.com/dvmazur/mixtral-offloading, src/expert_cache.py): a miss swaps the loaded expert with
the evicted one, copying the loaded expert host -> device and the evicted expert device -> host, both
issued non-blocking on the current CUDA stream, the one the experts compute on: load, write-back and
compute run one after another (on the clock: all three on the GPU lane). Its host copies are pinned
(`ExpertCache` pins every offloaded storage), so both copies run at the pinned PCIe rate. That released code
loads on demand only (no speculative prefetch: use prefetch=false with it, as
the preset mixtral_offloading_original does). Its per-expert `.tolist()` host syncs are inside the
per-layer transformers floor, not modelled one by one. The cache size the Fiddler authors ran it with on the
Ada 6000 (offload_per_layer = 5, i.e. cache_size 3) is set by runners/validate_sim.py for that comparison.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fiddler.executors import COPY, GPU, kind_counter
from fiddler.sim import SimContext, SimPolicy, Step
from fiddler.residency import ExpertLRU
from fiddler.sim.fiddler_policy import ATTENTION_LAUNCHES

from .cache import choose_cache_size, initial_residents


class MixtralOffloadingSimPolicy(SimPolicy):
    name = "mixtral_offloading"

    def __init__(self, cache_size: int | None, default_cache_size: int, prefetch: bool, prefetch_k: int | None,
                 original_swap: bool = False):
        self.cache_size_option, self.default_cache_size = cache_size, default_cache_size
        self.prefetch, self.prefetch_k = prefetch, prefetch_k
        self.original_swap = bool(original_swap)

    def setup(self, ctx: SimContext) -> None:
        c = ctx.config
        if not ctx.has_gpu:
            raise ValueError("Mixtral-Offloading runs every expert on the GPU: the environment has no GPU "
                             "(gpu.memory_gb, mem_bandwidth_gbps and bf16_tflops must be > 0)")
        self.cache_size, self.cache_size_source, self.cache_detail = choose_cache_size(
            c, ctx.dtype, cache_size=self.cache_size_option, gpu_budget_bytes=ctx.gpu_budget_bytes,
            budget_source="environment.gpu.memory_gb", max_seq_len=ctx.max_seq_len, max_batch=ctx.max_batch,
            expert_bytes=ctx.costs.expert_bytes, default=self.default_cache_size)
        self.k = min(self.prefetch_k or c.top_k, self.cache_size, c.num_experts)
        self.reset()

    def reset(self) -> None:
        if not hasattr(self, "cache_size"):
            return
        self.st = {"calls": 0, "routed_tokens": 0, "token_hits": 0, "hits": 0, "misses": 0, "prefetch_copies": 0,
                   "prefetch_hits": 0, "prefetch_evicted_unused": 0, "bytes_copied_demand": 0,
                   "bytes_copied_prefetch": 0, "tokens": kind_counter(), "experts": kind_counter()}
        self.lru: list[ExpertLRU] | None = None  # built on the first layer call (needs the model shape)

    def _caches(self, ctx: SimContext) -> None:
        E = ctx.config.num_experts
        # least recently used first (cache.initial_residents); each expert keeps when its slot is free
        self.lru = [ExpertLRU((e, 0.0) for e in initial_residents(E, self.cache_size))
                    for _ in range(ctx.config.num_layers)]

    def _evict(self, layer: int) -> float:
        """Evict the LRU expert of `layer`; returns when its slot is free (its last compute ended)."""
        free_at, unused = self.lru[layer].evict()
        self.st["prefetch_evicted_unused"] += unused
        return free_at

    def layer(self, clock, ctx: SimContext, step: Step, layer: int, routing, ready: float) -> float:
        if self.lru is None:
            self._caches(ctx)
        hw, costs = ctx.hw, ctx.costs
        eb, fpt = costs.expert_bytes, costs.expert_flops_per_token
        ids = routing.ids[layer]
        counts = np.bincount(ids.ravel(), minlength=ctx.config.num_experts)
        nbytes, flops = costs.attention(step)
        # per-layer host floor: fiddler's engine, or transformers' eager model under the released code
        floor = hw.eff.gpu.hf_layer_overhead_s if self.original_swap else hw.eff.gpu.engine_layer_overhead_s
        g = clock.gpu.run(ready, max(hw.gpu(nbytes, flops, ATTENTION_LAUNCHES), floor))
        cache, st = self.lru[layer], self.st
        hits, misses = cache.split(int(e) for e in np.nonzero(counts)[0])
        for e in hits:  # most recently used now; cache[e]: when its (prefetch) copy arrived
            st["prefetch_hits"] += cache.use(e)
        for e in hits:
            g = clock.gpu.run(max(g, cache[e]), hw.gpu(eb, fpt * int(counts[e])))
            cache[e] = g
        for e in misses:
            slot_free = self._evict(layer)
            if self.original_swap:
                # the released code issues both copies on the current (compute) stream: load, write-back and
                # compute run one after another
                copied = clock.gpu.run(max(ready, slot_free), hw.h2d(eb))
                clock.gpu.run(copied, hw.d2h(eb))
            else:
                copied = clock.h2d.run(max(ready, slot_free), hw.h2d(eb))
            g = clock.gpu.run(max(g, copied), hw.gpu(eb, fpt * int(counts[e])))
            cache.add(e, g)
        n_hit = int(sum(counts[e] for e in hits))
        st["calls"] += 1
        st["routed_tokens"] += int(ids.size)
        st["token_hits"] += n_hit
        st["hits"] += len(hits)
        st["misses"] += len(misses)
        st["bytes_copied_demand"] += len(misses) * eb
        if self.original_swap:
            st["bytes_written_back"] = st.get("bytes_written_back", 0) + len(misses) * eb
        st["tokens"][GPU] += n_hit
        st["tokens"][COPY] += int(ids.size) - n_hit
        st["experts"][GPU] += len(hits)
        st["experts"][COPY] += len(misses)
        if self.prefetch and layer + 1 < ctx.config.num_layers:
            self._prefetch(clock, ctx, layer + 1, routing.guess[layer + 1], g)
        return g

    def _prefetch(self, clock, ctx: SimContext, nxt: int, guess: np.ndarray, at: float) -> None:
        score = Counter(guess.ravel().tolist())
        guesses = [e for e, _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))[:self.k]]
        cache = self.lru[nxt]
        for e in cache.to_prefetch(guesses):
            slot_free = self._evict(nxt)
            cache.add(e, clock.h2d.run(max(at, slot_free), ctx.hw.h2d(ctx.costs.expert_bytes)), prefetched=True)
            self.st["prefetch_copies"] += 1
            self.st["bytes_copied_prefetch"] += ctx.costs.expert_bytes

    def stats(self) -> dict[str, Any]:
        st = dict(self.st)
        st["bytes_copied"] = st["bytes_h2d"] = st["bytes_copied_demand"] + st["bytes_copied_prefetch"]
        n = st["hits"] + st["misses"]
        st["hit_rate"] = st["hits"] / n if n else None
        st["gpu_hit_rate"] = st["token_hits"] / st["routed_tokens"] if st["routed_tokens"] else None
        st["prefetch_accuracy"] = st["prefetch_hits"] / st["prefetch_copies"] if st["prefetch_copies"] else None
        return st

    def info(self) -> dict[str, Any]:
        return {"policy": self.name, "cache_size": self.cache_size, "cache_size_source": self.cache_size_source,
                "cache_size_detail": self.cache_detail, "prefetch": self.prefetch, "prefetch_k_effective": self.k,
                "original_swap": self.original_swap}
