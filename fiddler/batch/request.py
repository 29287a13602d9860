"""A request to the batch engine: what to generate (`SamplingParams`) and its handle (`Request`), through which
its tokens arrive as they come and through which it is cancelled."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

FINISH_REASONS = ("length", "stop", "cancelled", "aborted", "error")  # aborted: cut by stop(drain=False)
# Temperatures below this sample as greedy (vLLM's rule): dividing the logits by 1e-300 makes them inf/NaN
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)  # an int64, as OpenAI's API documents it


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its maximum length: retry later (a server answers 503/429)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    max_tokens: tokens to generate (exactly that many unless a stop token comes first).
    temperature: 0, or any below GREEDY_BELOW_TEMPERATURE, is greedy (argmax); above, it samples after
    temperature, top-k and top-p (transformers' order, fiddler.generate.choose_token), with a torch.Generator
    seeded by `seed` (an int64; None: drawn from the engine's seed stream). stop_token_ids: generation ends
    after producing one of these (it is the request's last token). ignore_eos: do not stop at the model's EOS
    ids (the engine's eos_token_ids); stop_token_ids still apply."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0 or None: off), got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass
class Request:
    """One request's state and handle. Iterate it for its tokens as they come (`for tok in req`), or call
    `result()` for all of them; `cancel()` ends it at the next step boundary and frees its slot. When the
    engine runs no loop thread, iterating (or `result()`) drives the engine's steps itself.

    Timestamps (time.perf_counter): submitted_at, first_token_at, finished_at; token_times one per token."""

    id: int
    prompt: torch.Tensor  # [S] int64 on the CPU
    params: SamplingParams
    on_token: Callable[[int], None] | None = None  # called on the engine's thread with each new token
    on_finish: Callable[["Request"], None] | None = None  # called on the engine's thread once it has finished
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in its KV-cache row
    prefix_hit: int = 0  # of those, the ones copied from the prefix cache at admission (not computed)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    generator: torch.Generator | None = None
    _engine: object = field(default=None, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel_reason: str = field(default="cancelled", repr=False)  # the finish reason a cancel gives it

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    @property
    def decoding(self) -> bool:
        """Its whole prompt is in the cache: each step feeds it its last token."""
        return self.prefilled == self.prompt_len

    def cancel(self) -> None:
        """End this request at the next step boundary (its slot is freed; other requests are unaffected)."""
        self._cancel.set()
        self._engine._wake()

    def _abort(self) -> None:
        """Cut it as cancel() does, finishing 'aborted': the engine is stopping, not the client."""
        self._cancel_reason = "aborted"
        self._cancel.set()

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            while i < len(self.tokens):
                yield self.tokens[i]
                i += 1
            if self.done:
                if self.finish_reason == "error":
                    raise RuntimeError(f"request {self.id} failed: {self.error}")
                return
            self._engine._wait_for(self, i)

    def result(self) -> list[int]:
        """All its tokens, once it has finished (raises if it failed)."""
        return list(self)
