"""What one engine step runs: every decoding request's next token, then prompt chunks of the requests being
prefilled, up to a token budget (chunked prefill: a long prompt never stalls the others' decode for more than
one budget's worth of tokens). Plain logic over Request states: no tensors are touched here."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .request import QueueFull, Request


@dataclass(frozen=True)
class Work:
    """One request's part of a step: `length` tokens at positions start.. of its slot's cache row; `emits`
    when the step ends at the request's newest position (a decode token, or its prompt's last chunk), so its
    logits give the next token."""

    request: Request
    start: int
    length: int
    emits: bool

    @property
    def slot(self) -> int:
        return self.request.slot

    @property
    def decode(self) -> bool:
        return self.start >= self.request.prompt_len


class Scheduler:
    """FIFO admission into `slots` KV-cache rows. A request waits in the queue (at most max_queue) until a
    slot is free; then it is prefilled in chunks, decoded one token a step, and its slot is freed when it
    finishes or is cancelled."""

    def __init__(self, slots: int, token_budget: int, max_queue: int, on_admit=None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if token_budget < slots:
            raise ValueError(f"token_budget ({token_budget}) must be >= slots ({slots}): every running request "
                             "decodes one token a step")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.slots, self.token_budget, self.max_queue = slots, token_budget, max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot, in admission order
        self._free = list(range(slots))
        self.on_admit = on_admit  # called with each request given a slot, before its first chunk is planned
    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_queue + len(self._free):  # those beyond the free slots wait
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue={self.max_queue}, "
                            f"{len(self._free)} of {self.slots} slots free)")
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def cancelled(self) -> list[Request]:
        """Take cancelled requests out (their slots freed); the caller marks them finished."""
        out = [r for r in self.running if r.cancel_requested] + [r for r in self.waiting if r.cancel_requested]
        for r in out:
            self.release(r)
        return out

    def release(self, req: Request) -> None:
        """Take a request out of the queue or free its slot."""
        if req in self.running:
            self.running.remove(req)
            self._free.append(req.slot)
            self._free.sort()
        elif req in self.waiting:
            self.waiting.remove(req)

    def plan(self) -> list[Work]:
        """The next step's work: decode tokens first, then prompt chunks in admission order."""
        work = [Work(r, r.prompt_len + len(r.tokens) - 1, 1, True) for r in self.running if r.decoding]
        budget = self.token_budget - len(work)
        while budget > 0 and self.waiting and self._free:
            r = self.waiting.popleft()
            r.slot = self._free.pop(0)
            self.running.append(r)
            if self.on_admit is not None:
                self.on_admit(r)
        for r in self.running:
            if budget <= 0:
                break
            if not r.decoding:
                n = min(budget, r.prompt_len - r.prefilled)
                work.append(Work(r, r.prefilled, n, r.prefilled + n == r.prompt_len))
                budget -= n
        return work
