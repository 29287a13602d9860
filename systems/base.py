"""The one interface every benchmarked system implements.

The runner (``runners/``) owns timing: it starts a clock, calls ``generate`` and stops the clock.
The system calls ``on_first_token()`` exactly once, right after the first new token exists (after
the prefill forward and the first token choice), so that TTFT and decode time are measured by the
same code for every system. Systems never time themselves for the headline metrics.
"""
from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from fiddler.gpu_budget import AUTO, FreeMemory, choose_budget
from fiddler.plain import plain

MISSING = "???"  # omegaconf.MISSING: a value the yaml must give


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the offending key."""


def check(ok: Callable[[], Any], key: str, value: Any, allowed: str) -> None:
    """Raise ConfigError unless `ok()`; unset (MISSING) values are skipped (OmegaConf builds schema
    defaults before values are filled in)."""
    if value == MISSING or (isinstance(value, list) and MISSING in value):
        return
    if not ok():
        raise ConfigError(f"{key}={value!r} is invalid; allowed: {allowed}")


def check_number(key: str, value: Any, low: float = 0.0, *, above: bool = False, optional: bool = False,
                 note: str = "") -> None:
    """A finite number >= low (> low where `above`; None too where `optional`). Finite always: an inf or a
    NaN passes every comparison-free path of a cost model and comes out as an `ok` record of nonsense."""
    if optional and value is None:
        return
    sign = ">" if above else ">="
    allowed = f"{'null or ' if optional else ''}a finite number {sign} {low:g}{note}"
    check(lambda: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if above else value >= low), key, value, allowed)


@dataclass
class SystemConfig:
    """Options of one system: the base of every `systems/<name>/config.py` class, and its registration.
    A subclass whose `name` has a default is a system the harness offers as `system=<name>`
    (systems/registry.py finds it, runners/schema.py stores it in Hydra's ConfigStore); a subclass of a
    system that changes defaults and `name` is a preset (`fiddler_original`). Types and enum values are
    checked by Hydra, ranges by `__post_init__`; the adapter gets this typed object."""

    #: the row's label in tables and figures (default: the name)
    label: ClassVar[str] = ""
    #: the pip extra the system's adapter needs (`pip install -e ".[<extra>]"`), None = the base install
    extra: ClassVar[Optional[str]] = None
    #: the paper's experiments (runners/paper.py): this row's place in its tables, None = not a row
    paper_row: ClassVar[Optional[int]] = None
    #: "fiddler" (a Fiddler row, compared with the baselines) or "baseline"
    paper_role: ClassVar[Optional[str]] = None
    #: what the paper's reported values (results/reference/paper/paper-reported.csv) call the system this row
    #: runs as the paper ran it; None = a row the paper did not have
    paper_name: ClassVar[Optional[str]] = None
    #: False where the row models released code as the paper ran it (mode=simulate only), not today's code
    today: ClassVar[bool] = True

    name: str = MISSING
    adapter: str = MISSING  # "package.module:ClassName", imported lazily

    @classmethod
    def system_name(cls) -> str:
        """The `system=` choice this class is: its `name` default (MISSING for a base of several systems)."""
        return cls.__dataclass_fields__["name"].default  # type: ignore[attr-defined]

    @classmethod
    def row_label(cls) -> str:
        return cls.label or cls.system_name()

    @classmethod
    def build(cls, **options):
        """The config from keyword options, with the same type and enum checks as the runner's (for
        scripts and tests that make an adapter without Hydra)."""
        from omegaconf import OmegaConf

        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), options))

    def thread_count(self, env_threads: int) -> int:
        """The CPU threads this system runs with: the environment's `cpu.threads` unless the system has a
        thread option of its own set (EngineSystemConfig's cpu_threads, llama.cpp's threads)."""
        return int(env_threads)

    def popularity(self, model_name: str):
        """The expert popularity this system places by (fiddler.popularity.Popularity, a profile file, or None
        for uniform): the model's reference profile (systems/fiddler/profiles.py)."""
        from systems.fiddler.profiles import placement_popularity

        return placement_popularity(None, model_name)

    def sim_policy(self):
        """This system's policy for `mode=simulate`: a `fiddler.sim.SimPolicy` built from these options
        (each system's lives beside its adapter and is imported lazily here). Raise SystemUnavailable
        with the reason where the system has no simulation model (the record is then `skipped`)."""
        raise SystemUnavailable(f"system={self.name} has no simulation model")

    def check_model(self, model: str, model_config: Callable[[], Any]) -> None:
        """Raise ConfigError, naming the key, where these options cannot run `model` (checked at start in
        both modes). model_config() gives its fiddler.config.MoEConfig; call it only when needed."""

    def gpu_budget(self, env_gb: float) -> tuple[float | str, str]:
        """The GPU budget this system asks for, in GiB or "auto", and the key it came from (`gpu_budget`)."""
        return gpu_budget(self, env_gb)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums as their values), for records."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def gpu_budget(system: Any, env_gb: float | None) -> tuple[float | str, str]:
    """The harness's one rule for which GPU budget a job asks for: (GiB or "auto", the key it came from), the
    system's `gpu_budget_gb` where it has one set, else the environment's `gpu.memory_gb`. `system`: a
    SystemConfig or its plain dict. What a budget means (0 = no GPU; without CUDA one > 0 is emulated; auto =
    90% of the free memory) is the library's rule, fiddler.gpu_budget.choose_budget: execute mode builds the
    GPU side with it (GpuSide.for_budget_gb), and mode=simulate applies it to the environment's card."""
    own = system.get("gpu_budget_gb") if isinstance(system, dict) else getattr(system, "gpu_budget_gb", None)
    if own is not None:
        return (own if own == AUTO else float(own)), "system.gpu_budget_gb"
    return float(env_gb or 0), "environment.gpu.memory_gb"


def simulated_budget(system: Any, env_gb: float | None, env_name: str):
    """(fiddler.gpu_budget.Budget, the key): the budget mode=simulate gives the system, gpu_budget's request
    through the library's rule with the environment's card as the free-memory reading (a simulated card is
    empty: auto is 90% of its memory; a card of 0 GB, none)."""
    gb, key = gpu_budget(system, env_gb)
    card = float(env_gb or 0)
    free = FreeMemory(int(card * 2**30), f"on environment={env_name}'s card (mode=simulate reads it all as free)")
    return choose_budget(gb, free if card > 0 else None), key


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a record's reason."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class SystemUnavailable(RuntimeError):
    """The system cannot run on this machine (missing extra, no CUDA, ...).

    The runner turns it into a record with status ``skipped`` and ``str(exc)`` as the reason.
    """


@dataclass
class ModelSpec:
    """The checkpoint every system loads (a Hugging Face Mixtral-architecture directory)."""

    name: str
    path: str  # local directory with config.json, *.safetensors and tokenizer.model
    dtype: str = "bfloat16"  # "bfloat16" | "float32"


@dataclass
class RunContext:
    """Machine facts a system needs: thread count, GPU budget, work directory for caches."""

    threads: int
    gpu_memory_gb: float
    has_cuda: bool
    cache_dir: str
    environment: dict[str, Any] = field(default_factory=dict)  # resolved environment config
    # the largest request of the job (prompt + new tokens, beams), so systems can size KV caches
    max_seq_len: int = 4096
    max_batch: int = 1


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int  # generate exactly this many (end-of-sequence ignored)
    beam_width: int = 1  # 1 = greedy
    seed: int = 0


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens of the returned (best) sequence, len == max_new_tokens
    stats: dict[str, Any] = field(default_factory=dict)  # system-specific (hit rate, decisions, ...)


class SystemAdapter(abc.ABC):
    """Base class of every system adapter. Subclasses import heavy dependencies lazily in ``load``.
    ``config`` is the system's typed config (a SystemConfig subclass from its ``config.py``)."""

    #: token accounting used for beams: tokens counted are those of the returned sequence (paper)
    token_accounting = "returned_sequence"
    #: environment variables the system needs set before torch (or its own runtime) is imported,
    #: e.g. OpenMP settings read once at library load; the runner then runs it in a fresh process
    process_env: dict[str, str] = {}
    # The expert/attention weight type the decode bound counts bytes for (runners/decode_bound.py):
    # None = the model dtype, "q8_0"/"q4_0" = llama.cpp blocks (fiddler.quant), "unmodelled" = no bound
    weight_quant: str | None = None

    def __init__(self, config: SystemConfig, model: ModelSpec, ctx: RunContext):
        self.config = config
        self.model = model
        self.ctx = ctx

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights etc. Not timed. Raise SystemUnavailable if the system cannot run here."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        """Generate ``request.max_new_tokens`` tokens; call ``on_first_token()`` once."""

    def synchronize(self) -> None:
        """Wait for outstanding device work (the runner calls it around timed regions)."""

    def info(self) -> dict[str, Any]:
        """Facts for the record: library versions, implementation choices, thread counts."""
        return {}

    def close(self) -> None:
        """Release memory (called once after the last configuration of this system)."""

    #: the route mode=serve polls until it answers 200 (runners/serving/serve.py)
    server_health_path = "/health"

    def server_command(self, serve) -> list[str]:
        """mode=serve: the command that starts this system's OpenAI-compatible server on the model (an
        unloaded adapter; `serve` is runners.schema.ServeConfig). Raise SystemUnavailable where it cannot."""
        raise SystemUnavailable(f"system={self.config.name} has no OpenAI-compatible server")

    #: the environment variable this system's server reads its API key from (serve.api_key); None: it takes none
    server_api_key_env: str | None = None

    def server_env(self, serve) -> dict[str, str]:
        """mode=serve: environment the server needs beyond process_env, from this adapter's options (never a
        secret: the runner adds serve.api_key under server_api_key_env)."""
        return {}

    def server_notes(self) -> dict[str, Any]:
        """Facts about the server for the run folder's serve.json (what it serves and how)."""
        return {}
