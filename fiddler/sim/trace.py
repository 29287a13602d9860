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

    def shortfall(self, input_len: int, output_len: int, beam_width: int) -> list[str]:
        """Where this trace is shorter than one generate, which TraceRouting then cycles: e.g.
        ["prefill 8 tokens for 16", "decode 3 rows for 7"]; empty when it is long enough. A trace of one
        step has no decode rows (TraceRouting lets its prefill's stand in)."""
        short = []
        if self.prefill_tokens < input_len:
            short.append(f"prefill {self.prefill_tokens} tokens for {input_len}")
        if self.decode_rows < (output_len - 1) * beam_width:
            short.append(f"decode {self.decode_rows} rows for {(output_len - 1) * beam_width}")
        return short

    @property
    def prefill_tokens(self) -> int:
        return int(self.steps[0].shape[1])

    @property
    def decode_rows(self) -> int:
        return sum(int(s.shape[1]) for s in self.steps[1:])

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
    def from_dict(cls, d: Any, source: str | None = None) -> RoutingTrace:
        """Raises ValueError with a one-line reason for anything that is not a trace of this format."""
        if not isinstance(d, dict):
            raise ValueError(f"not a routing trace: a JSON {_json_kind(d)}, expected an object")
        if d.get("format") != FORMAT:
            raise ValueError(f"not a routing trace (format {d.get('format')!r}, expected {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"routing trace version {d.get('version')!r} is not supported (expected {VERSION})")
        L, E, K = (_count(d, key) for key in ("num_layers", "num_experts", "top_k"))
        if not isinstance(d.get("steps"), list):
            raise ValueError("not a routing trace: no 'steps'" if "steps" not in d else
                             f"not a routing trace: 'steps' is a JSON {_json_kind(d['steps'])}, expected a list")
        steps = [_step(s, i, L, K) for i, s in enumerate(d["steps"])]
        meta = dict(d.get("meta") or {}) if isinstance(d.get("meta"), dict) else {}
        if source:
            meta["source"] = source
        return cls(L, E, K, steps, meta)

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


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _count(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"not a routing trace: {key}={value!r}, expected an integer >= 1")
    return value


def _step(s: Any, i: int, layers: int, top_k: int) -> np.ndarray:
    """Step i's experts as [layers, tokens, top_k]."""
    tokens = s.get("tokens") if isinstance(s, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"trace step {i} is not an object with tokens >= 1 and experts")
    try:
        return np.asarray(s.get("experts"), dtype=np.int64).reshape(layers, tokens, top_k)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"trace step {i}'s experts are not {layers} layers x {tokens} tokens x top-{top_k} "
                         f"expert ids") from None


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
