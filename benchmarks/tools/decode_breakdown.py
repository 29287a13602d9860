#!/usr/bin/env python
"""Where a CPU decode step's time goes: per token, the time inside each part of the engine's real decode
step (norms, q/k/v and o projections, rope + attention, router logits, routing, experts, lm_head, the
token choice) and inside the C library's calls, measured by wrapping the very callables the step calls
(no re-implementation), over whole generate() runs.

    python benchmarks/tools/decode_breakdown.py [--model tiny_mixtral] [--quant q4_0] [--threads 2]
    PYTHONPATH=<another tree> python benchmarks/tools/decode_breakdown.py   # that tree's engine (before/after)

Printed per token: each part's wall time as the step sees it (its Python wrapper, argument checks and the
C call), the time inside the C calls it makes, and the step's remainder (the decode loop, the residual
adds, the executor's bookkeeping: planner, readback, stats). Wrapping adds ~0.3 us a call, counted in the
remainder. The generate loop's own per-token time is printed beside, unwrapped, best of the rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

import fiddler.model as fmodel
from fiddler import Engine
from fiddler.hardware import cpu_description
from fiddler.kernels import _lib


class Clock:
    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)

    def wrap(self, name: str, fn):
        return Timed(self, name, fn)


class Timed:
    """fn, timed into clock under name; its attributes (e.g. DecodeAttention's) pass through."""

    def __init__(self, clock: Clock, name: str, fn):
        self._clock, self._name, self._fn = clock, name, fn

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._fn(*a, **k)
        finally:
            self._clock.t[self._name] += time.perf_counter() - t0
            self._clock.n[self._name] += 1

    def __getattr__(self, attr):
        v = getattr(self._fn, attr)
        if attr == "rows" and callable(v):  # DecodeAttention.rows: the same part
            return Timed(self._clock, self._name, v)
        return v


C_CALLS = ("fk_rmsnorm_bf16", "fk_rope_attn_decode_bf16", "fk_rope_attn_decode_rows_bf16", "fk_linear",
           "fk_moe_ffn", "fk_qlinear", "fk_qmoe_ffn", "fk_quantize_rows", "fk_decode_attn_block_bf16",
           "fk_decode_attn_block_q", "fk_rmsnorm_f32", "fk_moe_ffn_residual_bf16")


@contextmanager
def instrumented(engine: Engine, clock: Clock):
    """Wraps the decode step's callables (restored after)."""
    m, ex = engine.model, engine.executor
    undo = []

    def patch(obj, attr, name):
        old = getattr(obj, attr)
        setattr(obj, attr, clock.wrap(name, old))
        undo.append((obj, attr, old))

    for layer in m.layers:  # the packed kernel's forward where a Linear has one (the Linear itself stays,
        # so the decode step's one-call layers still serve it), else the projection object
        for attr, name in (("qkv_proj", "qkv_proj"), ("o_proj", "o_proj"), ("router", "router_logits")):
            lin = getattr(layer, attr)
            if lin is None:
                continue
            if getattr(lin, "packed", None) is not None:  # fiddler.model.Linear's or fiddler.quant's kernel
                patch(lin.packed, "forward", name)
            else:
                patch(layer, attr, name)
    if getattr(m, "_block", None) is not None and m._block[1] is not None:  # bound by the warm-up's decode steps
        m._block = (m._block[0], clock.wrap("decode block (one call a layer)", m._block[1]))
        undo.append((m, "_block", (m._block[0], m._block[1]._fn)))
    for attr in ("_kernel_norm", "_kernel_norm_f32"):
        if getattr(m, attr, None) is not None:
            patch(m, attr, "rms_norm")
    patch(fmodel, "rms_norm_f32", "rms_norm")
    if m._decode_ops is not None:
        patch(m, "_decode_ops", "rope_attention")
    patch(fmodel, "route", "route")
    patch(ex, "forward", "experts (executor.forward)")
    patch(m.lm_head.packed if m.lm_head.packed is not None else m, "forward" if m.lm_head.packed is not None
          else "lm_head", "lm_head")
    import fiddler.generate as fgen
    patch(fgen, "_check_finite", "isfinite check")
    patch(fgen, "choose_token", "token choice (argmax)")
    if hasattr(fgen, "greedy_rows"):  # the greedy check + argmax in one call (older trees: the two above)
        patch(fgen, "greedy_rows", "token choice (check + argmax)")
    import fiddler.kernels.decode as kdec
    for attr, name in (("_rmsnorm", "fk_rmsnorm_bf16"), ("_rope_attn", "fk_rope_attn_decode_bf16"),
                       ("_rope_attn_rows", "fk_rope_attn_decode_rows_bf16"), ("_block", "fk_decode_attn_block_bf16"),
                       ("_rmsnorm_f32", "fk_rmsnorm_f32"), ("_block_q", "fk_decode_attn_block_q")):
        if hasattr(kdec, attr):
            patch(kdec, attr, "C: " + name)
    import importlib
    for mod, attr, name in (("route", "_topk", "fk_route_topk_f32"), ("argmax", "_argmax", "fk_argmax_f32")):
        try:  # bound at import under their own names (older trees lack a module)
            k = importlib.import_module(f"fiddler.kernels.{mod}")
        except ImportError:
            continue
        if hasattr(k, attr):
            patch(k, attr, "C: " + name)
    for name in C_CALLS:
        if hasattr(_lib.lib, name):
            patch(_lib.lib, name, "C: " + name)
    try:
        yield
    finally:
        for obj, attr, old in reversed(undo):
            setattr(obj, attr, old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny_mixtral")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from runners.models import synthetic_model

    path = synthetic_model(a.model)
    engine = Engine.from_pretrained(Path(path), cpu_threads=a.threads, quant=a.quant)
    ids = torch.Generator().manual_seed(a.prompt)
    ids = torch.randint(3, 1000, (a.prompt,), generator=ids).tolist()
    engine.generate(ids, max_new_tokens=a.tokens)  # warm

    plain = []
    for _ in range(a.rounds):  # unwrapped: the loop's per-token time (median step of a generate, best round)
        plain.append(statistics.median(engine.generate(ids, max_new_tokens=a.tokens).stats["decode_latencies_s"]))

    best = None
    for _ in range(a.rounds):  # the round with the fastest total is reported (the quietest moment)
        clock, clock2 = Clock(), Clock()
        with instrumented(engine, clock):
            engine.generate(ids, max_new_tokens=1)  # prefill alone: subtracted below
        pre = (dict(clock.t), dict(clock.n))
        with instrumented(engine, clock2):
            out = engine.generate(ids, max_new_tokens=a.tokens)
        steps = len(out.stats["decode_latencies_s"])
        total = sum(out.stats["decode_latencies_s"])
        # the prefill's share of clock2: measured alone above, taken off
        parts = {k: (v - pre[0].get(k, 0.0)) / steps for k, v in clock2.t.items()}
        calls = {k: (n - pre[1].get(k, 0)) / steps for k, n in clock2.n.items()}
        if best is None or total < best[0]:
            best = (total / steps, parts, calls, out.stats.get("step_paths"))
    per_tok, parts, calls, paths = best
    print(f"model {a.model} quant {a.quant or 'bf16'} threads {a.threads}  load {open('/proc/loadavg').read().split()[:3]}")
    print(f"CPU: {cpu_description()}  decode path {engine.model.decode_path()}  step paths {paths}")
    print(f"generate loop, unwrapped: {min(plain) * 1e6:8.1f} us/token (median step, best of {a.rounds})")
    print(f"generate loop, wrapped:   {per_tok * 1e6:8.1f} us/token (mean step of the best round)")
    print(f"{'part':34s} {'us/token':>9s} {'calls/token':>12s}")
    top = [k for k in parts if not k.startswith("C: ")]  # disjoint: none is called inside another
    for k in sorted(top, key=lambda k: -parts[k]):
        print(f"{k:34s} {parts[k] * 1e6:9.1f} {calls[k]:12.1f}")
    outer = sum(parts[k] for k in top)
    print(f"{'remainder (loop, adds, bookkeeping)':34s} {(per_tok - outer) * 1e6:9.1f}")
    print("inside the C library:")
    c_total = 0.0
    for k in sorted((k for k in parts if k.startswith("C: ")), key=lambda k: -parts[k]):
        c_total += parts[k]
        print(f"  {k[3:]:32s} {parts[k] * 1e6:9.1f} {calls[k]:12.1f}")
    print(f"{'  all C calls':34s} {c_total * 1e6:9.1f}   -> Python and binding: {(per_tok - c_total) * 1e6:.1f} us/token")


if __name__ == "__main__":
    main()
