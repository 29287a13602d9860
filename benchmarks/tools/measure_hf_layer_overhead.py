#!/usr/bin/env python3
"""Per-layer decode cost of transformers' eager Mixtral layer, with and without its experts.

The source of `hf_layer_overhead_s` (fiddler/sim/efficiency.py) as `system=fiddler_original` uses it: the
released Fiddler (efeslab/fiddler@227715b, transformers==4.36.2 per requirements.txt#L3) runs each layer's
input_layernorm, self_attn, post_attention_layernorm and router gate in transformers' modules on the GPU
(src/fiddler/mixtral.py#L482-505) and its experts by itself, so the floor the simulator charges per layer is
that of attention + norms + router, without the experts.

    python benchmarks/tools/measure_hf_layer_overhead.py --out hf.json                       # small_mixtral dims, CUDA
    python benchmarks/tools/measure_hf_layer_overhead.py --mixtral-8x7b-layers 4 --out hf8x7b.json
    python benchmarks/tools/measure_hf_layer_overhead.py --device cpu --tiny --out t.json     # a quick CPU check

Standalone on purpose (torch, transformers and the standard library; numpy only inside the release's plan
variant, as the release itself uses it): it runs unchanged under transformers 4.36.2 (the release's pin) and 5.x,
e.g. with the 4.36.2 wheels unpacked to a folder on PYTHONPATH (benchmarks/tools/device_hf_overhead.sh).

The model: MixtralForCausalLM from a MixtralConfig with random weights (transformers' own init), built on the
device in bf16 with attn_implementation="eager". The release loads the checkpoint with from_pretrained and default
arguments (torch_dtype=bfloat16, use_cache=True, mixtral.py#L16-21); under 4.36.2 Mixtral has no SDPA attention
(MISTRAL_ATTENTION_CLASSES holds "eager" and "flash_attention_2" only, and `_supports_sdpa` is unset), so the
default resolves to eager MixtralAttention. The script records the attention class it ended up with.

Protocol: per repetition a fresh cache, a --prompt-token prefill (untimed), then --steps decode steps of one token
each, each step timed alone between two device synchronizations (the release moves each step's logits to the CPU,
mixtral.py#L404; transformers' generate syncs once a step on its stopping check). One warm-up repetition first.
Reported per variant: the per-repetition mean step time, its median and min over repetitions; and the time of the
decoder layers alone (a synchronization before the first layer and after the last: forward hooks for the model
variants), divided by the number of layers.

Variants (all on one model; the MoE modules are swapped in place and restored):
- full: the model as transformers runs it, its own MoE block (5.x: its default experts implementation, recorded);
- full_eager_experts (5.x only): the same with experts_implementation="eager" (4.36.2's block is a Python loop);
- router_only: each layer's MoE block replaced by the router alone (gate linear, softmax, top-k, renormalisation as
  transformers' block does it, then a zero output; returns (out, router_logits) where that version's decoder layer
  unpacks a tuple): attention + norms + router;
- no_moe: the MoE block replaced by a zero output (no router): attention + norms;
- router_only_sdpa (where the version can switch attention at runtime): router_only with SDPA attention;
- fiddler_loop: the release's own per-layer sequence of module calls (mixtral.py#L480-508, #L640, #L644-645,
  #L404): embed, then per layer input_layernorm, self_attn called directly (no attention mask, the release's
  DynamicCache), residual, post_attention_layernorm, gate, softmax, top-2, renormalise, a zero expert output,
  residual; final norm, lm_head, logits to the CPU. Experts skipped. Under 5.x the attention module needs the
  rotary embeddings as an argument: computed once per step, as 5.x's model does (a 5.x adaptation: the release
  cannot run on 5.x);
- fiddler_loop_plan: fiddler_loop plus the release's per-layer planning (mixtral.py#L552-600): one-hot mask,
  torch.where per expert (each a device sync), the cost table, and the brute force over 2^E assignments in Python.
  This part is host-CPU work that the simulator does not charge separately.

Also recorded: the device's copy bandwidth (a device-to-device copy_, read + write bytes over time, best of 10) and
the time the weights a decode step reads would take at that rate, so a reader can see whether the floor is
bandwidth or overhead.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

T_PROCESS = time.perf_counter()  # --budget-s counts from here, before torch and transformers are imported

# transformers 4.36.2 registers ModelOutput with torch.utils._pytree._register_pytree_node, which torch >= 2.2
# deprecates (a FutureWarning at import; still present in torch 2.13, the newest tried). Only the warning is
# silenced: no shim is needed while the private name exists.
warnings.filterwarnings("ignore", message=r".*_register_pytree_node.*", category=FutureWarning)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import transformers  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

# small_mixtral: conf/model/small_mixtral.yaml (arch) with runners/synthetic.py's MIXTRAL_DEFAULTS for the keys
# it leaves out (rope_theta 1e6, rms_norm_eps 1e-5, head_dim = hidden / heads) and sliding_window=None as the
# generator writes it (runners/synthetic.py, MixtralConfig(..., sliding_window=None)).
SMALL_MIXTRAL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                     max_position_embeddings=8192, rope_theta=1e6, rms_norm_eps=1e-5)
# Mixtral-8x7B: conf/model/mixtral_8x7b.yaml (= the checkpoint's config.json; its sliding_window is null).
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                    max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5)
# For tests on a CPU: seconds, not minutes.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256,
            max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-5)

ALL_VARIANTS = ("router_only", "no_moe", "full", "fiddler_loop", "fiddler_loop_plan", "router_only_sdpa",
                "full_eager_experts")
# the release's fixed costs (mixtral.py#L38-39), used only to give the plan's brute force real numbers
LATENCY_CPU, LATENCY_GPU = 7, 70


# ----------------------------------------------------------------------------- environment


def host_cpu() -> dict:
    name = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model_name": name or platform.processor() or None, "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth_gbps(dev: torch.device, nbytes: int, iters: int = 10) -> float:
    """A device-to-device copy_ of nbytes: (read + write bytes) / time, best of iters."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(dev)
    best = math.inf
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best / 1e9


# ----------------------------------------------------------------------------- model


def moe_attr(layer: nn.Module) -> str:
    for name in ("block_sparse_moe", "mlp"):  # 4.x: block_sparse_moe; 5.x: mlp
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise RuntimeError(f"no MoE block on {type(layer).__name__}")


def build_model(dims: dict, dev: torch.device, dtype: torch.dtype) -> MixtralForCausalLM:
    cfg = MixtralConfig(**dims, sliding_window=None, use_cache=True, attn_implementation="eager")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # what from_pretrained(torch_dtype=bf16) does while it builds the modules
    try:
        with torch.device(dev):
            model = MixtralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    for p in model.parameters():  # parameters only: rotary buffers keep the dtype their code chose
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model.eval()


def weight_bytes(model: MixtralForCausalLM, dims: dict) -> dict:
    """Bytes of weights one decode step of one token reads, by part."""
    layer = model.model.layers[0]
    moe = getattr(layer, moe_attr(layer))

    def nbytes(mod: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    attn = nbytes(layer.self_attn)
    norms = nbytes(layer.input_layernorm) + nbytes(layer.post_attention_layernorm)
    gate = nbytes(moe.gate)
    experts_all = nbytes(moe.experts)
    per_expert = experts_all // dims["num_local_experts"]
    head = nbytes(model.lm_head) + nbytes(model.model.norm)
    return {"attention_per_layer": attn, "norms_per_layer": norms, "gate_per_layer": gate,
            "non_expert_per_layer": attn + norms + gate, "one_expert": per_expert,
            "experts_read_per_layer_1_token": per_expert * dims["num_experts_per_tok"],
            "lm_head_and_final_norm": head, "embedding_row": dims["hidden_size"] * 2}


def kv_bytes_per_layer(dims: dict, seq: float, itemsize: int) -> float:
    hd = dims["hidden_size"] // dims["num_attention_heads"]
    return 2 * dims["num_key_value_heads"] * hd * seq * itemsize


class RouterOnly(nn.Module):
    """The MoE block's router and nothing else: gate, softmax, top-k, renormalise; the experts' output is zeros."""

    def __init__(self, block: nn.Module, top_k: int, returns_tuple: bool):
        super().__init__()
        self.gate, self.top_k, self.returns_tuple = block.gate, top_k, returns_tuple

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        r = self.gate(x)
        if isinstance(r, tuple):  # 5.x's router module: (logits, top-k weights, top-k indices)
            logits = r[0]
        else:  # an nn.Linear (4.x): the routing as MixtralSparseMoeBlock.forward does it
            logits = r
            w = F.softmax(logits, dim=1, dtype=torch.float)
            w, _ = torch.topk(w, self.top_k, dim=-1)
            w /= w.sum(dim=-1, keepdim=True)
            w = w.to(x.dtype)
        out = torch.zeros_like(hidden_states)
        return (out, logits) if self.returns_tuple else out


class NoMoE(nn.Module):
    """No router, no experts: a zero output, so the decoder layer's residual makes the MoE half an identity."""

    def __init__(self, returns_tuple: bool):
        super().__init__()
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        return (out, None) if self.returns_tuple else out


def moe_returns_tuple(model: MixtralForCausalLM, dev: torch.device, dtype: torch.dtype) -> bool:
    layer = model.model.layers[0]
    with torch.no_grad():
        out = getattr(layer, moe_attr(layer))(torch.zeros(1, 1, model.config.hidden_size, device=dev, dtype=dtype))
    return isinstance(out, tuple)


class MoESwap:
    """Replace every layer's MoE block by make(block) for the duration of a with-block."""

    def __init__(self, model: MixtralForCausalLM, make):
        self.model, self.make, self.saved = model, make, []

    def __enter__(self):
        for layer in self.model.model.layers:
            name = moe_attr(layer)
            block = getattr(layer, name)
            self.saved.append((layer, name, block))
            setattr(layer, name, self.make(block))
        return self

    def __exit__(self, *exc):
        for layer, name, block in self.saved:
            setattr(layer, name, block)


def new_cache(model: MixtralForCausalLM):
    from transformers.cache_utils import DynamicCache

    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=model.config)
    return DynamicCache()


def cache_kwarg(fn) -> str:
    params = inspect.signature(fn).parameters
    for name in ("cache", "past_key_values", "past_key_value"):  # 5.2x; 4.x and early 5.x; 4.x attention
        if name in params:
            return name
    raise RuntimeError(f"no cache argument in {fn}")


# ----------------------------------------------------------------------------- decoding


class LayerSpan:
    """Synchronized wall clock from the first decoder layer's start to the last one's end (forward hooks)."""

    def __init__(self, layers, dev: torch.device):
        self.dev, self.t0, self.t1 = dev, 0.0, 0.0
        self.handles = [layers[0].register_forward_pre_hook(self._pre), layers[-1].register_forward_hook(self._post)]

    def _pre(self, *_):
        sync(self.dev)
        self.t0 = time.perf_counter()

    def _post(self, *_):
        sync(self.dev)
        self.t1 = time.perf_counter()

    def remove(self):
        for h in self.handles:
            h.remove()


def decode_model(model, prompt: torch.Tensor, steps: int, dev: torch.device) -> tuple[list[float], list[float]]:
    """One repetition through the model's forward: prefill, then steps one-token steps. Times in seconds."""
    kw = cache_kwarg(model.forward)
    cache = new_cache(model)
    p = prompt.shape[1]
    mask = torch.ones(1, p + steps, dtype=torch.long, device=dev)
    span = LayerSpan(model.model.layers, dev)
    try:
        out = model(input_ids=prompt, attention_mask=mask[:, :p], use_cache=True, **{kw: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        sync(dev)
        step_s, layer_s = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, attention_mask=mask[:, :p + s + 1], use_cache=True, **{kw: cache})
            nxt = out.logits[:, -1:].argmax(-1)
            sync(dev)
            step_s.append(time.perf_counter() - t0)
            layer_s.append(span.t1 - span.t0)
    finally:
        span.remove()
    return step_s, layer_s


def gate_logits(gate: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return gate(x) if isinstance(gate, nn.Linear) else F.linear(x, gate.weight)


def release_plan(expert_mask: torch.Tensor, n_expert: int) -> int:
    """The release's planning step (mixtral.py#L556-590), the same work: per expert torch.where on its mask row and
    its two costs in a numpy table (a non-resident expert here), then the brute force over 2^E assignments
    keeping the lowest sum."""
    import numpy as np  # the release's cost table is a numpy array (a transformers dependency)

    cost = np.zeros((n_expert, 2), dtype=float)
    for e in range(n_expert):
        _, tok = torch.where(expert_mask[e])
        cost[e, 0] = tok.shape[0] * LATENCY_CPU
        cost[e, 1] = LATENCY_GPU
    best, best_cost = -1, float("inf")
    for config in range(1 << n_expert):
        total = 0
        for e in range(n_expert):
            total += cost[e, 0] if (config >> e) & 1 else cost[e, 1]
        if total < best_cost:
            best, best_cost = config, total
    return best


def release_forward(model, ids: torch.Tensor, pos: torch.Tensor, cache, dev: torch.device, plan: bool):
    """The release's mixtral_forward (mixtral.py#L477-648) without the experts. Returns (logits on the CPU, the
    synchronized time of the layer loop)."""
    m = model.model
    cfg = model.config
    hidden, n_expert, top_k = cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok
    h = m.embed_tokens(ids)
    attn_fwd = m.layers[0].self_attn.forward
    new_style = "position_embeddings" in inspect.signature(attn_fwd).parameters
    kw = cache_kwarg(attn_fwd)
    sync(dev)
    t0 = time.perf_counter()
    if new_style:  # 5.x: rotary embeddings are an argument of the attention (4.36.2 computes them inside)
        pe = m.rotary_emb(h, pos)
    for layer in m.layers:
        shape = h.shape
        residual = h
        x = layer.input_layernorm(h)
        if new_style:
            x = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None, **{kw: cache})[0]
        else:
            x = layer.self_attn(x, position_ids=pos, use_cache=True, **{kw: cache})[0]
        x = residual + x
        residual = x
        x = layer.post_attention_layernorm(x).view(-1, hidden)
        logits = gate_logits(getattr(layer, moe_attr(layer)).gate, x)
        w = F.softmax(logits, dim=1)  # bf16, as the release (#L500)
        w, sel = torch.topk(w, top_k, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        acc = torch.zeros_like(x)
        if plan:
            release_plan(F.one_hot(sel, num_classes=n_expert).permute(2, 1, 0), n_expert)
        h = residual + acc.reshape(shape)
    sync(dev)
    t_layers = time.perf_counter() - t0
    h = m.norm(h)
    return model.lm_head(h).to("cpu"), t_layers


def decode_release(model, prompt: torch.Tensor, steps: int, dev: torch.device, plan: bool):
    cache = new_cache(model)  # the release: DynamicCache.from_legacy_cache() (#L29, #L375)
    p = prompt.shape[1]
    pos = torch.arange(p, dtype=torch.long, device=dev).unsqueeze(0)
    logits, _ = release_forward(model, prompt, pos, cache, dev, plan)
    nxt = logits[:, -1:].argmax(-1).to(dev)
    step_s, layer_s = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        pos = torch.tensor([[p + s]], dtype=torch.long, device=dev)
        logits, tl = release_forward(model, nxt, pos, cache, dev, plan)
        nxt = logits[:, -1:].argmax(-1).to(dev)
        sync(dev)
        step_s.append(time.perf_counter() - t0)
        layer_s.append(tl)
    return step_s, layer_s


# ----------------------------------------------------------------------------- variants


def summarize(reps: list[tuple[list[float], list[float]]], n_layers: int) -> dict:
    step_means = [statistics.fmean(s) * 1e3 for s, _ in reps]
    layer_means = [statistics.fmean(lt) * 1e3 for _, lt in reps]
    per_layer = [v / n_layers for v in layer_means]
    return {"step_ms": {"median": statistics.median(step_means), "min": min(step_means)},
            "layers_ms": {"median": statistics.median(layer_means), "min": min(layer_means)},
            "per_layer_ms": {"median": statistics.median(per_layer), "min": min(per_layer)},
            "rep_step_ms": step_means, "rep_per_layer_ms": per_layer,
            "step_ms_min_single": min(min(s) for s, _ in reps) * 1e3}


def run_variant(name: str, model, dev, dtype, args, returns_tuple: bool) -> dict:
    top_k = model.config.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=gen).to(dev)

    def repeat(fn):
        for _ in range(args.warmup):
            fn()
        return [fn() for _ in range(args.reps)]

    def via_model():
        return decode_model(model, prompt, args.steps, dev)

    info: dict = {}
    if name == "full":
        info["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
        reps = repeat(via_model)
    elif name == "full_eager_experts":
        if not hasattr(model, "set_experts_implementation"):
            return {"ok": False, "skipped": "this transformers has one MoE implementation (see full)"}
        before = model.config._experts_implementation
        model.set_experts_implementation("eager")
        try:
            info["experts_implementation"] = model.config._experts_implementation
            reps = repeat(via_model)
        finally:
            model.set_experts_implementation(before)
    elif name == "router_only":
        with MoESwap(model, lambda b: RouterOnly(b, top_k, returns_tuple)):
            reps = repeat(via_model)
    elif name == "no_moe":
        with MoESwap(model, lambda b: NoMoE(returns_tuple)):
            reps = repeat(via_model)
    elif name == "router_only_sdpa":
        if not hasattr(model, "set_attn_implementation"):
            return {"ok": False, "skipped": "no runtime attention switch in this transformers (4.36.2's Mixtral "
                                            "has no SDPA attention at all)"}
        before = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            info["attn_implementation"] = model.config._attn_implementation
            with MoESwap(model, lambda b: RouterOnly(b, top_k, returns_tuple)):
                reps = repeat(via_model)
        finally:
            model.set_attn_implementation(before)
    elif name in ("fiddler_loop", "fiddler_loop_plan"):
        plan = name == "fiddler_loop_plan"
        reps = repeat(lambda: decode_release(model, prompt, args.steps, dev, plan))
    else:
        raise ValueError(f"unknown variant {name!r}")
    return {"ok": True, **info, **summarize(reps, model.config.num_hidden_layers)}


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--mixtral-8x7b-layers", type=int, default=None, metavar="N",
                    help="Mixtral-8x7B's dims with N layers instead of small_mixtral's")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU tests)")
    for key in SMALL_MIXTRAL:
        ap.add_argument("--" + key.replace("_", "-"), type=type(SMALL_MIXTRAL[key]), default=None,
                        help=f"override (small_mixtral: {SMALL_MIXTRAL[key]})")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill, untimed)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS), help="comma-separated, in order")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new variant after this many seconds since the process started (the JSON is "
                         "written after each variant, so a timeout keeps what finished)")
    ap.add_argument("--bw-mib", type=int, default=None, help="copy-bandwidth buffer (default 1024 GPU, 64 CPU)")
    ap.add_argument("--out", default=None, help="JSON path")
    return ap.parse_args(argv)


def dims_of(args) -> tuple[dict, str]:
    if args.tiny:
        dims, src = dict(TINY), "tiny"
    elif args.mixtral_8x7b_layers:
        dims, src = dict(MIXTRAL_8X7B, num_hidden_layers=args.mixtral_8x7b_layers), \
            f"mixtral_8x7b ({args.mixtral_8x7b_layers} layers)"
    else:
        dims, src = dict(SMALL_MIXTRAL), "small_mixtral"
    over = {k: getattr(args, k) for k in SMALL_MIXTRAL if getattr(args, k) is not None}
    if over:
        dims.update(over)
        src += " + " + ",".join(f"{k}={v}" for k, v in over.items())
    return dims, src


def write(res: dict, path: str | None) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, path)


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    dims, dims_src = dims_of(args)
    torch.manual_seed(0)
    res: dict = {
        "script": "benchmarks/tools/measure_hf_layer_overhead.py", "transformers": transformers.__version__,
        "transformers_path": os.path.dirname(transformers.__file__), "torch": torch.__version__,
        "python": platform.python_version(), "device": str(dev),
        "gpu_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "host_cpu": host_cpu(), "dims": dims, "dims_source": dims_src, "dtype": "bfloat16",
        "protocol": {"prompt": args.prompt, "steps": args.steps, "reps": args.reps, "warmup": args.warmup,
                     "timing": "each decode step between two device syncs; per repetition the mean step; median "
                               "and min over repetitions; layers_ms = sync before the first decoder layer to sync "
                               "after the last"},
    }
    t0 = time.perf_counter()
    model = build_model(dims, dev, dtype)
    sync(dev)
    layer0 = model.model.layers[0]
    res["build_s"] = time.perf_counter() - t0
    res["attn_implementation"] = model.config._attn_implementation
    res["attention_class"] = type(layer0.self_attn).__name__
    res["moe_attribute"] = moe_attr(layer0)
    res["moe_class"] = type(getattr(layer0, moe_attr(layer0))).__name__
    res["gate_class"] = type(getattr(layer0, moe_attr(layer0)).gate).__name__
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    returns_tuple = moe_returns_tuple(model, dev, dtype)
    res["moe_returns_tuple"] = returns_tuple

    bw_bytes = (args.bw_mib or (1024 if dev.type == "cuda" else 64)) << 20
    gbps = copy_bandwidth_gbps(dev, bw_bytes)
    wb = weight_bytes(model, dims)
    seq_mid = args.prompt + args.steps / 2
    kv = kv_bytes_per_layer(dims, seq_mid, 2)
    L = dims["num_hidden_layers"]
    ms = lambda b: b / (gbps * 1e9) * 1e3  # noqa: E731
    res["copy_bandwidth_gbps"] = gbps
    res["copy_bandwidth_note"] = (f"device-to-device copy_ of {bw_bytes >> 20} MiB: (read + write bytes) / time, "
                                  "best of 10")
    res["weight_bytes"] = {**wb, "kv_cache_per_layer_mid_decode": kv}
    res["weight_read_ms_at_copy_bandwidth"] = {
        "non_expert_per_layer_plus_kv": ms(wb["non_expert_per_layer"] + kv),
        "attention_norms_per_layer_plus_kv": ms(wb["attention_per_layer"] + wb["norms_per_layer"] + kv),
        "full_layer_1_token": ms(wb["non_expert_per_layer"] + kv + wb["experts_read_per_layer_1_token"]),
        "step_router_only": ms(L * (wb["non_expert_per_layer"] + kv) + wb["lm_head_and_final_norm"]),
        "step_full": ms(L * (wb["non_expert_per_layer"] + kv + wb["experts_read_per_layer_1_token"])
                        + wb["lm_head_and_final_norm"]),
    }
    res["variants"] = {}
    write(res, args.out)
    print(f"transformers {transformers.__version__} torch {torch.__version__} on {res['gpu_name'] or 'CPU'} "
          f"({res['host_cpu']['model_name']}, {res['host_cpu']['logical_cores']} cores); {dims_src}; attention "
          f"{res['attention_class']} ({res['attn_implementation']}); experts {res['experts_implementation']}; "
          f"copy {gbps:.0f} GB/s; build {res['build_s']:.1f} s", flush=True)
    print(f"weights per layer without experts: {wb['non_expert_per_layer'] / 1e6:.1f} MB = "
          f"{res['weight_read_ms_at_copy_bandwidth']['non_expert_per_layer_plus_kv']:.4f} ms at the copy rate "
          f"(with KV); full layer at 1 token {res['weight_read_ms_at_copy_bandwidth']['full_layer_1_token']:.4f} ms",
          flush=True)

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    with torch.no_grad():
        for name in names:
            if args.budget_s is not None and time.perf_counter() - T_PROCESS > args.budget_s:
                res["variants"][name] = {"ok": False, "skipped": f"over --budget-s {args.budget_s}"}
                print(f"{name:20s} skipped (budget)", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                r = run_variant(name, model, dev, dtype, args, returns_tuple)
            except Exception as e:  # one variant's failure must not lose the others
                r = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-3000:]}
            r["wall_s"] = time.perf_counter() - t0
            res["variants"][name] = r
            write(res, args.out)
            if r.get("ok"):
                print(f"{name:20s} step {r['step_ms']['median']:8.3f} ms (min {r['step_ms']['min']:8.3f})  "
                      f"per layer {r['per_layer_ms']['median']:7.4f} ms (min {r['per_layer_ms']['min']:7.4f})  "
                      f"[{r['wall_s']:.1f} s]", flush=True)
            else:
                print(f"{name:20s} {r.get('skipped') or r.get('error')}", flush=True)

    v = res["variants"]

    def pl(name):
        return v[name]["per_layer_ms"]["median"] if v.get(name, {}).get("ok") else None

    derived = {}
    pairs = {"router_per_layer_ms": ("router_only", "no_moe"), "experts_per_layer_ms": ("full", "router_only"),
             "plan_per_layer_ms": ("fiddler_loop_plan", "fiddler_loop"),
             "model_forward_vs_release_loop_per_layer_ms": ("router_only", "fiddler_loop")}
    for key, (a, b) in pairs.items():
        if pl(a) is not None and pl(b) is not None:
            derived[key] = pl(a) - pl(b)
    res["derived_medians"] = derived
    res["total_s"] = time.perf_counter() - t_start
    res["process_s"] = time.perf_counter() - T_PROCESS
    write(res, args.out)
    if derived:
        print("derived (medians): " + ", ".join(f"{k} {x:.4f}" for k, x in derived.items()), flush=True)
    if args.out:
        print(f"wrote {args.out}", flush=True)
    return 0 if all(r.get("ok") or "skipped" in r for r in v.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
