"""Sections 4-6 of the device check: Fiddler's offload, its decode graphs, and transformers' offload of the same model."""
from __future__ import annotations

import os
import pathlib
import statistics
import time
import warnings

import torch

from dc_common import ROOT, Ctx, popularity_target, skipped, timed
from dc_model import budget_bytes, make_model, prompt_ids


# --------------------------------------------------------------------------------------------- 4 offload


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> dict:
    """How much of two sets of intervals (seconds) ran at the same time: |A and B| / min(|A|, |B|)."""
    def merged(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    ma, mb = merged(a), merged(b)
    tot_a, tot_b = sum(e - s for s, e in ma), sum(e - s for s, e in mb)
    both, i, j = 0.0, 0, 0
    while i < len(ma) and j < len(mb):
        both += max(0.0, min(ma[i][1], mb[j][1]) - max(ma[i][0], mb[j][0]))
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    small = min(tot_a, tot_b)
    return {"a_s": tot_a, "b_s": tot_b, "both_s": both, "fraction": both / small if small > 0 else None}


def profile_intervals(ctx: Ctx, engine, ids, new_tokens: int) -> dict:
    """One generate with the CPU queue's intervals (timed in whichever thread runs it), the GPU side's
    compute and its weight copies (on CUDA: device kernels and HtoD memcpys from torch.profiler, moved onto
    the host clock by a marker; on the emulated GPU: the executor's calls, timed), and their overlaps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ex = engine.executor
    iv: dict[str, list] = {"cpu_queue": [], "gpu_compute": [], "copy": []}
    wrapped = []

    def timed_calls(attr, kind):
        real = getattr(ex, attr)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                iv[kind].append((t0, time.perf_counter()))  # list.append is atomic: any thread may add

        setattr(ex, attr, call)
        wrapped.append(attr)

    timed_calls("_run_cpu_queue", "cpu_queue")
    timed_calls("_decode_row_on_cpu", "cpu_queue")
    if not ctx.cuda:
        timed_calls("_gpu_expert", "gpu_compute")
        timed_calls("_copy_in", "copy")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    try:
        with profile(activities=acts) as prof:
            mark = time.perf_counter()
            with record_function("dc.mark"):
                pass
            engine.generate(ids, max_new_tokens=new_tokens)
            ctx.sync()
    finally:
        for attr in wrapped:
            delattr(ex, attr)  # the instance attribute goes; the class's method shows again
    if ctx.cuda:
        evs = list(prof.events())
        m = next((e for e in evs if e.name == "dc.mark"), None)
        device = [e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA]
        if m is None or not device:
            return skipped(f"the profiler returned {'no marker' if m is None else 'no device events'}")
        shift = mark - m.time_range.start / 1e6  # profiler microseconds -> perf_counter seconds
        for ev in device:
            span = (ev.time_range.start / 1e6 + shift, ev.time_range.end / 1e6 + shift)
            iv["copy" if "HtoD" in ev.name else "gpu_compute"].append(span)
    return {"cpu_vs_gpu": overlap(iv["cpu_queue"], iv["gpu_compute"]),
            "copy_vs_compute": overlap(iv["copy"], iv["gpu_compute"]),
            "intervals": {k: len(v) for k, v in iv.items()}}


def makespans(ctx: Ctx, engine, ids, new_tokens: int) -> dict:
    """The planner's predicted makespan of each MoE call against its measured one (device synced around
    each call, so this pass is not the timed one)."""
    ex = engine.executor
    real = ex.forward
    calls = []

    def measured(layer, x, idx, w, **kw):
        before = ex.stats.predicted_s
        ctx.sync()
        t0 = time.perf_counter()
        out = real(layer, x, idx, w, **kw)
        ctx.sync()
        calls.append((int(idx.shape[0]), ex.stats.predicted_s - before, time.perf_counter() - t0))
        return out

    ex.forward = measured
    try:
        engine.generate(ids, max_new_tokens=new_tokens)
    finally:
        del ex.forward
    out = {}
    for name, sel in (("prefill", lambda t: t > 1), ("decode", lambda t: t == 1)):
        rows = [(p, m) for t, p, m in calls if sel(t)]
        if rows:
            out[name] = {"calls": len(rows), "predicted_s": sum(p for p, _ in rows),
                         "measured_s": sum(m for _, m in rows),
                         "measured_over_predicted": sum(m for _, m in rows) / max(1e-12, sum(p for p, _ in rows)),
                         "median_call_ratio": statistics.median(m / p for p, m in rows if p > 0)
                         if any(p > 0 for p, _ in rows) else None}
    return out


def sync_census(ctx: Ctx, engine, ids, new_tokens: int) -> dict:
    """Where the engine makes the host wait for the GPU: torch's sync debug mode warns at each syncing
    call; the warnings are counted by the Python line that made them."""
    if not ctx.cuda:
        return skipped("torch.cuda.set_sync_debug_mode needs CUDA")
    sites: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(ids, max_new_tokens=new_tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        key = f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"
        sites[key] = sites.get(key, 0) + 1
    steps = new_tokens
    return {"generate_new_tokens": steps, "syncs": sum(sites.values()),
            "syncs_per_token": sum(sites.values()) / max(1, steps),
            "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]))}


def launch_census(ctx: Ctx, engine, ids, steps: int = 4) -> dict:
    """Ops a decode step launches, per decoder layer (fiddler.launches: top-level aten ops less views and
    metadata; on CUDA also the kernels the profiler saw), and the readback's waits per MoE layer call (one
    is the design: fiddler.executors.readback)."""
    from fiddler.launches import count_launches
    from fiddler.step import Segment

    n = ids.shape[-1]
    ids = ids.reshape(-1)
    engine.step(ids, [Segment(0, 0, n, True)])
    pos = [n]

    def decode():
        engine.step(ids[-1:], [Segment(0, pos[0], 1, True)])
        pos[0] += 1

    ex, L = engine.executor, engine.config.num_layers
    waits0, calls0 = ex.readback.waits, ex.stats.calls
    per_step, names = count_launches(decode, steps=steps)
    out = {"aten_ops_per_step": per_step, "aten_ops_per_layer": per_step / L, "layers": L,
           "ops": dict(names.most_common(16)),
           "readback_waits_per_moe_call": (ex.readback.waits - waits0) / max(1, ex.stats.calls - calls0),
           "decode_path": engine.info().get("decode_path")}
    if ctx.cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                decode()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["cuda_kernels_per_layer"] = len(kernels) / steps / L
    return out


def load_fiddler(ctx: Ctx, path: pathlib.Path, **engine_kw):
    from fiddler import Engine
    from fiddler.config import MoEConfig
    from fiddler.executors import FiddlerPolicy, GpuSide
    from fiddler.popularity import Popularity

    shape = ctx.shape
    cfg = MoEConfig.from_pretrained(path)
    max_seq_len = shape.prefill + 64
    probe = GpuSide.cuda(1 << 30) if ctx.cuda else GpuSide.emulated(1 << 30)
    budget, resident = budget_bytes(ctx, cfg, max_seq_len, probe.overhead_bytes())
    gpu = GpuSide.cuda(budget) if ctx.cuda else GpuSide.emulated(budget)
    engine = Engine.from_pretrained(path, gpu=gpu, dtype=torch.bfloat16, max_seq_len=max_seq_len, max_batch=1,
                                    executor=FiddlerPolicy(placement="popularity",
                                                           popularity=Popularity(popularity_target(shape),
                                                                                 top_k=shape.top_k)),
                                    **engine_kw)
    return engine, budget, resident


def section_offload(ctx: Ctx) -> dict:
    shape = ctx.shape
    t0 = time.perf_counter()
    path = make_model(ctx)
    gen_s = time.perf_counter() - t0
    engine, budget, resident_target = load_fiddler(ctx, path)
    ex = engine.executor
    rec = ex.attach_recorder()
    prefill_ids, decode_ids = prompt_ids(shape.prefill), prompt_ids(32, seed=2)
    engine.generate(prompt_ids(16, seed=9), max_new_tokens=4)  # warm-up
    pre = engine.generate(prefill_ids, max_new_tokens=1).stats
    dec = engine.generate(decode_ids, max_new_tokens=shape.decode).stats
    ex.recorder = None
    shares = [[c / max(1e-9, sum(row)) * shape.top_k for c in row] for row in rec.popularity().counts]
    target = popularity_target(shape)
    info = engine.info()
    mem = ({"prefill": pre["cuda_memory"], "decode": dec["cuda_memory"]} if ctx.cuda
           else skipped("no CUDA: the emulated GPU's memory is host memory (engine.info host_bytes)"))
    result = {
        "model": {**shape.arch(), "path": str(path), "generated_s": gen_s, "load_s": info["load_s"]},
        "budget_bytes": budget, "resident_experts": info["executor_info"]["placement"].get("num_resident"),
        "resident_target": resident_target, "experts_total": shape.layers * shape.experts,
        "prefill": {"tokens": shape.prefill, "ttft_s": pre["ttft_s"], "prefill_tok_s": pre["prefill_tok_s"],
                    "decisions": pre["executor"]},
        "decode": {"prompt": 32, "new_tokens": shape.decode, "ttft_s": dec["ttft_s"],
                   "decode_tok_s": dec["decode_tok_s"], "decisions": dec["executor"]},
        "routing": {"target_shares": target, "measured_shares": shares,
                    "measured_max_over_min": [max(r) / max(1e-9, min(r)) for r in shares],
                    "target_max_over_min": [max(r) / min(r) for r in target]},
        "cuda_memory": mem, "host_bytes": info["host_bytes"],
        "overlap_decode": profile_intervals(ctx, engine, decode_ids, min(8, shape.decode)),
        "overlap_prefill": profile_intervals(ctx, engine, prefill_ids, 1),
        "makespan": makespans(ctx, engine, prefill_ids, 8),
        "sync_census": sync_census(ctx, engine, decode_ids, 8),
        "sync_census_prefill": sync_census(ctx, engine, prefill_ids, 1),
        "launches": launch_census(ctx, engine, decode_ids),
    }
    if ctx.cuda:  # each generate resets the peak: the larger of the timed prefill's and decode's
        result["max_memory_reserved"] = max(m["max_memory_reserved"] for m in mem.values())
    return result


def hbm_read_gbps(ctx: Ctx) -> dict:
    """The GPU memory's read rate, measured independently of the engine: the best of 5 sums over a 4 GiB
    bf16 tensor (bytes read / time), the limit a decode step streaming its weights can reach."""
    if not ctx.cuda:
        return skipped("no CUDA: an emulated GPU has no device memory of its own")
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    best = min(timed(lambda: x.sum(), ctx, repeats=5, warmup=2))
    del x
    return {"gbps": (4 << 30) / best / 1e9, "bytes": 4 << 30, "best_s": best}


def section_graphs(ctx: Ctx) -> dict:
    """All-resident decode at the shape's dims (Mixtral-8x7B's on the device: every expert of its 4 layers
    on the GPU) with each layer's dense part as a CUDA graph (fiddler.decode_graph), against the eager GPU
    side on the same engine and weights: the first steps' logits and greedy tokens, decode tok/s of each
    (median of 3) and as a fraction of the HBM roofline (bytes a decode step reads, MoEConfig's
    decode_bytes_per_token, at the measured read rate), the launches a step makes (aten ops; on CUDA the
    kernels and graph launches the profiler saw), and a decode step under torch.cuda.set_sync_debug_mode
    ("error"). On an emulated GPU (dry run) the graphs' static ops run eagerly: the numbers check the
    section, not the graphs."""
    from fiddler import Engine
    from fiddler.config import MoEConfig
    from fiddler.executors import FiddlerPolicy, GpuSide
    from fiddler.launches import count_launches
    from fiddler.placement import reservation
    from fiddler.step import Segment

    shape = ctx.shape
    path = make_model(ctx)
    cfg = MoEConfig.from_pretrained(path)
    max_seq_len = 32 + shape.decode + 64
    probe = GpuSide.cuda(1 << 30) if ctx.cuda else GpuSide.emulated(1 << 30)
    budget = sum(reservation(cfg, torch.bfloat16, max_seq_len, 1, overhead=probe.overhead_bytes()).values()) + \
        cfg.num_moe_layers * cfg.expert_slots * int(cfg.expert_bytes(torch.bfloat16))
    gpu = GpuSide.cuda(budget) if ctx.cuda else GpuSide.emulated(budget)
    engine = Engine.from_pretrained(path, gpu=gpu, dtype=torch.bfloat16, max_seq_len=max_seq_len, max_batch=1,
                                    executor=FiddlerPolicy(placement="all"), decode_graphs=True)
    m, graphs = engine.model, engine.model.decode_graphs
    ids = prompt_ids(32, seed=3)
    n = ids.shape[-1]

    def decode_logits(steps: int) -> list[torch.Tensor]:
        engine.step(ids.reshape(-1), [Segment(0, 0, n, True)])
        tok, out = ids.reshape(-1)[-1:], []
        for t in range(steps):
            logits = engine.step(tok, [Segment(0, n + t, 1, True)]).float().clone()
            out.append(logits)
            tok = logits.argmax(-1)
        return out

    def tok_s(new: int) -> float:
        return statistics.median(engine.generate(ids, max_new_tokens=new).stats["decode_tok_s"] for _ in range(3))

    with_g = decode_logits(8)
    assert m.last_path == "graph_decode", m.last_path
    with_g_tok_s = tok_s(shape.decode)
    per_step, names = count_launches(lambda: engine.step(ids.reshape(-1)[-1:], [Segment(0, n, 1, True)]), steps=4)
    out = {"captured_batch_sizes": list(graphs.captured), "replays": graphs.replays, "capture": graphs.capture,
           "graph": {"decode_tok_s": with_g_tok_s, "aten_ops_per_step": per_step, "ops": dict(names.most_common(12))}}
    if ctx.cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                engine.step(ids.reshape(-1)[-1:], [Segment(0, n, 1, True)])
            torch.cuda.synchronize()
        ev = prof.events()
        out["graph"]["cuda_kernels_per_step"] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in ev) / 4
        out["graph"]["graph_launches_per_step"] = sum(e.name == "cudaGraphLaunch" for e in ev) / 4
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.step(ids.reshape(-1)[-1:], [Segment(0, n, 1, True)])
            out["graph"]["sync_debug_error_mode"] = "no unexpected sync outside the readback"
        except RuntimeError as e:
            out["graph"]["sync_debug_error_mode"] = f"raised: {str(e)[:300]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    m.decode_graphs = None  # the eager GPU side, same engine
    try:
        eager = decode_logits(8)
        eager_tok_s = tok_s(shape.decode)
    finally:
        m.decode_graphs = graphs
    hbm = hbm_read_gbps(ctx)
    nbytes = sum(cfg.decode_bytes_per_token(kv, torch.bfloat16) for kv in range(n + 1, n + shape.decode)) / \
        (shape.decode - 1)
    out["roofline"] = {"bytes_per_token": nbytes, "hbm_read": hbm, "resident_experts":
                       engine.info()["executor_info"]["placement"].get("num_resident"),
                       "experts_total": cfg.num_moe_layers * cfg.expert_slots}
    if "gbps" in hbm:
        bound = hbm["gbps"] * 1e9 / nbytes
        out["roofline"] |= {"bound_tok_s": bound, "graph_fraction": with_g_tok_s / bound,
                            "eager_fraction": eager_tok_s / bound}
    diffs = [float((a - b).abs().max()) for a, b in zip(with_g, eager)]
    scale = max(float(b.abs().max()) for b in eager)
    out["eager"] = {"decode_tok_s": eager_tok_s}
    out["compare"] = {"max_abs_logit_diff": max(diffs), "logit_scale": scale,
                      "greedy_tokens_equal": [int(a.argmax()) for a in with_g] == [int(b.argmax()) for b in eager],
                      "graph_over_eager_tok_s": with_g_tok_s / eager_tok_s if eager_tok_s else None}
    return out


# --------------------------------------------------------------------------------------------- 5 transformers


def section_hf_offload(ctx: Ctx) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shape = ctx.shape
    path = make_model(ctx)
    fid = ctx.earlier("offload")
    if ctx.cuda:
        # the GPU memory Fiddler actually used, so both systems are compared at the same footprint
        gpu_bytes = (fid or {}).get("max_memory_reserved") or budget_bytes(ctx, _cfg(path), shape.prefill + 64, {})[0]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        kw = {"device_map": "auto", "max_memory": {0: int(gpu_bytes), "cpu": 512 << 30}}
        placement = f"device_map='auto', max_memory GPU {gpu_bytes / 2**30:.2f} GiB (Fiddler's max_memory_reserved)"
    else:
        gpu_bytes, kw = None, {"device_map": {"": "cpu"}}
        placement = "no GPU: the whole model on the CPU (what transformers does without one)"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
    load_s = time.perf_counter() - t0
    dev = next(model.parameters()).device if not ctx.cuda else torch.device("cuda:0")
    where = {}
    for v in getattr(model, "hf_device_map", {"": "cpu"}).values():
        where[str(v)] = where.get(str(v), 0) + 1

    def gen(ids, n):
        with torch.inference_mode():
            model.generate(ids[None].to(dev), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)

    gen(prompt_ids(16, seed=9), 2)  # warm-up
    reps = 1  # a step of its offload reloads every offloaded layer: seconds each on the device
    ttft = statistics.median(timed(lambda: gen(prompt_ids(shape.prefill), 1), ctx, repeats=reps, warmup=0))
    decode_ids = prompt_ids(32, seed=2)
    one = statistics.median(timed(lambda: gen(decode_ids, 1), ctx, repeats=reps, warmup=0))
    full = timed(lambda: gen(decode_ids, shape.hf_decode), ctx, repeats=1, warmup=0)[0]
    out = {"placement": placement, "device_map_modules": where, "load_s": load_s,
           "prefill": {"tokens": shape.prefill, "ttft_s": ttft, "prefill_tok_s": shape.prefill / ttft},
           "decode": {"prompt": 32, "new_tokens": shape.hf_decode,
                      "decode_tok_s": (shape.hf_decode - 1) / max(1e-9, full - one)},
           "gpu_memory_given_bytes": gpu_bytes,
           "max_memory_reserved": int(torch.cuda.max_memory_reserved()) if ctx.cuda else
           skipped("no CUDA"),
           "fiddler_max_memory_reserved": (fid or {}).get("max_memory_reserved")}
    if fid:
        out["fiddler_over_transformers"] = {
            "decode_tok_s": fid["decode"]["decode_tok_s"] / out["decode"]["decode_tok_s"],
            "ttft": out["prefill"]["ttft_s"] / fid["prefill"]["ttft_s"]}
    return out


def _cfg(path):
    from fiddler.config import MoEConfig

    return MoEConfig.from_pretrained(path)
