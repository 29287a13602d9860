"""The OpenAI-compatible HTTP app over a BatchEngine (FastAPI on uvicorn: the stack vLLM, llama-cpp-python's
server and `transformers serve` use, so clients meet the same SSE framing and disconnect behaviour).

The batch engine steps on its own loop thread; each HTTP request submits to it and receives tokens through
callbacks bridged into its asyncio task. Parsing and tokenizing run on a worker thread, never on the event
loop. A client that disconnects, streamed or not, cancels its request (its slot is freed at the next step).
While loading or draining, /health and the generation routes answer 503. Every error is OpenAI-shaped and
counted in /metrics (fiddler.server.guard refuses foreign hosts and origins, other media types and bodies
over the limit before any route runs).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..batch import QueueFull
from . import protocol as P
from .guard import Guard, Limits
from .metrics import Metrics

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def route_of(path: str) -> str:
    """The route label of /metrics' request counters ('other' for every path but the generation ones)."""
    return ROUTES.get(path, "other")


class Detokenizer:
    """Text deltas of a growing token list for streaming (the offsets scheme of vLLM's and TGI's
    detokenizers): a token's text is decoded with a few tokens before it, since pieces like SentencePiece's
    byte fallback only make text together, and a trailing partial UTF-8 sequence (U+FFFD) waits for the
    next token. `full()` is the whole decode, which a non-streamed answer returns."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._delta(final=False)

    def flush(self) -> str:
        """The rest, once the tokens are complete (a partial sequence stays U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(before) and (final or not text.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def full(self) -> str:
        return self._decode(self.ids)


@dataclass
class ServerState:
    """What the routes share. `loader` builds (batch engine, tokenizer) on a thread at startup; a failure
    is kept for /health and passed to on_load_error (a standalone server then exits with it)."""

    loader: Callable[[], tuple]
    model_name: str
    limits: Limits = field(default_factory=Limits)
    on_load_error: Callable[[str], None] | None = None
    context: int | None = None
    batch_engine: object = None
    tokenizer: object = None
    load_error: str | None = None
    draining: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    ready: threading.Event = field(default_factory=threading.Event)
    # parsing and tokenizing, off the event loop on one thread: a fast tokenizer is not safe to call from
    # several threads at once, and one thread bounds the CPU a burst of requests can take from the engine
    preparer: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "fiddler-prepare"))

    def load(self) -> None:
        try:
            be, tok = self.loader()
            self.metrics.watch(be)
            be.start()
            self.batch_engine, self.tokenizer = be, tok
            self.context = min(be.model.max_seq_len, be.engine.config.max_position_embeddings)
            self.ready.set()
        except Exception as e:  # /health says why
            self.load_error = f"{type(e).__name__}: {e}"
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def check_serving(self) -> None:
        if self.draining:
            raise P.unavailable("the server is draining (shutting down)", 5)
        if not self.ready.is_set():
            raise P.unavailable(f"the model failed to load: {self.load_error}" if self.load_error else
                                "the model is loading")

    def job(self, raw: bytes, chat: bool) -> P.Job:
        """A request body to a Job: parsing and tokenizing, the work kept off the event loop."""
        return P.make_job(P.parse_body(raw), self.tokenizer, chat=chat, context=self.context,
                          served_model=self.model_name)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="fiddler", docs_url=None, redoc_url=None)

    def count(path: str, e: P.APIError) -> None:
        state.metrics.request_done(route_of(path), f"error_{e.status}")

    app.add_middleware(Guard, limits=state.limits, on_error=count)

    @app.on_event("startup")
    async def _load():
        threading.Thread(target=state.load, name="fiddler-load", daemon=True).start()

    def error_response(e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def fail(path: str, e: P.APIError):
        count(path, e)
        return error_response(e)

    def internal(path: str, e: BaseException):
        """An exception nobody foresaw: its traceback on stderr, an OpenAI-shaped 500 to the client."""
        traceback.print_exception(e, file=sys.stderr)
        return fail(path, P.APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error",
                                     "internal_error"))

    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        return fail(request.url.path, e)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return fail(request.url.path, P.APIError(404, f"no route {request.method} {request.url.path}",
                                                 "invalid_request_error", "not_found"))

    @app.exception_handler(405)
    async def _not_allowed(request, e):
        return fail(request.url.path, P.APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                                 "invalid_request_error", "method_not_allowed"))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return internal(request.url.path, e)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
        if not state.ready.is_set():
            body = {"status": "error", "error": state.load_error} if state.load_error else {"status": "loading"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        chosen = getattr(getattr(getattr(state.batch_engine, "engine", None), "gpu", None), "chosen", None)
        return {"status": "ok", **({"gpu_budget": chosen.to_dict()} if chosen is not None else {})}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "fiddler"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.batch_engine), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        route, path = ("chat" if chat else "completions"), request.url.path
        try:
            state.check_serving()
            raw = await request.body()
            job = await asyncio.get_running_loop().run_in_executor(state.preparer, state.job, raw, chat)
        except P.APIError as e:
            return fail(path, e)
        except ClientDisconnect:
            state.metrics.request_done(route, "disconnected")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - answered and counted, never a plain-text 500
            return internal(path, e)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
        try:
            req = state.batch_engine.submit(job.prompt_ids, job.params, on_token=put, on_finish=lambda r: put(None))
        except QueueFull as e:
            return fail(path, P.unavailable(str(e)))
        except ValueError as e:
            return fail(path, P.bad(str(e)))
        run = _Run(state, job, req, queue, route)
        if job.stream:
            return StreamingResponse(run.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await run.whole(request)

    @app.post("/v1/completions", openapi_extra=_openapi(False, state.model_name))
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_openapi(True, state.model_name))
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": ["string", "null"]}}}}}


def _openapi(chat: bool, model: str) -> dict:
    """A generation route's request body and answers in /openapi.json (the routes read raw bodies, so FastAPI
    cannot infer them): 503 (loading, draining, a full queue) is the only 5xx a request may meet by design."""
    error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    answers = {"400": "invalid request", "403": "foreign Host or Origin", "404": "unknown model",
               "413": "body over --max-body-bytes", "415": "not application/json",
               "503": "loading, draining or a full queue (Retry-After)"}
    body = {"application/json": {"schema": P.request_schema(chat, model)}}
    return {"requestBody": {"required": True, "content": body},
            "responses": {"200": {"description": "the completion, or its server-sent events when stream is true",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **{code: {"description": what, **error} for code, what in answers.items()}}}


class _Run:
    """One HTTP request's generation: tokens from the engine's callbacks, text through the detokenizer, stop
    strings applied (text that may still begin one is held back until it cannot), the request cancelled if
    the client goes away."""

    def __init__(self, state: ServerState, job: P.Job, req, queue: asyncio.Queue, route: str):
        self.state, self.job, self.req, self.queue, self.route = state, job, req, queue, route
        self.detok = Detokenizer(state.tokenizer)
        self.text, self.sent, self.tokens = "", 0, 0  # text decoded; how much of it the client has
        self.stopped = self.gone = False
        self.longest_stop = max(map(len, job.stop_strings), default=0)

    def _take(self, token: int | None) -> str:
        """The text this token lets the client have (None: the rest, at the end), cut at a stop string (which
        then ends the request)."""
        if self.stopped:
            return ""
        if token is None:
            self.text += self.detok.flush()
        else:
            self.tokens += 1
            self.text += self.detok.add(token)
        end = len(self.text)
        if self.job.stop_strings:  # no match can begin before `sent`: that text could begin none
            hits = [i for i in (self.text.find(s, self.sent) for s in self.job.stop_strings) if i >= 0]
            if hits:
                self.stopped, end = True, min(hits)
                self.req.cancel()
            elif token is not None:
                end -= self._held()
        out, self.sent = self.text[self.sent : end], end
        return out

    def _held(self) -> int:
        """How many of the unsent text's last characters could begin a stop string."""
        tail = self.text[self.sent :]
        for k in range(min(len(tail), self.longest_stop - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.job.stop_strings):
                return k
        return 0

    def _outcome(self) -> str:
        reason = self.req.finish_reason
        return "error_500" if reason == "error" else "aborted" if reason == "aborted" and not self.stopped else "ok"

    def _finish(self, outcome: str):
        r = self.req
        ttft = r.first_token_at - r.submitted_at if r.first_token_at is not None else None
        self.state.metrics.request_done(self.route, outcome, len(self.job.prompt_ids), self.tokens, ttft,
                                        r.token_times[: self.tokens])

    def _reason(self) -> str | None:
        return "stop" if self.stopped else P.finish_reason(self.req.finish_reason)

    async def events(self):
        """Server-sent events: chunks as tokens come, the final chunk with its finish reason, the usage chunk
        if asked for, then [DONE]."""
        model, done = self.state.model_name, False
        try:
            if self.job.chat:
                yield _sse(P.chunk(self.job, model, None, None, first=True))
            while True:
                item = await self.queue.get()
                if self.stopped:
                    if item is None:
                        break
                    continue
                sent = len(self.detok.ids)
                delta = self._take(item)
                ids = self.detok.ids[sent:] if self.job.return_token_ids and item is not None else None  # this token's
                if delta or ids:
                    yield _sse(P.chunk(self.job, model, delta, None, token_ids=ids))
                if item is None:
                    break
            if self.req.finish_reason == "error":
                yield _sse({"error": {"message": self.req.error, "type": "server_error", "code": "engine_error"}})
            else:
                yield _sse(P.chunk(self.job, model, None if self.job.chat else "", self._reason()))
                if self.job.include_usage:
                    yield _sse(P.usage_chunk(self.job, model, self.tokens))
            yield "data: [DONE]\n\n"
            done = True
            self._finish(self._outcome())
        finally:
            if not done:  # the client went away mid-stream: free its slot
                self.req.cancel()
                self._finish("disconnected")

    async def _watch(self, request: Request) -> None:
        """Until the client disconnects; then cancel its request (the engine takes it out at its next step)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.req.cancel()

    async def whole(self, request: Request):
        watch = asyncio.create_task(self._watch(request))
        try:
            while True:
                item = await self.queue.get()
                self._take(item)
                if item is None:
                    break
        finally:
            watch.cancel()
        if self.gone:
            self._finish("disconnected")
            return Response(status_code=499)
        if self.req.finish_reason == "error":
            self._finish("error_500")
            return JSONResponse(P.APIError(500, self.req.error or "engine error", "server_error",
                                           "engine_error").body(), status_code=500)
        self._finish(self._outcome())
        text = self.detok.full()
        if self.stopped:  # the whole decode, cut at the first stop string as the stream was
            text = text[: min((i for i in (text.find(s) for s in self.job.stop_strings) if i >= 0), default=len(text))]
        return P.response(self.job, self.state.model_name, text, self._reason(), self.tokens,
                          self.detok.ids if self.job.return_token_ids else None)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def drain(state: ServerState, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Stop taking requests and wait until those in flight have finished (True) or timeout_s passed."""
    state.draining = True
    be = state.batch_engine
    end = time.monotonic() + timeout_s
    while be is not None and not be.scheduler.idle and time.monotonic() < end:
        time.sleep(poll_s)
    return be is None or be.scheduler.idle
