"""Start-up checks beyond the schema's (runners.schema.validate: known keys, types, ranges): what the
job will read or write on this host (index, prompt file, cores) and whether its environment is this
host. Each raises ConfigError with a one-line reason that starts with the key, so a bad input fails
with exit 2 before anything is loaded or run.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

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
