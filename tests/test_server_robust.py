"""The server against a hostile client and a careless user (issue 55): the bugs and misleading answers found by
probing `python -m fiddler.server --slots 4 --max-queue 8` on the generated tiny Mixtral, each one's guard.
Servers listen on 127.0.0.1 only; each is stopped, bounded in time."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from runners.models import synthetic_model  # noqa: E402
from tests.server_helpers import (  # noqa: E402
    WrappedTokenizer, assert_error, free_port, inprocess_server, metrics, request, running_server, stream,
    tiny_loader,
)

WAIT_S = 60  # bound of every wait for a server-side change


@pytest.fixture(scope="module")
def S():
    """The issue's probe server: `python -m fiddler.server --model <tiny_mixtral> --slots 4 --max-queue 8`."""
    with running_server("--slots", "4", "--max-queue", "8") as (_, port):
        yield port


def wait_until(cond, what: str, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def outcome(m: dict, route: str, what: str) -> float:
    return m.get(f'fiddler_requests_total{{route="{route}",outcome="{what}"}}', 0)


# ---------------------------------------------------------------- bug 1: a request's sampling fails only itself

@pytest.mark.parametrize("temperature", [1e-300, 1e-45])
def test_a_vanishing_temperature_harms_no_stream_beside_it(S, temperature):
    ev = stream(S, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0,
                                       "ignore_eos": True})
    conn = next(ev)
    next(ev)  # the greedy stream is running
    poison = request(S, "POST", "/v1/completions", {"prompt": "poison", "max_tokens": 50,
                                                    "temperature": temperature})
    rest = list(ev)
    conn.close()
    assert poison[0] == 200, poison
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length", rest[-3:]


# ---------------------------------------------------------------- bug 2: a large prompt must not freeze the server

def test_a_body_over_the_limit_is_413_before_it_is_read(S):
    """A 5 MB body (over the default 4 MiB) is refused on its Content-Length, before the server reads it: the
    client, having sent only its start, reads the 413."""
    huge = json.dumps({"prompt": "x" * 5_000_000, "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", S), timeout=WAIT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(huge) + huge[:65536])
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer
    assert json.loads(body)["error"]["code"] == "request_too_large"
    # a body that declares no length is cut where it passes the limit
    pieces = [huge[i : i + 65536] for i in range(0, len(huge), 65536)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    with socket.create_connection(("127.0.0.1", S), timeout=WAIT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            s.sendall(chunked + b"0\r\n\r\n")
        except OSError:  # the server answered and closed while we were still sending
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert request(S, "GET", "/health")[0] == 200


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized():
    """A prompt longer in characters than the context times the longest token's text cannot fit, whatever
    its tokens: 400 without tokenizing it (tokenizing megabytes of text took seconds of the event loop)."""
    from fiddler.server import protocol as P

    class Untouchable:
        chat_template = None

        def get_vocab(self):
            return {"a": 0, "bcd": 1, "<0x0A>": 2}

        def __call__(self, *a, **kw):
            raise AssertionError("tokenized")

    for chat in (False, True):
        body = {"messages": [{"role": "user", "content": "a" * 7 * 100}]} if chat else {"prompt": "a" * 6 * 101}
        with pytest.raises(P.APIError) as e:
            P.make_job(body, Untouchable(), chat=chat, context=100, served_model="m")
        assert e.value.status == 400 and e.value.code == "context_length_exceeded", e.value.message


def test_health_answers_while_a_prompt_is_being_tokenized():
    entered, release = threading.Event(), threading.Event()

    def hook(text):
        if text == "hold":
            entered.set()
            release.wait(WAIT_S)

    with inprocess_server(tiny_loader(lambda tok: WrappedTokenizer(tok, hook))) as (state, port):
        held: list = []
        t = threading.Thread(target=lambda: held.append(request(port, "POST", "/v1/completions",
                                                                {"prompt": "hold", "max_tokens": 2})))
        t.start()
        try:
            assert entered.wait(WAIT_S)
            health = request(port, "GET", "/health", timeout=10)
        finally:
            release.set()
            t.join(WAIT_S)
        assert health[0] == 200 and held[0][0] == 200


@pytest.mark.realtime
def test_300_half_open_connections_leave_the_server_answering_and_are_closed(S):
    """The acceptance check on the real server (default --header-timeout 10): 300 connections that never
    finish their headers are held; a normal request still answers, and the server closes every one of them."""
    socks = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", S), timeout=WAIT_S)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        st, _, body = request(S, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0,
                                                             "ignore_eos": True})
        assert st == 200 and body["usage"]["completion_tokens"] == 4

        def closed(s):
            s.settimeout(0)
            try:
                return s.recv(1 << 16) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True
        wait_until(lambda: all(closed(s) for s in socks), "the server closed every half-open connection")
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------- bug 3: stop strings never leak into a stream

def test_streamed_text_never_holds_the_start_of_a_stop_string(S):
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    deltas = [e["choices"][0]["text"] for e in list(stream(S, "/v1/completions", body))[1:-1]]
    text = "".join(deltas)
    # stop strings that begin with one token's text and end in the next's: no single delta holds them
    cases, pos = [], 0
    for a, b in zip(deltas, deltas[1:]):
        if a and b and text.find(a + b[0]) == pos:
            cases.append((pos, a + b[0]))
        pos += len(a)
    assert cases, deltas
    for pos, stop in cases[:3]:
        whole = request(S, "POST", "/v1/completions", {**body, "stop": [stop]})[2]["choices"][0]
        events = list(stream(S, "/v1/completions", {**body, "stop": [stop]}))[1:-1]
        streamed = "".join(e["choices"][0]["text"] for e in events)
        assert (whole["text"], whole["finish_reason"]) == (text[:pos], "stop")
        assert streamed == text[:pos] and events[-1]["choices"][0]["finish_reason"] == "stop", (stop, streamed)


# ---------------------------------------------------------------- bug 4: a non-streamed request dies with its client

@pytest.mark.realtime
def test_a_non_streamed_request_is_cancelled_when_its_client_goes(S):
    before = metrics(S)
    c = http.client.HTTPConnection("127.0.0.1", S, timeout=WAIT_S)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "go", "max_tokens": 4000, "temperature": 0,
                                                          "ignore_eos": True}).encode(),
              headers={"Content-Type": "application/json"})
    wait_until(lambda: metrics(S)["fiddler_requests_running"] == 1, "the request holds a slot")
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    # The engine frees the slot at its next step; the handler counts the outcome when the finish reaches it, a
    # moment later: wait for both, then check what was counted.
    gone = lambda m: outcome(m, "completions", "disconnected") - outcome(before, "completions", "disconnected")  # noqa: E731
    after = wait_until(lambda: (m := metrics(S))["fiddler_requests_running"] == 0 and gone(m) >= 1 and m,
                       "the slot is free and the request counted disconnected")
    assert gone(after) == 1
    assert outcome(after, "completions", "ok") == outcome(before, "completions", "ok")
    assert after["fiddler_generation_tokens_total"] - before["fiddler_generation_tokens_total"] < 4000


# ---------------------------------------------------------------- bug 5: a request cut by the drain says so

@pytest.mark.realtime
def test_a_request_cut_by_the_drain_timeout_reports_abort():
    with running_server("--slots", "4", "--drain-timeout", "0.5") as (proc, port):
        got: dict = {}
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}

        def streamed():
            got["stream"] = list(stream(port, "/v1/completions", body))[1:]

        def whole():
            got["whole"] = request(port, "POST", "/v1/completions", body)

        threads = [threading.Thread(target=f) for f in (streamed, whole)]
        for t in threads:
            t.start()
        wait_until(lambda: metrics(port)["fiddler_requests_running"] == 2, "both requests hold a slot")
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(WAIT_S)
        assert proc.wait(WAIT_S) == 0
    st, _, w = got["whole"]
    assert st == 200 and w["choices"][0]["finish_reason"] == "abort" and w["usage"]["completion_tokens"] < 4000
    s = got["stream"]
    assert s[-1] == "[DONE]" and s[-2]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.realtime
def test_a_request_cut_by_the_drain_is_counted_aborted():
    from fiddler.server.app import drain

    with inprocess_server(tiny_loader()) as (state, port):
        ev = stream(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "max_tokens": 900,
                                                   "temperature": 0, "ignore_eos": True})
        conn = next(ev)
        next(ev)
        assert not drain(state, 0.05)  # what SIGTERM does, as __main__ runs it, with a drain timeout that cuts
        state.batch_engine.stop(drain=False, timeout=WAIT_S)
        rest = list(ev)
        conn.close()
        m = metrics(port)
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert outcome(m, "chat", "aborted") == 1 and outcome(m, "chat", "ok") == 0


# ---------------------------------------------------------------- bug 6: every error OpenAI-shaped and counted

def test_malformed_inputs_get_openai_400s_that_are_counted(S):
    before = metrics(S)
    assert_error(request(S, "POST", "/v1/completions", raw=b'{"prompt": "\\ud800", "max_tokens": 2}'), 400)
    assert_error(request(S, "POST", "/v1/completions", raw=b"[" * 100_000 + b"]" * 100_000), 400, "invalid_json")
    assert_error(request(S, "POST", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}), 400)
    after = metrics(S)
    assert outcome(after, "completions", "error_400") - outcome(before, "completions", "error_400") == 2
    assert outcome(after, "chat", "error_400") - outcome(before, "chat", "error_400") == 1
    assert request(S, "POST", "/v1/completions", {"prompt": "fine", "max_tokens": 2})[0] == 200


def test_an_unexpected_failure_is_an_openai_500_that_is_counted():
    def hook(text):
        if text == "explode":
            raise KeyError("a failure nobody foresaw")

    with inprocess_server(tiny_loader(lambda tok: WrappedTokenizer(tok, hook))) as (state, port):
        resp = request(port, "POST", "/v1/completions", {"prompt": "explode", "max_tokens": 2})
        m = metrics(port)
        assert request(port, "POST", "/v1/completions", {"prompt": "fine", "max_tokens": 2})[0] == 200
    assert_error(resp, 500, "internal_error")
    assert outcome(m, "completions", "error_500") == 1


# ---------------------------------------------------------------- bug 7: /metrics counts every step

def test_metrics_count_every_step_not_only_those_kept():
    from fiddler.batch import SamplingParams
    from fiddler.server.app import ServerState

    state = ServerState(tiny_loader(keep_steps=8), "tiny")
    state.load()
    be = state.batch_engine
    try:
        be.submit([3, 5, 7], SamplingParams(max_tokens=30, ignore_eos=True)).result()
        state.metrics.render(be)
        be.submit([3, 5, 9], SamplingParams(max_tokens=20, ignore_eos=True)).result()
        text = state.metrics.render(be)
    finally:
        be.stop(timeout=WAIT_S)
    count = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("fiddler_step_tokens_count"))
    assert be.n_steps > 16 and count == be.n_steps


# ---------------------------------------------------------------- misleading answers

UNSUPPORTED = {  # field: (a value that asks for something this server does not do, its neutral value)
    "logprobs": (True, False), "top_logprobs": (3, 0), "tools": ([{"type": "function", "function": {"name": "f"}}], []),
    "tool_choice": ("required", "none"), "response_format": ({"type": "json_object"}, {"type": "text"}),
    "echo": (True, False), "best_of": (2, 1), "suffix": ("tail", ""), "logit_bias": ({"5": 100}, {}),
    "presence_penalty": (0.5, 0), "frequency_penalty": (-1, 0.0), "n": (2, 1),
}


def test_unsupported_fields_are_400_unless_neutral(S):
    for field, (asks, neutral) in UNSUPPORTED.items():
        for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})):
            st, _, resp = request(S, "POST", route, {**body, field: asks})
            assert st == 400 and f"'{field}'" in resp["error"]["message"] and "not supported" in \
                resp["error"]["message"], (field, route, resp)
            st, _, resp = request(S, "POST", route, {**body, field: neutral})
            assert st == 200, (field, neutral, route, resp)


def test_a_seed_out_of_range_is_a_400_naming_seed(S):
    for seed in (2**64, -(2**63) - 1):
        st, _, resp = request(S, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1,
                                                             "seed": seed})
        assert st == 400 and "'seed'" in resp["error"]["message"], resp
    assert request(S, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1,
                                                  "seed": 2**63 - 1})[0] == 200


def test_a_model_that_fails_to_load_exits_non_zero_with_the_reason(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    src = synthetic_model("tiny_mixtral")
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    cmd = [sys.executable, "-m", "fiddler.server", "--model", str(broken), "--port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rc = proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        rc = None
    out = proc.stdout.read()
    assert rc not in (None, 0), out
    assert "failed to load" in out and "safetensors" in out, out
