"""Counting the ops a decode step launches: the GPU side's launch overhead, counted where no GPU is.

On a GPU every top-level aten op that computes something is at least one kernel launch, and at small
batch the launches, not the bytes, set the step time. torch.profiler records the top-level aten ops a
step calls on any device; ops that only make a new view of a tensor or read its metadata launch nothing
and are left out (NO_LAUNCH), as are conversions that copy nothing (`aten::to` of a tensor already in
the target dtype and device). On the emulated GPU the model runs the op sequence CUDA runs (the engine
turns the CPU-only fusions off there), so the count is what CUDA would launch, kernel libraries' own
internal launches aside.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

# Ops that make views or read metadata (no kernel on any device).
NO_LAUNCH = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::slice", "aten::select", "aten::expand",
    "aten::transpose", "aten::permute", "aten::t", "aten::unsqueeze", "aten::squeeze", "aten::as_strided",
    "aten::resolve_conj", "aten::resolve_neg", "aten::detach", "aten::alias", "aten::split", "aten::chunk",
    "aten::unbind", "aten::narrow", "aten::split_with_sizes", "aten::view_as", "aten::flatten",
    "aten::contiguous", "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::result_type", "aten::size",
    "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size", "aten::_reshape_alias",
    "aten::movedim", "aten::expand_as", "aten::unflatten", "aten::matrix_H", "aten::conj",
})
# Conversions that launch only when they copy (their child aten::_to_copy / copy_ is then present).
COPY_IF_CHILD = frozenset({"aten::to", "aten::type_as", "aten::contiguous", "aten::reshape", "aten::flatten"})


def _launches(ev) -> bool:
    if ev.name in COPY_IF_CHILD:
        return any(c.name in ("aten::_to_copy", "aten::copy_", "aten::clone") for c in _descendants(ev))
    return ev.name.startswith("aten::") and ev.name not in NO_LAUNCH


def _descendants(ev):
    for c in ev.cpu_children:
        yield c
        yield from _descendants(c)


def _top_level_aten(events) -> list:
    """Aten ops not called from inside another aten op (what a Python caller launched)."""
    out = []
    for ev in events:
        p, inside = ev.cpu_parent, False
        while p is not None:
            if p.name.startswith("aten::"):
                inside = True
                break
            p = p.cpu_parent
        if ev.name.startswith("aten::") and not inside:
            out.append(ev)
    return out


def count_launches(fn: Callable[[], object], steps: int = 1) -> tuple[int, Counter]:
    """(launching top-level aten ops per call of fn, averaged over `steps` calls, and their names counted
    over all calls). fn is one step; it runs once unprofiled first (buffers, caches) and then `steps` times
    under the profiler."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    names = Counter(ev.name for ev in _top_level_aten(prof.events()) if _launches(ev))
    return round(sum(names.values()) / steps), names
