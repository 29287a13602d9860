"""Per-layer, per-step decision for every routed expert:

  a: resident on the GPU -> run there;
  b: copy its weights host -> GPU, then run there;
  c: copy the activations to the CPU and run there.

CPU and GPU work concurrently, so a layer takes max(CPU queue, GPU queue) where the CPU queue is the
sum of cpu(s) over kind-c experts and the GPU queue the sum of gpu(s) over kind a plus transfer + gpu(s)
over kind b (copies are counted serially with compute: conservative, and the copy dominates for real
expert sizes). Planners only choose between b and c for non-resident experts; resident ones are a.

- "paper": the rule of the Fiddler paper (Algorithm 1): b when transfer + gpu(s) < cpu(s), else c.
- "makespan": minimise the predicted max(CPU, GPU) exactly over the 2^n splits of the n non-resident
  routed experts (a Pareto-front dynamic programme) for n <= EXACT_LIMIT, else the best prefix of a
  ratio ordering improved by single moves. Never worse than all-CPU, all-GPU or the paper's rule
  (they are candidates).
- "cpu" / "gpu": every non-resident expert on c / b (ablations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

GPU, COPY, CPU = "a", "b", "c"
KINDS = (GPU, COPY, CPU)
EXACT_LIMIT = 16  # experts per layer in today's MoEs: 8 (Mixtral) to 16; beyond, the greedy


@dataclass(frozen=True)
class LayerPlan:
    decisions: tuple  # per expert: "a" | "b" | "c" | None (no tokens routed)
    counts: tuple  # tokens routed to each expert
    cpu_time: float  # predicted seconds of the CPU queue
    gpu_time: float  # predicted seconds of the GPU queue (copies included)

    @property
    def makespan(self) -> float:
        return max(self.cpu_time, self.gpu_time)

    def experts(self, kind: str) -> list[int]:
        return [e for e, d in enumerate(self.decisions) if d == kind]

    def tokens(self, kind: str) -> int:
        return sum(n for n, d in zip(self.counts, self.decisions) if d == kind)


def predict(counts: Sequence[int], decisions: Sequence, lm) -> tuple[float, float]:
    """(cpu_time, gpu_time) of a decision vector under latency model `lm` (zeros without a model)."""
    cpu = gpu = 0.0
    if lm is None:
        return cpu, gpu
    for n, d in zip(counts, decisions):
        if d == CPU:
            cpu += lm.cpu(n)
        elif d == GPU:
            gpu += lm.gpu(n)
        elif d == COPY:
            gpu += lm.transfer() + lm.gpu(n)
    return cpu, gpu


def _plan(counts, decisions, lm) -> LayerPlan:
    c, g = predict(counts, decisions, lm)
    return LayerPlan(tuple(decisions), tuple(counts), c, g)


def _base(counts: Sequence[int], resident: Sequence[bool]) -> tuple[list, list[int]]:
    """Decisions with resident experts set to a, and the non-resident routed experts still to decide."""
    if len(counts) != len(resident):
        raise ValueError(f"{len(counts)} expert counts but {len(resident)} residency flags")
    dec: list = [None] * len(counts)
    free = []
    for e, (n, r) in enumerate(zip(counts, resident)):
        if n < 0:
            raise ValueError(f"negative token count {n} for expert {e}")
        if n > 0:
            if r:
                dec[e] = GPU
            else:
                free.append(e)
    return dec, free


def plan_all(kind: str) -> Callable:
    def planner(counts, resident, lm) -> LayerPlan:
        dec, free = _base(counts, resident)
        for e in free:
            dec[e] = kind
        return _plan(counts, dec, lm)
    return planner


def _need(lm, name):
    if lm is None:
        raise ValueError(f"planner {name!r} needs a latency model")


def paper_rule(n: int, lm) -> str:
    """The Fiddler paper's choice for a non-resident expert with n tokens: copy it in (b) when the copy
    plus the GPU run is faster than the CPU run, else run it on the CPU (c)."""
    return COPY if lm.transfer() + lm.gpu(n) < lm.cpu(n) else CPU


def plan_paper(counts: Sequence[int], resident: Sequence[bool], lm) -> LayerPlan:
    _need(lm, "paper")
    dec, free = _base(counts, resident)
    for e in free:
        dec[e] = paper_rule(counts[e], lm)
    return _plan(counts, dec, lm)


def _exact(free, p, q, cpu0, gpu0) -> list[bool]:
    """Minimise max(cpu0 + sum p over CPU, gpu0 + sum q over GPU) over all 2^n splits; ties -> less total
    work. Dynamic programme over the experts keeping only Pareto-optimal (CPU load, GPU load) pairs: the
    objective is monotone in both loads, so a dominated partial split can never finish better. The front
    stays small in practice (equal token counts collapse; for distinct costs it is ~n^2 expected), so
    this is exact and fast without enumerating every subset."""
    front = [(0.0, 0.0, 0)]  # (CPU load, GPU load, bit mask of experts on the GPU)
    for j, (pj, qj) in enumerate(zip(p, q)):
        bit = 1 << j
        nxt = sorted([(c + pj, g, m) for c, g, m in front] + [(c, g + qj, m | bit) for c, g, m in front])
        front, best_g = [], float("inf")
        for c, g, m in nxt:  # ascending CPU load: keep a state only if its GPU load is strictly lower
            if g < best_g:
                front.append((c, g, m))
                best_g = g
    c, g, mask = min(front, key=lambda s: (max(cpu0 + s[0], gpu0 + s[1]), s[0] + s[1]))
    return [bool(mask >> j & 1) for j in range(len(free))]


def _greedy(free, p, q, cpu0, gpu0) -> list[bool]:
    """Best prefix of the experts ordered by CPU cost per unit of GPU cost (most worth moving first),
    then single-expert moves while they lower the makespan."""
    order = sorted(range(len(free)), key=lambda j: -p[j] / q[j] if q[j] > 0 else float("-inf"))
    best, best_on = None, None
    for k in range(len(order) + 1):
        on = [False] * len(free)
        for j in order[:k]:
            on[j] = True
        cpu = cpu0 + sum(p[j] for j in range(len(free)) if not on[j])
        gpu = gpu0 + sum(q[j] for j in range(len(free)) if on[j])
        if best is None or max(cpu, gpu) < best:
            best, best_on = max(cpu, gpu), on
    improved = True
    while improved:
        improved = False
        cpu = cpu0 + sum(p[j] for j in range(len(free)) if not best_on[j])
        gpu = gpu0 + sum(q[j] for j in range(len(free)) if best_on[j])
        for j in range(len(free)):
            c2, g2 = (cpu + p[j], gpu - q[j]) if best_on[j] else (cpu - p[j], gpu + q[j])
            if max(c2, g2) < max(cpu, gpu) * (1 - 1e-12):
                best_on[j] = not best_on[j]
                improved = True
                break
    return best_on


def plan_makespan(counts: Sequence[int], resident: Sequence[bool], lm) -> LayerPlan:
    _need(lm, "makespan")
    dec, free = _base(counts, resident)
    if not free:
        return _plan(counts, dec, lm)
    gpu0 = sum(lm.gpu(counts[e]) for e in range(len(counts)) if dec[e] == GPU)
    p = [lm.cpu(counts[e]) for e in free]
    q = [lm.transfer() + lm.gpu(counts[e]) for e in free]
    search = _exact if len(free) <= EXACT_LIMIT else _greedy
    on_gpu = search(free, p, q, 0.0, gpu0)
    # Recompute with predict() and keep all-CPU, all-GPU and the paper's rule as candidates, so rounding
    # in the search (vectorised sums add in another order) can never make the answer worse than them.
    paper = [paper_rule(counts[e], lm) for e in free]
    plans = []
    for choice in ([COPY if g else CPU for g in on_gpu], [CPU] * len(free), [COPY] * len(free), paper):
        for e, d in zip(free, choice):
            dec[e] = d
        plans.append(_plan(counts, dec, lm))
    return min(plans, key=lambda pl: (pl.makespan, pl.cpu_time + pl.gpu_time))


PLANNERS: dict[str, Callable[..., LayerPlan]] = {
    "paper": plan_paper,
    "makespan": plan_makespan,
    "cpu": plan_all(CPU),
    "gpu": plan_all(COPY),
}


def get_planner(name: str) -> Callable[..., LayerPlan]:
    try:
        return PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; choose one of {sorted(PLANNERS)}") from None
