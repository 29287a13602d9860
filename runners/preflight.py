"""Start-up checks beyond the schema's (runners.schema.validate: known keys, types, ranges): what the
job will read or write on this host (index, prompt file, cores) and whether its environment is this
host. Each raises ConfigError with a one-line reason that starts with the key, so a bad input fails
with exit 2 before anything is loaded or run.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from fiddler import hardware
from runners import provenance
from runners.schema import Config, ConfigError


def check_execute_environment(requested: dict) -> None:
    """Execute mode runs this host's hardware and nothing else: `environment=local` (its GPU is
    detected), or a described environment whose `gpu.name` is this host's CUDA device (both `none`
    without CUDA). Anything else is refused, naming the two ways out (mode=simulate, or a budget
    emulated on `local`): `environment=rtx3060` on a CPU-only host ran the host and recorded it as
    an RTX 3060. Takes the config as requested (runners.identity), so it runs before resume and
    imports nothing for `local`."""
    if requested.get("mode") != "execute":
        return
    env = requested["environment"]
    if env["gpu"]["name"] == "<detected gpu.name>":
        return  # environment=local: the host by construction (other keys may emulate a budget)
    reason = provenance.foreign_environment_reason(env, provenance.host_gpu())
    if reason:
        raise ConfigError(reason)


def check_threads(conf: Config) -> None:
    """Refuse more threads than this process may run on: 1000 torch threads on 2 cores measured 1.8
    tok/s against ~190, with nothing in the record saying why. (Refused rather than clamped, so
    that the record's config is what ran.)"""
    cores = hardware.cpu_cores()
    asked = [("environment.cpu.threads", conf.environment.cpu.threads)]
    asked += [(f"system.{k}", getattr(conf.system, k)) for k in ("cpu_threads", "threads") if hasattr(conf.system, k)]
    for key, n in asked:
        if n is not None and n > cores:
            hint = (f" (environment={conf.environment.name} describes another machine; set "
                    f"environment.cpu.threads={cores} to run it here)" if conf.environment.described else "")
            raise ConfigError(f"{key}={n} is more than the {cores} cores this process may use "
                              f"(os.sched_getaffinity); allowed: 1..{cores}{hint}")


def check_prompt_file(path: str | None) -> None:
    """The prompt file exists and is a non-empty text file (an empty one gave prompts of BOS only)."""
    if path is None:
        return
    key = f"workload.prompt_file={path!r}"
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key} does not exist")
    if not p.is_file():
        raise ConfigError(f"{key} is not a regular file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key} cannot be read ({exc.strerror})") from exc
    try:
        if b"\0" in data:
            raise UnicodeError
        text = data.decode("utf-8")
    except UnicodeError:
        raise ConfigError(f"{key} is not a UTF-8 text file") from None
    if not text.strip():
        raise ConfigError(f"{key} is empty")


def check_index_path(path: Path) -> None:
    """Records can be appended to the index (and its lock created beside it), checked without
    creating anything, so that a bad path fails before the first configuration, not after it."""
    key = f"run.index_path={str(path)!r}"
    if path.exists():
        if not path.is_file():
            raise ConfigError(f"{key} is {'a directory' if path.is_dir() else 'not a regular file'}; "
                              f"allowed: a JSONL file")
        try:
            open(path, "ab").close()  # appends nothing
        except OSError as exc:
            raise ConfigError(f"{key} is not writable ({exc.strerror})") from exc
    parent = path.parent
    while not parent.exists():  # the directories the first append would create
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key} cannot be created: {parent} is not a directory")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise ConfigError(f"{key} cannot be created: {parent} is not writable ({exc.strerror})") from exc


def check_trace(conf: Config, points: list[dict[str, int]]) -> None:
    """mode=simulate's routing trace, when the routing replays one: the file is a trace of the model's shape
    and as long as the workload's longest point, or sim.trace_cycle=true. Found per job at run time, a bad
    trace was an `error` record (a list or a trace without steps a traceback), and a short one was cycled
    without a word."""
    from fiddler.sim import RoutingTrace
    from runners.simulate import model_config

    sim = conf.sim
    if not sim.trace or sim.routing.value not in ("auto", "trace"):
        return
    key = f"sim.trace={sim.trace!r}"
    path = Path(sim.trace).expanduser()
    if not path.exists():
        raise ConfigError(f"{key} does not exist")
    if not path.is_file():
        raise ConfigError(f"{key} is not a regular file")
    try:
        trace = RoutingTrace.load(path)
    except ValueError as exc:
        raise ConfigError(f"{key}: {str(exc).removeprefix(f'{path}: ').splitlines()[0]}") from None
    try:
        config = model_config(dict(conf.model.arch))
    except (ValueError, KeyError):
        config = None  # a model the simulator cannot build: its setup records that
    if config is not None:
        try:
            trace.check_shape(config)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    longest = max(p["input_len"] for p in points)
    rows = max((p["output_len"] - 1) * p["beam_width"] for p in points)
    short = ([f"prefill: {trace.prefill_tokens} tokens for workload.input_lens up to {longest}"]
             if trace.prefill_tokens < longest else [])
    short += [f"decode: {trace.decode_rows} rows for {rows}"] if trace.decode_rows < rows else []
    if short and not sim.trace_cycle:
        raise ConfigError(f"{key} is shorter than the workload ({'; '.join(short)}); allowed: a trace as long as "
                          f"its longest point, or sim.trace_cycle=true to cycle it (the record then says so)")


def check_model_support(conf: Config, model_config: Callable[[], Any]) -> None:
    """What the system refuses to load for this model, refused at start in both modes with the system's own
    message (SystemConfig.check_model; e.g. the engine's quant= on attention it does not implement, for
    which simulate mode gave `ok` records and execute mode an `error` record at load). `model_config()`
    gives the model's MoEConfig, read only where the system asks."""
    conf.system.check_model(conf.model.name, model_config)
