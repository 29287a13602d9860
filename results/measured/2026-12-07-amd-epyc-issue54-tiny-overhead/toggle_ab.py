#!/usr/bin/env python
"""In one process, on one engine: tiny_mixtral's decode with this branch's per-layer path (route's top-k in C,
the executor's row through an ExpertTable) against the calls it replaced (torch's top-k ops; main's
_cpu_only_row / _decode_row_on_cpu bodies, restored on the instance below), interleaved ABBA, so both see the
same machine. Per token = the mean decode step of a generate (prompt 32, 16 new tokens), as the harness
times it. One JSON line last.

    PYTHONPATH=<this branch> python toggle_ab.py [--rounds 40]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from pathlib import Path

import torch

import fiddler.model as fm
from fiddler import Engine
from fiddler.executors.orchestrator import CPU
from fiddler.executors.contract import add_residual
from fiddler.executors.routing import row_counts
from fiddler.threads import small_call_threads
from runners.models import synthetic_model


def old_cpu_only_row(self, layer, x, topk_idx, topk_w, residual, t_start):  # main's (78d3ae1)
    if not (self.fused_decode and self.packed_host and x.is_contiguous() and topk_w.dtype == torch.bfloat16):
        return None
    ids = topk_idx[0].tolist()
    counts = row_counts(ids, self.config.expert_slots, layer)
    if max(counts) != 1:
        return None
    plan = self.planner(counts, self.cache.resident[layer], self.latency_model)
    if any(d is not None and d != CPU for d in plan.decisions):
        return None
    return self._decode_row_on_cpu(layer, x, ids, topk_w, plan, t_start, residual)


def old_decode_row_on_cpu(self, layer, x, ids, topk_w, plan, t_start, residual=None):  # main's (78d3ae1)
    packed = self.packed[layer]
    experts = [packed[e] for e in ids]
    threads = small_call_threads(len(ids) * self.expert_bytes, self.threads.all)
    if residual is not None and self.quant is None and self.device.type == "cpu" and residual.is_contiguous():
        out = self.kernel.moe_ffn_residual(experts, topk_w[0].contiguous(), x, residual, threads=threads)
        residual = None
    else:
        moe_ffn = self.kernel.moe_ffn if self.quant is None else self.kernel.quant.moe_ffn
        out = moe_ffn(experts, topk_w[0].contiguous(), x, threads=threads)
    if self.device.type != "cpu":
        out = out.to(self.device, non_blocking=True)
    wall = time.perf_counter() - t_start
    self.stats.add_plan(layer, plan, len(ids), wall, wall)
    return add_residual(residual, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    e = Engine.from_pretrained(Path(synthetic_model("tiny_mixtral")))
    ex = e.executor
    ids = torch.randint(3, 1000, (32,), generator=torch.Generator().manual_seed(32)).tolist()
    real_topk = fm._topk_in_kernel

    def side(name: str) -> None:
        if name == "old":
            fm._topk_in_kernel = lambda *a: None
            ex._cpu_only_row = types.MethodType(old_cpu_only_row, ex)
            ex._decode_row_on_cpu = types.MethodType(old_decode_row_on_cpu, ex)
        else:
            fm._topk_in_kernel = real_topk
            vars(ex).pop("_cpu_only_row", None)
            vars(ex).pop("_decode_row_on_cpu", None)

    tokens = {}
    for name in ("old", "new"):  # warm, and the same tokens both ways
        side(name)
        tokens[name] = e.generate(ids, max_new_tokens=16).tokens.tolist()
    assert tokens["old"] == tokens["new"]
    times = {"old": [], "new": []}
    for r in range(a.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            side(name)
            lat = e.generate(ids, max_new_tokens=16).stats["decode_latencies_s"]
            times[name].append(sum(lat) / len(lat))
    side("new")
    out = {f"{n}_{k}_us": f(ts) * 1e6 for n, ts in times.items() for k, f in (("best", min), ("median", statistics.median))}
    out["new_over_old_best"] = out["new_best_us"] / out["old_best_us"]
    out["new_over_old_median"] = out["new_median_us"] / out["old_median_us"]
    out["loadavg"] = os.getloadavg()[0]
    for k, v in out.items():
        print(f"{k:22s} {v:10.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
