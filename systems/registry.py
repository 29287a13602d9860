"""Which systems exist: every `SystemConfig` subclass in a `<package>/config.py` of `systems/` or of a folder
named in FIDDLER_SYSTEMS. The class is the registration: its `name` default is what `system=<name>` chooses,
its `adapter` default the class that runs it, its ClassVars the rest (systems/base.py). Nothing else lists
systems, so adding one is one folder with a config class (and its adapter).

FIDDLER_SYSTEMS (os.pathsep-separated folders) lets a system live outside this checkout: each folder holds
system packages laid out as systems/ does (`<folder>/<package>/config.py`, imported as `<package>.config`);
the folder is put on sys.path, so a spawned measuring process imports the same packages. Torch-free.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
from pathlib import Path

from systems.base import MISSING, ConfigError, SystemAdapter, SystemConfig, SystemUnavailable

PATH_VARIABLE = "FIDDLER_SYSTEMS"


def _packages() -> list[str]:
    """Module names of every system package's config module: systems/ first, then FIDDLER_SYSTEMS's folders."""
    import systems

    found = [f"systems.{p.name}.config" for p in pkgutil.iter_modules(systems.__path__) if p.ispkg]
    for folder in filter(None, os.environ.get(PATH_VARIABLE, "").split(os.pathsep)):
        folder = str(Path(folder).expanduser().resolve())
        if not Path(folder).is_dir():
            raise ConfigError(f"{PATH_VARIABLE}={folder!r} is not a folder; allowed: folders of system packages "
                              f"(<folder>/<package>/config.py)")
        if folder not in sys.path:
            sys.path.insert(0, folder)
        found += [f"{p.name}.config" for p in pkgutil.iter_modules([folder]) if p.ispkg]
    return [m for m in found if importlib.util.find_spec(m) is not None]


def system_classes() -> dict[str, type[SystemConfig]]:
    """name -> config class, for every system and preset, in the order their packages and classes are found."""
    out: dict[str, type[SystemConfig]] = {}
    for module_name in _packages():
        module = importlib.import_module(module_name)
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if issubclass(c, SystemConfig) and c.__module__ == module.__name__]
        for cls in sorted(classes, key=lambda c: inspect.getsourcelines(c)[1]):
            name = cls.system_name()
            if name == MISSING:
                continue  # a base class of several systems
            if name in out:
                raise ConfigError(f"system {name!r} is defined twice: {out[name].__module__}.{out[name].__name__} "
                                  f"and {cls.__module__}.{cls.__name__}")
            out[name] = cls
    return out


def system_class(name: str) -> type[SystemConfig]:
    classes = system_classes()
    if name not in classes:
        raise ConfigError(f"system={name!r} is not a system; allowed: {', '.join(classes)}")
    return classes[name]


ADAPTER_ALLOWED = "allowed: module:Class naming a concrete subclass of systems.base.SystemAdapter " \
                  "(a system's config class names its own)"


def adapter_class(spec: str) -> type[SystemAdapter]:
    """The SystemAdapter class `module:Class` names. Anything else is a ConfigError naming the key:
    `system.adapter=builtins:print` was imported and called with the system's options. A module that
    exists but lacks a dependency (an extra not installed) stays SystemUnavailable: a `skipped` record."""
    module_name, _, class_name = spec.partition(":")
    key = f"system.adapter={spec!r}"
    if not all(part.isidentifier() for part in module_name.split(".")) or not class_name.isidentifier():
        raise ConfigError(f"{key} is not module:Class; {ADAPTER_ALLOWED}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name + ".").startswith(exc.name + "."):  # the module named, or a package above it
            raise ConfigError(f"{key}: there is no module {exc.name}; {ADAPTER_ALLOWED}") from None
        raise SystemUnavailable(f"cannot import adapter module {module_name} ({exc})") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"{key}: module {module_name} has no {class_name}; {ADAPTER_ALLOWED}")
    if not isinstance(cls, type):
        raise ConfigError(f"{key} is a {type(cls).__name__}, not a class; {ADAPTER_ALLOWED}")
    if not issubclass(cls, SystemAdapter) or inspect.isabstract(cls):
        what = "abstract" if issubclass(cls, SystemAdapter) else "not a SystemAdapter subclass"
        raise ConfigError(f"{key} is {what}; {ADAPTER_ALLOWED}")
    return cls
