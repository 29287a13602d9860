"""Host -> GPU-side weight copies into reusable device slots (expert copy buffers, cache slots)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class CopyIn:
    """Copies into `num_slots` reusable slots. On CUDA a copy runs on a side stream, after the compute that
    last read its slot was issued, and the compute that next reads the slot waits for the copy: events
    order the two streams and the host never waits. On a CPU device a copy is a plain memcpy.

    Protocol per slot: copy(slot, ...) -> acquire(slot) -> compute reading the slot -> release(slot)."""

    def __init__(self, device: torch.device, num_slots: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event() for _ in range(num_slots)]
            self._free = [torch.cuda.Event() for _ in range(num_slots)]

    def copy(self, slot: int, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if self.cuda:
            self.stream.wait_event(self._free[slot])
            with torch.cuda.stream(self.stream):
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src, non_blocking=True)
                self._ready[slot].record(self.stream)
        else:
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)

    def acquire(self, slot: int) -> None:
        """Work issued from now on the current stream sees the slot's last copy."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[slot])

    def release(self, slot: int) -> None:
        """Every read of the slot is issued: the next copy into it waits for them."""
        if self.cuda:
            self._free[slot].record(torch.cuda.current_stream(self.device))
