"""The one-engine issue's speed lines, six rates (higher is better) in one process on one engine, printed as
one JSON line; run on both trees by scripts/ab.py (this file is data: the commit it ran at is in README.md).

    python engine_speed.py   # small_mixtral bf16, the engine's defaults

decode_tok_s: one request, 128-token prompt, 64 new tokens (generate's decode_tok_s). beam4/beam16_e2e_tok_s:
32 new tokens / (TTFT + decode time), same prompt. prefill512/2048_tok_s: prompt tokens / TTFT of a
1-token generation. batch_decode16_vs_1: BatchEngine output tok/s at 16 concurrent requests / at 1 (128-token
prompts, 64 tokens each), as benchmarks/test_batch_ratios.py defines it. One warm-up generation first.

The two choices the engine times at load are pinned to what this machine chooses when quiet (the linears'
kernel/torch crossover at 32 tokens, the kernel's prefill attention): on a shared machine their timing flips
them from run to run, and each flip moves prefill tok/s by up to 3x, which would drown the change measured.
The kernel's own tuned settings are printed beside the rates."""
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the harness runs the engine

import fiddler.engine  # noqa: E402
from fiddler import Engine  # noqa: E402
from fiddler.batch import BatchEngine  # noqa: E402
from runners.concurrency import prompts, timed_concurrent  # noqa: E402
from runners.models import synthetic_model  # noqa: E402

fiddler.engine.choose_kernel_max_tokens = lambda weight, **kw: 32
e = Engine.from_pretrained(synthetic_model("small_mixtral"), max_batch=16, max_seq_len=2048 + 64,
                           prefill_attention="kernel")
V = e.config.vocab_size
p128, p512, p2048 = (prompts(1, n, V, seed=n)[0] for n in (128, 512, 2048))
e.generate(p128, max_new_tokens=4)  # warm-up: first-call allocations, the kernel pool
out = {"decode_tok_s": e.generate(p128, max_new_tokens=64).stats["decode_tok_s"]}
for w in (4, 16):
    st = e.generate(p128, max_new_tokens=32, beam_width=w).stats
    out[f"beam{w}_e2e_tok_s"] = st["new_tokens"] / (st["ttft_s"] + st["decode_s"])
for n, p in ((512, p512), (2048, p2048)):
    out[f"prefill{n}_tok_s"] = e.generate(p, max_new_tokens=1).stats["prefill_tok_s"]
be = BatchEngine(e, slots=16)
ps = prompts(16, 128, V)
one = timed_concurrent(be, ps[:1], 64)["output_tok_s"]
many = timed_concurrent(be, ps, 64)["output_tok_s"]
out["batch_decode16_vs_1"] = many / one
info = e.info()
out["choices"] = {k: info[k] for k in ("kernel_max_tokens", "kernel_blocking", "kernel_stream", "kernel_amx")}
print(json.dumps(out))
