#!/usr/bin/env python
"""Decode and prompt rates of whichever llama-cpp-python this Python imports, on one GGUF, CPU only: for
setting one llama.cpp build beside another on the same host and file (e.g. a 2024 build, from
llama-cpp-python 0.2.77 with `llama_beam_search`, beside today's).

    python scripts/bench_llama_build.py MODEL.gguf [--prompt 128] [--decode 64] [--threads 2] [--reps 5]

Only llama_cpp's oldest stable calls are used (`Llama(...)`, `eval`, `reset`), so the same script runs on
either build. A fixed token sequence is evaluated (decode cost does not depend on which token is fed).
Prints one JSON line: the version, the prompt tok/s and decode tok/s of each repetition, and the best.
Measure on a quiet machine; interleave the builds (A B B A ...) to share the machine's drift.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.prompt + args.decode + 8, n_batch=512,
                          n_threads=args.threads, n_gpu_layers=0, verbose=False, logits_all=False)
    vocab = llm.n_vocab()
    prompt = [1 + (7 * i) % (vocab - 2) for i in range(args.prompt)]
    decode = [1 + (13 * i + 5) % (vocab - 2) for i in range(args.decode)]
    prompt_rates, decode_rates = [], []
    for rep in range(args.reps + 1):  # the first is a warm-up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for tok in decode:
            llm.eval([tok])
        t2 = time.perf_counter()
        if rep:
            prompt_rates.append(args.prompt / (t1 - t0))
            decode_rates.append(args.decode / (t2 - t1))
    print(json.dumps({"llama_cpp_python": llama_cpp.__version__, "gguf": os.path.basename(args.gguf),
                      "threads": args.threads, "prompt_tokens": args.prompt, "decode_tokens": args.decode,
                      "prompt_tok_s": prompt_rates, "decode_tok_s": decode_rates,
                      "best_prompt_tok_s": max(prompt_rates), "best_decode_tok_s": max(decode_rates)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
