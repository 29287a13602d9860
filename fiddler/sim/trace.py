"""Routing traces: the experts the engine's router chose, per forward, layer and token, recorded in execute
mode and replayed by the simulator (`fiddler.sim.routing.TraceRouting`).

File format (JSON, one object):

    {"format": "fiddler.routing_trace", "version": 1,
     "num_layers": L, "num_experts": E, "top_k": K, "meta": {...},
     "steps": [{"tokens": T, "experts": [[T*K expert ids, token-major] per layer]}, ...]}

A step is one forward of the model: the prefill (T = prompt length), then each decode step (T = rows:
1 greedy, the beam width with beams). `RoutingRecorder` is a `fiddler.popularity.PopularityRecorder`
(attach it with `executor.attach_recorder(recorder)`) that also keeps this sequence.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..popularity import Popularity, PopularityRecorder

FORMAT, VERSION = "fiddler.routing_trace", 1


class RoutingTrace:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, steps: list[np.ndarray],
                 meta: dict[str, Any] | None = None):
        for i, s in enumerate(steps):
            if s.ndim != 3 or s.shape[0] != num_layers or s.shape[2] != top_k:
                raise ValueError(f"trace step {i} has shape {s.shape}, expected ({num_layers}, tokens, {top_k})")
            if s.size and (s.min() < 0 or s.max() >= num_experts):
                raise ValueError(f"trace step {i} has expert ids outside [0, {num_experts})")
        if not steps:
            raise ValueError("a routing trace needs at least one step")
        self.num_layers, self.num_experts, self.top_k = int(num_layers), int(num_experts), int(top_k)
        self.steps = [np.asarray(s, dtype=np.int64) for s in steps]
        self.meta = dict(meta or {})

    def popularity(self) -> Popularity:
        counts = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for s in self.steps:
            for l in range(self.num_layers):
                counts[l] += np.bincount(s[l].ravel(), minlength=self.num_experts)
        return Popularity(counts.tolist(), top_k=self.top_k, meta={"source": f"trace {self.meta.get('source')}"})

    def check_shape(self, config) -> None:
        want = (config.num_layers, config.num_experts, config.top_k)
        if (self.num_layers, self.num_experts, self.top_k) != want:
            raise ValueError(f"routing trace is {self.num_layers} layers x {self.num_experts} experts, top-{self.top_k}"
                             f"; the model is {want[0]} x {want[1]}, top-{want[2]}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "meta": self.meta,
                "steps": [{"tokens": int(s.shape[1]), "experts": s.reshape(self.num_layers, -1).tolist()}
                          for s in self.steps]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> RoutingTrace:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a routing trace (format {d.get('format')!r}, expected {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"routing trace version {d.get('version')!r} is not supported (expected {VERSION})")
        L, K = int(d["num_layers"]), int(d["top_k"])
        steps = [np.asarray(s["experts"], dtype=np.int64).reshape(L, int(s["tokens"]), K) for s in d["steps"]]
        meta = dict(d.get("meta") or {})
        if source:
            meta["source"] = source
        return cls(L, int(d["num_experts"]), K, steps, meta)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict()) + "\n")
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{p}: cannot read a routing trace ({exc})") from exc
        return cls.from_dict(d, source=str(p))


class RoutingRecorder(PopularityRecorder):
    """Counts like PopularityRecorder and keeps every forward's routing in order (layer 0 starts a step)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        super().__init__(num_layers, num_experts, top_k)
        self._steps: list[list[np.ndarray | None]] = []

    def record(self, layer: int, topk_idx: torch.Tensor) -> None:
        super().record(layer, topk_idx)
        ids = topk_idx.detach().to("cpu", torch.int64).numpy().reshape(topk_idx.shape[0], -1)
        if layer == 0 or not self._steps:
            self._steps.append([None] * self.num_layers)
        self._steps[-1][layer] = ids

    def reset(self) -> None:
        super().reset()
        self._steps = []

    def trace(self, **meta) -> RoutingTrace:
        steps = [np.stack(s) for s in self._steps if all(x is not None for x in s)]
        return RoutingTrace(self.num_layers, self.num_experts, self.top_k, steps, meta)
