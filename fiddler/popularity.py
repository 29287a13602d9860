"""Expert popularity profiles: how often each (layer, expert) pair is routed to.

The JSON format is the one the Fiddler authors published for Mixtral-8x7B:
``{"total_input_tokens": N, "expert_popularity": [[count per expert] per layer]}``.
Counts are normalised per layer (counts / layer sum * top_k) into each expert's expected share of
tokens, so profiles of different lengths (and whose ``total_input_tokens`` is a word count, as in the
published files) compare on the same scale. Extra keys (``top_k``, ``source``) are kept as metadata.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def _shape_of(counts: Sequence[Sequence[float]]) -> tuple[int, int]:
    return len(counts), (len(counts[0]) if counts else 0)


class Popularity:
    """Per-layer per-expert routing counts (float, so uniform profiles need no fake integers)."""

    def __init__(self, counts: Sequence[Sequence[float]], *, top_k: int = 2,
                 total_input_tokens: int | None = None, meta: dict[str, Any] | None = None):
        rows = [[float(c) for c in row] for row in counts]
        if not rows or not rows[0]:
            raise ValueError("popularity needs at least one layer and one expert")
        if any(len(r) != len(rows[0]) for r in rows):
            raise ValueError(f"ragged popularity: layers have {sorted({len(r) for r in rows})} experts")
        if any(c < 0 for r in rows for c in r):
            raise ValueError("popularity counts must be non-negative")
        if top_k < 1 or top_k > len(rows[0]):
            raise ValueError(f"top_k={top_k} out of range for {len(rows[0])} experts")
        self.counts = rows
        self.top_k = int(top_k)
        self.total_input_tokens = total_input_tokens
        self.meta = dict(meta or {})

    # ---- shape ----
    @property
    def num_layers(self) -> int:
        return len(self.counts)

    @property
    def num_experts(self) -> int:
        return len(self.counts[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_layers, self.num_experts

    def check_shape(self, config) -> None:
        """Raise ValueError unless this profile is (MoE layers x expert slots) of `config`."""
        want = (config.num_moe_layers, config.expert_slots)
        if self.shape != want:
            raise ValueError(
                f"popularity profile has shape {self.shape[0]} layers x {self.shape[1]} experts but the model "
                f"has {want[0]} layers x {want[1]} experts"
                + (f" (profile: {self.meta['source']})" if "source" in self.meta else "")
            )

    # ---- derived ----
    def shares(self) -> list[list[float]]:
        """Expected share of a layer's tokens routed to each expert (each layer sums to top_k).
        A layer with no recorded tokens is treated as uniform."""
        out = []
        for row in self.counts:
            s = sum(row)
            n = len(row)
            out.append([c / s * self.top_k for c in row] if s > 0 else [self.top_k / n] * n)
        return out

    def ranking(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs, most popular first. Ties are broken by (expert, layer), so a uniform
        profile spreads residents over all layers (expert 0 of every layer first) instead of filling the
        first layers."""
        sh = self.shares()
        pairs = [(l, e) for l in range(self.num_layers) for e in range(self.num_experts)]
        return sorted(pairs, key=lambda p: (-sh[p[0]][p[1]], p[1], p[0]))

    # ---- constructors / IO ----
    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, top_k: int = 2) -> Popularity:
        return cls([[1.0] * num_experts for _ in range(num_layers)], top_k=top_k, meta={"source": "uniform"})

    @classmethod
    def uniform_for(cls, config) -> Popularity:
        """Uniform over the routed experts; shared-expert slots (run by every token) the most popular:
        each routed expert gets a share top_k / num_experts of a layer's tokens, each shared slot 1."""
        E, S, K = config.num_experts, config.shared_slots, config.top_k
        row = [1.0] * E + [E / K] * S
        return cls([list(row) for _ in range(config.num_moe_layers)], top_k=K + S,
                   meta={"source": "uniform" + (" (shared experts first)" if S else "")})

    @classmethod
    def for_config(cls, config, popularity=None) -> Popularity:
        """`popularity` (a Popularity, a path or None for uniform), shape-checked against `config`."""
        if popularity is None:
            return cls.uniform_for(config)
        pop = popularity if isinstance(popularity, Popularity) else cls.load(popularity, top_k=config.active_slots)
        pop.check_shape(config)
        return pop

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, top_k: int | None = None, source: str | None = None) -> Popularity:
        if "expert_popularity" not in d:
            raise ValueError(f"not a popularity profile: missing 'expert_popularity' (keys: {sorted(d)})")
        counts = d["expert_popularity"]
        meta = {k: v for k, v in d.items() if k not in ("expert_popularity", "total_input_tokens", "top_k")}
        if source is not None:
            meta.setdefault("source", source)
        k = top_k if top_k is not None else d.get("top_k", 2)
        return cls(counts, top_k=k, total_input_tokens=d.get("total_input_tokens"), meta=meta)

    @classmethod
    def load(cls, path: str | Path, *, top_k: int | None = None) -> Popularity:
        p = Path(path)
        with open(p) as f:
            return cls.from_dict(json.load(f), top_k=top_k, source=str(p))

    def to_dict(self) -> dict[str, Any]:
        counts = [[int(c) if float(c).is_integer() else c for c in row] for row in self.counts]
        d: dict[str, Any] = {"total_input_tokens": self.total_input_tokens, "expert_popularity": counts,
                             "top_k": self.top_k}
        d.update({k: v for k, v in self.meta.items() if k not in d})
        return d

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict()) + "\n")

    def __repr__(self) -> str:
        return f"Popularity({self.num_layers}x{self.num_experts}, top_k={self.top_k}, source={self.meta.get('source')})"


class PopularityRecorder:
    """Accumulates routing decisions; the executor feeds it every MoE layer's top-k indices."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.tokens = 0  # tokens seen by layer 0 (each token passes every layer once)

    @classmethod
    def for_config(cls, config) -> PopularityRecorder:
        return cls(config.num_moe_layers, config.expert_slots, config.active_slots)

    def record(self, layer: int, topk_idx: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        flat = topk_idx.reshape(-1).to("cpu", torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise ValueError(f"expert index out of range [0, {self.num_experts}) in layer {layer}")
        self._counts[layer] += torch.bincount(flat, minlength=self.num_experts)
        if layer == 0:
            self.tokens += topk_idx.shape[0]

    def reset(self) -> None:
        self._counts.zero_()
        self.tokens = 0

    def popularity(self, **meta) -> Popularity:
        return Popularity(self._counts.tolist(), top_k=self.top_k, total_input_tokens=self.tokens,
                          meta={"token_count_kind": "tokens", **meta})
