"""Output throughput of the batch engine at 1, 8 and 16 concurrent requests, on one engine, in one process.

    python scripts/bench_batch.py                                  # small_mixtral, 128-token prompts, 64 out
    python scripts/bench_batch.py --model tiny_mixtral --concurrency 1,4,16 --rounds 3 --json out.json

Every request returns exactly --max-tokens tokens (ignore_eos). Rounds interleave the concurrencies (the
machine may be shared; ratios matter) and the best of --rounds is kept. The 1-request figure is the better
of the batch engine with one request and Engine.generate (the one-request path), so a ratio never gains from
a slow single-request path. Prints the planner's decisions by kind (a: resident on the GPU, b: copied in,
c: on the CPU) at each concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the harness runs the engine (systems/engine_adapter.py)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fiddler.batch import BatchEngine  # noqa: E402
from fiddler.hardware import cpu_description  # noqa: E402
from fiddler.server.__main__ import SIZE  # noqa: E402  (the server's sizes, written once)
from runners.concurrency import prompts, timed_concurrent  # noqa: E402
from runners.models import synthetic_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small_mixtral", help="checkpoint dir or a synthetic model of conf/model/")
    ap.add_argument("--concurrency", default="1,8,16", help="comma-separated request counts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=SIZE["token_budget"].default, help=SIZE["token_budget"].help)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write the results here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if not levels or min(levels) < 1:
        ap.error("--concurrency needs request counts >= 1")

    path = pathlib.Path(args.model)
    if not path.is_dir():
        path = synthetic_model(args.model, progress=True)
    be = BatchEngine.from_pretrained(path, slots=max(levels), token_budget=args.token_budget,
                                     cpu_threads=args.threads, max_seq_len=args.prompt_len + args.max_tokens)
    engine = be.engine
    ps = prompts(max(levels), args.prompt_len, engine.config.vocab_size)
    best: dict[int, dict] = {}
    single_path = None
    timed_concurrent(be, ps[:1], 4)  # warm-up: first-call allocations, the kernel pool
    for r in range(args.rounds):
        for c in levels:
            res = timed_concurrent(be, ps[:c], args.max_tokens)
            if c not in best or res["output_tok_s"] > best[c]["output_tok_s"]:
                best[c] = res
            print(f"round {r + 1}/{args.rounds}: {c:3d} requests {res['output_tok_s']:8.2f} tok/s", flush=True)
        t = time.perf_counter()
        engine.generate(ps[0], max_new_tokens=args.max_tokens)
        tok_s = args.max_tokens / (time.perf_counter() - t)
        single_path = max(single_path or 0.0, tok_s)
    one = max(([best[1]["output_tok_s"]] if 1 in best else []) + [single_path])
    cpu = cpu_description()
    print(f"\n{cpu}, {engine.info()['kernel_isa']}: {args.model}, prompts {args.prompt_len}, {args.max_tokens} tokens each, best of {args.rounds}, "
          f"token budget {args.token_budget}; 1-request figure {one:.2f} tok/s (batch engine "
          f"{best[1]['output_tok_s'] if 1 in best else float('nan'):.2f}, Engine.generate {single_path:.2f})")
    print(f"{'requests':>8} {'tok/s':>9} {'x 1-req':>8} {'steps':>6} {'TTFT mean s':>12} {'experts a/b/c':>16}")
    for c in levels:
        b = best[c]
        k = b["experts_by_kind"]
        print(f"{c:8d} {b['output_tok_s']:9.2f} {b['output_tok_s'] / one:8.2f} {b['steps']:6d} "
              f"{b['ttft_s_mean']:12.3f} {k['a']:>5}/{k['b']}/{k['c']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "token_budget": args.token_budget, "cpu": cpu, "engine": {k: v for k, v in engine.info().items()
                                                                      if k in ("kernel_isa", "executor", "dtype")},
            "one_request_tok_s": one, "engine_generate_tok_s": single_path,
            "best": {str(c): best[c] for c in levels}, "speedup": {str(c): best[c]["output_tok_s"] / one for c in levels},
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
