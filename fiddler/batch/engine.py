"""`BatchEngine`: many sequences at once on one `fiddler.Engine` (continuous batching).

    be = BatchEngine.from_pretrained(path, slots=16)
    req = be.submit(prompt_ids, SamplingParams(max_tokens=64))
    for tok in req: ...            # tokens as they come (drives the steps itself without a loop thread)
    be.start(); ...; be.stop()     # or a loop thread, as a server runs it

Each slot is a row of the engine's KV cache (`Engine.from_pretrained(max_batch=slots)`, so placement's
GPU-side reservation counts it). One step runs every decoding request's next token plus prompt chunks up to
`token_budget` tokens (fiddler.batch.scheduler): attention per sequence, with its own row and positions;
the router and the experts on the step's flat token batch, so the executor's planner decides on the tokens
per expert of the whole step. A request's tokens are those it gets alone (tests/test_batch.py): no state is
shared between rows but the weights.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..generate import check_lengths, choose_token, greedy_rows
from ..step import Segment
from ..threads import torch_threads
from .prefix_cache import DEFAULT_BLOCK, PrefixCache
from .request import QueueFull, Request, SamplingParams
from .scheduler import Scheduler, Work

DEFAULT_TOKEN_BUDGET = 512
DEFAULT_MAX_QUEUE = 256


@dataclass
class StepStats:
    """One engine step: its tokens (decode / prefill), requests, experts run by decision kind (a: resident
    on the GPU, b: copied in, c: on the CPU) with the tokens they took, its wall time and its path."""

    step: int
    tokens: int
    decode_tokens: int
    prefill_tokens: int
    requests: int
    finished: int
    experts: dict[str, int] = field(default_factory=dict)
    expert_tokens: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    path: str | None = None  # the path the step took (fiddler.step.PATHS)
    # prompt tokens of the requests admitted this step: copied from the prefix cache / left to compute
    prefix_hit_tokens: int = 0
    prefix_miss_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def eos_token_ids(path) -> tuple[int, ...]:
    """The checkpoint's EOS ids (generation_config.json, else config.json); () when it names none."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def _kind_counts(stats) -> tuple[dict[str, int], dict[str, int]]:
    experts, tokens = getattr(stats, "experts", None), getattr(stats, "tokens", None)
    return (dict(experts) if isinstance(experts, dict) else {}), (dict(tokens) if isinstance(tokens, dict) else {})


class BatchEngine:
    """Continuous batching over an Engine's model and executor. Do not call the Engine's own generate() while
    this runs on it: both use the KV cache's rows."""

    def __init__(self, engine, *, slots: int | None = None, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_queue: int = DEFAULT_MAX_QUEUE, eos_token_ids: tuple[int, ...] | None = None,
                 seed: int = 0, keep_steps: int = 10_000, prefix_cache_bytes: int = 0,
                 prefix_block: int = DEFAULT_BLOCK):
        model = engine.model
        slots = slots or model.max_batch
        if slots > model.max_batch:
            raise ValueError(f"slots={slots} exceeds the engine's KV-cache rows (max_batch={model.max_batch}); "
                             f"build it with Engine.from_pretrained(..., max_batch={slots})")
        self.engine, self.model = engine, model
        # prompts' KV entries kept for reuse (fiddler.batch.prefix_cache), within prefix_cache_bytes; 0: off
        self.prefix_cache = PrefixCache(model.cache, prefix_cache_bytes, prefix_block) if prefix_cache_bytes else None
        self._admitted = [0, 0]  # this step's admissions: prompt tokens from the prefix cache, left to compute
        self.scheduler = Scheduler(slots, token_budget, max_queue, on_admit=self._admit)
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else \
            eos_token_ids_of(engine)
        self._seeds = torch.Generator().manual_seed(seed)
        self._next_id = 0
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_lock = threading.Lock()  # one step at a time, whoever drives it
        self.steps: deque[StepStats] = deque(maxlen=keep_steps)
        self.n_steps = 0
        # called with each step's StepStats on the stepping thread, under the engine's lock (keep them quick):
        # a server's counters see every step, not only the `keep_steps` the deque holds
        self.step_observers: list = []
        # since construction, whatever `steps` still keeps (a server's counters)
        self.totals = {"steps": 0, "tokens": 0, "decode_tokens": 0, "prefill_tokens": 0, "seconds": 0.0,
                       "prefix_hit_tokens": 0, "prefix_miss_tokens": 0, "experts": {k: 0 for k in "abc"},
                       "finished": {}}
        engine.executor.reset_stats()

    @classmethod
    def from_pretrained(cls, path, *, slots: int = 8, token_budget: int = DEFAULT_TOKEN_BUDGET,
                        max_queue: int = DEFAULT_MAX_QUEUE, prefix_cache_bytes: int = 0,
                        **engine_kw) -> "BatchEngine":
        """Engine.from_pretrained(path, max_batch=slots, **engine_kw) under a BatchEngine."""
        from ..engine import Engine

        return cls(Engine.from_pretrained(path, max_batch=slots, **engine_kw), slots=slots,
                   token_budget=token_budget, max_queue=max_queue, prefix_cache_bytes=prefix_cache_bytes)

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, params: SamplingParams | None = None, *, on_token=None, on_finish=None) -> Request:
        """Queue a request. Raises ValueError if it can never fit the context (naming the lengths) or its
        ids are out of the vocabulary, QueueFull if the queue is at max_queue."""
        params = params or SamplingParams()
        ids = self.engine.prompt_ids(prompt).cpu()
        check_lengths(ids.shape[0], params.max_tokens, self.engine.config.max_position_embeddings,
                      self.model.max_seq_len)
        with self._lock:
            seed = params.seed if params.seed is not None else \
                int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            gen = None if params.greedy else torch.Generator(device=self.model.device).manual_seed(seed)
            req = Request(self._next_id, ids, params, on_token=on_token, on_finish=on_finish, generator=gen,
                          _engine=self)
            self.scheduler.add(req)  # QueueFull before the id is used
            self._next_id += 1
            self._cv.notify_all()
        return req

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Submit every prompt, run until all finish, return their tokens in order."""
        ps = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.submit(p, q) for p, q in zip(prompts, ps)]
        return [r.result() for r in reqs]

    # ------------------------------------------------------------------ steps

    def step(self) -> StepStats | None:
        """Run one engine step (None when there is nothing to run)."""
        with self._step_lock:
            with self._lock:
                for r in self.scheduler.cancelled():
                    self._finish(r, r._cancel_reason)
                work = self.scheduler.plan()
            if not work:
                return None
            try:
                return self._run(work)
            except Exception as e:  # nothing half-done survives: the step's requests fail, the engine goes on
                with self._lock:
                    for w in work:
                        self.scheduler.release(w.request)
                        self._finish(w.request, "error", f"{type(e).__name__}: {e}")
                raise

    def _run(self, work: list[Work]) -> StepStats:
        model = self.model
        t0 = time.perf_counter()
        ex_before = _kind_counts(self.engine.executor.stats)
        tokens = torch.cat([self._tokens_of(w) for w in work])
        with torch_threads(self.engine.torch_threads):
            logits = self.engine.step(tokens, [Segment(w.slot, w.start, w.length, w.emits) for w in work])
            chosen = self._choose([w for w in work if w.emits], logits)
            if self.prefix_cache is not None:  # prompts computed to their end this step (sanely): kept for reuse
                for w, tok in zip([w for w in work if w.emits], chosen):
                    if not w.decode and not isinstance(tok, str):
                        self.prefix_cache.store(w.request.prompt.tolist(), w.slot)
        hit, miss = self._admitted
        self._admitted = [0, 0]
        now = time.perf_counter()
        finished = 0
        with self._lock:
            for w in work:
                w.request.prefilled = max(w.request.prefilled, min(w.start + w.length, w.request.prompt_len))
            for w, tok in zip([w for w in work if w.emits], chosen):
                finished += self._append(w.request, tok, now)
            ex_after = _kind_counts(self.engine.executor.stats)
            st = StepStats(
                step=self.n_steps, tokens=int(tokens.shape[0]),
                decode_tokens=sum(w.length for w in work if w.decode),
                prefill_tokens=sum(w.length for w in work if not w.decode), requests=len(work), finished=finished,
                experts={k: ex_after[0][k] - ex_before[0].get(k, 0) for k in ex_after[0]},
                expert_tokens={k: ex_after[1][k] - ex_before[1].get(k, 0) for k in ex_after[1]},
                seconds=time.perf_counter() - t0, path=model.last_path, prefix_hit_tokens=hit,
                prefix_miss_tokens=miss)
            self.steps.append(st)
            self.n_steps += 1
            t = self.totals
            t["steps"] += 1
            for f in ("tokens", "decode_tokens", "prefill_tokens", "seconds", "prefix_hit_tokens", "prefix_miss_tokens"):
                t[f] += getattr(st, f)
            for k, v in st.experts.items():
                t["experts"][k] = t["experts"].get(k, 0) + v
            for observe in self.step_observers:
                observe(st)
            self._cv.notify_all()
        return st

    def _admit(self, r: Request) -> None:
        """A request just got its slot: the longest cached prefix of its prompt is copied into its row, and its
        prefill starts after it."""
        if self.prefix_cache is None:
            return
        entry, n = self.prefix_cache.lookup(r.prompt.tolist())
        if n:
            self.prefix_cache.load(entry, n, r.slot)
            r.prefilled = r.prefix_hit = n
        self._admitted[0] += n
        self._admitted[1] += r.prompt_len - n

    @staticmethod
    def _tokens_of(w: Work) -> torch.Tensor:
        r = w.request
        if w.decode:
            return torch.tensor([r.tokens[-1]], dtype=torch.long)
        return r.prompt[w.start : w.start + w.length]

    def _choose(self, emitting: list[Work], logits: torch.Tensor | None) -> list[int | str]:
        """Each emitting request's next token, or the reason it fails: a request's own logits or sampling
        can fail only that request (its neighbours in the step get their tokens)."""
        if not emitting:
            return []
        best = greedy_rows(logits)  # every row's argmax, -1 where it is not finite
        out: list[int | str] = [t if t >= 0 else "non-finite logits" for t in best]
        for j, w in enumerate(emitting):
            p = w.request.params
            if best[j] >= 0 and not p.greedy:
                try:
                    out[j] = int(choose_token(logits[j : j + 1], True, p.temperature, p.top_k, p.top_p,
                                              w.request.generator))
                except Exception as e:  # noqa: BLE001 - its own sampling: it fails alone
                    out[j] = f"sampling failed: {type(e).__name__}: {e}"
        return out

    def _append(self, r: Request, tok: int | str, now: float) -> int:
        """Record a request's new token (or its failure, a str); finish it when it stops. Returns 1 if it
        finished."""
        if isinstance(tok, str):
            self.scheduler.release(r)
            self._finish(r, "error", f"{tok} at its token {len(r.tokens)}")
            return 1
        r.tokens.append(tok)
        r.token_times.append(now)
        if r.first_token_at is None:
            r.first_token_at = now
        if r.on_token is not None:
            r.on_token(tok)
        p = r.params
        reason = "stop" if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids) else \
            "length" if len(r.tokens) >= p.max_tokens else None
        if reason is None:
            return 0
        self.scheduler.release(r)
        self._finish(r, reason)
        return 1

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        r.finish_reason, r.error, r.finished_at = reason, error, time.perf_counter()
        r.slot = None
        self.totals["finished"][reason] = self.totals["finished"].get(reason, 0) + 1
        self._cv.notify_all()
        if r.on_finish is not None:
            r.on_finish(r)

    # ------------------------------------------------------------------ driving

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.step() is not None:
            pass

    def start(self) -> None:
        """Run the steps on a loop thread (a server's mode); requests' iterators then wait for it."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="fiddler-batch", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the loop thread: after every request has finished (drain), or cancelling them all."""
        with self._lock:
            if not drain:
                for r in list(self.scheduler.running) + list(self.scheduler.waiting):
                    r._abort()
            self._stopping = True
            self._cv.notify_all()
            t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"the batch loop did not stop within {timeout} s")
        with self._lock:
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.scheduler.idle and not self._stopping:
                    self._cv.wait()
                if self._stopping and self.scheduler.idle:
                    return
            try:
                self.step()
            except Exception:  # the step's requests carry the error; the loop serves the others
                pass

    def _wake(self) -> None:
        """A request was cancelled: the loop thread takes it out at its next step; without one, now (unless a
        step is running, which takes it out when it starts the next)."""
        with self._lock:
            self._cv.notify_all()
        if self._thread is None and self._step_lock.acquire(blocking=False):
            try:
                with self._lock:
                    for r in self.scheduler.cancelled():
                        self._finish(r, r._cancel_reason)
            finally:
                self._step_lock.release()

    def _wait_for(self, req: Request, n: int) -> None:
        """Until `req` has more than n tokens or has finished: wait for the loop thread, or drive a step."""
        if self._thread is not None:
            with self._lock:
                while len(req.tokens) <= n and not req.done:
                    self._cv.wait()
            return
        if self.step() is None and not req.done:
            raise RuntimeError(f"request {req.id} is neither running nor waiting")

    # ------------------------------------------------------------------ facts

    def stats(self) -> dict:
        """Totals over the kept steps, and the queue now."""
        steps = list(self.steps)
        tot = lambda f: sum(getattr(s, f) for s in steps)  # noqa: E731
        kinds = lambda f: {k: sum(getattr(s, f).get(k, 0) for s in steps) for k in "abc"}  # noqa: E731
        return {"steps": len(steps), "tokens": tot("tokens"), "decode_tokens": tot("decode_tokens"),
                "prefill_tokens": tot("prefill_tokens"), "prefix_hit_tokens": tot("prefix_hit_tokens"),
                "prefix_miss_tokens": tot("prefix_miss_tokens"), "seconds": tot("seconds"), "experts": kinds("experts"),
                "expert_tokens": kinds("expert_tokens"), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "slots": self.scheduler.slots,
                "token_budget": self.scheduler.token_budget}


def eos_token_ids_of(engine) -> tuple[int, ...]:
    path = getattr(engine, "_info", {}).get("path")
    return eos_token_ids(path) if path else ()


__all__ = ["BatchEngine", "QueueFull", "Request", "SamplingParams", "StepStats", "eos_token_ids"]
