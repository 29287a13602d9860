"""Mixtral-Offloading's expert cache, the rules its executor (executor.py, torch) and its simulator (sim.py)
share: how many experts per layer the GPU holds, which ones it holds at load, and the LRU order they are used
and evicted in (ExpertLRU, fiddler.residency's, which Fiddler's LRU residency uses too). Torch-free at import, so
the simulator and the config import it without the executor (which made config -> sim -> executor ->
config a circle)."""
from __future__ import annotations

from typing import Any

#: cache_size per layer when there is neither an explicit option nor a GPU budget: the original's demo
#: offloads 4-6 of Mixtral's 8 experts per layer; 2 resident of 8 is the "offload 6" setting.
DEFAULT_CACHE_SIZE = 2


def initial_residents(num_experts: int, cache_size: int) -> list[int]:
    """The experts each layer's cache holds at load, least recently used first: the original keeps the
    layer's last `cache_size` experts."""
    return list(range(num_experts - cache_size, num_experts))


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
