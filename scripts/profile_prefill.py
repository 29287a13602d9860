"""Where prefill time goes, in the engine and in transformers, part by part, on the same prompt.

    python scripts/profile_prefill.py                          # small_mixtral, 512 2048 4096 tokens
    python scripts/profile_prefill.py --lens 512 --repeats 3 --json out.json --markdown out.md

Each part is timed by wrapping the calls that do it (perf_counter; CPU work is synchronous) and is charged
its *self* time: a part called inside another (the expert kernel inside the executor's forward) is taken
out of the outer one. "Python/other" is the prefill's wall time less every part: the interpreter, the
embedding, reshapes and whatever no wrapper covers. Engine and transformers alternate, one prefill each
per round, and each keeps the round of its best wall time (the machine may be shared).

Parts: experts (kernel): the expert FFN calls (the engine's packed kernel, transformers' experts module);
experts (around): grouping tokens by expert, gathers, weighting and the combination; router: gate logits
and top-k; attention: the attention kernel (SDPA) with its mask and GQA handling; rope; kv copy: writing
the cache; projections: q/k/v/o; norms; lm_head.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine's adapter runs it (systems/engine_adapter.py)

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fiddler.hardware import cpu_description  # noqa: E402

PARTS = ("experts (kernel)", "experts (around)", "router", "attention", "rope", "kv copy", "projections",
         "norms", "lm_head", "mask")


class Sections:
    """Self time per part: a stack of open sections, each charged its wall time less its children's."""

    def __init__(self):
        self.self_s: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []

    @contextlib.contextmanager
    def section(self, name: str):
        frame = [name, 0.0]
        self._stack.append(frame)
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self._stack.pop()
            self.self_s[name] += dt - frame[1]
            if self._stack:
                self._stack[-1][1] += dt

    def wrap(self, fn, name: str):
        def wrapped(*a, **kw):
            with self.section(name):
                return fn(*a, **kw)

        wrapped.__wrapped__ = fn
        return wrapped

    def reset(self):
        self.self_s.clear()


class Patches:
    """setattr with undo."""

    def __init__(self):
        self._undo = []

    def set(self, obj, attr, value):
        self._undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def wrap(self, obj, attr, sections: Sections, name: str):
        self.set(obj, attr, sections.wrap(getattr(obj, attr), name))

    def time_calls(self, obj, sections: Sections, name: str):
        """Time obj's calls by giving it a subclass of its own type whose __call__ is wrapped: the object
        stays an instance of its class, so code that checks its type (the model's thread switch looks
        for its packed Linears) behaves as without the profiler. A wrapper function in its place did
        not: the engine then kept torch at one thread for long prefills, and its attention and
        projections read twice transformers'."""
        cls = type(obj)
        timed = type(f"Timed{cls.__name__}", (cls,), {"__call__": sections.wrap(cls.__call__, name)})
        self.set(obj, "__class__", timed)

    def undo(self):
        while self._undo:
            obj, attr, v = self._undo.pop()
            setattr(obj, attr, v)


# ---------------------------------------------------------------------------- the engine

def engine_runner(path, max_seq: int, threads: int | None, sec: Sections):
    from fiddler import Engine
    from fiddler.step import rows

    engine = Engine.from_pretrained(path, cpu_threads=threads, max_seq_len=max_seq, max_batch=1)
    p = instrument_engine(engine, sec)

    def prefill(ids):
        engine.step(ids, rows(1, 0, ids.shape[0]))

    info = {"executor": engine.info()["executor_info"].get("cpu_expert_path"),
            "kernel_max_tokens": engine.info()["kernel_max_tokens"],
            # torch's threads beside the kernel, and where torch serves the linears (a long prefill)
            "torch_threads_in_run": engine.torch_threads or torch.get_num_threads(),
            "torch_threads_torch_linears": engine.model.torch_linear_threads}
    return prefill, info, p


def instrument_engine(engine, sec: Sections) -> Patches:
    """Charge the engine's calls to their parts (undo with the returned Patches)."""
    import fiddler.model as fm

    model, ex = engine.model, engine.executor
    p = Patches()
    p.wrap(fm, "apply_rope", sec, "rope")
    p.wrap(fm, "rms_norm", sec, "norms")
    p.wrap(fm, "rms_norm_f32", sec, "norms")
    p.wrap(fm, "route", sec, "router")
    p.wrap(model, "_sdpa", sec, "attention")
    p.wrap(model.cache, "append", sec, "kv copy")
    p.wrap(model, "lm_head", sec, "lm_head")
    for layer in model.layers:
        for attr, name in (("qkv_proj", "projections"), ("o_proj", "projections"), ("router", "router")):
            if getattr(layer, attr) is not None:
                p.time_calls(getattr(layer, attr), sec, name)
    p.wrap(ex, "forward", sec, "experts (around)")
    packed = next(x for row in ex.packed for x in row if x is not None)
    p.wrap(type(packed), "forward", sec, "experts (kernel)")
    return p


# ---------------------------------------------------------------------------- transformers

def hf_runner(path, threads: int | None, sec: Sections):
    from transformers import AutoModelForCausalLM, DynamicCache
    import transformers.models.mixtral.modeling_mixtral as mm
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from systems.hf_transformers.adapter import HFTransformersAdapter

    if threads:
        torch.set_num_threads(threads)
    impl = HFTransformersAdapter._fastest_available()  # the path the benchmark's hf_transformers runs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation=impl).eval()
    p = Patches()
    p.wrap(mm, "apply_rotary_pos_emb", sec, "rope")
    p.wrap(mm, "create_causal_mask", sec, "mask")
    attn_impl = model.config._attn_implementation
    p.set(ALL_ATTENTION_FUNCTIONS, "_global_mapping", dict(ALL_ATTENTION_FUNCTIONS._global_mapping))
    ALL_ATTENTION_FUNCTIONS._global_mapping[attn_impl] = sec.wrap(ALL_ATTENTION_FUNCTIONS[attn_impl], "attention")
    p.wrap(DynamicCache, "update", sec, "kv copy")

    def hook(module, name):
        p.set(module, "forward", sec.wrap(module.forward, name))

    hook(model.model.rotary_emb, "rope")
    hook(model.model.norm, "norms")
    hook(model.lm_head, "lm_head")
    for layer in model.model.layers:
        a = layer.self_attn
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
            hook(lin, "projections")
        hook(layer.input_layernorm, "norms")
        hook(layer.post_attention_layernorm, "norms")
        moe = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        hook(moe.gate, "router")
        hook(moe.experts, "experts (kernel)")
        hook(moe, "experts (around)")

    def prefill(ids):
        with torch.inference_mode():
            model(ids[None], attention_mask=torch.ones_like(ids)[None], past_key_values=DynamicCache(config=model.config),
                  use_cache=True, logits_to_keep=1)

    info = {"experts_implementation": model.config._experts_implementation, "attn_implementation": attn_impl,
            "torch_threads": torch.get_num_threads()}
    return prefill, info, p


# ---------------------------------------------------------------------------- report

def breakdown(wall: float, self_s: dict[str, float]) -> dict[str, float]:
    parts = {k: self_s.get(k, 0.0) for k in PARTS}
    parts["Python/other"] = wall - sum(parts.values())
    return parts


def markdown(results: dict) -> str:
    out = []
    for n, r in results["lens"].items():
        out.append(f"\n### {n} tokens\n")
        out.append("| part | engine ms | engine % | transformers ms | transformers % |")
        out.append("|---|---:|---:|---:|---:|")
        e, h = r["engine"], r.get("hf")
        for k in (*PARTS, "Python/other"):
            ev = e["parts"][k] * 1e3
            row = f"| {k} | {ev:.1f} | {100 * e['parts'][k] / e['wall_s']:.1f} |"
            row += (f" {h['parts'][k] * 1e3:.1f} | {100 * h['parts'][k] / h['wall_s']:.1f} |" if h else " | |")
            out.append(row)
        tot = f"| **prefill (best round)** | **{e['wall_s'] * 1e3:.1f}** | 100 |"
        tot += f" **{h['wall_s'] * 1e3:.1f}** | 100 |" if h else " | |"
        out.append(tot)
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small_mixtral", help="checkpoint dir or a synthetic model of conf/model/")
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: every core (as the benchmark runs)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the tables here")
    args = ap.parse_args()

    from runners.models import synthetic_model

    path = pathlib.Path(args.model)
    if not path.is_dir():
        path = synthetic_model(args.model, progress=True)
    threads = args.threads or os.cpu_count()
    sec = Sections()
    runners = {"engine": engine_runner(path, max(args.lens) + 1, threads, sec)}
    if not args.no_hf:
        runners["hf"] = hf_runner(path, threads, sec)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    results = {"model": str(path), "threads": threads, "cpu": cpu_description(),
               "info": {k: v[1] for k, v in runners.items()}, "lens": {}}
    for n in args.lens:
        ids = torch.randint(0, vocab, (n,), generator=g)
        for _, (fn, _, _) in runners.items():
            fn(ids)  # warmup
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, (fn, _, _) in runners.items():
                sec.reset()
                t = time.perf_counter()
                fn(ids)
                wall = time.perf_counter() - t
                if name not in best or wall < best[name]["wall_s"]:
                    best[name] = {"wall_s": wall, "parts": breakdown(wall, sec.self_s)}
        results["lens"][n] = best
        print(f"{n} tokens: " + ", ".join(f"{k} {v['wall_s'] * 1e3:.0f} ms" for k, v in best.items()), flush=True)
    md = markdown(results)
    print(md)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
