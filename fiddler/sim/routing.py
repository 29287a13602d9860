"""Where the simulator's routing comes from: a popularity profile with temporal reuse, or a recorded trace.

A routing yields one `RoutingStep` per forward: the prefill (input_len tokens, one row) and each decode
step (beam_width rows). `ids[l, t]` are the top-k experts of token t in layer l; `guess[l, t]` is what a
speculative router applied one layer early would pick for layer l (Mixtral-Offloading's prefetch).

Profile routing (`ProfileRouting`): per token and layer, top-k experts drawn without replacement with
probabilities proportional to the layer's popularity shares (Plackett-Luce, by the Gumbel top-k trick),
except that each of the previous token's experts is kept with probability `reuse` (temporal reuse:
consecutive tokens of real text share experts, which is what makes an LRU cache work). A speculative
guess finds each true expert with probability `speculative_recall`, else a popularity draw.

Calibration (labelled, second-hand): Mixtral-Offloading (Eliseev & Mazur, arXiv 2312.17238, Fig. 2),
as summarised second-hand, reports LRU hit rates of about 40-60% for caches of 2-4 experts per layer on
Mixtral-8x7B and about 80-90% recall for speculative loading. DEFAULT_REUSE = 0.26 puts an LRU
cache of 2 / 3 / 4 experts per layer on the real Mixtral-8x7B profiles at 40 / 50 / 60% hits (the band's
edges and centre; `lru_hit_rates` measures it, tests/test_sim_routing.py checks it); without reuse the
same caches hit 20 / 33 / 47%. DEFAULT_RECALL is the middle of 80-90%.
"""
from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..popularity import Popularity

DEFAULT_REUSE = 0.26
DEFAULT_RECALL = 0.85
CALIBRATION_SOURCE = ("Mixtral-Offloading, arXiv 2312.17238 Fig. 2, as summarised second-hand: LRU hit rate "
                      "~40-60% for 2-4 cached experts per layer, speculative-loading recall ~80-90%")


@dataclass
class RoutingStep:
    ids: np.ndarray  # [L, T, K] int64
    guess: np.ndarray  # [L, T, K] int64: speculative router's pick for each layer (from the layer before)
    prefill: bool

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])


class Routing(abc.ABC):
    num_layers: int
    num_experts: int
    top_k: int

    @abc.abstractmethod
    def steps(self, input_len: int, output_len: int, beam_width: int) -> Iterator[RoutingStep]:
        """The prefill step, then output_len - 1 decode steps of beam_width rows (deterministic)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Where the routing comes from, for the record."""


def _probs(pop: Popularity) -> np.ndarray:
    p = np.asarray(pop.shares(), dtype=np.float64) / pop.top_k
    return np.maximum(p, 1e-12) / np.maximum(p, 1e-12).sum(axis=1, keepdims=True)


class ProfileRouting(Routing):
    def __init__(self, popularity: Popularity, *, reuse: float = DEFAULT_REUSE,
                 speculative_recall: float = DEFAULT_RECALL, seed: int = 0):
        if not 0.0 <= reuse <= 1.0:
            raise ValueError(f"reuse must be in [0, 1], got {reuse}")
        if not 0.0 <= speculative_recall <= 1.0:
            raise ValueError(f"speculative_recall must be in [0, 1], got {speculative_recall}")
        self.popularity = popularity
        self.num_layers, self.num_experts = popularity.shape
        self.top_k = popularity.top_k
        self.reuse, self.recall, self.seed = float(reuse), float(speculative_recall), int(seed)
        self._logp = np.log(_probs(popularity))
        self._p = _probs(popularity)

    def _token(self, rng: np.random.Generator, prev: np.ndarray | None) -> np.ndarray:
        """[L, K] experts of one token given the previous token's [L, K] (or None)."""
        L, E, K = self.num_layers, self.num_experts, self.top_k
        scores = self._logp + rng.gumbel(size=(L, E))
        if prev is not None and self.reuse > 0:
            keep = rng.random((L, K)) < self.reuse
            rows = np.repeat(np.arange(L), K).reshape(L, K)
            scores[rows[keep], prev[keep]] = np.inf
        return np.argsort(-scores, axis=1, kind="stable")[:, :K]

    def _guess(self, rng: np.random.Generator, ids: np.ndarray) -> np.ndarray:
        L, T, K = ids.shape
        hit = rng.random((L, T, K)) < self.recall
        u = rng.random((L, T, K))
        cdf = np.cumsum(self._p, axis=1)
        other = np.stack([np.searchsorted(cdf[l], u[l].ravel()).reshape(T, K) for l in range(L)])
        return np.where(hit, ids, np.minimum(other, self.num_experts - 1))

    def steps(self, input_len: int, output_len: int, beam_width: int) -> Iterator[RoutingStep]:
        rng = np.random.default_rng([self.seed, input_len, output_len, beam_width])
        prev = None
        toks = []
        for _ in range(input_len):
            prev = self._token(rng, prev)
            toks.append(prev)
        ids = np.stack(toks, axis=1)
        yield RoutingStep(ids, self._guess(rng, ids), True)
        rows = [prev] * beam_width
        for _ in range(output_len - 1):
            rows = [self._token(rng, r) for r in rows]
            ids = np.stack(rows, axis=1)
            yield RoutingStep(ids, self._guess(rng, ids), False)

    def describe(self) -> dict[str, Any]:
        return {"kind": "profile", "profile": self.popularity.meta.get("source"), "reuse": self.reuse,
                "speculative_recall": self.recall, "seed": self.seed, "calibration": CALIBRATION_SOURCE}


class TraceRouting(Routing):
    """Replays a routing trace recorded by the engine (fiddler.sim.trace.RoutingTrace): the recorded
    prefill's tokens (its first forward), cycled to input_len, then the recorded decode steps' rows in
    order, cycled, as many rows per step as the beam width asks. Speculative guesses follow the recall model (the trace has no router guesses)."""

    def __init__(self, trace, *, speculative_recall: float = DEFAULT_RECALL, seed: int = 0):
        self.trace = trace
        self.num_layers, self.num_experts, self.top_k = trace.num_layers, trace.num_experts, trace.top_k
        self.recall, self.seed = float(speculative_recall), int(seed)
        pop = trace.popularity()
        self._guesser = ProfileRouting(pop, reuse=0.0, speculative_recall=speculative_recall, seed=seed)
        # a trace is one generate: its first forward is the prefill, the others decode steps (1 row each, or
        # the beam width)
        self._prefill = trace.steps[0]
        self._decode = np.concatenate(trace.steps[1:] or trace.steps[:1], axis=1)  # [L, rows, K]

    def steps(self, input_len: int, output_len: int, beam_width: int) -> Iterator[RoutingStep]:
        rng = np.random.default_rng([self.seed, input_len, output_len, beam_width, 1])
        n = self._prefill.shape[1]
        ids = self._prefill[:, np.arange(input_len) % n]
        yield RoutingStep(ids, self._guesser._guess(rng, ids), True)
        m = self._decode.shape[1]
        for step in range(output_len - 1):
            cols = (step * beam_width + np.arange(beam_width)) % m
            ids = self._decode[:, cols]
            yield RoutingStep(ids, self._guesser._guess(rng, ids), False)

    def describe(self) -> dict[str, Any]:
        return {"kind": "trace", "trace": self.trace.meta.get("source"), "trace_meta": self.trace.meta,
                "speculative_recall": self.recall, "seed": self.seed}


# ---------------------------------------------------------------- calibration measures

def lru_hit_rates(routing: Routing, cache_sizes: Sequence[int] = (2, 3, 4), tokens: int = 256,
                  input_len: int = 16) -> dict[int, float]:
    """Per cache size, the share of routed (token, layer, expert) lookups an LRU cache of that many experts
    per layer serves, over `tokens` greedy decode steps (what Mixtral-Offloading's Fig. 2 measures)."""
    out = {}
    for size in cache_sizes:
        caches = [OrderedDict() for _ in range(routing.num_layers)]
        hits = total = 0
        for step in routing.steps(input_len, tokens + 1, 1):
            if step.prefill:
                continue
            for l in range(routing.num_layers):
                c = caches[l]
                for e in step.ids[l, 0].tolist():
                    total += 1
                    if e in c:
                        hits += 1
                        c.move_to_end(e)
                    else:
                        c[e] = True
                        if len(c) > size:
                            c.popitem(last=False)
        out[size] = hits / total
    return out


def speculative_recall(routing: Routing, tokens: int = 128) -> float:
    """Share of true experts a speculative guess contains, over decode steps."""
    found = total = 0
    for step in routing.steps(16, tokens + 1, 1):
        if step.prefill:
            continue
        for l in range(routing.num_layers):
            g = set(step.guess[l, 0].tolist())
            ids = step.ids[l, 0].tolist()
            found += sum(e in g for e in ids)
            total += len(ids)
    return found / total
