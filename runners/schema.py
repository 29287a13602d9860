"""Structured configs: the schema of every config group, registered in Hydra's ConfigStore.

OmegaConf checks types and enum values when the config is composed; the range checks in
``__post_init__`` run when :func:`validate` turns the config into objects. Every error names the
key and what is allowed, so a bad command line fails at start with a one-line reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the offending key."""


def _check(ok: Any, key: str, value: Any, allowed: str) -> None:
    """Raise ConfigError unless `ok`; `ok` is a callable so that unset (MISSING) values are skipped
    (OmegaConf builds schema defaults before values are filled in)."""
    if value is MISSING or (isinstance(value, list) and MISSING in value):
        return
    if not ok():
        raise ConfigError(f"{key}={value!r} is invalid; allowed: {allowed}")


def _check_list(values: List[int], key: str, minimum: int) -> None:
    _check(lambda: len(values) > 0, key, values, f"a non-empty list of integers >= {minimum}")
    _check(lambda: all(v >= minimum for v in values), key, values, f"integers >= {minimum}")


# ---------------------------------------------------------------- environment
class Isa(Enum):
    avx512_bf16 = "avx512_bf16"
    avx512 = "avx512"
    avx2 = "avx2"


@dataclass
class GpuSpec:
    name: str = "none"
    memory_gb: float = 0.0  # 0 = no GPU
    mem_bandwidth_gbps: float = 0.0
    bf16_tflops: float = 0.0

    def __post_init__(self) -> None:
        for key in ("memory_gb", "mem_bandwidth_gbps", "bf16_tflops"):
            _check(lambda: getattr(self, key) >= 0, f"environment.gpu.{key}", getattr(self, key), "a number >= 0")


@dataclass
class PcieSpec:
    h2d_gbps: float = 0.0
    d2h_gbps: float = 0.0

    def __post_init__(self) -> None:
        for key in ("h2d_gbps", "d2h_gbps"):
            _check(lambda: getattr(self, key) >= 0, f"environment.pcie.{key}", getattr(self, key), "a number >= 0")


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
        _check(lambda: self.mem_bandwidth_gbps > 0, "environment.cpu.mem_bandwidth_gbps", self.mem_bandwidth_gbps,
               "a number > 0")


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
        _check(lambda: self.host_memory_gb > 0, "environment.host_memory_gb", self.host_memory_gb, "a number > 0")


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

    def __post_init__(self) -> None:
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


# ---------------------------------------------------------------- systems
@dataclass
class SystemConfig:
    name: str = MISSING
    adapter: str = MISSING  # "package.module:ClassName", imported lazily


class ExpertsImpl(Enum):
    auto = "auto"
    grouped_mm = "grouped_mm"
    batched_mm = "batched_mm"
    eager = "eager"


@dataclass
class HFTransformersConfig(SystemConfig):
    # transformers' MoE experts implementation; auto = the fastest measured on this CPU (grouped_mm)
    experts_implementation: ExpertsImpl = ExpertsImpl.auto


class Planner(Enum):
    paper = "paper"
    makespan = "makespan"


class Placement(Enum):
    popularity = "popularity"
    random = "random"


@dataclass
class EngineSystemConfig(SystemConfig):
    """Options of every system that runs inside fiddler's engine (fiddler, mixtral_offloading)."""

    cpu_threads: Optional[int] = None  # None = environment.cpu.threads
    gpu_budget_gb: Optional[float] = None  # None = environment.gpu.memory_gb

    def __post_init__(self) -> None:
        if self.cpu_threads is not None:
            _check(lambda: self.cpu_threads >= 1, "system.cpu_threads", self.cpu_threads, "null or an integer >= 1")
        if self.gpu_budget_gb is not None:
            _check(lambda: self.gpu_budget_gb >= 0, "system.gpu_budget_gb", self.gpu_budget_gb, "null or a number >= 0")


@dataclass
class FiddlerConfig(EngineSystemConfig):
    planner: Planner = Planner.makespan
    placement: Placement = Placement.popularity
    popularity_profile: Optional[str] = None  # JSON profile; None = uniform


_LLAMA_QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m",
                 "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")


_LLAMA_KV_TYPES = ("f16", "bf16", "f32", "q8_0", "q4_0")


class OnOffAuto(Enum):
    auto = "auto"
    on = "on"
    off = "off"


@dataclass
class LlamaCppConfig(SystemConfig):
    quant: str = "bf16"  # GGUF type: converter types f32/f16/bf16/q8_0 or llama.cpp's quantizer types
    n_gpu_layers: int = 0  # -ngl; -1 = all
    n_cpu_moe: int = 0  # --n-cpu-moe: expert FFNs of the first N layers stay in host memory
    n_ctx: Optional[int] = None  # None = derived from the request
    n_batch: int = 512
    flash_attn: OnOffAuto = OnOffAuto.auto
    threads: Optional[int] = None  # None = environment.cpu.threads
    converter_dir: Optional[str] = None  # llama.cpp source tree with convert_hf_to_gguf.py
    verbose: bool = False
    kv_cache_type: str = "f16"  # llama.cpp's default; also bf16, f32, q8_0, q4_0

    def __post_init__(self) -> None:
        _check(lambda: self.quant in _LLAMA_QUANTS, "system.quant", self.quant, ", ".join(_LLAMA_QUANTS))
        _check(lambda: self.n_gpu_layers >= -1, "system.n_gpu_layers", self.n_gpu_layers, "-1 (all) or >= 0")
        _check(lambda: self.n_cpu_moe >= 0, "system.n_cpu_moe", self.n_cpu_moe, "an integer >= 0")
        _check(lambda: self.n_batch >= 1, "system.n_batch", self.n_batch, "an integer >= 1")
        if self.threads is not None:
            _check(lambda: self.threads >= 1, "system.threads", self.threads, "null or an integer >= 1")
        _check(lambda: self.kv_cache_type in _LLAMA_KV_TYPES, "system.kv_cache_type", self.kv_cache_type,
               ", ".join(_LLAMA_KV_TYPES))


class PrefetchInput(Enum):
    residual = "residual"  # hidden state after the layer's MoE output is added
    moe_input = "moe_input"  # the layer's (normed) expert input


@dataclass
class MixtralOffloadingConfig(EngineSystemConfig):
    cache_size: Optional[int] = None  # experts per layer on the GPU; None = derived from the GPU budget
    default_cache_size: int = 2  # when cache_size is None and there is no GPU budget
    prefetch: bool = True
    prefetch_k: Optional[int] = None  # None = the model's top_k
    prefetch_input: PrefetchInput = PrefetchInput.residual
    quantize: bool = False  # HQQ: attention 4-bit g64, experts 2-bit g16 (needs the hqq package)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("cache_size", "prefetch_k"):
            v = getattr(self, key)
            if v is not None:
                _check(lambda: v >= 1, f"system.{key}", v, "null or an integer >= 1")
        _check(lambda: self.default_cache_size >= 1, "system.default_cache_size", self.default_cache_size,
               "an integer >= 1")


class DeepSpeedEngine(Enum):
    zero_offload = "zero_offload"  # ZeRO-Inference: ZeRO-3 with parameters offloaded (the paper's baseline)
    mii = "mii"  # DeepSpeed-MII FastGen (CUDA only)


class OffloadDevice(Enum):
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class DeepSpeedConfig(SystemConfig):
    engine: DeepSpeedEngine = DeepSpeedEngine.zero_offload
    offload_device: OffloadDevice = OffloadDevice.cpu
    pin_memory: bool = True
    nvme_path: Optional[str] = None
    zero_overrides: Dict[str, Any] = field(default_factory=dict)
    tensor_parallel: int = 1
    max_length: Optional[int] = None

    def __post_init__(self) -> None:
        _check(lambda: self.tensor_parallel == 1, "system.tensor_parallel", self.tensor_parallel,
               "1 (the harness runs one process)")
        if self.max_length is not None:
            _check(lambda: self.max_length >= 1, "system.max_length", self.max_length, "null or an integer >= 1")


# ---------------------------------------------------------------- run control
class Mode(Enum):
    execute = "execute"
    simulate = "simulate"


class Isolation(Enum):
    auto = "auto"  # a fresh process per configuration when there is more than one
    process = "process"
    inline = "inline"


@dataclass
class RunConfig:
    isolation: Isolation = Isolation.auto
    timeout_s: Optional[float] = None  # per configuration; a hang becomes status `timeout`
    memory_limit_gb: Optional[float] = None  # RLIMIT_AS of the child process (isolation=process)
    force: bool = False  # re-run configurations that already have an `ok` record
    resume: bool = True
    index_path: Optional[str] = None  # project-wide JSONL index; None = <project>/results/index.jsonl
    progress: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            _check(lambda: self.timeout_s > 0, "run.timeout_s", self.timeout_s, "null or a number > 0")
        if self.memory_limit_gb is not None:
            _check(lambda: self.memory_limit_gb > 0, "run.memory_limit_gb", self.memory_limit_gb, "null or a number > 0")


@dataclass
class Config:
    environment: EnvironmentConfig = MISSING
    workload: WorkloadConfig = MISSING
    system: Any = MISSING  # one of the SystemConfig subclasses (chosen by the group's yaml)
    model: ModelConfig = MISSING
    mode: Mode = Mode.execute
    run: RunConfig = field(default_factory=RunConfig)
    cache_dir: str = "${oc.env:FIDDLER_CACHE,${oc.env:HOME}/.cache/fiddler}"


SYSTEM_SCHEMAS: dict[str, type] = {
    "hf_transformers_schema": HFTransformersConfig,
    "fiddler_schema": FiddlerConfig,
    "llama_cpp_schema": LlamaCppConfig,
    "deepspeed_mii_schema": DeepSpeedConfig,
    "mixtral_offloading_schema": MixtralOffloadingConfig,
}


def register_system_schema(name: str, node: type) -> None:
    """Register a system's structured config (its yaml lists `<name>` in its defaults)."""
    SYSTEM_SCHEMAS[name] = node
    ConfigStore.instance().store(group="system", name=name, node=node)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="environment", name="environment_schema", node=EnvironmentConfig)
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    for name, node in SYSTEM_SCHEMAS.items():
        cs.store(group="system", name=name, node=node)


def validate(cfg: DictConfig) -> Config:
    """Resolve interpolations and run every range check; raises ConfigError naming the key."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]
