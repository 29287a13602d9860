"""What identifies a measurement for resume: the configuration as the user asked for it.

`environment=local` fills some keys with `${detect:...}` at every start. Those are facts of this
start, not choices: the memory-bandwidth probe alone varied 2x between runs, so a hash of the
resolved config never matched and resume re-ran everything. The hash therefore sees each detected
value as the expression that asked for it (`<detected cpu.mem_bandwidth_gbps>`), and the record
states the values measured this time (`environment_info.detected`).
"""
from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

_DETECT = re.compile(r"\$\{detect:([^}]*)\}")


def _mark(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _mark(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v) for v in value]
    if isinstance(value, str):
        return _DETECT.sub(r"<detected \1>", value)
    return value


def requested_config(cfg: DictConfig) -> dict[str, Any]:
    """The config resolved, except that every detected value stays a marker naming what was asked;
    keys derived from one (`threads: ${.cores}`) carry the same marker. Runs no detection."""
    raw = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    # a plain (untyped) copy, so that a marker may stand where the schema wants a number
    return OmegaConf.to_container(OmegaConf.create(_mark(raw)), resolve=True)  # type: ignore[return-value]


def detected(requested: Any, resolved: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of this start, for every key whose requested value is detected."""
    if isinstance(requested, dict) and isinstance(resolved, dict):
        out: dict[str, Any] = {}
        for k, v in requested.items():
            out.update(detected(v, resolved.get(k), f"{prefix}{k}."))
        return out
    if isinstance(requested, str) and "<detected " in requested:
        return {prefix[:-1]: resolved}
    return {}
