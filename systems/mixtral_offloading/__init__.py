"""`system=mixtral_offloading`: the Mixtral-Offloading policy (Eliseev & Mazur, arXiv 2312.17238) --
a per-layer LRU expert cache on the GPU plus speculative prefetch with the next layer's router --
re-implemented as an executor of fiddler's engine (the original is a research repository, not a package).
"""

__all__ = ["DEFAULT_CACHE_SIZE", "MixtralOffloadingPolicy", "OffloadingExecutor", "OffloadStats", "derive_cache_size",
           "load_engine"]


def __getattr__(name: str):
    # Lazy: the harness imports this package's config.py at start-up (runners/schema.py), and the
    # executor pulls in torch; a resumed run with nothing left to do should not pay for it.
    if name in ("DEFAULT_CACHE_SIZE", "derive_cache_size"):
        from . import cache

        return getattr(cache, name)
    if name in __all__:
        from . import executor

        return getattr(executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
