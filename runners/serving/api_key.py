"""serve.api_key: the key a system's server asks its clients for. The one place that keeps it out of what is
written down: it comes from the environment (FIDDLER_API_KEY, or serve.api_key='${oc.env:NAME}'), never as a
literal on the command line (Hydra keeps overrides in the run folder's .hydra/, the shell in its history); the
server gets it in its environment (the adapter's server_api_key_env), the load generator in a file only this
user can read; records and logs carry REDACTED in its place.
"""
from __future__ import annotations

import copy
import re
from typing import Any

KEY_ENV = "FIDDLER_API_KEY"
REDACTED = "<redacted>"
_OVERRIDE = re.compile(r"^[+~]{0,2}serve\.api_key=(.*)$")


def literal_on_command_line(argv: list[str]) -> str | None:
    """Why argv may not run (it gives serve.api_key a literal key), or None."""
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if m and m.group(1) not in ("", "null") and not m.group(1).startswith("${oc.env:"):
            return (f"serve.api_key=...: a key on the command line is kept in the run folder's .hydra/overrides.yaml "
                    f"and in shell history; export {KEY_ENV}=<key> instead (or serve.api_key='${{oc.env:NAME}}')")
    return None


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved config as records may keep it: serve.api_key replaced by REDACTED where one is set."""
    serve = config.get("serve")
    if not isinstance(serve, dict) or not serve.get("api_key"):
        return config
    out = copy.copy(config)
    out["serve"] = {**serve, "api_key": REDACTED}
    return out


def scrub(text: str, key: str | None) -> str:
    """text with every occurrence of key replaced (a server's log, an error message)."""
    return text.replace(key, REDACTED) if key else text
