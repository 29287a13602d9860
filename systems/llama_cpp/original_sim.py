"""llama.cpp as the paper ran it (`system=llama_cpp_original`, mode=simulate): a 2024 build with
`llama_beam_search`.

Which build: the Fiddler repository names none (its README and benchmarks/README at efeslab/fiddler@227715b
list only DeepSpeed-MII and Mixtral-Offloading), and the paper's setup text was not readable here. A beam search
in llama.cpp in 2024 was `llama_beam_search` (examples/beam-search), removed on 2024-06-04 (ggml-org/llama.cpp
0cd6bd3, "llama : remove beam search"); the build modelled is its parent, 5ca0944, the last one with it. Placement
and kernels are today's llama_cpp policy (systems/llama_cpp/sim.py): -ngl whole layers that fit the budget,
llama.cpp's CPU factors, scaled by what that build's F16 kernels do against today's bf16 ones (measured,
PARAMS): its CUDA backend converts no BF16 tensor, so its 16-bit weights were F16. Since 2024-03-18 (2bf8d0f,
"backend : offload large batches to GPU") the CUDA backend offloads an op with host weights to the GPU when its
batch has >= 32 rows (ggml-cuda.cu offload_op), so that build streams a host layer's weights over PCIe for
every prompt chunk: modelled as in sim.py (OFFLOAD_MIN_BATCH); a build before 2024-03-18 would not (stated in summary.md).

Beam search, per step (llama.cpp#L14907-14927 at 5ca0944): the newly common prefix decoded once
(`llama_decode(... common_prefix_length ...)`, #L14914-14917), then for each beam one `llama_decode` over its
tokens since the common prefix (#L14835-14837), after which the KV cache past the prefix is cleared
(#L14843). So step i with prefix P_i costs one forward of P_i - P_(i-1) tokens and beam_width forwards of
i - P_i tokens each (one row; logits of the last token). P_i, the beams' common prefix, is a property of the
search on real text: `beam_prefix=measured` takes it from this project's engine's beam search on the benchmark
model (scripts/record_beam_prefix.py), `prompt` is the lower bound (P_i = 0: every beam re-decodes everything
it generated) and `all_but_last` the upper one (P_i = i - 1: one token per beam per step).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from systems.citations import Cited
from fiddler.sim import Step

from .sim import OFFLOAD_MIN_BATCH, LlamaCppSimPolicy

_LC = "ggml-org/llama.cpp@5ca0944a153b65724d51b2f484139aa25ccb7a8b"
PREFIX_FILE = "results/measured/2026-12-03-small_mixtral-beam-prefix/beam_prefix.json"
_F16 = "results/measured/2026-12-05-intel-xeon-llama-cpp-2024-f16/README.md"
ROOT = Path(__file__).resolve().parents[2]

PARAMS: dict[str, Cited] = {
    "build": Cited("5ca0944", f"{_LC}:examples/beam-search/beam-search.cpp#L164-174",
                   "the parent of 0cd6bd3 (which removed llama_beam_search): prompt decoded, then the beam search"),
    "beam_decode_per_beam": Cited(True, f"{_LC}:llama.cpp#L14835-14837",
                                  "one llama_decode per beam over its tokens since the common prefix"),
    "beam_kv_cleared_past_prefix": Cited(True, f"{_LC}:llama.cpp#L14841-14843", "llama_kv_cache_seq_rm after each beam"),
    "beam_common_prefix_once": Cited(True, f"{_LC}:llama.cpp#L14912-14917", "the newly common prefix decoded once"),
    "beam_first_step_free": Cited(True, f"{_LC}:llama.cpp#L14835-14838", "the empty first beam decodes nothing"),
    "beam_logits_last_token": Cited(True, f"{_LC}:llama.cpp#L14838-14839", "top-k of the last token's logits"),
    "offload_min_batch": Cited(OFFLOAD_MIN_BATCH, f"{_LC}:ggml-cuda.cu#L2924-2928",
                               "ops of >= 32 rows with host weights run on the GPU"),
    "offload_since": Cited("2bf8d0f", "ggml-org/llama.cpp@2bf8d0f7c4cc1235755ad06961ca761e458c5e55:ggml-cuda.cu#L11377-11383",
                           "backend : offload large batches to GPU (2024-03-18)"),
    "ngl_fits_budget": Cited(True, "assumption: the paper's -ngl value is not stated in the Fiddler repository; "
                                   "as many whole layers as the card holds, as llama.cpp users set it", ""),
    "beam_prefix_measured": Cited(PREFIX_FILE, PREFIX_FILE, "the engine's beam search on the benchmark model"),
    "gguf_type": Cited("f16", _F16, "16-bit weights of that build were F16: its CUDA backend converts no BF16 "
                                    "tensor (ggml_get_to_fp16_cuda / ggml_get_to_fp32_cuda return nullptr, "
                                    "then GGML_ASSERT), and BF16 GGUF did not exist before 2024-05"),
    "cpu_decode_vs_today": Cited(1.034, _F16, "that build's F16 CPU decode over today's bf16 (the llama.cpp CPU "
                                              "factors' basis), same host and model, interleaved; measured on the "
                                              "Sapphire Rapids class, applied to every class"),
    "cpu_prompt_vs_today": Cited(0.87, _F16, "the same for CPU prompt processing"),
}

PREFIX_MODES = ("measured", "prompt", "all_but_last")


def prefix_schedule(mode: str, beam_width: int, steps: int) -> list[int]:
    """P_i for i = 0..steps (P_0 = 0): generated tokens all beams share when step i starts."""
    if mode == "prompt":
        return [0] * (steps + 1)
    if mode == "all_but_last":
        return [max(0, i - 1) for i in range(steps + 1)]
    if mode != "measured":
        raise ValueError(f"beam_prefix must be one of {PREFIX_MODES}, got {mode!r}")
    data = json.loads((ROOT / PREFIX_FILE).read_text())
    widths = {int(k): v for k, v in data["widths"].items()}
    if beam_width not in widths:  # the nearest width measured
        beam_width = min(widths, key=lambda w: (abs(w - beam_width), w))
    lens = widths[beam_width]
    # lens[j]: the prefix after j + 1 tokens; a search that stopped early keeps its last value
    return [0] + [min(i - 1, lens[min(i - 1, len(lens) - 1)]) for i in range(1, steps + 1)]


class LlamaCppOriginalSimPolicy(LlamaCppSimPolicy):
    name = "llama_cpp_original"

    def __init__(self, *args, beam_prefix: str = "measured", **kw):
        super().__init__(*args, **kw)
        if beam_prefix not in PREFIX_MODES:
            raise ValueError(f"beam_prefix must be one of {PREFIX_MODES}, got {beam_prefix!r}")
        self.beam_prefix = beam_prefix

    def setup(self, ctx) -> None:
        super().setup(ctx)
        if self.quant != PARAMS["gguf_type"].value:
            raise ValueError(f"llama_cpp_original models the 2024 build, whose 16-bit GPU weights were "
                             f"{PARAMS['gguf_type'].value}; got quant={self.quant!r}")
        f = dict(self.cpu_factors)  # today's factors, scaled to the 2024 build's F16 kernels
        f["bw_fraction"] *= PARAMS["cpu_decode_vs_today"].value
        f["gflops_per_core"] *= PARAMS["cpu_prompt_vs_today"].value
        f["source"] = f"{f['source']}; x the 2024 build's F16 over today's bf16 ({_F16})"
        self.cpu_factors = f

    def reset(self) -> None:
        super().reset()
        self._hist: list[list[np.ndarray]] = []
        self._prefix: list[int] | None = None
        self.st["beam_decode_calls"] = 0
        self.st["beam_tokens_decoded"] = 0

    def forwards(self, step: Step, routing) -> list[tuple[Step, Any]]:
        import dataclasses

        if step.prefill or step.rows == 1:
            return [(step, routing)]
        B, i = step.rows, step.index  # decode step i: every beam holds i generated tokens
        if not self._hist:
            self._hist = [[] for _ in range(B)]
        for b in range(B):
            self._hist[b].append(routing.ids[:, b])
        if self._prefix is None:
            self._prefix = prefix_schedule(self.beam_prefix, B, 4096)
        p_now, p_prev = self._prefix[i], self._prefix[i - 1]
        prompt = step.kv_len - i
        out = []

        def call(tokens: list[np.ndarray], past: int):
            ids = np.stack(tokens, axis=1)
            r = dataclasses.replace(routing, ids=ids, guess=ids)
            self.st["beam_decode_calls"] += 1
            self.st["beam_tokens_decoded"] += len(tokens)
            return Step(step.index, len(tokens), 1, past + len(tokens), False), r

        if p_now > p_prev:
            out.append(call(self._hist[0][p_prev:p_now], prompt + p_prev))
        for b in range(B):
            out.append(call(self._hist[b][p_now:i], prompt + p_now))
        return out

    def info(self) -> dict[str, Any]:
        return {**super().info(), "policy": self.name, "beam_prefix": self.beam_prefix,
                "offload_min_batch": OFFLOAD_MIN_BATCH,
                "params": {k: {"value": v.value, "source": v.source} for k, v in PARAMS.items()}}
