"""Side-by-side speed of the Fiddler engine and transformers on one model, in one process.

    python benchmarks/tools/bench_engine.py                       # small_mixtral (generated on first use), bf16
    python benchmarks/tools/bench_engine.py --model PATH --prompt-len 128 --new-tokens 32 --repeats 3
    python benchmarks/tools/bench_engine.py --no-hf --compare-fastpath   # fused decode kernels on vs torch ops

Both systems are timed the same way from outside: prefill = time to the first new token of a
1-token generation; decode tok/s = (N-1) / (time(generate N) - time(generate 1)). Runs alternate
between the systems and the best of --repeats is kept (the machine is shared; ratios matter). Also
prints the engine's decode bound (bytes per token / measured bandwidth) and its fraction of it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from fiddler import Engine  # noqa: E402
from runners.hardware import measured_cpu_bandwidth  # noqa: E402
from runners.decode_bound import decode_bound  # noqa: E402
from runners.models import synthetic_model  # noqa: E402


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small_mixtral", help="checkpoint dir or a synthetic model of conf/model/")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--beam-width", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="engine only")
    ap.add_argument("--json", action="store_true", help="print one JSON line with the results")
    ap.add_argument("--compare-fastpath", action="store_true",
                    help="also time the engine with its fused decode kernels off (torch ops for norms, rope, "
                         "KV-cache write and attention: MoETransformer.decode_fastpath = False), alternating")
    args = ap.parse_args()

    path = pathlib.Path(args.model)
    if not path.is_dir():
        path = synthetic_model(args.model, progress=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    engine = Engine.from_pretrained(path, cpu_threads=args.threads, max_seq_len=args.prompt_len + args.new_tokens,
                                    max_batch=args.beam_width)
    vocab = engine.config.vocab_size
    ids = torch.randint(3, vocab, (args.prompt_len,), generator=g)
    N, B = args.new_tokens, args.beam_width

    systems = {"fiddler": {}}
    fast_default = engine.model.decode_fastpath

    def gen(n, fast=fast_default):
        engine.model.decode_fastpath = fast
        return engine.generate(ids, max_new_tokens=n, beam_width=B)

    runs = {"fiddler": (lambda: gen(1), lambda: gen(N))}
    if args.compare_fastpath:
        if not fast_default:
            print("note: the fused decode kernels are not available here; both rows use the torch ops")
        systems["fiddler-torch-ops"] = {}
        runs["fiddler-torch-ops"] = (lambda: gen(1, False), lambda: gen(N, False))
    if not args.no_hf:
        from transformers import MixtralForCausalLM

        hf = MixtralForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        kw = dict(do_sample=False, num_beams=B)
        runs["transformers"] = (
            lambda: hf.generate(ids[None], max_new_tokens=1, min_new_tokens=1, **kw),
            lambda: hf.generate(ids[None], max_new_tokens=N, min_new_tokens=N, **kw),
        )
        systems["transformers"] = {}

    with torch.inference_mode():
        for name, (one, full) in runs.items():  # warm-up (page faults, oneDNN primitive caches)
            one()
            full()
        for _ in range(args.repeats):
            for name, (one, full) in runs.items():
                t1, tn = _timed(one), _timed(full)
                r = systems[name]
                r["prefill_s"] = min(r.get("prefill_s", 1e9), t1)
                r["decode_tok_s"] = max(r.get("decode_tok_s", 0.0), (N - 1) / max(tn - t1, 1e-9))
    out = gen(N)
    st = out.stats
    for r in systems.values():
        r["prefill_tok_s"] = args.prompt_len / r["prefill_s"]
    bound = decode_bound(str(path), "bfloat16", args.prompt_len, N, B,
                         {"in_engine": st["decode_tok_s"], "external": systems["fiddler"]["decode_tok_s"]},
                         st.get("decode_experts_per_layer"), measured_cpu_bandwidth()) \
        if engine.device.type == "cpu" else None
    res = {
        "model": str(path), "prompt_len": args.prompt_len, "new_tokens": N, "beam_width": B,
        "threads": torch.get_num_threads(), "systems": systems,
        "engine": {k: st.get(k) for k in ("decode_tok_s", "ttft_s")},
        "decode_bound": bound,
        "engine_info": {k: engine.info().get(k) for k in ("kernel_isa", "kernel_stream", "kernel_linears",
                                                          "kernel_max_tokens", "executor")},
        "decode_fastpath": fast_default,
    }
    if "transformers" in systems:
        f, t = systems["fiddler"], systems["transformers"]
        res["ratios"] = {"decode": f["decode_tok_s"] / t["decode_tok_s"], "prefill": f["prefill_tok_s"] / t["prefill_tok_s"]}
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model {path.name}  prompt {args.prompt_len}  new {N}  beam {B}  threads {res['threads']}")
    for name, r in systems.items():
        print(f"  {name:17s} prefill {r['prefill_tok_s']:8.1f} tok/s   decode {r['decode_tok_s']:7.2f} tok/s")
    if "fiddler-torch-ops" in systems:
        r = systems["fiddler"]["decode_tok_s"] / systems["fiddler-torch-ops"]["decode_tok_s"]
        print(f"  fused decode kernels on/off: decode {r:.3f}x")
    if "ratios" in res:
        print(f"  ratios fiddler/transformers: decode {res['ratios']['decode']:.2f}x  prefill {res['ratios']['prefill']:.2f}x")
    if bound:
        print(f"  decode bound {bound['bound_tok_s']:.2f} tok/s ({bound['bytes_per_token'] / 1e9:.3f} GB/token at "
              f"{bound['limit_gbps']:.1f} GB/s, {bound['limit_by']}); in-engine decode {st['decode_tok_s']:.2f} tok/s = "
              f"{bound['fraction']['in_engine']:.2f} of the bound; best external {bound['fraction']['external']:.2f}")
    print(f"  {res['engine_info']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
