"""Mixtral-Offloading's expert cache, the rules its executor (executor.py, torch) and its simulator (sim.py)
share: how many experts per layer the GPU holds, which ones it holds at load, and the LRU order they are used
and evicted in (ExpertLRU). Torch-free at import, so
the simulator and the config import it without the executor (which made config -> sim -> executor ->
config a circle)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

#: cache_size per layer when there is neither an explicit option nor a GPU budget: the original's demo
#: offloads 4-6 of Mixtral's 8 experts per layer; 2 resident of 8 is the "offload 6" setting.
DEFAULT_CACHE_SIZE = 2


def initial_residents(num_experts: int, cache_size: int) -> list[int]:
    """The experts each layer's cache holds at load, least recently used first: the original keeps the
    layer's last `cache_size` experts."""
    return list(range(num_experts - cache_size, num_experts))


class ExpertLRU(OrderedDict):
    """One layer's cached experts, least recently used first: expert -> what its user keeps for it (the
    executor's device slot, the simulator's time the slot is free), and which were prefetched and not used
    since. The executor and the simulator run the same rule through it: hits become most recently used in
    routing order, then each miss evicts the least recently used expert."""

    def __init__(self, residents: Iterable[tuple[int, Any]] = ()):
        super().__init__(residents)
        self.prefetched: set[int] = set()

    def split(self, active: Iterable[int]) -> tuple[list[int], list[int]]:
        """(hits, misses) of the layer's active experts, each in the order given."""
        active = list(active)
        return [e for e in active if e in self], [e for e in active if e not in self]

    def use(self, e: int) -> bool:
        """Mark a cached expert most recently used; True where that is the first use of a prefetched one."""
        self.move_to_end(e)
        if e in self.prefetched:
            self.prefetched.discard(e)
            return True
        return False

    def evict(self) -> tuple[Any, bool]:
        """Drop the least recently used expert: (what was kept for it, whether it was prefetched and never used)."""
        e, kept = self.popitem(last=False)
        unused = e in self.prefetched
        self.prefetched.discard(e)
        return kept, unused

    def to_prefetch(self, guesses: Iterable[int]) -> list[int]:
        """The guessed experts to copy in, in order: the cached ones become most recently used (kept) first."""
        guesses = list(guesses)
        for e in guesses:
            if e in self:
                self.move_to_end(e)
        return [e for e in guesses if e not in self]

    def add(self, e: int, kept: Any, prefetched: bool = False) -> None:
        """A copied-in expert, most recently used."""
        self[e] = kept
        if prefetched:
            self.prefetched.add(e)


def derive_cache_size(config, dtype, budget_bytes: int, *, max_seq_len: int, max_batch: int,
                      expert_bytes: int | None = None) -> tuple[int, dict[str, Any]]:
    """Experts per layer that fit in `budget_bytes`: (budget - non-expert weights - KV cache - activations)
    / (layers * expert bytes), clamped to [1, num_experts]. Misses are copied straight into the evicted
    slot, so there are no separate copy buffers to reserve (fiddler's reservation counts two)."""
    from fiddler.placement import reservation  # torch: only when a budget is sized

    res = reservation(config, dtype, max_seq_len, max_batch)
    for part in ("expert_copy_buffers", "unpack_scratch"):  # fiddler's copy-in path, not this policy's
        res.pop(part, None)
    eb = int(expert_bytes if expert_bytes is not None else config.expert_bytes(dtype))
    free = budget_bytes - sum(res.values())
    per_layer = free // (config.num_layers * eb) if free > 0 else 0
    size = int(max(1, min(config.num_experts, per_layer)))
    return size, {"budget_bytes": int(budget_bytes), "reserved_bytes": res, "expert_bytes": eb,
                  "fits_per_layer": int(per_layer), "clamped": size != per_layer}


def choose_cache_size(config, dtype, *, cache_size: int | None, gpu_budget_bytes: int | None,
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
