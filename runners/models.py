"""Synthetic model presets, read from `conf/model/<name>.yaml` (the one source of their architecture)
for scripts and tests that need a model without composing the whole Hydra config."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from systems import paths

CONF_MODEL = paths.conf_dir() / "model"


def synthetic_presets() -> list[str]:
    return sorted(p.stem for p in CONF_MODEL.glob("*.yaml")
                  if OmegaConf.load(p).get("synthetic", False))


def preset(name: str) -> tuple[dict, int, str]:
    """(arch, seed, dtype) of a synthetic model preset."""
    path = CONF_MODEL / f"{name}.yaml"
    if not path.is_file() or name not in synthetic_presets():
        raise ValueError(f"unknown synthetic model {name!r}; known: {synthetic_presets()}")
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    return dict(cfg["arch"]), int(cfg.get("seed", 0)), str(cfg.get("dtype", "bfloat16"))


def synthetic_model(name: str, cache_root=None, progress: bool = False) -> Path:
    """The preset's checkpoint directory, generated on first use (same cache as the harness)."""
    from runners.synthetic import default_cache_root, ensure_synthetic_model

    arch, seed, dtype = preset(name)
    return ensure_synthetic_model(name, arch, seed, cache_root or default_cache_root(), dtype=dtype,
                                  progress=progress)
