"""The bf16 token fixture: small_mixtral's greedy and beam outputs for 8 fixed prompts, recorded once per
kernel class and compared by tests/test_token_fixture.py, so that a change to the engine's structure (not
its numerics) shows it produces the same tokens as before. fp32 exactness against transformers is proven
elsewhere; bf16 has no reference but the engine's own past, since rounding makes near-ties fragile.

Every choice the engine makes from a timing at load is pinned here, since a timing must not decide bits:
the linears run on the packed kernel at every token count (set_kernel_max_tokens), a prompt's attention
on torch's SDPA, AMX tiles (where present) from a fixed token count. A class is the CPU (vendor, family,
model) and the kernel's ISA path: torch's and the kernel's bf16 arithmetic may differ between them, so a
class is compared only on the CPUs it was recorded on, and a new class may be recorded at any time.

    python -m tests.token_fixture --record   # (re)record this machine's class; see the rule below

Re-recording an existing class is allowed only with evidence that every changed output's first differing
step had a top-2 logit margin below bf16's rounding at that magnitude (--margins prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

FIXTURE = pathlib.Path(__file__).parent / "data" / "small_mixtral_bf16_tokens.json"
PROMPT_LENS = (5, 17, 33, 64, 100, 128, 200, 256)
GREEDY_TOKENS, BEAM_TOKENS, BEAM_WIDTHS = 64, 32, (4, 16)
AMX_MIN_TOKENS = "4"  # pinned AMX-BF16 crossover (where tiles exist)


def kernel_class() -> str:
    import re

    from fiddler import kernels
    from fiddler.hardware import cpu_description

    d = cpu_description()  # "<model name> (family F model M)"
    fm = re.search(r"family (\d+) model (\d+)", d)
    return f"{d.split()[0]}-f{fm[1]}m{fm[2]}-{kernels.isa()}" if fm else f"{d.split()[0]}-{kernels.isa()}"


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(46)
    return [torch.randint(3, 32000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def load_engine():
    """small_mixtral in bf16 on the CPU, with every timing-chosen numeric pinned."""
    os.environ.setdefault("FIDDLER_KERNEL_AMX_MIN_TOKENS", AMX_MIN_TOKENS)
    from fiddler.engine import Engine
    from fiddler.gpu_side import GpuSide
    from fiddler.model import KERNEL_EVERY_COUNT
    from runners.models import synthetic_model

    engine = Engine.from_pretrained(synthetic_model("small_mixtral"), dtype=torch.bfloat16, gpu=GpuSide.none(),
                                    max_batch=max(BEAM_WIDTHS), max_seq_len=max(PROMPT_LENS) + GREEDY_TOKENS,
                                    prefill_attention="torch")
    engine.model.set_kernel_max_tokens(KERNEL_EVERY_COUNT)
    return engine


def outputs(engine) -> dict:
    """{case: [tokens per prompt]} for greedy and each beam width."""
    out = {"greedy": [], **{f"beam{w}": [] for w in BEAM_WIDTHS}}
    for p in prompts():
        out["greedy"].append(engine.generate(p, max_new_tokens=GREEDY_TOKENS).tokens.tolist())
        for w in BEAM_WIDTHS:
            out[f"beam{w}"].append(engine.generate(p, max_new_tokens=BEAM_TOKENS, beam_width=w).tokens.tolist())
    return out


def recorded() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {}


def first_difference(want: list[int], got: list[int]) -> int | None:
    n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    return n if n is not None or len(want) == len(got) else min(len(want), len(got))


def greedy_margin(engine, prompt: list[int], tokens: list[int], step: int) -> dict:
    """Top-2 logit margin at greedy step `step` (teacher-forced on the recorded tokens), beside bf16's
    rounding step (2^-8 of the logit's magnitude): the evidence a re-record needs."""
    logits = engine.forward_logits(prompt + tokens[:step])[-1]
    top = torch.topk(logits, 2).values
    return {"step": step, "margin": float(top[0] - top[1]), "bf16_ulp": float(top[0].abs() * 2**-8)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="record this machine's class into the fixture")
    ap.add_argument("--force", action="store_true", help="replace an existing class (see the re-record rule)")
    ap.add_argument("--margins", action="store_true", help="compare and print the greedy margins where they differ")
    a = ap.parse_args(argv)
    engine, cls = load_engine(), kernel_class()
    data, got = recorded(), None
    if a.record:
        if cls in data and not a.force:
            print(f"{cls} is recorded already; --force replaces it (with margin evidence in the note)")
            return 1
        got = outputs(engine)
        data[cls] = {"commit": os.popen("git rev-parse HEAD").read().strip(), **got}
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(data, indent=1) + "\n")
        print(f"recorded {cls} -> {FIXTURE}")
    if a.margins:
        got = got or outputs(engine)
        for case, want in data[cls].items():
            if case == "commit":
                continue
            for i, (w, g) in enumerate(zip(want, got[case])):
                n = first_difference(w, g)
                if n is not None:
                    extra = greedy_margin(engine, prompts()[i], w, n) if case == "greedy" else {}
                    print(f"{case} prompt {i}: first difference at step {n} {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
