"""Host memory: what is free, the error when the engine's holdings do not fit, and exactly sized pinned copies.

Running short of host memory is an error at load that names the numbers, never a silent fallback. Pinned
memory is allocated here at the byte (page-aligned, registered with cudaHostRegister), not through
PyTorch's caching host allocator, which rounds each block up to a power of two (a 112 MiB tensor takes
128 MiB there).
"""

from __future__ import annotations


from collections import OrderedDict

import torch

PAGE = 4096


class HostMemoryError(MemoryError):
    """What the engine must hold in host memory does not fit in what is available."""


def available_bytes() -> int | None:
    """Host memory available to this process now (psutil; None if unknown)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 -- psutil missing: unknown
        return None


def check_fits(what: str, need: dict[str, int], released: int = 0) -> None:
    """Raise HostMemoryError unless `need` (bytes by part) fits in the available host memory plus `released`
    (bytes the caller frees as it allocates, e.g. the checkpoint's copies of what it packs)."""
    avail = available_bytes()
    total = sum(need.values())
    if avail is None or total <= avail + released:
        return
    parts = ", ".join(f"{k} {v} B ({v / 2**30:.3f} GiB)" for k, v in need.items())
    raise HostMemoryError(
        f"{what}: not enough host memory: needs {total} B ({total / 2**30:.3f} GiB) = {parts}; available "
        f"{avail} B ({avail / 2**30:.3f} GiB) + {released} B released while loading")


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Registration:
    """Owns a registered host region: unregisters it before the memory can be freed."""

    def __init__(self, raw: torch.Tensor, ptr: int):
        self.raw, self.ptr = raw, ptr

    def __del__(self):
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor `t` in page-locked memory of exactly its size (whole pages), registered with CUDA
    (cudaHostRegister) and unregistered when the returned tensor object goes. Page (so 64-byte) aligned."""
    n = nbytes(t)
    size = max(PAGE, (n + PAGE - 1) // PAGE * PAGE)
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % PAGE
    region = raw[off:off + size]
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} B failed (error {int(err)})")
    out = region[:n].view(t.dtype).view(t.shape)
    out.copy_(t)
    out._fiddler_pinned = _Registration(raw, region.data_ptr())  # the tensor object keeps the registration
    return out


def require_pinned(what: str, tensors) -> None:
    """Assert (at build) that every host tensor feeding a non-blocking copy is page-locked: a pageable source
    makes a "non-blocking" copy block silently."""
    bad = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and not t.is_pinned()]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} host tensor(s) feeding non-blocking copies are not pinned "
                           f"(first: #{bad[0]})")


# Packages whose objects the walk enters (their attributes): the engine's and the policies' own objects.
# torch modules are entered too (parameters, buffers, submodules); anything else (library objects, modules,
# lazy mappings that import on access) is a leaf.
WALKED_PACKAGES = ("fiddler", "systems")


def host_storages(*roots, skip=()) -> dict[int, int]:
    """The host (CPU) storages of the tensors reachable from `roots` through lists, tuples, plain dicts and
    the attributes of the roots and of objects of WALKED_PACKAGES (and torch modules), as {data pointer:
    bytes} (whole storages: what the allocator holds). `skip`: objects not entered."""
    seen, found = {id(o) for o in skip}, {}
    stack = []
    for r in roots:  # a root is entered whatever its package (a policy defined anywhere)
        if hasattr(r, "__dict__") and not isinstance(r, (torch.Tensor, type)):
            seen.add(id(r))
            stack.extend(vars(r).values())
        else:
            stack.append(r)
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type == "cpu":
                st = o.untyped_storage()
                found[st.data_ptr()] = st.nbytes()
        elif type(o) in (dict, OrderedDict):
            stack.extend(dict.values(o))
        elif type(o) in (list, tuple, set, frozenset):
            stack.extend(o)
        elif isinstance(o, torch.nn.Module) or type(o).__module__.split(".")[0] in WALKED_PACKAGES:
            stack.extend(getattr(o, "__dict__", {}).values())
    return found


def held_bytes(*roots, skip=()) -> int:
    """Bytes of host_storages(*roots, skip=skip)."""
    return sum(host_storages(*roots, skip=skip).values())
