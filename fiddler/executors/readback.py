"""The one device-to-host wait of a MoE layer call on the GPU side.

Fiddler plans each layer on the host from how many tokens each expert got, so a GPU-side layer call must
bring the routing back once. Everything the host needs comes back in that one wait: the expert ids (the
host counts them per expert), and, where the layer has experts outside the GPU, the rows and weights the
CPU queue needs, all copied non-blocking into reused pinned buffers and waited on by one event. The
host-side decisions then read host tensors only. (Counting on the device would take launches and, with
bincount, a sync of its own to size the output.)

On an emulated GPU the same copies are real memcpys into separate host tensors, so the host side never
reads a GPU-side tensor there either (tests trap every syncing tensor method to prove it). Without a GPU
there is nothing to bring back: the routing is already on the host (bincount counts it, the faster op
on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .routing import expert_counts, row_counts


@dataclass
class HostRouting:
    """A layer call's routing on the host: counts per expert slot, ids [T, K], and (when asked for) the
    rows x [T, H] and weights [T, K] in host memory."""

    counts: list[int]
    ids: torch.Tensor
    x: torch.Tensor | None = None
    w: torch.Tensor | None = None
    row_ids: list[int] | None = None  # a one-token call's ids as a list


class Readback:
    def __init__(self, device: torch.device, gpu_side: bool):
        """gpu_side: the executor's device stands in for a GPU (CUDA or emulated); else the CPU, no copies."""
        self.device = torch.device(device)
        self.gpu_side = gpu_side
        self.cuda = self.device.type == "cuda"
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.waits = 0  # device-to-host waits so far (one per GPU-side call)

    def __call__(self, topk_idx: torch.Tensor, num_experts: int, layer: int, x: torch.Tensor | None = None,
                 w: torch.Tensor | None = None) -> HostRouting:
        """The routing of one layer call on the host; x and w come back too where given (the CPU queue's
        inputs). Rejects expert ids outside [0, num_experts)."""
        if self.gpu_side:
            ids = self._to_host("ids", topk_idx)
            x = self._to_host("x", x) if x is not None else None
            w = self._to_host("w", w) if w is not None else None
            self._wait()
        else:
            ids = topk_idx
        # counted on the host from the ids: no launch, and a host bincount of T * K ids is microseconds (a
        # lone row's few ids are cheaper still as a list)
        if ids.shape[0] == 1:
            row = ids[0].tolist()
            return HostRouting(row_counts(row, num_experts, layer), ids, x, w, row)
        return HostRouting(expert_counts(ids.reshape(-1), num_experts, layer), ids, x, w)

    def _to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A non-blocking copy of t into the reused host buffer `name` (pinned on CUDA). A buffer is valid
        until the next call: the layer call that read it has finished by then."""
        n = t.numel()
        key = (name, t.dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(max(n, 1), dtype=t.dtype, pin_memory=self.cuda)
        out = buf[:n].view(t.shape)
        out.copy_(t, non_blocking=self.cuda)
        return out

    def _wait(self) -> None:
        """The one wait: every copy above has landed (on CUDA an event recorded after them)."""
        self.waits += 1
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()
