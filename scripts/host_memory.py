"""Host memory of the engine on an emulated GPU: peak RssAnon through load and a generate, and the engine's
host_bytes by part against the sizes computed from the config (issue 22's acceptance check).

    python scripts/host_memory.py                          # small_mixtral, 0 / 50 / 100% of experts resident
    python scripts/host_memory.py --model tiny_mixtral --fractions 0.5 --json
    python scripts/host_memory.py --fractions 0.5 --plan copy   # every non-resident expert copied in (kind b)

Each fraction runs in a fresh process (`--one`), so that one run's memory does not carry into the next. A
thread samples /proc/self/status RssAnon every --interval seconds from before load until the generate
returns. Judged: peak RssAnon <= --limit x (checkpoint bytes + KV cache), and each host_bytes part within
2% of its size from the config (a part expected to be 0 may be at most 1 MiB: the decode-step buffers).
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

ZERO_SLACK = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class Sampler(threading.Thread):
    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.peak, self.samples, self._halt = interval, 0, 0, threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.peak = max(self.peak, rss_anon())
            self.samples += 1
            self._halt.wait(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, rss_anon())
        return self.peak


def expected_parts(cfg, dtype, placement: dict, reserved: dict, max_seq_len: int, max_batch: int,
                   linears_twice: bool) -> dict[str, int]:
    """host_bytes computed from the config on an emulated GPU (its "device" memory is host memory): every
    non-expert weight (the CPU linears twice, torch's copy and the kernel's packed one, when the engine
    measured that torch serves long prompts faster: linears_twice), every expert once, the KV cache, and
    the copy buffers + unpack scratch when some expert is not resident."""
    from fiddler.kernels import layout

    dense = int(cfg.non_expert_bytes(dtype))
    if linears_twice:  # attention projections, routers and lm_head
        dense += (cfg.num_layers * (cfg.attention_params() + cfg.num_experts * cfg.hidden_size)
                  + cfg.vocab_size * cfg.hidden_size) * dtype.itemsize

    L, E = cfg.num_moe_layers, cfg.expert_slots
    n_res = placement["num_resident"]
    packed = sum(layout.expert_packed_bytes(cfg.hidden_size, cfg.intermediate_size))
    some_copied = n_res < L * E
    return {"dense": dense,
            "experts": n_res * int(cfg.expert_bytes(dtype)) + (L * E - n_res) * packed,
            "kv_cache": int(cfg.kv_cache_bytes(max_seq_len, max_batch, dtype)),
            "buffers": (reserved["expert_copy_buffers"] + reserved["unpack_scratch"]) if some_copied else 0}


def one(args) -> dict:
    import torch

    from fiddler import Engine
    from fiddler.config import MoEConfig
    from fiddler.executors import FiddlerPolicy, GpuSide
    from fiddler.latency import LatencyModel
    from fiddler.placement import reservation
    from runners.models import synthetic_model

    path = pathlib.Path(args.model)
    if not path.is_dir():
        path = synthetic_model(args.model)
    cfg, dtype = MoEConfig.from_pretrained(path), torch.bfloat16
    L, E = cfg.num_moe_layers, cfg.expert_slots
    res = reservation(cfg, dtype, args.max_seq_len, args.max_batch)
    n = int(args.fraction * L * E + 1e-9)
    budget = sum(res.values()) + n * int(cfg.expert_bytes(dtype))
    ckpt = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    sampler = Sampler(args.interval)
    before = rss_anon()
    sampler.start()
    t0 = time.perf_counter()
    lm = None  # calibrated here
    if args.plan == "copy":  # copying always pays, the CPU never does: kind b for every non-resident expert
        lm = LatencyModel.manual(cpu=(1.0, 10.0), gpu=(1e-6, 1e-5), transfer=1e-4)
    engine = Engine.from_pretrained(path, dtype=dtype, gpu=GpuSide.emulated(budget), max_seq_len=args.max_seq_len,
                                    max_batch=args.max_batch,
                                    executor=FiddlerPolicy(placement="popularity", latency_model=lm))
    t_load = time.perf_counter() - t0
    ids = torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    out = engine.generate(ids, max_new_tokens=args.new_tokens)
    peak = sampler.stop()
    info = engine.info()
    ex = info["executor_info"]
    kv = int(cfg.kv_cache_bytes(args.max_seq_len, args.max_batch, dtype))
    twice = info["kernel_linears"] and info["kernel_max_tokens"] < (1 << 30)
    want = expected_parts(cfg, dtype, ex["placement"], res, args.max_seq_len, args.max_batch, twice)
    got = info["host_bytes"]
    parts = {k: {"host_bytes": got[k], "from_config": want[k],
                 "ok": abs(got[k] - want[k]) <= (0.02 * want[k] if want[k] else ZERO_SLACK)} for k in want}
    limit = args.limit * (ckpt + kv)
    return {"model": str(path), "fraction": args.fraction, "num_resident": ex["placement"]["num_resident"],
            "budget_bytes": budget, "checkpoint_bytes": ckpt, "kv_cache_bytes": kv,
            "rss_anon_before": before, "rss_anon_peak": peak, "samples": sampler.samples,
            "peak_over_ckpt_plus_kv": peak / (ckpt + kv), "limit": args.limit, "peak_ok": peak <= limit,
            "parts": parts, "linears_twice": twice, "kinds": out.stats["executor"]["tokens"],
            "load_s": round(t_load, 1),
            "new_tokens": int(out.tokens.shape[0])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small_mixtral", help="checkpoint dir or a synthetic model of conf/model/")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.05, help="RssAnon sampling period, seconds")
    ap.add_argument("--limit", type=float, default=1.15, help="peak RssAnon / (checkpoint + KV cache) allowed")
    ap.add_argument("--plan", choices=["calibrated", "copy"], default="calibrated",
                    help="the planner's latency model: calibrated here, or one that copies every non-resident expert")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return 0
    results, ok = [], True
    for fr in args.fractions:
        cmd = [sys.executable, __file__, "--one", "--fraction", str(fr), "--model", args.model,
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--max-seq-len", str(args.max_seq_len), "--max-batch", str(args.max_batch),
               "--interval", str(args.interval), "--limit", str(args.limit), "--plan", args.plan]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return 2
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results.append(r)
        parts_ok = all(v["ok"] for v in r["parts"].values())
        ok &= r["peak_ok"] and parts_ok
        gib = 2**30
        print(f"fraction {fr:.2f}: {r['num_resident']} resident; peak RssAnon {r['rss_anon_peak'] / gib:.3f} GiB = "
              f"{r['peak_over_ckpt_plus_kv']:.3f} x (checkpoint {r['checkpoint_bytes'] / gib:.3f} + KV "
              f"{r['kv_cache_bytes'] / gib:.3f} GiB) [limit {r['limit']}: {'ok' if r['peak_ok'] else 'FAIL'}], "
              f"{r['samples']} samples, load {r['load_s']} s, kinds {r['kinds']}")
        for k, v in r["parts"].items():
            print(f"    {k:9s} host_bytes {v['host_bytes']:>13d}  from config {v['from_config']:>13d}  "
                  f"{'ok' if v['ok'] else 'FAIL'}")
    if args.json:
        print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
