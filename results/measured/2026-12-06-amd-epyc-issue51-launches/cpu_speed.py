"""Issue 51's "no slower on the CPU" line: three rates (higher is better) of small_mixtral bf16 with no GPU, in
one process on one engine, printed as one JSON line; run on both trees by scripts/ab.py (this file is data:
the commit it ran at is in README.md).

decode_tok_s: one request, 128-token prompt, 64 new tokens (generate's decode_tok_s), best of 2 generations.
prefill512_tok_s: 512 prompt tokens / TTFT of a 1-token generation. beam4_e2e_tok_s: 32 new tokens / (TTFT +
decode time) at beam width 4. The two load-time timing choices are pinned as in the issue-46 A/B
(results/measured/2026-12-06-amd-epyc-issue46-one-engine-ab/engine_speed.py says why)."""
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the harness runs the engine

import fiddler.engine  # noqa: E402
from fiddler import Engine  # noqa: E402
from runners.concurrency import prompts  # noqa: E402
from runners.models import synthetic_model  # noqa: E402

fiddler.engine.choose_kernel_max_tokens = lambda weight, **kw: 32
e = Engine.from_pretrained(synthetic_model("small_mixtral"), max_batch=4, max_seq_len=512 + 64,
                           prefill_attention="kernel")
V = e.config.vocab_size
p128, p512 = (prompts(1, n, V, seed=n)[0] for n in (128, 512))
e.generate(p128, max_new_tokens=4)  # warm-up: first-call allocations, the kernel pool
out = {"decode_tok_s": max(e.generate(p128, max_new_tokens=64).stats["decode_tok_s"] for _ in range(2))}
st = e.generate(p128, max_new_tokens=32, beam_width=4).stats
out["beam4_e2e_tok_s"] = st["new_tokens"] / (st["ttft_s"] + st["decode_s"])
out["prefill512_tok_s"] = e.generate(p512, max_new_tokens=1).stats["prefill_tok_s"]
print(json.dumps(out))
