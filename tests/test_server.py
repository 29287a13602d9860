"""The OpenAI-compatible server (python -m fiddler.server) over real HTTP on 127.0.0.1, as a subprocess on the
generated tiny Mixtral: error shapes, 64 concurrent requests against /metrics, greedy outputs equal to the
batch engine's, a disconnect freeing its slot, and SIGTERM draining in-flight streams. Every server started
here is stopped, bounded in time."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from runners.models import synthetic_model  # noqa: E402
# free_port and request are imported from here by test_serve_mode
from tests.server_helpers import assert_error, free_port, metrics, request, running_server, stream  # noqa: E402, F401


@pytest.fixture(scope="module")
def server():
    with running_server("--slots", "8", "--max-queue", "64", "--dtype", "float32", "--max-seq-len", "256") as (_, port):
        yield port


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    p = server
    assert_error(request(p, "POST", "/v1/completions", raw=b"{not json"), 400, "invalid_json")
    assert_error(request(p, "POST", "/v1/completions", raw=b"[1, 2]"), 400, "invalid_json")
    assert_error(request(p, "POST", "/v1/completions", {"max_tokens": 4}), 400, "missing_prompt")
    assert_error(request(p, "POST", "/v1/chat/completions", {"max_tokens": 4}), 400, "missing_messages")
    assert_error(request(p, "POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}), 400)
    assert_error(request(p, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}), 400)
    assert_error(request(p, "POST", "/v1/completions", {"prompt": [1, 10**7], "max_tokens": 2}), 400)
    assert_error(request(p, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1000}), 400,
                 "context_length_exceeded")
    assert_error(request(p, "POST", "/v1/completions", {"prompt": "hi", "model": "gpt-nope"}), 404, "model_not_found")
    assert_error(request(p, "GET", "/v1/nothing"), 404)
    st, _, body = request(p, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stop": None, "seed": 1,
                                                        "an_unknown_field": {"x": 1}})
    assert st == 200 and body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
    st, _, models = request(p, "GET", "/v1/models")
    assert st == 200 and models["data"][0]["object"] == "model"


def test_64_concurrent_requests_complete_and_metrics_agree(server):
    p = server
    before = metrics(p)
    results: list = [None] * 64

    def client(i):
        body = {"prompt": [3 + i, 5 + i, 7], "max_tokens": 1 + i % 7, "temperature": 0, "ignore_eos": True}
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_completion_tokens": 1 + i % 7,
                    "temperature": 0, "ignore_eos": True}
        results[i] = request(p, "POST", "/v1/chat/completions" if i % 2 else "/v1/completions", body)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(r is not None and r[0] == 200 for r in results), [r for r in results if r is None or r[0] != 200][:3]
    got = sum(r[2]["usage"]["completion_tokens"] for r in results)
    assert got == sum(1 + i % 7 for i in range(64))
    after = metrics(p)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    assert delta("fiddler_generation_tokens_total") == got
    assert delta("fiddler_prompt_tokens_total") == sum(r[2]["usage"]["prompt_tokens"] for r in results)
    assert delta('fiddler_requests_total{route="completions",outcome="ok"}') == 32
    assert delta('fiddler_requests_total{route="chat",outcome="ok"}') == 32
    assert delta("fiddler_time_to_first_token_seconds_count") == 64
    assert delta("fiddler_inter_token_latency_seconds_count") == sum(i % 7 for i in range(64))  # n - 1 gaps each
    assert after["fiddler_requests_running"] == after["fiddler_requests_waiting"] == 0


def test_greedy_over_http_equals_the_batch_engine(server):
    from transformers import AutoTokenizer

    from fiddler.batch import BatchEngine, SamplingParams

    path = synthetic_model("tiny_mixtral")
    be = BatchEngine.from_pretrained(path, slots=8, dtype=torch.float32, max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = ["The quick brown fox", "Once upon a time", "MoE models route tokens", "1 2 3 4"]
    ids = [tok(t)["input_ids"] for t in prompts]
    want = be.generate(ids, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(ids))
    for text, w in zip(prompts, want):
        body = {"prompt": text, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        st, _, whole = request(server, "POST", "/v1/completions", body)
        assert st == 200 and whole["choices"][0]["token_ids"] == w
        assert whole["choices"][0]["text"] == tok.decode(w, skip_special_tokens=True)
        events = list(stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}))[1:]
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
        assert [t for e in events[:-2] for t in e["choices"][0].get("token_ids", [])] == w
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        # the streamed deltas are the text of the tokens so far (a held-back partial character comes later)
        streamed = "".join(e["choices"][0]["text"] for e in events[:-2])
        assert streamed == tok.decode(w, skip_special_tokens=True) or "\ufffd" in streamed


def test_a_disconnect_mid_stream_frees_the_slot(server):
    p = server
    before = metrics(p)
    events = stream(p, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}],
                                                "max_tokens": 200, "temperature": 0, "ignore_eos": True})
    conn = next(events)
    assert next(events)["choices"][0]["delta"] == {"role": "assistant"}
    next(events)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away
    conn.close()
    end = time.monotonic() + 60
    while True:
        m = metrics(p)
        gone = m.get('fiddler_requests_total{route="chat",outcome="disconnected"}', 0) - \
            before.get('fiddler_requests_total{route="chat",outcome="disconnected"}', 0)
        if gone == 1 and m["fiddler_requests_running"] == 0:
            break
        assert time.monotonic() < end, m
        time.sleep(0.1)
    assert m["fiddler_generation_tokens_total"] - before["fiddler_generation_tokens_total"] < 200


def test_sigterm_finishes_the_streams_in_flight_refuses_new_ones_and_exits_0():
    n, tokens = 8, 600
    with running_server("--slots", "8", "--max-seq-len", "640", "--drain-timeout", "120") as (proc, port):
        got: list = [None] * n
        started = threading.Barrier(n + 1)

        def client(i):
            ev = stream(port, "/v1/completions", {"prompt": [5 + i, 9], "max_tokens": tokens, "temperature": 0,
                                                  "ignore_eos": True, "stream_options": {"include_usage": True}})
            next(ev)
            out = [next(ev)]
            started.wait(60)
            out += list(ev)
            got[i] = out

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first token
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        refused = request(port, "POST", "/v1/completions", {"prompt": "late", "max_tokens": 2})
        health = request(port, "GET", "/health")
        for t in threads:
            t.join(180)
        rc = proc.wait(150)
        assert rc == 0, proc.stdout.read()
        assert time.monotonic() - t0 < 120 + 10
    assert_error(refused, 503)
    assert refused[1].get("retry-after") or refused[1].get("Retry-After")
    assert health[0] == 503
    for out in got:
        assert out is not None and out[-1] == "[DONE]" and out[-2]["usage"]["completion_tokens"] == tokens
        assert out[-3]["choices"][0]["finish_reason"] == "length"


def test_health_and_generation_refuse_while_loading_or_after_a_failed_load():
    from fiddler.server.app import ServerState
    from fiddler.server.protocol import APIError

    def failing():
        raise OSError("no such checkpoint")

    st = ServerState(failing, "m")
    with pytest.raises(APIError) as e:
        st.check_serving()
    assert e.value.status == 503 and "loading" in e.value.message and e.value.headers["Retry-After"]
    st.load()
    with pytest.raises(APIError, match="failed to load: OSError: no such checkpoint"):
        st.check_serving()
    st.draining = True
    with pytest.raises(APIError, match="draining"):
        st.check_serving()


def test_a_full_queue_answers_503_with_retry_after_and_the_server_keeps_serving():
    with running_server("--slots", "1", "--max-queue", "0", "--max-seq-len", "512") as (_, port):
        events = stream(port, "/v1/completions", {"prompt": [5, 9], "max_tokens": 400, "temperature": 0,
                                                  "ignore_eos": True})
        conn = next(events)
        next(events)  # the one slot is busy, and nothing may wait
        full = request(port, "POST", "/v1/completions", {"prompt": "more", "max_tokens": 2})
        assert_error(full, 503)
        assert full[1].get("retry-after") or full[1].get("Retry-After")
        rest = list(events)
        conn.close()
        assert rest[-1] == "[DONE]"
        st, _, body = request(port, "POST", "/v1/completions", {"prompt": "now", "max_tokens": 2})
        assert st == 200 and body["usage"]["completion_tokens"] == 2
