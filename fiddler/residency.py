"""Which experts hold a GPU slot while the engine serves, and how that set changes: the residency policy
(static, LRU, decayed LFU) and the one mechanism (`ExpertCache`) the executor and its simulator both run.

Placement (fiddler.placement) decides how many slots each layer has and which experts start in them; a policy
decides what to hold next. The planner (fiddler.planner) sees the live set: a resident expert is kind a, every
other routed expert b or c as before.

A fill is an extra copy of one expert's host bytes into the GPU side's fill buffer, issued only in the copy
engine's idle time as the planner predicts it for the layer being run: a layer whose plan copies no expert in
(kind b: the copy engine is theirs) leaves it idle until its CPU queue's results come back (the planner's
predicted CPU time; with no CPU expert, its makespan). The layer's fill chunk is issued as the layer is
planned and sized to that window, so a fill never makes a layer slower than its plan by the planner's own
prediction; a fill that needs more idle time than one layer has goes on over later layers (of any layer: the
copy engine is one). When the last byte is in, the policy is asked again (the routing may have moved
on) and the buffer is installed into the slot of the expert it evicts, which stays resident until then.

One fill at a time, into the last of the copy buffers (placement.COPY_BUFFERS): the copy engine copies one thing
at a time anyway, and a layer that copies no expert in leaves the copy buffers idle, so a fill costs no budget;
a layer whose plan needs the last buffer (COPY_BUFFERS kind-b copies or more) overwrites it, and the fill in
flight starts again.

A kind-b copy may become a fill for nothing but an unpack: an expert the plan copies in is on the GPU side
already, so after it has run its weights can go into an evicted slot (a promotion), where the plan's GPU queue
leaves the GPU the time for it by the planner's prediction (makespan less GPU time; an unpack costs two
one-token GPU runs of the expert, each a read of its weights). Torch-free, so the simulator and the harness import it cheaply.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
POLICIES = ("static", "lru", "lfu")
# The constants below were chosen on the base model's profiles (results/reference/mixtral-8x7b/expert-popularity/
# original: place from one subject, route from another, mode=simulate); the instruct profiles are the evaluation's.
#: named before the 42-pair evaluation (issue 52): a decayed count follows a shift without thrashing on noise
DEFAULT_ADAPTIVE = "lfu"
#: the decayed count halves every this many calls of a layer (decode steps; a prefill is one call)
DEFAULT_HALF_LIFE = 128
#: LFU admits an expert only when its decayed count beats the one it evicts by this factor: a pair whose counts
#: cross back and forth would otherwise swap on every call
ADMIT_MARGIN = 1.1
#: how many calls' worth of one token each the placement profile counts as (0: the decayed count's steady state):
#: little, since the routing seen is the better evidence once there is some
PRIOR_CALLS = 8
#: LFU evicts within the layer it fills. Across layers the counts do not compare within a forward pass: the
#: layers after the one being filled have not seen this step's tokens yet (a prefill's are many)
LFU_PER_LAYER = True
#: the LRU's admission filter forgets fast (recency is the LRU's point) and admits only a clear winner
LRU_ADMISSION_HALF_LIFE = 16
LRU_ADMIT_MARGIN = 1.25


class ExpertLRU(OrderedDict):
    """One layer's cached experts, least recently used first: expert -> what its user keeps for it (the
    executor's device slot, the simulator's time the slot is free), and which were prefetched and not used
    since. Mixtral-Offloading's executor and simulator run their rule through it (hits become most recently
    used in routing order, then each miss evicts the least recently used expert), and Fiddler's LRU residency
    keeps its order in it."""

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


# ---------------------------------------------------------------------------------------------- policies

class ResidencyPolicy:
    """Static: the resident set is the placement's, for good (the paper's policy). Subclasses adapt it.

    The cache calls `observe` once per layer call with the tokens routed to each expert, `candidate` for the
    expert it should fill next in that layer, `victim` for the slot that fill would take ((layer, expert): a
    slot holds any layer's expert, they are all one size), `admit` to confirm the swap is worth it (asked again
    when the copy is done), and `swapped` once it is made. `resident` is the whole set, [layer][expert]."""

    name = "static"
    adaptive = False

    def __init__(self, resident: Sequence[Sequence[bool]], shares: Sequence[Sequence[float]]):
        self.num_layers, self.num_experts = len(resident), len(resident[0]) if resident else 0

    def observe(self, layer: int, counts: Sequence[int], resident: Sequence[bool]) -> None:
        pass

    def candidate(self, layer: int, counts: Sequence[int], resident: Sequence[bool]) -> int | None:
        return None

    def victim(self, layer: int, resident) -> tuple[int, int] | None:
        return None

    def admit(self, layer: int, e: int, victim: tuple[int, int]) -> bool:
        return False

    def swapped(self, layer: int, e: int, victim: tuple[int, int]) -> None:
        pass

    def rank(self, layer: int, experts: Sequence[int]) -> list[int]:
        """`experts` (copied in by this call's plan), the ones most worth a slot first."""
        return []

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name}


class LRUPolicy(ResidencyPolicy):
    """Least recently used out, the most routed miss of the call in. Per layer, as the LRU caches of
    Mixtral-Offloading and llama.cpp's forks are: a layer keeps its number of slots. The order starts from the
    placement: least popular resident first.

    Classic LRU admits every miss, which on routing without temporal locality trades popular experts for
    whatever came last and loses to the static placement; so a miss is admitted only when a short decayed count
    (`admission`, half-life LRU_ADMISSION_HALF_LIFE calls, seeded from the profile) ranks it above the expert it
    would evict, as TinyLFU's admission filter does in front of an LRU."""

    name = "lru"
    adaptive = True

    def __init__(self, resident, shares, admission_half_life: float | None = None):
        super().__init__(resident, shares)
        self.lru = [ExpertLRU((e, None) for e in sorted((e for e, r in enumerate(row) if r),
                                                         key=lambda e: (sh[e], -e)))
                    for row, sh in zip(resident, shares)]
        hl = LRU_ADMISSION_HALF_LIFE if admission_half_life is None else admission_half_life
        self.admission = DecayedLFUPolicy(resident, shares, half_life=hl, margin=LRU_ADMIT_MARGIN)

    def observe(self, layer, counts, resident):
        self.admission.observe(layer, counts, resident)
        lru = self.lru[layer]
        for e in np.flatnonzero(counts):
            if int(e) in lru:
                lru.use(int(e))

    def candidate(self, layer, counts, resident):
        misses = [int(e) for e in np.flatnonzero(counts) if not resident[e]]
        return max(misses, key=lambda e: (counts[e], -e)) if misses else None

    def victim(self, layer, resident):
        e = next((e for e in self.lru[layer] if resident[layer][e]), None)
        return None if e is None else (layer, e)

    def admit(self, layer, e, victim):
        return self.admission.admit(layer, e, victim)

    def rank(self, layer, experts):
        return self.admission.rank(layer, experts)

    def swapped(self, layer, e, victim):
        self.admission.swapped(layer, e, victim)
        self.lru[victim[0]].pop(victim[1], None)
        self.lru[layer].add(e, None)


class DecayedLFUPolicy(ResidencyPolicy):
    """Decayed frequency: each expert's count of routed tokens, halved every `half_life` calls of its layer,
    seeded with the placement profile's shares as PRIOR_CALLS calls' worth. A fill goes to the layer's
    non-resident expert with the highest count, into the slot of the layer's resident one with the lowest,
    when it beats it by ADMIT_MARGIN. per_layer=False takes the lowest of any layer instead (see
    LFU_PER_LAYER for why that is not the default)."""

    name = "lfu"
    adaptive = True

    def __init__(self, resident, shares, half_life: float | None = None, margin: float | None = None,
                 prior_calls: float | None = None, per_layer: bool | None = None):
        super().__init__(resident, shares)
        half_life = DEFAULT_HALF_LIFE if half_life is None else half_life
        if half_life <= 0:
            raise ValueError(f"residency half-life must be > 0 calls, got {half_life}")
        self.half_life = float(half_life)
        self.margin = float(ADMIT_MARGIN if margin is None else margin)
        self.per_layer = LFU_PER_LAYER if per_layer is None else bool(per_layer)
        self.decay = 0.5 ** (1.0 / self.half_life)
        # the profile counts as this many calls of one token each (default: the steady state, 1 / (1 - decay))
        self.prior_calls = float(PRIOR_CALLS if prior_calls is None else prior_calls) or 1.0 / (1.0 - self.decay)
        self.score = np.asarray(shares, dtype=np.float64) * self.prior_calls  # [layer, expert], vectorised per call
        self.held = np.asarray(resident, dtype=bool)  # the slots this policy knows of (the cache's set)
        # each layer's coldest resident expert, (count, layer, expert): a layer's counts change only when it is
        # called, so the coldest slot of all is the least of these (O(layers + experts) a call, not O(slots))
        self.coldest = [self._coldest(l) for l in range(len(resident))]

    def _coldest(self, layer):
        held = self.held[layer]
        if not held.any():
            return None
        e = int(np.where(held, self.score[layer], np.inf).argmin())  # the lowest index among equals
        return float(self.score[layer, e]), layer, e

    def observe(self, layer, counts, resident):
        sc = self.score[layer]
        sc *= self.decay
        sc += counts
        self.coldest[layer] = self._coldest(layer)

    def candidate(self, layer, counts, resident):
        out = ~self.held[layer]
        if not out.any():
            return None
        return int(np.where(out, self.score[layer], -np.inf).argmax())  # the lowest index among equals

    def victim(self, layer, resident):
        c = self.coldest[layer] if self.per_layer else min((c for c in self.coldest if c is not None), default=None)
        return None if c is None else (c[1], c[2])

    def admit(self, layer, e, victim):
        return bool(self.score[layer, e] > self.score[victim[0], victim[1]] * self.margin)

    def rank(self, layer, experts):
        sc = self.score[layer]
        return sorted(experts, key=lambda e: (-sc[e], e))

    def swapped(self, layer, e, victim):
        self.held[victim[0], victim[1]], self.held[layer, e] = False, True
        for l in {layer, victim[0]}:
            self.coldest[l] = self._coldest(l)

    def describe(self):
        return {"policy": self.name, "half_life_calls": self.half_life, "admit_margin": self.margin}


def make_policy(name: str, resident, shares, *, half_life: float | None = None) -> ResidencyPolicy:
    """The residency policy `name` (one of POLICIES), seeded from the placement and its popularity shares."""
    if name == "static":
        return ResidencyPolicy(resident, shares)
    if name == "lru":
        return LRUPolicy(resident, shares)
    if name == "lfu":
        return DecayedLFUPolicy(resident, shares, half_life=half_life)
    raise ValueError(f"unknown residency policy {name!r}; choose one of {', '.join(POLICIES)}")


# ---------------------------------------------------------------------------------------------- mechanism

@dataclass
class Chunk:
    """Copy bytes [start, end) of expert (layer, expert)'s host copy into the fill buffer."""
    layer: int
    expert: int
    start: int
    end: int


@dataclass
class Install:
    """The fill buffer holds expert (layer, expert) whole: unpack it into the slot of expert `victim` of layer
    `victim_layer`, which leaves."""
    layer: int
    expert: int
    victim_layer: int
    victim: int


@dataclass
class Promote:
    """Expert (layer, expert), copied in by this call's plan, goes into the slot of expert `victim` of layer
    `victim_layer` once it has run (its weights are on the GPU side already)."""
    layer: int
    expert: int
    victim_layer: int
    victim: int


@dataclass
class _Fill:
    layer: int
    expert: int
    done: int = 0


@dataclass
class CacheStats:
    fills_started: int = 0
    fills: int = 0  # installed (each one an eviction)
    abandoned: int = 0  # copied whole, then no longer worth a slot
    restarted: int = 0  # a plan's copies took the buffer mid-fill
    promoted: int = 0  # kind-b copies kept in a slot (each one an eviction)
    fill_bytes: int = 0
    by_layer: list[int] = field(default_factory=list)  # fills per layer

    def to_dict(self) -> dict[str, Any]:
        return {"fills_started": self.fills_started, "fills": self.fills, "promoted": self.promoted,
                "evictions": self.fills + self.promoted, "abandoned": self.abandoned, "restarted": self.restarted,
                "fill_bytes": self.fill_bytes}


class ExpertCache:
    """The live resident set (`resident[layer][expert]`, what the planner sees) and the fill in flight.

    Per layer call: plan against `resident[layer]`, run the layer, then `step(layer, counts, plan, lm)`, which
    returns what to copy (Chunk) and what to install (Install) now. `host_bytes` is the size of one expert's
    host copy (what a fill copies, what lm.transfer() times)."""

    def __init__(self, resident: Sequence[Sequence[bool]], policy: ResidencyPolicy, host_bytes: int):
        self.resident = [list(map(bool, r)) for r in resident]
        self.policy = policy
        self.host_bytes = int(host_bytes)
        self.fill: _Fill | None = None
        self.stats = CacheStats(by_layer=[0] * len(self.resident))

    @property
    def adaptive(self) -> bool:
        return self.policy.adaptive

    def reset_stats(self) -> None:
        self.stats = CacheStats(by_layer=[0] * len(self.resident))

    def copy_slack(self, plan, lm, streams: bool = False) -> float:
        """Seconds the copy engine is idle from the start of this layer call, by the planner's prediction: none
        where the plan copies experts in (kind b) or the call stages the next layer's copies (`streams`,
        fiddler.streaming), else until the CPU queue's results come back (its predicted
        CPU time), or the whole makespan where no expert runs on the CPU. Without a latency model, one expert's
        copy per call (the planner prices nothing then, and a fill must still finish)."""
        from .planner import COPY, CPU  # at call time: the planner imports torch

        if streams or COPY in plan.decisions:
            return 0.0
        if lm is None:
            return float("inf")
        return plan.cpu_time if plan.experts(CPU) else plan.makespan

    def _promote(self, layer: int, plan, lm) -> list[Promote]:
        """Kind-b experts of this call kept in an evicted slot, while the GPU has the time (see the module)."""
        from .planner import COPY

        if COPY not in plan.decisions:
            return []
        copied = plan.experts(COPY)
        pol, out = self.policy, []
        cost = 2 * lm.gpu(1) if lm is not None else 0.0  # read the buffer, write the slot: two expert reads
        room = plan.makespan - plan.gpu_time if lm is not None else float("inf")
        for e in pol.rank(layer, copied):
            if room < cost:
                break
            v = pol.victim(layer, self.resident)
            if v is None or not pol.admit(layer, e, v):
                break  # ranked best first: the rest are worth less
            self.resident[v[0]][v[1]], self.resident[layer][e] = False, True
            pol.swapped(layer, e, v)
            if self.fill is not None and (self.fill.layer, self.fill.expert) == (layer, e):
                self.fill = None  # promoted while it was being filled
                self.stats.abandoned += 1
            self.stats.promoted += 1
            self.stats.by_layer[layer] += 1
            room -= cost
            out.append(Promote(layer, e, *v))
        return out

    def step(self, layer: int, counts: Sequence[int], plan, lm, streams: bool = False) -> list[Chunk | Install | Promote]:
        """streams: this call also copies the next layer's experts into the copy buffers (fiddler.streaming), which
        takes the fill's buffer and the copy engine's idle time."""
        pol = self.policy
        if not pol.adaptive:  # nothing to learn or fill (hits are FiddlerStats.gpu_hit_rate's: kind a)
            return []
        res = self.resident[layer]
        st = self.stats
        counts = np.asarray(counts)  # once, for the policy's vector arithmetic
        pol.observe(layer, counts, res)
        out: list = self._promote(layer, plan, lm)
        if self.fill is None:
            e = pol.candidate(layer, counts, res)
            v = pol.victim(layer, self.resident) if e is not None else None
            if v is not None and pol.admit(layer, e, v):
                self.fill = _Fill(layer, e)
                st.fills_started += 1
        if self.fill is None:
            return out
        f = self.fill
        from .placement import COPY_BUFFERS
        from .planner import COPY

        if f.done and (streams or plan.decisions.count(COPY) >= COPY_BUFFERS):  # the copies take the fill's buffer
            f.done = 0
            st.restarted += 1
        slack = self.copy_slack(plan, lm, streams)
        if slack > 0:
            t = lm.transfer() if lm is not None else 0.0
            room = self.host_bytes if t <= 0 or slack == float("inf") else int(slack / t * self.host_bytes)
            n = min(self.host_bytes - f.done, room)
            if n > 0:
                out.append(Chunk(f.layer, f.expert, f.done, f.done + n))
                f.done += n
                st.fill_bytes += n
        if f.done >= self.host_bytes:
            self.fill = None
            v = pol.victim(f.layer, self.resident)
            if not self.resident[f.layer][f.expert] and v is not None and pol.admit(f.layer, f.expert, v):
                self.resident[v[0]][v[1]], self.resident[f.layer][f.expert] = False, True
                pol.swapped(f.layer, f.expert, v)
                st.fills += 1
                st.by_layer[f.layer] += 1
                out.append(Install(f.layer, f.expert, *v))
            else:
                st.abandoned += 1
        return out

    def describe(self) -> dict[str, Any]:
        if not self.adaptive:
            return self.policy.describe()
        return {**self.policy.describe(), **self.stats.to_dict()}
