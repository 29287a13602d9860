"""The engine against transformers on the same generated checkpoints: Mixtral and every other family
(tests/models.py FAMILY_ARCHS: Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2 with and without q_lora_rank,
DeepSeek-V3).

fp32: identical greedy tokens (32), identical beam-search sequences with sequences_scores within 1e-4,
identical seeded samples, logits equal to rounding. bf16: logits at every position within a stated
tolerance (see test_bf16_logits_within_tolerance). Every test runs for every engine variant in
VARIANTS, so a new executor configuration (placement, planner, ...) is covered by adding one line.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fiddler import Engine
from fiddler.executors import FiddlerPolicy, GpuSide, local_executor
from tests.models import ARCHS, EXPECTED_KINDS, FAMILY_ARCHS, VARIANTS, hf_model, model_path, prompt

transformers = pytest.importorskip("transformers")


variant_params = pytest.mark.parametrize("variant", list(VARIANTS))


def assert_decision_kinds(variant: str, out) -> None:
    """The run really used the decision kinds its placement implies (not, say, all-CPU)."""
    if not variant.startswith("fiddler-emul-"):
        return
    tokens = out.stats["executor"]["tokens"]
    used = "".join(k for k in "abc" if tokens[k] > 0)
    assert used == EXPECTED_KINDS[variant.split("-")[2]], (variant, tokens)
# Generation tests on the two required Mixtral shapes and every family; logits tests also on the
# head_dim/tied-embedding model.
arch_params = pytest.mark.parametrize("arch", ["e8k2", "e16k4_odd", *FAMILY_ARCHS])
all_arch_params = pytest.mark.parametrize("arch", list(ARCHS))


@functools.cache
def engine(arch: str, variant: str, dtype: torch.dtype) -> Engine:
    return Engine.from_pretrained(model_path(arch), dtype=dtype, **VARIANTS[variant])


@functools.cache
def hf(arch: str, dtype: torch.dtype):
    return hf_model(arch, dtype)


@all_arch_params
@variant_params
def test_fp32_logits_match(arch, variant):
    ids = prompt(40, ARCHS[arch]["vocab_size"], seed=1)
    with torch.no_grad():
        ref = hf(arch, torch.float32)(ids[None]).logits[0]
    got = engine(arch, variant, torch.float32).forward_logits(ids)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))


@arch_params
@variant_params
def test_fp32_greedy_matches_transformers(arch, variant):
    ids = prompt(12, ARCHS[arch]["vocab_size"], seed=2)
    ref = hf(arch, torch.float32).generate(ids[None], max_new_tokens=32, do_sample=False)[0, 12:]
    out = engine(arch, variant, torch.float32).generate(ids, max_new_tokens=32)
    assert out.tokens.tolist() == ref.tolist()
    assert_decision_kinds(variant, out)


@arch_params
@variant_params
def test_fp32_beam_search_matches_transformers(arch, variant):
    ids = prompt(10, ARCHS[arch]["vocab_size"], seed=3)
    ref = hf(arch, torch.float32).generate(
        ids[None], max_new_tokens=16, num_beams=4, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    out = engine(arch, variant, torch.float32).generate(ids, max_new_tokens=16, beam_width=4)
    assert out.tokens.tolist() == ref.sequences[0, 10:].tolist()
    assert out.sequences_scores == pytest.approx(float(ref.sequences_scores[0]), abs=1e-4)
    assert_decision_kinds(variant, out)
    # Beam search must beat (or tie) greedy on the length-normalised log-prob it maximises.
    greedy = engine(arch, variant, torch.float32).generate(ids, max_new_tokens=16).tokens
    logp = torch.log_softmax(engine(arch, variant, torch.float32).forward_logits(torch.cat([ids, greedy])), -1)
    greedy_score = float(logp[9:-1].gather(1, greedy[:, None]).sum()) / 16
    assert out.sequences_scores >= greedy_score - 1e-5


@variant_params
def test_fp32_beam_search_with_eos_matches_transformers(variant):
    """With an EOS token, finished hypotheses, the early-stop heuristic and length normalisation all matter."""
    arch = "e8k2"
    ids = prompt(10, ARCHS[arch]["vocab_size"], seed=4)
    e = engine(arch, variant, torch.float32)
    # Try tokens the beams do produce as EOS until transformers' best sequence ends early with it.
    for eos in e.generate(ids, max_new_tokens=6, beam_width=4).tokens.tolist()[1:]:
        ref = hf(arch, torch.float32).generate(
            ids[None], max_new_tokens=16, num_beams=4, do_sample=False, eos_token_id=eos,
            output_scores=True, return_dict_in_generate=True,
        )
        ref_tokens = ref.sequences[0, 10:].tolist()
        if eos in ref_tokens:
            break
    else:
        pytest.fail("no candidate EOS token finishes the best beam early; pick another prompt")
    ref_tokens = ref_tokens[: ref_tokens.index(eos) + 1]  # transformers pads after EOS
    out = e.generate(ids, max_new_tokens=16, beam_width=4, eos_token_id=eos)
    assert out.tokens.tolist() == ref_tokens
    assert out.sequences_scores == pytest.approx(float(ref.sequences_scores[0]), abs=1e-4)


@variant_params
def test_fp32_sampling_matches_transformers(variant):
    arch = "e16k4_odd"
    ids = prompt(8, ARCHS[arch]["vocab_size"], seed=5)
    kw = dict(temperature=0.7, top_k=40, top_p=0.9)
    torch.manual_seed(123)  # transformers samples from the global generator
    ref = hf(arch, torch.float32).generate(ids[None], max_new_tokens=32, do_sample=True, **kw)[0, 8:]
    out = engine(arch, variant, torch.float32).generate(ids, max_new_tokens=32, do_sample=True, seed=123, **kw)
    assert out.tokens.tolist() == ref.tolist()


@variant_params
def test_fp32_greedy_with_eos_stops_like_transformers(variant):
    arch = "e8k2"
    ids = prompt(12, ARCHS[arch]["vocab_size"], seed=2)
    e = engine(arch, variant, torch.float32)
    eos = int(e.generate(ids, max_new_tokens=8).tokens[5])
    ref = hf(arch, torch.float32).generate(ids[None], max_new_tokens=32, do_sample=False, eos_token_id=eos)[0, 12:].tolist()
    out = e.generate(ids, max_new_tokens=32, eos_token_id=eos).tokens.tolist()
    assert out == ref[: ref.index(eos) + 1] and len(out) <= 6


def _router_margin(arch: str, ids: torch.Tensor) -> torch.Tensor:
    """Per position: the smallest fp32 gap, over layers, between the last chosen and the first unchosen
    candidate of every routing decision: the k-th and (k+1)-th expert's router logit; with grouped routing
    also the topk_group-th and next group's score, and the experts' gap within the chosen groups (V3:
    in bias-corrected sigmoid scores, the quantity it ranks)."""
    a = ARCHS[arch]
    k = a["num_experts_per_tok"]
    with torch.no_grad():
        out = hf(arch, torch.float32)(ids[None], output_router_logits=True)
    gaps = []
    model = hf(arch, torch.float32).model
    moe_gates = [l.mlp.gate for l in model.layers if hasattr(l.mlp, "gate")]
    for rl, gate in zip(out.router_logits, moe_gates):
        rl = rl.float()
        method = a.get("topk_method", "noaux_tc" if a.get("model_type") == "deepseek_v3" else "greedy")
        if method == "greedy":
            s = rl.sort(-1, descending=True).values
            gaps.append(s[:, k - 1] - s[:, k])
            continue
        G, tg = a["n_group"], a["topk_group"]
        if method == "noaux_tc":
            score = rl.sigmoid() + gate.e_score_correction_bias.float()
            group = score.view(score.shape[0], G, -1).topk(2, dim=-1)[0].sum(-1)
        else:  # group_limited_greedy: softmax is monotone, so logit gaps order the same way
            score = rl
            group = score.view(score.shape[0], G, -1).max(-1).values
        gs = group.sort(-1, descending=True)
        g_gap = gs.values[:, tg - 1] - gs.values[:, tg]
        chosen = torch.zeros_like(group, dtype=torch.bool).scatter_(1, gs.indices[:, :tg], True)
        masked = score.masked_fill(~chosen.repeat_interleave(score.shape[1] // G, dim=1), float("-inf"))
        e = masked.sort(-1, descending=True).values
        gaps.append(torch.minimum(g_gap, e[:, k - 1] - e[:, k]))
    return torch.stack(gaps).min(0).values


# bf16: every Mixtral arch x variant x 2 seeds; the other families (whose fp32 tests cover every variant)
# on the reference, the CPU executor and one emulated placement with all decision kinds, one seed.
_BF16_FAMILY_VARIANTS = ("reference", "fiddler-cpu", "fiddler-emul-half-makespan")
BF16_CASES = [(a, v, s) for a in ARCHS if a not in FAMILY_ARCHS for v in VARIANTS for s in (0, 1)] + \
             [(a, v, 0) for a in FAMILY_ARCHS for v in _BF16_FAMILY_VARIANTS]


@pytest.mark.parametrize("arch,variant,seed", BF16_CASES)
def test_bf16_logits_within_tolerance(arch, variant, seed):
    """bf16 keeps 8 mantissa bits (rounding 2^-9 ~ 0.2%); a logit comes out of ~10 rounded matmuls and
    residual adds per layer, so two correct bf16 implementations that round in different places (fused
    kernels, fp32 vs bf16 accumulation, summation order) differ by a few 2^-9 of the logit scale S =
    max|fp32 logits|. Measured: max 1.1% of S, median 0.3-0.6%. Tolerance at every position: 3% of S.
    Exception: where a router's k-th/(k+1)-th logit gap is < 0.05 in the fp32 reference, bf16 noise
    in EITHER implementation can swap an expert for that token (a discrete, O(S) change; transformers'
    own bf16 run does it against fp32 too). There we only require agreement within 50% of S (catches
    wrong-expert bugs that affect every token), and we require that the engine's bf16 stays as close to
    the fp32 truth as transformers' bf16 does on average. Token identity is not required: random
    models have near-tied top-1 logits."""
    ids = prompt(64, ARCHS[arch]["vocab_size"], seed=seed)
    impl = "grouped_mm"
    ffn = ARCHS[arch].get("moe_intermediate_size", ARCHS[arch]["intermediate_size"])
    if (ffn * 2) % 16 or (ARCHS[arch]["hidden_size"] * 2) % 16:
        impl = "eager"  # transformers' CPU grouped_mm needs 16-byte strides; its eager loop is its other path
    ref_model = hf_model(arch, torch.bfloat16, experts_implementation=impl)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0].float()
        ref32 = hf(arch, torch.float32)(ids[None]).logits[0]
    got = engine(arch, variant, torch.bfloat16).forward_logits(ids)
    scale = float(ref32.abs().max())
    dev = (got - ref).abs().amax(-1) / scale  # per position
    tie = _router_margin(arch, ids) < 0.05
    assert tie.float().mean() < 0.75, "the model must have enough positions without router near-ties"
    # Outside ties the engine must be within 3% of S of transformers' bf16. On the other families it may
    # instead be within 3% of the fp32 truth itself: transformers' bf16 has its own noise, and where it
    # flips an expert near (not under) the tie threshold (measured: DeepSeek-V2's MLA, margin 0.053,
    # transformers 6.1% off fp32, the engine 1.2%) the engine agreeing with fp32 is as correct. Mixtral
    # keeps the original, stricter check.
    bad = (~tie) & (dev > 0.03)
    if ARCHS[arch].get("model_type", "mixtral") != "mixtral":
        bad &= (got - ref32).abs().amax(-1) / scale > 0.03
    assert not bad.any(), f"positions {bad.nonzero().flatten().tolist()} deviate {dev[bad].tolist()} x scale"
    assert float(dev.max()) < 0.5, f"max deviation {float(dev.max()):.3f} x scale"
    assert float(dev.median()) < 0.01
    err_engine = (got - ref32).abs().mean()
    err_hf = (ref - ref32).abs().mean()
    assert err_engine <= 1.25 * err_hf + 1e-3 * scale


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_cuda_fp32_greedy_and_beam_match_transformers(fraction):
    """On a GPU: non-expert weights on the device, a share of experts resident, the rest copied or run on
    the CPU as planned; results must still be transformers' (fp32)."""
    arch = "e16k4_odd"
    cfg = ARCHS[arch]
    budget = 256 << 20  # far above non-expert weights + KV cache of the test model; placement decides residency
    e = Engine.from_pretrained(
        model_path(arch), dtype=torch.float32, gpu=GpuSide.cuda(budget),
        executor=FiddlerPolicy(placement=f"fraction:{fraction}"),
    )
    ids = prompt(12, cfg["vocab_size"], seed=2)
    ref = hf(arch, torch.float32).generate(ids[None], max_new_tokens=32, do_sample=False)[0, 12:]
    assert e.generate(ids, max_new_tokens=32).tokens.tolist() == ref.tolist()
    ref = hf(arch, torch.float32).generate(
        ids[None], max_new_tokens=16, num_beams=4, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    out = e.generate(ids, max_new_tokens=16, beam_width=4)
    assert out.tokens.tolist() == ref.sequences[0, 12:].tolist()
    assert out.sequences_scores == pytest.approx(float(ref.sequences_scores[0]), abs=1e-4)


def test_fp32_sliding_window_matches_transformers(tmp_path):
    """A config with sliding_window (Mistral-style local attention) masks keys older than the window, in
    prefill and in decode."""
    import json
    import shutil

    from transformers import MixtralForCausalLM

    d = shutil.copytree(model_path("e8k2"), tmp_path / "sw")
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 6
    (d / "config.json").write_text(json.dumps(cfg))
    ref_model = MixtralForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref_model.generation_config.eos_token_id = None
    ref_model.generation_config.pad_token_id = 0
    e = Engine.from_pretrained(d, dtype=torch.float32, executor=local_executor,
                               gpu=GpuSide.none())
    ids = prompt(14, ARCHS["e8k2"]["vocab_size"], seed=6)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    torch.testing.assert_close(e.forward_logits(ids), ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    full = engine("e8k2", "reference", torch.float32).forward_logits(ids)
    assert (full[-1] - ref[-1]).abs().max() > 1e-2  # the window really changes the result
    gen = ref_model.generate(ids[None], max_new_tokens=16, do_sample=False)[0, 14:]
    assert e.generate(ids, max_new_tokens=16).tokens.tolist() == gen.tolist()
