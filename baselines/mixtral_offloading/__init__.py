"""`system=mixtral_offloading`: the Mixtral-Offloading policy (Eliseev & Mazur, arXiv 2312.17238) --
a per-layer LRU expert cache on the GPU plus speculative prefetch with the next layer's router --
re-implemented as an executor of fiddler's engine (the original is a research repository, not a package).
"""

from .executor import (DEFAULT_CACHE_SIZE, MixtralOffloadingPolicy, OffloadingExecutor, OffloadStats,
                       derive_cache_size, load_engine)

__all__ = ["DEFAULT_CACHE_SIZE", "MixtralOffloadingPolicy", "OffloadingExecutor", "OffloadStats", "derive_cache_size",
           "load_engine"]
