"""The beams' common prefix, step by step, in this project's engine's beam search (fiddler.generate's
`common_prefix_lens` stat): the input of `system=llama_cpp_original`'s `beam_prefix=measured`.

    python scripts/record_beam_prefix.py --out results/measured/<dir>/beam_prefix.json [--model small_mixtral]

The paper's beam workload (input 32, output 64, widths 4/8/12/16) on the benchmark model (a synthetic
checkpoint, runners/synthetic.py: its logits are not real text's, so the prefix is a property of that model;
the summary reports the bounds beside it), the harness's synthetic prompt (runners/workloads.py, seed 0),
every expert on the CPU (the executor does not change the tokens). Writes
{"widths": {B: [common prefix after step 1..64]}, ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from omegaconf import OmegaConf

    import torch

    from fiddler import Engine
    from runners.synthetic import ensure_synthetic_model
    from runners.workloads import synthetic_prompt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small_mixtral")
    ap.add_argument("--widths", default="4,8,12,16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fiddler"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    m = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml"))
    path = ensure_synthetic_model(args.model, m["arch"], int(m["seed"]), args.cache, m["dtype"])
    widths = [int(w) for w in args.widths.split(",")]
    eng = Engine.from_pretrained(path, max_seq_len=args.input_len + args.output_len, max_batch=max(widths))
    prompt = torch.tensor(synthetic_prompt(0, args.input_len, m["arch"]["vocab_size"]))
    out = {"what": "common prefix (generated tokens all running beams share) after each step, fiddler.generate beam "
                   "search, greedy scores, length_penalty 1", "model": args.model, "input_len": args.input_len,
           "output_len": args.output_len, "prompt": "runners.workloads.synthetic_prompt(seed=0)", "widths": {}}
    for b in widths:
        res = eng.generate(prompt, max_new_tokens=args.output_len, beam_width=b)
        lens = res.stats["common_prefix_lens"]
        out["widths"][str(b)] = lens
        print(b, len(lens), lens[-1], file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
