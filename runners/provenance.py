"""What produced a record's numbers, and whether the environment it names is this host.

Every number is one of three things, and records, tables and plots say which:

- ``measured``: executed on this host's hardware (``environment=local``, or a described environment
  whose GPU is this host's CUDA device);
- ``emulated``: executed on this host with a GPU budget it does not have as such (a budget below
  the card's memory on CUDA, or any budget without CUDA, where the CPU device stands in for the GPU);
- ``simulated``: ``mode=simulate``, from the environment's hardware spec, no weights touched.

The rule for execute mode (checked by :func:`refuse_foreign_environment` before anything runs): the
environment's GPU must be this host's (``gpu.name`` matches the CUDA device, or both have none). A
described environment's CPU was often our own choice, so a CPU that differs is recorded, not refused.
"""
from __future__ import annotations

from typing import Any

from fiddler import hardware
from fiddler.gpu_budget import AUTO, choose_budget
from systems import base as systems_base

MEASURED, EMULATED, SIMULATED = "measured", "emulated", "simulated"
LABELS = (MEASURED, EMULATED, SIMULATED)

# what each label means, for table headers and plot captions
MEANING = {
    MEASURED: "measured on this host",
    EMULATED: "measured on this host with an emulated GPU budget (not the named card's hardware)",
    SIMULATED: "simulated from the environment's hardware spec (mode=simulate; no hardware ran)",
}


def gpu_key(name: Any) -> str:
    """A GPU name compared loosely: case, spacing and the vendor prefix do not matter ('NVIDIA
    GeForce RTX 4090' == 'GeForce RTX 4090'); the model does ('RTX 6000' != 'RTX 6000 Ada Generation')."""
    words = str(name or "none").lower().split()
    return " ".join(w for w in words if w != "nvidia") or "none"


def host_gpu() -> dict[str, Any] | None:
    return hardware.cuda_device()


def host_gpu_name(gpu: dict[str, Any] | None = None) -> str:
    gpu = host_gpu() if gpu is None else gpu
    return gpu["name"] if gpu else "none"


def gpu_is_hosts(env_gpu_name: Any, gpu: dict[str, Any] | None) -> bool:
    return gpu_key(env_gpu_name) == gpu_key(host_gpu_name(gpu) if gpu else "none")


def foreign_environment_reason(env: dict[str, Any], gpu: dict[str, Any] | None) -> str | None:
    """None when execute mode may run `env` on this host; else the one-line refusal."""
    if gpu_is_hosts(env["gpu"]["name"], gpu):
        return None
    name = env.get("name", "?")
    theirs = env["gpu"]["name"]
    ours = f"its CUDA device is {gpu['name']}" if gpu else "it has no CUDA GPU"
    try:
        budget = f"{float(env['gpu'].get('memory_gb') or 0):g}"
    except ValueError:  # local's detected value, as requested
        budget = "N"
    return (f"environment={name} describes a {theirs} GPU, not this host ({ours}); execute mode runs only on "
            f"this host's hardware, so its numbers would be mislabelled: use mode=simulate to simulate {name}, "
            f"or environment=local environment.gpu.memory_gb={budget} to emulate its GPU budget here")


def gpu_budget_gb(config: dict[str, Any]) -> float | str:
    """The GPU budget a job asks for, GiB or "auto" (systems.base.gpu_budget of its plain config)."""
    return systems_base.gpu_budget(config.get("system") or {}, config["environment"]["gpu"].get("memory_gb"))[0]


def budget_emulated(config: dict[str, Any], gpu: dict[str, Any] | None) -> bool:
    """True when the GPU budget is not the host's GPU as it is: without CUDA any budget > 0 (the CPU
    device stands in for the GPU), with CUDA a budget below the card's memory. auto sizes from the host's own
    free memory (the library's rule): the card as it is with CUDA, and without CUDA no GPU (emulated only where
    a test injects a reading, $FIDDLER_FAKE_FREE_GPU_BYTES)."""
    budget = gpu_budget_gb(config)
    if budget == AUTO:
        return not gpu and choose_budget(AUTO).bytes is not None
    if not gpu:
        return budget > 0
    return budget < gpu["memory_gb"] - 0.5


def cpu_mismatch(env: dict[str, Any]) -> list[str]:
    """Where the environment's CPU is not this host's (recorded; the host's CPU is what ran)."""
    cpu = env["cpu"]
    out = []
    host_isa = hardware.cpu_isa()
    if str(cpu.get("isa")) != host_isa:
        out.append(f"cpu.isa: the environment says {cpu.get('isa')}, this host's kernels run {host_isa}")
    if str(cpu.get("name")) != hardware.cpu_name():
        out.append(f"cpu.name: the environment says {cpu.get('name')}, this host is {hardware.cpu_name()}")
    if int(cpu.get("cores") or 0) != hardware.cpu_cores():
        out.append(f"cpu.cores: the environment says {cpu.get('cores')}, this process may use {hardware.cpu_cores()}")
    return out


def label(mode: str, emulated: bool) -> str:
    if mode == "simulate":
        return SIMULATED
    return EMULATED if emulated else MEASURED


def environment_info(config: dict[str, Any], detected: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record's `environment_info`: what the numbers are and how the environment relates to the host."""
    env = config["environment"]
    simulated = config.get("mode") == "simulate"
    info: dict[str, Any] = {"described": bool(env.get("described")), "simulated": simulated,
                            "detected": detected or {}}
    if simulated:
        info.update(budget_emulated=False, provenance=SIMULATED, meaning=MEANING[SIMULATED])
        return info
    gpu = host_gpu()
    emulated = budget_emulated(config, gpu)
    mismatch = cpu_mismatch(env)
    info.update(budget_emulated=emulated, provenance=label("execute", emulated),
                meaning=MEANING[label("execute", emulated)],
                host_gpu=host_gpu_name(gpu), gpu_is_hosts=gpu_is_hosts(env["gpu"]["name"], gpu),
                cpu_is_hosts=not mismatch, cpu_mismatch=mismatch)
    return info


def of_record(rec: dict[str, Any]) -> str:
    """The label of any record, also of records written before labels existed."""
    info = rec.get("environment_info") or {}
    if info.get("provenance") in LABELS:
        return info["provenance"]
    if rec.get("mode") == "simulate" or info.get("simulated"):
        return SIMULATED
    # before the rule, a described environment executed on the host, with or without a budget flag
    return EMULATED if info.get("budget_emulated") or info.get("described") else MEASURED
