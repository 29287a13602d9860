#!/usr/bin/env python
"""Profile expert popularity: run prompts through a checkpoint and write per-layer expert counts.

The output is the JSON format of the Fiddler authors' Mixtral profiles
({"total_input_tokens": N, "expert_popularity": [[counts] x layers]}) plus provenance keys, and is
what `FiddlerPolicy(popularity=PATH)` / `placement=popularity` read.

Examples:
  python scripts/profile_popularity.py --model DIR --synthetic 32 --prompt-len 64 --out pop.json
  python scripts/profile_popularity.py --model DIR --prompts-file prompts.txt --out pop.json
With --max-new-tokens 0 (the default) only prompt tokens are routed, as in the published profiles;
otherwise generated tokens are counted too. Runs on the CPU path (no GPU needed; routing does not
depend on where experts run).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # usable from a checkout without `pip install -e .`

import torch

from fiddler import Engine
from fiddler.gpu_side import GpuSide

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synthetic_prompts(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]


def file_prompts(path: pathlib.Path, model: pathlib.Path, max_len: int) -> list[torch.Tensor]:
    """One prompt per non-empty line, tokenized with the checkpoint's tokenizer, truncated to max_len."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path}: no prompts (one per non-empty line)")
    return [torch.tensor(tok(line)["input_ids"][:max_len], dtype=torch.long) for line in lines]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=pathlib.Path, help="Hugging Face Mixtral checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N", help="N seeded random prompts")
    src.add_argument("--prompts-file", type=pathlib.Path, help="text file, one prompt per line")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per synthetic prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=0, help="also route this many generated tokens per prompt")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--out", required=True, type=pathlib.Path)
    args = p.parse_args(argv)

    engine = Engine.from_pretrained(args.model, dtype=DTYPES[args.dtype], gpu=GpuSide.none(),
                                    max_seq_len=args.max_seq_len, max_batch=1)
    cfg = engine.config
    if args.synthetic is not None:
        prompts = synthetic_prompts(args.synthetic, args.prompt_len, cfg.vocab_size, args.seed)
        described = f"{args.synthetic} synthetic prompts of {args.prompt_len} tokens, seed {args.seed}"
    else:
        prompts = file_prompts(args.prompts_file, args.model, args.max_seq_len - args.max_new_tokens)
        described = f"{len(prompts)} prompts from {args.prompts_file}"
    rec = engine.executor.attach_recorder()
    for ids in prompts:
        if args.max_new_tokens > 0:
            engine.generate(ids, max_new_tokens=args.max_new_tokens)
        else:
            engine.forward_logits(ids)
    pop = rec.popularity(
        source={"tool": "scripts/profile_popularity.py", "model": str(args.model), "prompts": described,
                "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
        routed_tokens=rec.tokens,
    )
    pop.total_input_tokens = sum(int(ids.numel()) for ids in prompts)  # prompt tokens, as in the published files
    pop.save(args.out)
    print(f"wrote {args.out}: {cfg.num_layers} layers x {cfg.num_experts} experts, "
          f"{pop.total_input_tokens} prompt tokens, {rec.tokens} tokens routed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
