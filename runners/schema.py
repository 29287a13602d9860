"""Structured configs: the schema of every config group, registered in Hydra's ConfigStore.

OmegaConf checks types and enum values when the config is composed; unknown keys are refused and the
range checks in ``__post_init__`` run when :func:`validate` turns the config into objects. Every error names the
key and what is allowed, so a bad command line fails at start with a one-line reason.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from fiddler.server.__main__ import SIZE, SIZES
from systems.base import ConfigError, simulated_budget
from systems.registry import system_classes
from systems.base import check as _check
from systems.base import check_number as _check_number


def _check_list(values: List[int], key: str, minimum: int) -> None:
    _check(lambda: len(values) > 0, key, values, f"a non-empty list of integers >= {minimum}")
    _check(lambda: all(v >= minimum for v in values), key, values, f"integers >= {minimum}")


# ---------------------------------------------------------------- environment
class Isa(Enum):
    avx512_bf16 = "avx512_bf16"
    avx512 = "avx512"
    avx2 = "avx2"


# A GPU's memory may be 0 (no GPU). Its bandwidth, its FLOP/s and the PCIe rates may be 0 here, meaning
# unknown: environment=local cannot detect them and execute mode never reads them. Where mode=simulate
# simulates a GPU they are divisors, so check_simulation wants them > 0 there.
@dataclass
class GpuSpec:
    name: str = "none"
    memory_gb: float = 0.0  # 0 = no GPU
    mem_bandwidth_gbps: float = 0.0
    bf16_tflops: float = 0.0

    def __post_init__(self) -> None:
        _check_number("environment.gpu.memory_gb", self.memory_gb, note=" (0 = no GPU)")
        for key in ("mem_bandwidth_gbps", "bf16_tflops"):
            _check_number(f"environment.gpu.{key}", getattr(self, key), note=" (0 = unknown)")


@dataclass
class PcieSpec:
    h2d_gbps: float = 0.0
    d2h_gbps: float = 0.0

    def __post_init__(self) -> None:
        for key in ("h2d_gbps", "d2h_gbps"):
            _check_number(f"environment.pcie.{key}", getattr(self, key), note=" (0 = unknown)")


@dataclass
class CpuSpec:
    name: str = MISSING
    cores: int = MISSING
    mem_bandwidth_gbps: float = MISSING
    isa: Isa = MISSING
    threads: int = MISSING  # the thread count every system uses

    def __post_init__(self) -> None:
        _check(lambda: self.cores >= 1, "environment.cpu.cores", self.cores, "an integer >= 1")
        _check(lambda: self.threads >= 1, "environment.cpu.threads", self.threads, "an integer >= 1")
        # the CPU always computes: its read limit divides every CPU cost
        _check_number("environment.cpu.mem_bandwidth_gbps", self.mem_bandwidth_gbps, above=True)


@dataclass
class EnvironmentConfig:
    name: str = MISSING
    # True when the hardware is a description, not this host (the record then says simulated/emulated)
    described: bool = False
    source: str = ""  # where the numbers come from
    gpu: GpuSpec = field(default_factory=GpuSpec)
    pcie: PcieSpec = field(default_factory=PcieSpec)
    cpu: CpuSpec = field(default_factory=CpuSpec)
    host_memory_gb: float = MISSING

    def __post_init__(self) -> None:
        _check_number("environment.host_memory_gb", self.host_memory_gb, above=True)


# ---------------------------------------------------------------- workload
@dataclass
class WorkloadConfig:
    name: str = MISSING
    input_lens: List[int] = MISSING
    output_lens: List[int] = MISSING
    beam_widths: List[int] = field(default_factory=lambda: [1])
    repetitions: int = 3
    warmup: int = 1
    seed: int = 0
    # None: seeded synthetic token ids (the same for every system); else a text file whose
    # tokens (by the model's tokenizer) are cycled to each input length
    prompt_file: Optional[str] = None
    # workload=serving (runners/serving/workload.py): a non-empty list makes this a serving workload, measured by
    # guidellm against the system's server at each number of concurrent streams
    concurrency: List[int] = field(default_factory=list)
    requests_per_stream: int = 4  # guidellm sends concurrency x this many requests per level
    ignore_eos: bool = True  # every request generates exactly its output length (guidellm's synthetic data)
    # p99 limits (MLPerf Inference's Server scenario for Mixtral-8x7B, mlcommons/inference loadgen/mlperf.conf:
    # TTFT 2 s, TPOT 200 ms): goodput counts the requests within both; the rate search the highest rate whose
    # p99s stay within them. Borrowed from the real Mixtral: loose on a small model, hence also slo_scale
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    # scaled limits: p99 TTFT and TPOT within slo_scale x the system's own unloaded (one stream) p50s
    slo_scale: float = 3.0
    # Poisson arrival rates (requests/s, seeded by workload.seed), each a level beside the concurrency levels
    rates: List[float] = field(default_factory=list)
    # per system, the highest rate within each SLO: at most this many rates tried (0: no search), starting from
    # the capacity measured at the largest concurrency; each rate gets rate_requests requests or rate_max_s
    rate_search: int = 0
    rate_requests: int = 64
    rate_max_s: float = 600.0
    # tokens of a system prompt every request starts with (then input_len tokens of its own); 0: none
    shared_prefix_len: int = 0
    # per-token latency at each concurrency level: the same load again from aiperf, which keeps each token's
    # time (guidellm does not), and the server's own ITL histogram over it (runners/serving/itl.py); where aiperf
    # is not installed (scripts/install.sh sets it up; --no-aiperf skips it) the record says so
    itl: bool = True

    def __post_init__(self) -> None:
        if self.concurrency:
            _check_list(self.concurrency, "workload.concurrency", 1)
        # fewer: a level's statistics are those of its first wave, which starts all at once
        _check(lambda: self.requests_per_stream >= 4, "workload.requests_per_stream", self.requests_per_stream,
               "an integer >= 4")
        _check_number("workload.slo_ttft_s", self.slo_ttft_s, above=True)
        _check_number("workload.slo_tpot_s", self.slo_tpot_s, above=True)
        _check_number("workload.slo_scale", self.slo_scale, 1.0, note=" (a multiple of the unloaded latency)")
        for r in self.rates:
            _check_number("workload.rates", r, above=True, note=" (requests/s)")
        _check(lambda: 0 <= self.rate_search <= 5, "workload.rate_search", self.rate_search, "an integer in 0..5")
        _check(lambda: self.rate_requests >= 64, "workload.rate_requests", self.rate_requests, "an integer >= 64")
        _check_number("workload.rate_max_s", self.rate_max_s, above=True)
        _check(lambda: not self.rate_search or bool(self.concurrency), "workload.rate_search", self.rate_search,
               "0 without workload.concurrency (the search starts from the capacity at the largest concurrency)")
        _check(lambda: self.shared_prefix_len >= 0, "workload.shared_prefix_len", self.shared_prefix_len,
               "an integer >= 0")
        _check_list(self.input_lens, "workload.input_lens", 1)
        _check_list(self.output_lens, "workload.output_lens", 1)
        _check_list(self.beam_widths, "workload.beam_widths", 1)
        _check(lambda: self.repetitions >= 1, "workload.repetitions", self.repetitions, "an integer >= 1")
        _check(lambda: self.warmup >= 0, "workload.warmup", self.warmup, "an integer >= 0")


# ---------------------------------------------------------------- model
class Dtype(Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"


@dataclass
class ModelConfig:
    name: str = MISSING
    # local Hugging Face checkpoint directory; None = generate from `arch` (synthetic models)
    path: Optional[str] = None
    # Hugging Face MixtralConfig fields; for synthetic models the generator uses them, for real
    # checkpoints they describe the architecture (the simulator needs no weights)
    arch: Dict[str, Any] = field(default_factory=dict)
    synthetic: bool = False
    seed: int = 0
    dtype: Dtype = Dtype.bfloat16

    def __post_init__(self) -> None:
        if self.arch != MISSING:
            check_arch(self.arch)


# model.arch sizes (widths, counts, lengths) that must be integers >= 1 where given: a 0 or negative one
# gave "negative duration" from the simulator and nonsense shapes from the generator. The counts where 0
# means none are >= 0. Other numbers of arch (eps, rope theta, scaling factors) must be finite.
ARCH_SIZES = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts",
              "n_routed_experts", "num_experts_per_tok", "vocab_size", "max_position_embeddings", "kv_lora_rank",
              "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
              "decoder_sparse_step", "sliding_window")
ARCH_COUNTS = ("first_k_dense_replace", "n_shared_experts", "shared_expert_intermediate_size")


def check_arch(arch: Dict[str, Any], prefix: str = "model.arch") -> None:
    for key, value in arch.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            check_arch(value, name)
        elif value is None or isinstance(value, bool):
            continue
        elif prefix == "model.arch" and key in ARCH_SIZES + ARCH_COUNTS:
            low = 1 if key in ARCH_SIZES else 0
            _check(lambda: isinstance(value, int) and value >= low, name, value, f"an integer >= {low}")
        elif isinstance(value, float):
            _check(lambda: math.isfinite(value), name, value, "a finite number")


# ---------------------------------------------------------------- systems
# Each system's options are one typed class beside its adapter (systems/<name>/config.py, a
# systems.base.SystemConfig subclass); systems/registry.py finds them and register() stores each under its name.


# ---------------------------------------------------------------- run control
class Mode(Enum):
    execute = "execute"
    simulate = "simulate"
    serve = "serve"  # start the system's OpenAI-compatible server on the model until SIGTERM (runners/serving/serve.py)


class Isolation(Enum):
    auto = "auto"  # a child process when there is more than one configuration or a limit is set
    process = "process"
    inline = "inline"


@dataclass
class RunConfig:
    isolation: Isolation = Isolation.auto
    # limits, enforced by running the job in a child process (inline refuses them)
    timeout_s: Optional[float] = None  # per configuration, the system load not counted; a hang -> `timeout`
    load_timeout_s: Optional[float] = None  # for loading the system in each child process
    memory_limit_gb: Optional[float] = None  # RLIMIT_AS of the child process
    force: bool = False  # re-run configurations that already have an `ok` record
    resume: bool = True
    index_path: Optional[str] = None  # project-wide JSONL index; None = <project>/results/index.jsonl
    progress: bool = True

    def __post_init__(self) -> None:
        for key in ("timeout_s", "load_timeout_s", "memory_limit_gb"):  # null, not inf, means no limit
            _check_number(f"run.{key}", getattr(self, key), above=True, optional=True)


class SimRouting(Enum):
    auto = "auto"  # sim.trace if given, else the model's reference popularity profile, else uniform
    profile = "profile"  # sim.profile, or the model's reference profile
    uniform = "uniform"
    trace = "trace"  # sim.trace: a routing trace recorded in execute mode (system.record_routing=true)


class SimLatencyModel(Enum):
    spec = "spec"  # from the environment's hardware spec (LatencyModel.from_hardware_spec)
    trace = "trace"  # the engine's own, recorded with sim.trace (its meta's latency_model)


@dataclass
class SimConfig:
    """mode=simulate: where routing comes from and the efficiency factors (fiddler/sim)."""

    routing: SimRouting = SimRouting.auto
    profile: Optional[str] = None  # popularity JSON; None = the model's reference profile (mixtral_8x7b)
    trace: Optional[str] = None  # routing trace JSON (fiddler.sim.trace format)
    # temporal reuse between consecutive tokens and speculative-router recall (fiddler/sim/routing.py,
    # calibrated to Mixtral-Offloading's Fig. 2 as summarised second-hand)
    reuse: float = 0.26
    speculative_recall: float = 0.85
    seed: int = 0
    # a trace shorter than the workload (prefill tokens, decode rows) is cycled only when asked; the record
    # then says so (simulation.routing.cycled)
    trace_cycle: bool = False
    # the latency model the simulated engine decides with (plans, fills): "spec" (built from the environment's
    # hardware spec, as the engine would calibrate on it) or "trace" (the one the engine calibrated when it
    # recorded sim.trace: a replay of that run's decisions, e.g. to check that the simulator's resident set is
    # the engine's); the virtual clock's costs come from the spec either way
    latency_model: SimLatencyModel = SimLatencyModel.spec
    cpu_class: Optional[str] = None  # None = from environment.cpu.name / isa (fiddler.sim.cpu_class_of)
    gpu_class: str = "nvidia"
    # overrides of the class's factors, e.g. sim.efficiency={cpu:{kernel_bw_fraction:0.9}} or
    # +sim.efficiency.gpu.bw_fraction=0.85 (fiddler/sim/efficiency.py names them)
    efficiency: Dict[str, Dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("reuse", "speculative_recall"):
            v = getattr(self, key)
            _check(lambda: 0.0 <= v <= 1.0, f"sim.{key}", v, "a number in [0, 1]")
        _check(lambda: self.routing is not SimRouting.trace or bool(self.trace), "sim.routing", self.routing.value,
               "trace only with sim.trace=<routing trace file>")
        _check(lambda: self.latency_model is not SimLatencyModel.trace or bool(self.trace), "sim.latency_model",
               self.latency_model.value, "trace only with sim.trace=<routing trace file>")
        if self.efficiency and self.efficiency != MISSING:
            from fiddler.sim.efficiency import FACTOR_RANGES, factor_problem  # only when overrides are given

            for part, factors in self.efficiency.items():
                names = [k.partition(".")[2] for k in FACTOR_RANGES if k.startswith(f"{part}.")]
                _check(lambda: bool(names), "sim.efficiency", part, "cpu.<factor> or gpu.<factor>")
                for name, value in (factors or {}).items():
                    key = f"sim.efficiency.{part}.{name}"
                    _check(lambda: name in names, key, value,
                           f"a factor of fiddler/sim/efficiency.py: {', '.join(names)}")
                    problem = factor_problem(f"{part}.{name}", value)
                    _check(lambda: problem is None, key, value, problem or "")


@dataclass
class ServeConfig:
    """mode=serve and workload=serving: where the system's server listens and how its batch loop is sized.
    The sizes' defaults, meanings and least values are fiddler.server's (fiddler/server/__main__.py SIZES: slots,
    max_queue, token_budget, drain_timeout_s, prefix_cache_mb), written there once; every system's server gets
    them (llama.cpp's llama_cpp.server runs one slot)."""

    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = SIZE["slots"].default
    max_queue: int = SIZE["max_queue"].default
    token_budget: int = SIZE["token_budget"].default
    max_seq_len: int = 4096  # positions per slot (clipped to the model's context)
    drain_timeout_s: float = SIZE["drain_timeout_s"].default
    prefix_cache_mb: float = SIZE["prefix_cache_mb"].default
    # the key the server asks clients for (Authorization: Bearer), handed to it in its environment; from
    # FIDDLER_API_KEY by default, never a literal on the command line (runners/serving/api_key.py), never in records
    api_key: Optional[str] = "${oc.env:FIDDLER_API_KEY,null}"
    ready_timeout_s: float = 900.0  # for the server to load and answer /health

    def __post_init__(self) -> None:
        _check(lambda: 0 < self.port < 65536, "serve.port", self.port, "an integer in 1..65535")
        _check(lambda: self.max_seq_len >= 1, "serve.max_seq_len", self.max_seq_len, "an integer >= 1")
        for s in SIZES:  # the server's least values
            value = getattr(self, s.key)
            if s.type is int:
                _check(lambda: value >= s.minimum, f"serve.{s.key}", value, f"an integer >= {s.minimum:g}")
            else:
                _check_number(f"serve.{s.key}", value, s.minimum)
        _check(lambda: self.token_budget >= self.slots, "serve.token_budget", self.token_budget,
               f"an integer >= serve.slots ({self.slots})")
        _check_number("serve.ready_timeout_s", self.ready_timeout_s, above=True)


@dataclass
class Config:
    environment: EnvironmentConfig = MISSING
    workload: WorkloadConfig = MISSING
    system: Any = MISSING  # the system's SystemConfig subclass (its class is the group's option)
    model: ModelConfig = MISSING
    mode: Mode = Mode.execute
    run: RunConfig = field(default_factory=RunConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    cache_dir: str = "${oc.env:FIDDLER_CACHE,${oc.env:HOME}/.cache/fiddler}"


def paper_systems() -> str:
    """`${paper_systems:}`, the paper experiments' system sweep (conf/experiment/paper_*.yaml): every system
    whose config class has a row in the paper's tables, in the tables' order."""
    rows = sorted((c.paper_row, name) for name, c in system_classes().items() if c.paper_row is not None)
    return ",".join(name for _, name in rows)


def register() -> None:
    if not OmegaConf.has_resolver("paper_systems"):
        OmegaConf.register_new_resolver("paper_systems", paper_systems)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="environment", name="environment_schema", node=EnvironmentConfig)
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    for name, node in system_classes().items():
        # Lenient about unknown keys at composition, strict in validate() (check_known_keys), which
        # every job runs at its start. In `-m system=fiddler,llama_cpp system.quant=q4_0` Hydra applies
        # system.quant to the sweep's primary config, composed with the default system (hf_transformers,
        # no quant) before any sweeper exists, so no custom sweeper could help; then BasicSweeper
        # composes every job before the first runs. A strict node stopped the whole sweep at either
        # step; lenient, each job gets the key on its own system and one whose system lacks it is
        # refused alone (job_error.txt), with any launcher. The fields stay typed: a bad value for a
        # known key still fails at composition.
        cs.store(group="system", name=name, node=OmegaConf.structured(node, flags={"struct": False}))


def check_known_keys(node: DictConfig, prefix: str = "") -> None:
    """Every key is one of its schema's fields. A system's node takes any key at composition
    (register), and `+key=value` adds one anywhere; converting the config to objects would then drop
    it silently (`+system.planer=paper` ran as ok)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form mapping (model.arch, system.zero_overrides)
    fields = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items_ex(resolve=False):
        name = f"{prefix}{key}"
        if key not in fields:
            where = prefix[:-1] or "the top level"
            if where == "system":  # in a sweep over systems, say which one lacks it
                where = f"system={node.get('name')}"
            raise ConfigError(_unknown_key(str(key), prefix, fields, where))
        if isinstance(value, DictConfig):
            check_known_keys(value, f"{name}.")


def _unknown_key(key: str, prefix: str, fields: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, fields, n=1)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    return f"{prefix}{key} is not a known key; {hint}allowed under {where}: {', '.join(fields)}"


def override_hints(args: list[str]) -> list[str]:
    """For the command line's `key=value` overrides (without +, ~ or hydra.) whose key the schema does not
    have: the line check_known_keys would say, with its did-you-mean. Hydra refuses such a typo first, and
    suggests adding `+` to it. system.* keys are left to check_known_keys: they depend on the system. Also
    environment.gpu.memory_gb=auto, which Hydra refuses as not a number: where auto belongs instead."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if key == "environment.gpu.memory_gb" and value.strip().lower() == "auto":
            out.append("environment.gpu.memory_gb=auto is not a number: it describes the card (GB; 0 = no GPU; "
                       "environment=local detects it); a budget that sizes itself is system.gpu_budget_gb=auto "
                       "(system=fiddler, mixtral_offloading; docs/harness.md 'The GPU budget')")
            continue
        if not eq or key.startswith(("-", "+", "~", "hydra.", "system.")):
            continue
        node: Any = Config
        prefix = ""
        for part in key.split("."):
            if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
                break  # a free-form mapping, a list or a system: any key
            fields = [f.name for f in dataclasses.fields(node)]
            if part not in fields:
                out.append(_unknown_key(part, prefix, fields, prefix[:-1] or "the top level"))
                break
            node = typing.get_type_hints(node)[part]
            prefix += f"{part}."
    return out


def validate(cfg: DictConfig) -> Config:
    """Check that every key is known, resolve interpolations and run every range check; raises
    ConfigError naming the key."""
    check_known_keys(cfg)
    conf: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    if conf.mode is Mode.simulate:
        check_simulation(conf)
    return conf


def simulated_gpu_budget(conf: Config):
    """(fiddler.gpu_budget.Budget, key): the GPU budget mode=simulate gives the system
    (systems.base.simulated_budget)."""
    return simulated_budget(conf.system, conf.environment.gpu.memory_gb, conf.environment.name)


def check_simulation(conf: Config) -> None:
    """What mode=simulate computes with beyond each key's own range: the machine it describes. Where it
    simulates a GPU (a budget > 0), the GPU's bandwidth and FLOP/s and both PCIe rates are divisors: 0 gave a
    ZeroDivisionError, or silently no GPU, or the h2d rate for d2h. Threads beyond the cores it describes
    were simulated as that many cores."""
    env = conf.environment
    budget, source = simulated_gpu_budget(conf)
    if budget.bytes is not None:
        asked = f"{budget.requested:g}" if isinstance(budget.requested, (int, float)) else budget.source
        for key, value in (("gpu.mem_bandwidth_gbps", env.gpu.mem_bandwidth_gbps),
                           ("gpu.bf16_tflops", env.gpu.bf16_tflops), ("pcie.h2d_gbps", env.pcie.h2d_gbps),
                           ("pcie.d2h_gbps", env.pcie.d2h_gbps)):
            _check_number(f"environment.{key}", value, above=True,
                          note=f" where mode=simulate simulates a GPU ({source}={asked}; 0 simulates none)")
    asked = [("environment.cpu.threads", env.cpu.threads)]
    asked += [(f"system.{k}", getattr(conf.system, k)) for k in ("cpu_threads", "threads") if hasattr(conf.system, k)]
    for key, n in asked:
        if n is not None and n > env.cpu.cores:
            raise ConfigError(f"{key}={n} is more than the {env.cpu.cores} cores environment={env.name} describes; "
                              f"allowed: 1..{env.cpu.cores} (or describe more with environment.cpu.cores)")
