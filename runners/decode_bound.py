"""The decode bound of a CPU run: the bytes one decode step must read from memory, over the host's
memory-read limit: the environment's cpu.mem_bandwidth_gbps, which `environment=local` measures with
fiddler.kernels.read_limit (the project's one probe; its strategies are then named in the record).

Bytes per token come from the model's config (MoEConfig.decode_bytes_per_token: the active experts,
attention projections, router, norms, lm_head and the KV cache), averaged over the decode steps of
the point (the KV cache grows). With beams, the experts the beams actually used when the system
reports them (the engine's `decode_experts_per_layer`), else top_k x beams capped at the expert count.
Every system that decodes from host memory gets it, so fiddler and llama.cpp rows compare in one table.
"""
from __future__ import annotations

from typing import Any

from runners import hardware


def environment_limit(env_gbps: float) -> dict | None:
    """The limit a record's bound uses: the environment's cpu.mem_bandwidth_gbps, with the strategies of
    the measurement behind it when this run measured it (environment=local); never measures."""
    if not env_gbps or env_gbps <= 0:
        return None
    measured = hardware.known_read_limit()
    if measured and round(float(measured["gbps"]), 1) == round(float(env_gbps), 1):
        return measured
    return {"gbps": float(env_gbps), "best": "environment.cpu.mem_bandwidth_gbps (as configured)", "strategies": {}}


def decode_bound(model_path: str, dtype: str, input_len: int, output_len: int, beam_width: int,
                 decode_tok_s: dict[str, float | None], experts_per_layer: float | None, limit: dict | None,
                 quant: str | None = None) -> dict[str, Any] | None:
    """{"bytes_per_token", "weight_quant", "limit_gbps", "limit_by", "limit_strategies", "bound_tok_s",
    "fraction": {name: measured / bound}, "experts_per_layer"} for a point whose decode tok/s were
    measured (`decode_tok_s`: e.g. mean and best); None without decode steps or without a limit.
    quant: the expert and attention projection weight type (None: dtype; "q8_0"/"q4_0": llama.cpp
    blocks, fiddler.quant; "unmodelled": a mix whose bytes are not modelled -> no bound)."""
    if output_len < 2 or not limit:
        return None
    if quant == "unmodelled":
        return {"unavailable": "bytes per token are not modelled for this weight type mix (only bf16 and the "
                               "pure q8_0/q4_0 policy are)"}
    import torch  # here, not at import: a resumed run with nothing to do never loads torch

    from fiddler.config import MoEConfig

    cfg = MoEConfig.from_pretrained(model_path)
    t = getattr(torch, dtype)
    steps = range(input_len + 1, input_len + output_len)
    nbytes = sum(cfg.decode_bytes_per_token(kv, t, beam_width, experts_per_layer, quant=quant)
                 for kv in steps) / len(steps)
    bound = limit["gbps"] * 1e9 / nbytes
    return {
        "bytes_per_token": nbytes,
        "weight_quant": quant,
        "limit_gbps": limit["gbps"],
        "limit_by": limit["best"],
        "limit_strategies": limit["strategies"],
        "bound_tok_s": bound,
        "fraction": {k: (v / bound if v else None) for k, v in decode_tok_s.items()},
        "experts_per_layer": experts_per_layer if experts_per_layer is not None else
        min(cfg.top_k * beam_width, cfg.num_experts) + cfg.shared_slots,
    }
