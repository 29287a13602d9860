"""The reference popularity profile of a model, where the project has real routing statistics.

For `model=mixtral_8x7b`: the Fiddler authors' Mixtral-8x7B (base model) profiles on seven MMLU subjects
(results/reference/mixtral-8x7b/expert-popularity/original, see its PROVENANCE.md), each normalised per
layer to expert shares and averaged over the subjects, so no subject weighs more for having more words.
"""
from __future__ import annotations

import functools

from fiddler.popularity import Popularity
from systems import paths

REFERENCE_DIR = paths.reference_dir()
PROFILES = {"mixtral_8x7b": REFERENCE_DIR / "mixtral-8x7b" / "expert-popularity" / "original"}


def placement_popularity(profile: str | None, model_name: str) -> str | Popularity | None:
    """The popularity Fiddler places experts by, the one rule execute mode, mode=serve and mode=simulate
    follow: `system.popularity_profile` (a JSON file) where given, else the model's reference profile, else
    None (uniform)."""
    return profile or reference_popularity(model_name)


@functools.lru_cache(maxsize=None)
def reference_popularity(model_name: str) -> Popularity | None:
    """The model's reference profile, or None when the project has none for it."""
    folder = PROFILES.get(model_name)
    if folder is None:
        return None
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{folder}: no popularity profiles (the reference data of {model_name} is missing)")
    profiles = [Popularity.load(f) for f in files]
    L, E = profiles[0].shape
    mean = [[sum(p.shares()[l][e] for p in profiles) / len(profiles) for e in range(E)] for l in range(L)]
    return Popularity(mean, top_k=profiles[0].top_k,
                      meta={"source": f"results/reference/{folder.relative_to(REFERENCE_DIR)}/*.json (mean of "
                                      f"{len(files)} subjects' per-layer shares)",
                            "subjects": [f.stem for f in files]})
