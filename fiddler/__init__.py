"""Fiddler: CPU-GPU orchestration for fast inference of Mixture-of-Experts models."""

__all__ = ["Engine", "MoEConfig"]


def __getattr__(name):
    # Lazy, so that `import fiddler.kernels` (or hardware) does not pull in the whole engine.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "MoEConfig":
        from .config import MoEConfig

        return MoEConfig
    raise AttributeError(f"module 'fiddler' has no attribute {name!r}")
