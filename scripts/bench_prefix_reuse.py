"""Prefix reuse in Fiddler's server, measured side by side: mean TTFT of requests that share a system prompt,
with the engine's prefix cache (--prefix-cache-mb) and without it, the same prompts and load.

Every request's prompt is BOS, a shared prefix of --prefix tokens, then --suffix tokens of its own (seeded
random ids, sent as token ids, so both servers see exactly the same tokens). Before timing, each server gets
one request with the prefix and a suffix of its own (the warm-up: with the cache on, it stores the prefix).
Then --requests requests go out --concurrency at a time, streamed; TTFT is the client's time to the first
streamed token. Servers with and without the cache are started one after the other, --rounds times
alternately, on 127.0.0.1. The server's own /metrics prefix counters are read to show the reuse happened.

    python scripts/bench_prefix_reuse.py --model-path ~/.cache/fiddler/models/small_mixtral-* --out results/...
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fiddler.server.__main__ import SIZE  # noqa: E402  (the server's sizes, written once)
from runners.serving.process import ServerProcess  # noqa: E402
from runners.serving.workload import free_port  # noqa: E402


def prompts(vocab: int, prefix: int, suffix: int, n: int, seed: int) -> tuple[list[int], list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = [1] + rng.integers(3, vocab, size=prefix).tolist()
    return shared, [shared + rng.integers(3, vocab, size=suffix).tolist() for _ in range(n)]


def stream_ttft(port: int, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first streamed token, tokens streamed) of one completion."""
    import http.client

    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, chunks = None, 0
    for line in r:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
    c.close()
    return ttft, chunks


def prefix_counters(text: str | None) -> dict[str, int]:
    out = {}
    for result in ("hit", "miss"):
        m = re.search(rf'fiddler_prefix_cache_tokens_total\{{result="{result}"\}} (\d+)', text or "")
        out[result] = int(m.group(1)) if m else None
    return out


def one_side(args, cache_mb: float, shared: list[int], reqs: list[list[int]], log: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "fiddler.server", "--model", args.model_path, "--port", str(port),
           "--slots", str(args.concurrency), "--token-budget", str(args.token_budget),
           "--max-seq-len", str(len(reqs[0]) + args.max_tokens + 8), "--cpu-threads", str(args.threads),
           "--gpu-budget-gb", "0", "--served-model-name", "m", "--prefix-cache-mb", f"{cache_mb:g}"]
    server = ServerProcess(cmd, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, "127.0.0.1", port, "/health", log=log)
    try:
        server.wait_ready(900)
        warm = prompts(args.vocab, 0, args.suffix, 1, seed=args.seed + 999)[1][0][1:]
        stream_ttft(port, shared + warm, 1)  # the warm-up: the prefix with a suffix of its own
        before = prefix_counters(server.metrics_text())
        lock, ttfts = threading.Lock(), []

        def send(ids):
            t, n = stream_ttft(port, ids, args.max_tokens)
            with lock:
                ttfts.append(t)
            return n

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            streamed = list(pool.map(send, reqs))
        wall = time.perf_counter() - t0
        after = prefix_counters(server.metrics_text())
    finally:
        server.stop(60)
    delta = {k: (after[k] - before[k]) if after[k] is not None and before[k] is not None else None for k in after}
    return {"prefix_cache_mb": cache_mb, "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "ttft_max_s": max(ttfts), "requests": len(ttfts), "wall_s": wall, "streamed_tokens": sum(streamed),
            "server_prefix_tokens_timed": delta}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=SIZE["token_budget"].default, help=SIZE["token_budget"].help)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cache-mb", type=float, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = ap.parse_args(argv)
    args.vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    shared, reqs = prompts(args.vocab, args.prefix, args.suffix, args.requests, args.seed)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mb in (0.0, args.cache_mb):
                side = one_side(args, mb, shared, reqs, Path(tmp) / f"server-{r}-{mb:g}.log")
                side["round"] = r
                runs.append(side)
                print(json.dumps(side), flush=True)
    off = statistics.mean(s["ttft_mean_s"] for s in runs if not s["prefix_cache_mb"])
    on = statistics.mean(s["ttft_mean_s"] for s in runs if s["prefix_cache_mb"])
    out = {"prompt": {"bos_plus_prefix": len(shared), "suffix": args.suffix, "requests": args.requests,
                      "concurrency": args.concurrency, "max_tokens": args.max_tokens},
           "ttft_mean_without_s": off, "ttft_mean_with_s": on, "ratio_with_over_without": on / off,
           "runs": runs, "cpu": platform.processor() or platform.machine(), "threads": args.threads}
    print(f"mean TTFT without reuse {off:.3f} s, with reuse {on:.3f} s: {on / off:.3f}x "
          f"({args.requests} requests x {args.rounds} rounds each, concurrency {args.concurrency})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
