"""Look-ahead streaming of experts for long prompts: the copy pipeline across MoE layers, written once for the
executor (fiddler/executors/orchestrator.py) and its simulator (fiddler/sim/fiddler_policy.py).

Without look-ahead a layer call's kind-b copies start once its routing is known, so the copy engine idles
through the next layer's attention and router. When this call's tokens make copying an expert in cheaper than
running it on the CPU for an expert's share of them (the planner's own rule for kind b, `paper_rule`), the next
layer, which routes the same tokens, will copy its non-resident experts in too: so its first copies are issued
now, into the copy buffers as this call's last uses of them end, and they overlap this layer's experts and the
next layer's attention. The next layer plans with a staged expert priced as resident (its copy is paid for, and
in its buffer or on its way: `staged_plan`) and runs it from its buffer as kind b (`pipeline`); a staged expert the next
layer routes no token to, or that became resident meanwhile, was a wasted copy (FiddlerStats.copies_ahead_unused).

The buffers are the executor's COPY_BUFFERS copy buffers, which the GPU budget already pays for
(fiddler.placement.reservation's `expert_copy_buffers`): look-ahead adds no memory, so it stages at most that many
experts, the first non-resident ones in expert order (the order a plan copies its kind-b experts in).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from .placement import COPY_BUFFERS
from .planner import COPY, CPU, GPU, LayerPlan, paper_rule


def lookahead(counts: Sequence[int], resident_next: Sequence[bool], lm, planner: str, plan: LayerPlan) -> list[int]:
    """The next layer's experts to stage during this layer call (`plan` is its plan): its first COPY_BUFFERS
    non-resident experts when an expert's share of this call's routed tokens (sum(counts) / experts) makes
    paper_rule choose b and the plan runs no expert on the CPU, else none (no latency model, the all-CPU planner,
    too few tokens). A call with CPU experts stages nothing: its CPU results come back over the copy engine the
    staged copies would hold up, and the CPU being worth using says copying is not yet the cheaper side."""
    if lm is None or planner == "cpu" or not counts or CPU in plan.decisions:
        return []
    share = sum(counts) // len(counts)
    if share < 1 or paper_rule(share, lm) != COPY:
        return []
    return [e for e, r in enumerate(resident_next) if not r][:COPY_BUFFERS]


def staged_plan(planner: Callable[..., LayerPlan], counts: Sequence[int], resident: Sequence[bool], lm,
         staged: Collection[int]) -> LayerPlan:
    """The layer call's plan where the previous call staged copies for it: `planner` sees a staged expert as
    resident (kind a: no copy to pay for any more), and the plan runs it from its buffer (kind b)."""
    if not staged:
        return planner(counts, resident, lm)
    p = planner(counts, [r or e in staged for e, r in enumerate(resident)], lm)
    return dataclasses.replace(p, decisions=tuple(COPY if d == GPU and not resident[e] else d
                                                  for e, d in enumerate(p.decisions)))


@dataclass(frozen=True)
class Pipeline:
    """One layer call's copies through the buffers. `order`: the plan's kind-b experts in the order they run
    (the staged ones first, then expert order); `slots`: the buffer of each; `staged`: those whose copy the
    previous layer call issued; `ahead`: (next layer's expert, buffer, i) per staged copy of this call, issued
    once order[i] has run (its buffer's last use here; i = -1: the buffer is unused here, so at the start)."""

    order: tuple[int, ...]
    slots: tuple[int, ...]
    staged: frozenset
    ahead: tuple[tuple[int, int, int], ...]

    def ahead_after(self, i: int) -> list[tuple[int, int]]:
        """(expert, buffer) of the next layer's copies issued once order[i] has run (i = -1: at the start)."""
        return [(e, s) for e, s, after in self.ahead if after == i]


def pipeline(copied: Sequence[int], staged: dict[int, int], ahead: Sequence[int]) -> Pipeline:
    """The buffers of a plan's kind-b experts `copied` (expert order) given the copies staged for this call
    ({expert: buffer}), and where this call stages the next layer's `ahead` experts. A buffer is reused two
    copies later (COPY_BUFFERS), as the double buffer always was."""
    used = {e: s for e, s in staged.items() if e in copied}
    order = list(used) + [e for e in copied if e not in used]
    free = [s for s in range(COPY_BUFFERS) if s not in used.values()]
    slots: list[int] = []
    for i, e in enumerate(order):
        if e in used:
            slots.append(used[e])
        elif i < COPY_BUFFERS:
            slots.append(free.pop(0))
        else:
            slots.append(slots[i - COPY_BUFFERS])
    last = {s: -1 for s in range(COPY_BUFFERS)}  # each buffer's last use in this call
    for i, s in enumerate(slots):
        last[s] = i
    freed = sorted(last, key=lambda s: (last[s], s))  # buffers in the order they are free for the next layer
    staged_next = tuple((e, s, last[s]) for e, s in zip(ahead, freed))
    return Pipeline(tuple(order), tuple(slots), frozenset(used), staged_next)
