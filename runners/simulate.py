"""`mode=simulate`: a job's configurations on the virtual clock (fiddler/sim), in this process, no weights.

The model comes from `model.arch`, the machine from the environment (runners.hardware.hardware_spec plus the
efficiency factors of its hardware class, `sim.efficiency` overrides), the routing from `sim.*`, and the
policy from the system's own config (`SystemConfig.sim_policy`). Records carry the same metric fields as
execute mode, `mode: simulate`, and a `simulation` block naming the spec, the efficiency factors and
their sources, and the routing (profile or trace, reuse parameter).
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import OmegaConf

from systems.base import SystemUnavailable, one_line
from systems import base as systems_base
from systems import paths
from runners import measure
from runners.hardware import hardware_spec
from runners.session import Job, base_record, timing

CONF_DIR = paths.conf_dir()


def model_config(arch: dict[str, Any]):
    """fiddler.config.MoEConfig from a model's `arch` (Hugging Face config fields; `model_type` picks the
    family, default mixtral)."""
    from fiddler.config import SUPPORTED, MoEConfig

    model_type = arch.get("model_type") or "mixtral"
    archs = SUPPORTED.get(model_type, ("?",))
    cfg = {"model_type": model_type, "architectures": [archs[0]], **arch}
    return MoEConfig.from_dict(cfg)


def card_memory_gb(env: dict[str, Any]) -> float | None:
    """The GPU memory the environment's yaml gives its card (None for local / unknown)."""
    path = CONF_DIR / "environment" / f"{env.get('name')}.yaml"
    if not path.is_file():
        return None
    try:
        value = OmegaConf.to_container(OmegaConf.load(path), resolve=False).get("gpu", {}).get("memory_gb")
        return float(value)
    except (TypeError, ValueError):
        return None  # detected (local)


def gpu_budget(config: dict[str, Any]):
    """(fiddler.gpu_budget.Budget, the key it came from): systems.base.simulated_budget of the job's plain
    config (auto: the library's rule on the environment's card)."""
    env = config["environment"]
    return systems_base.simulated_budget(config.get("system") or {}, env["gpu"].get("memory_gb"), env.get("name"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def budget_info(config: dict[str, Any]) -> dict[str, Any]:
    """The budget simulated (requested, bytes, and why: `source`; `key`: where the request came from), and
    whether a number given differs from the card's memory (a budget sweep beyond the card is labelled as such;
    auto is the rule's share of the card, said in `source`)."""
    budget, key = gpu_budget(config)
    gb = float(budget.requested) if _is_number(budget.requested) else (budget.bytes or 0) / 2**30
    card = card_memory_gb(config["environment"])
    info = {**budget.to_dict(), "key": key, "budget_gb": gb, "card_memory_gb": card}
    if card is not None and _is_number(budget.requested) and abs(gb - card) > 1e-9:  # auto: sized from the card
        info["override"] = "beyond the card's memory" if gb > card else "below the card's memory"
    return info


class SimSetup:
    """Everything of a job that does not depend on the workload point: model, machine, routing, policy."""

    def __init__(self, job: Job):
        from systems.fiddler.profiles import reference_popularity
        from fiddler.popularity import Popularity
        from fiddler.sim import Efficiency, ProfileRouting, SimContext, SimHardware, RoutingTrace, TraceRouting
        from fiddler.sim import cpu_class_of

        cfg = job.config
        env, sim, model = cfg["environment"], cfg["sim"], cfg["model"]
        self.config = model_config(model["arch"])
        self.dtype = getattr(torch, model["dtype"])
        system = job.system_config  # the typed options: what the harness asks of a system is a method
        spec = hardware_spec(env, cpu_threads=system.thread_count(env["cpu"]["threads"]))
        cpu_class = sim.get("cpu_class") or cpu_class_of(env["cpu"]["name"], env["cpu"]["isa"],
                                                         _host_amx() if env["name"] == "local" else None)
        overrides = {f"{part}.{k}": v for part, factors in (sim.get("efficiency") or {}).items()
                     for k, v in (factors or {}).items()}
        eff = Efficiency.for_classes(cpu_class, sim.get("gpu_class") or "nvidia").with_overrides(overrides)
        self.hw = SimHardware.build(spec, eff, measured_limit=not env.get("described"))
        chosen, _ = gpu_budget(cfg)
        budget = chosen.bytes if self.hw.has_gpu else None

        reference = reference_popularity(model["name"])
        if reference is not None:
            reference.check_shape(self.config)
        placement_pop = system.popularity(model["name"])
        self.placement_popularity = Popularity.for_config(self.config, placement_pop)
        routing = sim["routing"]
        if routing == "auto":
            routing = "trace" if sim.get("trace") else "profile"
        if routing == "trace":
            trace = RoutingTrace.load(Path(sim["trace"]).expanduser())
            trace.check_shape(self.config)
            self.routing = TraceRouting(trace, speculative_recall=sim["speculative_recall"], seed=sim["seed"])
        else:
            if routing == "profile":
                pop = Popularity.load(sim["profile"], top_k=self.config.active_slots) if sim.get("profile") else reference
            else:
                pop = None
            pop = Popularity.for_config(self.config, pop)  # None: uniform
            self.routing = ProfileRouting(pop, reuse=sim["reuse"], speculative_recall=sim["speculative_recall"],
                                          seed=sim["seed"], always=self.config.shared_slots)
        self.policy = job.system_config.sim_policy()
        if sim.get("latency_model") == "trace":  # replay the recorded run's decisions (schema: needs sim.trace)
            lm = RoutingTrace.load(Path(sim["trace"]).expanduser()).meta.get("latency_model")
            if lm is None:
                raise SystemUnavailable(f"sim.latency_model=trace: {sim['trace']} holds no latency model (recorded "
                                        "by a system without one, or before traces carried it)")
            if not hasattr(self.policy, "latency_model_override"):
                raise SystemUnavailable(f"sim.latency_model=trace: {type(self.policy).__name__} decides without "
                                        "a latency model of its own to replace")
            self.policy.latency_model_override = lm
        self.ctx = SimContext(self.config, self.dtype, self.hw, budget,
                              max_seq_len=max(p["input_len"] + p["output_len"] for p in job.points),
                              max_batch=max(p["beam_width"] for p in job.points), seed=int(sim["seed"]),
                              popularity=self.placement_popularity, quant=self.policy.weight_quant)
        self.policy.setup(self.ctx)

    def prefill_bound(self, input_len: int, beam_width: int) -> dict[str, Any] | None:
        """fiddler.sim.bounds.prefill_streaming_bound for a policy that places experts on a GPU (else None)."""
        from fiddler.sim.bounds import prefill_streaming_bound

        placement = getattr(self.policy, "placement", None)
        if not self.ctx.has_gpu or placement is None:
            return None
        bound = prefill_streaming_bound(self.ctx, placement.num_resident, input_len,
                                        self.policy.prefill_rows(beam_width))
        # the bound has every layer's attention on the GPU: say where the placement put some on the CPU
        bound["dense_cpu_layers"] = len(placement.to_dict().get("dense_cpu_layers") or [])
        return bound

    def describe(self, env: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"environment": env["name"], "source": env.get("source"), **self.hw.to_dict()},
                "cpu_class": self.hw.eff.cpu.name, "gpu_class": self.hw.eff.gpu.name,
                "efficiency_sources": {"cpu": self.hw.eff.cpu.sources, "gpu": self.hw.eff.gpu.sources},
                "routing": self.routing.describe(),
                "placement_popularity": self.placement_popularity.meta.get("source"),
                "latency_model": "the recorded engine's (sim.latency_model=trace)"
                if getattr(self.policy, "latency_model_override", None) else "from the spec",
                "gpu_budget_bytes": self.ctx.gpu_budget_bytes, "weight_quant": self.ctx.quant,
                "expert_bytes": self.ctx.costs.expert_bytes, "max_seq_len": self.ctx.max_seq_len,
                "max_batch": self.ctx.max_batch}


def _host_amx() -> bool | None:
    try:
        from fiddler import kernels

        return bool(kernels.features().get("amx_bf16"))
    except Exception:  # noqa: BLE001 -- no kernel: unknown
        return None


def measure_all(job: Job, todo: list[int], progress=None, current: list | None = None) -> Iterator[dict[str, Any]]:
    """Records of the job's points `todo`, simulated."""
    from fiddler.sim import simulate

    start = time.perf_counter()
    setup = failed = None
    try:
        setup = SimSetup(job)
    except SystemUnavailable as exc:
        failed = ("skipped", str(exc), None)
    except Exception as exc:  # noqa: BLE001 -- whatever the inputs the start checks let through: a record
        failed = ("error", f"simulation setup failed: {one_line(exc)}", traceback.format_exc(limit=8))
    load_s = time.perf_counter() - start
    env = job.config["environment"]
    for index in todo:
        if current is not None:
            current[0] = index
        if progress is not None:
            progress.start(index)
        t0 = time.perf_counter()
        if failed is not None:
            rec = base_record(job, index, *failed[:2])
            if failed[2]:
                rec["traceback"] = failed[2]
            rec["environment_info"]["gpu_budget"] = budget_info(job.config)
            rec["timing"] = timing(load_s, None)
            yield rec
            continue
        p = job.points[index]
        rec = base_record(job, index, "ok", None)
        rec["environment_info"]["gpu_budget"] = budget_info(job.config)
        rec["method"] = {"timer": "virtual clock (fiddler.sim)", "warmup": 0, "repetitions": 1,
                         "deterministic": True, "isolation": "inline"}
        rec["simulation"] = setup.describe(env)
        if rec["simulation"]["routing"]["kind"] == "trace":  # checked at start: short only with sim.trace_cycle
            short = setup.routing.trace.shortfall(p["input_len"], p["output_len"], p["beam_width"])
            rec["simulation"]["routing"]["cycled"] = f"trace cycled: {'; '.join(short)}" if short else None
        try:
            r = simulate(setup.policy, setup.ctx, setup.routing, p["input_len"], p["output_len"], p["beam_width"])
        except Exception as exc:  # noqa: BLE001 -- a point the model cannot simulate is an error record
            rec.update(status="error", reason=one_line(exc), traceback=traceback.format_exc(limit=8))
        else:
            sample = measure.Sample(r.ttft_s, r.decode_s, r.tokens, {})
            rec["metrics"] = measure.metrics_of([sample], p["input_len"], p["output_len"], 1)
            rec["raw"] = measure.raw_of([sample])
            rec["stats"] = {"executor": r.stats, "ttft_s": r.ttft_s, "decode_s": r.decode_s,
                            "lanes_busy_s": r.lanes_busy_s}
            bound = setup.prefill_bound(p["input_len"], p["beam_width"])
            if bound is not None:  # what any schedule streaming the experts could reach (fiddler.sim.bounds)
                rec["stats"]["prefill_bound"] = {**bound, "ttft_over_bound": r.ttft_s / bound["bound_s"]}
            rec["system_info"] = setup.policy.info()
            rec["method"]["token_accounting"] = "returned_sequence"
        rec["timing"] = timing(load_s, time.perf_counter() - t0)
        if current is not None:
            current[0] = None
        yield rec
