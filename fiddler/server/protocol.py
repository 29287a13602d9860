"""The OpenAI API's request fields and response shapes, as benchmark clients (guidellm, vllm bench serve) and
chat UIs send and read them. No HTTP here: the app (fiddler.server.app) turns APIError into a response."""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..batch import SamplingParams
from ..batch.request import SEED_RANGE

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # for /v1/chat/completions, clipped to the context left after the prompt


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code)


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, "service_unavailable", "unavailable", {"Retry-After": str(retry_after_s)})


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the request body is nested too deeply", "invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise bad(f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", "invalid_json")
    return body


def default_chat_prompt(messages: list[dict]) -> str:
    """The documented default chat format for models without a chat template (the generated ones): each
    message as "<|role|>\\n{content}\\n", then "<|assistant|>\\n" to cue the reply."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


@dataclass
class Job:
    """A validated request: what to submit to the batch engine and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    chat: bool
    stream: bool = False
    include_usage: bool = False
    stop_strings: tuple[str, ...] = ()
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) also carries its token ids
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def _opt(body: dict, key: str, kind, check=None, what: str = "") -> object:
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, kind) and not isinstance(v, bool) if kind is not bool else isinstance(v, bool)
    if not ok or (check is not None and not check(v)):
        raise bad(f"'{key}' must be {what}, got {v!r}")
    return v


def _text(value: str, what: str) -> str:
    """A string the tokenizer can take: UTF-8 encodable (JSON's "\\ud800" decodes to a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{what} is not valid Unicode text: {e.reason} at character {e.start}") from None
    return value


def _content(c) -> str:
    """A message's content: a string, or a list of text parts (other kinds, images or audio, are not
    supported here)."""
    if isinstance(c, list):
        texts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text":
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad(f"content part {kind!r} is not supported (only {{'type': 'text', 'text': str}})",
                          "unsupported_field")
            if not isinstance(p.get("text"), str):
                raise bad(f"a text content part needs a string 'text', got {p.get('text')!r}")
            texts.append(p["text"])
        c = "".join(texts)
    if not isinstance(c, str):
        raise bad(f"each message needs a string 'content', got {c!r}")
    return _text(c, "a message's 'content'")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content}", "missing_messages")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"each message needs a string 'role', got {m!r}")
        out.append({"role": _text(m["role"], "a message's 'role'"), "content": _content(m.get("content"))})
    return out


# OpenAI fields this server does not implement: accepted only at a value that asks for nothing (absent, null or
# one of these), otherwise a 400 naming the field, so a client asking for JSON mode or a tool call is told.
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "n": (1,), "suffix": ("",),
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "min_p": (0,), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "prediction": (),
}


def _check_unsupported(body: dict) -> None:
    for key, neutral in UNSUPPORTED.items():
        v = body.get(key)
        if v is None or any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral):
            continue
        allowed = " or ".join(["null", *(json.dumps(n) for n in neutral)])
        raise bad(f"'{key}' is not supported by this server (got {json.dumps(v)[:80]}; accepted: {allowed})",
                  "unsupported_field")


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer) -> int | None:
    """The most characters one token's text can hold: its vocabulary's longest piece (a SentencePiece or
    byte-level piece decodes to at most as many characters as it is long). None if the vocabulary is not
    readable."""
    try:
        return max(map(len, tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - then no early check; the token count still is
        return None


def _check_chars(chars: int, tokenizer, context: int) -> None:
    """Before tokenizing: a text longer than the context's tokens times the longest piece cannot fit, whatever
    it tokenizes to (tokenizing megabytes would take seconds and gigabytes first)."""
    most = max_token_chars(tokenizer)
    if most is not None and chars > most * context:
        raise bad(f"the prompt of {chars} characters cannot fit the context of {context} tokens (a token holds at "
                  f"most {most} characters here)", "context_length_exceeded")


def make_job(body: dict, tokenizer, *, chat: bool, context: int, served_model: str) -> Job:
    """Validate a /v1/completions or /v1/chat/completions body into a Job (APIError 400/404 otherwise).
    Unknown fields are ignored; the OpenAI fields in UNSUPPORTED are refused unless they ask for nothing."""
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served_model}'",
                       "invalid_request_error", "model_not_found")
    _check_unsupported(body)
    if chat:
        msgs = _messages(body)
        _check_chars(sum(len(m["role"]) + len(m["content"]) for m in msgs), tokenizer, context)
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            ids = tokenizer(default_chat_prompt(msgs))["input_ids"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            _check_chars(len(prompt), tokenizer, context)
            ids = tokenizer(_text(prompt, "'prompt'"))["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif prompt is None:
            raise bad("'prompt' is required", "missing_prompt")
        else:
            raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)")
    max_tokens = _opt(body, "max_completion_tokens", int, lambda v: v >= 1, "an integer >= 1") if chat else None
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, context - len(ids))) if chat else DEFAULT_MAX_TOKENS
    temperature = _opt(body, "temperature", (int, float), lambda v: math.isfinite(v) and 0 <= v <= 2,
                       "a number in [0, 2]")
    top_p = _opt(body, "top_p", (int, float), lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _opt(body, "top_k", int, lambda v: v >= -1, "an integer >= -1 (-1 or 0: off)")
    seed = _opt(body, "seed", int, lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1], "an integer in [-2**63, 2**63 - 1]")
    ignore_eos = _opt(body, "ignore_eos", bool, None, "true or false")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(s for s in stop if s)
    else:
        raise bad(f"'stop' must be null, a string or a list of at most 4 strings, got {stop!r}")
    stream = _opt(body, "stream", bool, None, "true or false") or False
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad(f"'stream_options' must be an object, got {opts!r}")
    include_usage = bool((opts or {}).get("include_usage")) and stream
    if len(ids) + max_tokens > context:
        raise bad(f"the prompt of {len(ids)} tokens plus max_tokens={max_tokens} exceeds the context of "
                  f"{context} tokens", "context_length_exceeded")
    params = SamplingParams(max_tokens=int(max_tokens), temperature=1.0 if temperature is None else float(temperature),
                            top_k=None if top_k in (None, -1, 0) else int(top_k),
                            top_p=None if top_p is None else float(top_p), seed=seed,
                            ignore_eos=bool(ignore_eos))
    return_ids = _opt(body, "return_token_ids", bool, None, "true or false") or False
    return Job(list(ids), params, chat, stream, include_usage, stops, return_ids)


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def request_schema(chat: bool, served_model: str | None = None) -> dict:
    """The JSON Schema of a request body, as make_job reads it (published in /openapi.json for clients and
    for the fuzz campaign, tests/test_server_fuzz.py). Unsupported fields appear with their neutral values."""
    count = {"type": "integer", "minimum": 1}
    props = {
        "model": {"enum": [served_model]} if served_model else {"type": "string"},
        "max_tokens": _nullable(count),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "seed": _nullable({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
        "stop": _nullable({"anyOf": [{"type": "string"},
                                     {"type": "array", "items": {"type": "string"}, "maxItems": 4}]}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "return_token_ids": _nullable({"type": "boolean"}),
        **{k: {"enum": [None, *v]} for k, v in UNSUPPORTED.items()},
    }
    if chat:
        part = {"type": "object", "required": ["type", "text"],
                "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"type": "string"},
                                  "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}}}
        props |= {"messages": {"type": "array", "items": message, "minItems": 1},
                  "max_completion_tokens": _nullable(count)}
        required = ["messages"]
    else:
        props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}
        required = ["prompt"]
    return {"type": "object", "required": required, "properties": props}


def usage(job: Job, completion_tokens: int) -> dict:
    p = len(job.prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reasons in OpenAI's terms (a stop string ends the request by cancelling it; a
    request cut by the server's stop is vLLM's 'abort')."""
    return {"length": "length", "stop": "stop", "cancelled": "stop", "aborted": "abort"}.get(reason, reason)


def chunk(job: Job, model: str, text: str | None, reason: str | None, first: bool = False,
          token_ids: list[int] | None = None) -> dict:
    """One streamed chunk (text None: no content, e.g. the chat stream's opening role)."""
    if job.chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return {"id": job.id, "object": obj, "created": job.created, "model": model, "choices": [choice]}


def usage_chunk(job: Job, model: str, completion_tokens: int) -> dict:
    return {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created, "model": model, "choices": [], "usage": usage(job, completion_tokens)}


def response(job: Job, model: str, text: str, reason: str | None, completion_tokens: int,
             token_ids: list[int] | None = None) -> dict:
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return {"id": job.id, "object": obj, "created": job.created, "model": model, "choices": [choice],
            "usage": usage(job, completion_tokens)}
