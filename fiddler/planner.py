"""Per-layer, per-step decision for every routed expert:

  a: resident on the GPU -> run there;
  b: copy its weights host -> GPU, then run there;
  c: copy the activations to the CPU and run there.

CPU and GPU work concurrently, so a layer takes max(CPU queue, GPU queue). The CPU queue is the sum of
cpu(s) over kind-c experts. The GPU queue is what the executor (fiddler/executors/orchestrator.py) does:
the resident experts (a) one after another, then the copied-in experts (b) in expert order through
COPY_BUFFERS buffers filled on their own copy stream: the copy of the next expert overlaps the compute of
the current one, and a buffer is refilled only once the expert in it has run (`gpu_queue`).
Planners only choose between b and c for non-resident experts; resident ones are a.

- "paper": the rule of the Fiddler paper (Algorithm 1): b when transfer + gpu(s) < cpu(s), else c.
- "makespan": minimise the predicted max(CPU, GPU) exactly over the 2^n splits of the n non-resident
  routed experts (a Pareto-front dynamic programme over the pipeline's state) for n <= EXACT_LIMIT,
  else the best prefix of a ratio ordering improved by single moves. Never worse than all-CPU, all-GPU or the paper's rule
  (they are candidates).
- "cpu" / "gpu": every non-resident expert on c / b (ablations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .placement import COPY_BUFFERS

GPU, COPY, CPU = "a", "b", "c"
KINDS = (GPU, COPY, CPU)
EXACT_LIMIT = 16  # experts per layer in today's MoEs: 8 (Mixtral) to 16; beyond, the greedy


@dataclass(frozen=True)
class LayerPlan:
    decisions: tuple  # per expert: "a" | "b" | "c" | None (no tokens routed)
    counts: tuple  # tokens routed to each expert
    cpu_time: float  # predicted seconds of the CPU queue
    gpu_time: float  # predicted seconds of the GPU queue (copies overlapped as the executor does)

    @property
    def makespan(self) -> float:
        return max(self.cpu_time, self.gpu_time)

    def experts(self, kind: str) -> list[int]:
        return [e for e, d in enumerate(self.decisions) if d == kind]

    def tokens(self, kind: str) -> int:
        return sum(n for n, d in zip(self.counts, self.decisions) if d == kind)


def gpu_queue(gpu0: float, transfer: float, computes: Sequence[float]) -> float:
    """Seconds until the GPU queue is done: gpu0 of resident-expert compute, then one copied-in expert per
    entry of `computes` (its GPU seconds, in execution order), each copied in `transfer` seconds on the
    copy stream into one of COPY_BUFFERS buffers. Copy i starts when copy i-1 is done and the expert that
    last used its buffer (i - COPY_BUFFERS) has run; compute i starts when compute i-1 is done and copy i
    has landed. Everything starts at 0 (the layer's routing is known)."""
    done = [0.0] * len(computes)  # when each copied-in expert has run (its buffer is free again)
    copied, g = 0.0, gpu0
    for i, t in enumerate(computes):
        copied = max(copied, done[i - COPY_BUFFERS] if i >= COPY_BUFFERS else 0.0) + transfer
        g = done[i] = max(g, copied) + t
    return g


def predict(counts: Sequence[int], decisions: Sequence, lm) -> tuple[float, float]:
    """(cpu_time, gpu_time) of a decision vector under latency model `lm` (zeros without a model)."""
    cpu = gpu0 = 0.0
    if lm is None:
        return cpu, gpu0
    copies = []
    for n, d in zip(counts, decisions):
        if d == CPU:
            cpu += lm.cpu(n)
        elif d == GPU:
            gpu0 += lm.gpu(n)
        elif d == COPY:
            copies.append(lm.gpu(n))
    return cpu, gpu_queue(gpu0, lm.transfer(), copies)


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


def _exact(p, q, transfer, gpu0) -> list[bool]:
    """Minimise max(CPU queue, GPU queue) over all 2^n splits of the free experts (CPU seconds p, GPU
    compute seconds q, in expert order = the executor's copy order); ties -> less CPU + GPU time.

    Dynamic programme over the experts in order, keeping only Pareto-optimal states. A state is
    (CPU load, when the next copy may start, when the GPU queue is done): with COPY_BUFFERS = 2 the
    next copy waits for the copy engine and for the expert before the last one, and the last one's
    completion is the GPU queue's end, so these three numbers determine every later time (see
    gpu_queue). Every later time is monotone in them and the objective is monotone in the final ones, so a
    dominated state can never finish better: the search is exact. The only state before the first copy
    (all on the CPU so far) is kept apart, since its next copy waits for no buffer. The front stays small
    in practice (equal token counts collapse), so this is fast without enumerating every subset."""
    assert COPY_BUFFERS == 2, "the DP's state assumes two copy buffers"
    cpu_only = 0.0  # the state with no copy yet: next copy at 0, GPU queue done at gpu0
    front: list[tuple[float, float, float, int]] = []  # (CPU load, next copy start, GPU done, GPU mask)
    for j, (pj, qj) in enumerate(zip(p, q)):
        bit = 1 << j
        cand = [(c + pj, s, g, m) for c, s, g, m in front]  # expert j on the CPU
        for c, s, g, m in front:  # expert j copied in: its buffer was freed when the one before last ran
            copied = s + transfer
            cand.append((c, g, g + qj, m | bit) if g > copied else (c, copied, copied + qj, m | bit))
        cand.append((cpu_only, transfer, max(gpu0, transfer) + qj, bit))  # the first copy
        cpu_only += pj
        cand.sort()
        front, kept = [], []  # kept: the (next copy start, GPU done) of the states kept so far
        for st in cand:  # ascending CPU load: keep a state unless an earlier one is no later in both times
            _, s, g, _ = st
            for ks, kg in reversed(kept):  # equal states sort next to each other: check the newest first
                if ks <= s and kg <= g:
                    break
            else:
                kept.append((s, g))
                front.append(st)
    states = [(c, g, m) for c, _, g, m in front] + [(cpu_only, gpu0, 0)]
    c, g, mask = min(states, key=lambda st: (max(st[0], st[1]), st[0] + st[1]))
    return [bool(mask >> j & 1) for j in range(len(p))]


def _greedy(p, q, transfer, gpu0) -> list[bool]:
    """Best prefix of the experts ordered by CPU cost per unit of GPU cost (copy + compute: most worth
    moving first), then single-expert moves while they lower the makespan; each candidate's GPU queue is
    timed with the executor's pipeline (gpu_queue). Adding a copy never shortens the GPU queue and removing
    one never lengthens it, which bounds most candidates without timing them: along the prefixes the CPU
    load falls and the GPU queue grows, so the best prefix is at their crossing (a binary search)."""
    n = len(p)

    def gpu(on):
        return gpu_queue(gpu0, transfer, [q[j] for j in range(n) if on[j]])

    order = sorted(range(n), key=lambda j: -p[j] / (transfer + q[j]) if transfer + q[j] > 0 else float("-inf"))
    cpu_left = [sum(p)]  # CPU load of each prefix (the first k of `order` copied)
    for j in order:
        cpu_left.append(cpu_left[-1] - p[j])

    def prefix(k):
        on = [False] * n
        for j in order[:k]:
            on[j] = True
        return on

    lo, hi = 0, n  # the first prefix whose GPU queue reaches its CPU load (n if none does before the end)
    while lo < hi:
        mid = (lo + hi) // 2
        if gpu(prefix(mid)) >= cpu_left[mid]:
            hi = mid
        else:
            lo = mid + 1
    best, best_on = None, None
    for k in {max(lo - 1, 0), lo}:
        on = prefix(k)
        t = max(cpu_left[k], gpu(on))
        if best is None or t < best or (t == best and k < sum(best_on)):
            best, best_on = t, on
    cpu, g = sum(p[j] for j in range(n) if not best_on[j]), gpu(best_on)
    improved = True
    while improved:
        improved = False
        for j in range(n):
            if best_on[j]:  # back to the CPU: the GPU queue can only get shorter
                if cpu + p[j] >= best * (1 - 1e-12):
                    continue
            elif g >= best * (1 - 1e-12):  # copied in: the GPU queue can only get longer
                continue
            best_on[j] = not best_on[j]
            c2, g2 = (cpu - p[j] if best_on[j] else cpu + p[j]), gpu(best_on)
            if max(c2, g2) < best * (1 - 1e-12):
                best, cpu, g, improved = max(c2, g2), c2, g2, True
                break
            best_on[j] = not best_on[j]
    return best_on


def plan_makespan(counts: Sequence[int], resident: Sequence[bool], lm) -> LayerPlan:
    _need(lm, "makespan")
    dec, free = _base(counts, resident)
    if not free:
        return _plan(counts, dec, lm)
    gpu0 = sum(lm.gpu(counts[e]) for e in range(len(counts)) if dec[e] == GPU)
    p = [lm.cpu(counts[e]) for e in free]
    q = [lm.gpu(counts[e]) for e in free]
    search = _exact if len(free) <= EXACT_LIMIT else _greedy
    on_gpu = search(p, q, lm.transfer(), gpu0)
    # Recompute with predict() and keep all-CPU, all-GPU and the paper's rule as candidates, so the
    # answer is never worse than them by the planner's own prediction.
    paper = [paper_rule(counts[e], lm) for e in free]
    plans = []
    candidates = (tuple(COPY if g else CPU for g in on_gpu), (CPU,) * len(free), (COPY,) * len(free), tuple(paper))
    for choice in dict.fromkeys(candidates):  # each distinct candidate once, in this order
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
