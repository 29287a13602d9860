"""What a client may send the server (issue 55): Host, Origin and Content-Type checks (fiddler.server.guard), the
connection bounds uvicorn lacks (fiddler.server.transport: header and body deadlines, a connection limit, the
header-size limit) and the warning on a non-loopback bind. The transport's tests run uvicorn on a thread with a
trivial app (no model); the checks' tests run the real server. All on 127.0.0.1, every server stopped, bounded
in time; no assertion on how long anything took beyond generous correctness bounds."""

from __future__ import annotations

import select
import socket
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fiddler.server.guard import Limits, check, host_allowed, origin_allowed  # noqa: E402
from fiddler.server.protocol import APIError  # noqa: E402
from tests.server_helpers import assert_error, free_port, request, running_server  # noqa: E402

WAIT_S = 60


def test_hosts_that_cannot_be_rebound_pass_and_names_need_allowing():
    lim = Limits()
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "10.1.2.3", "LOCALHOST", "[fe80::1]"):
        assert host_allowed(host, lim), host
    for host in ("evil.example:8000", "attacker.test", "localhost.evil.example"):
        assert not host_allowed(host, lim), host
    assert host_allowed("box.lan:8000", Limits(allowed_hosts=("box.lan",)))
    assert host_allowed("any.name", Limits(allowed_hosts=("*",)))


def test_only_the_servers_own_origin_or_an_allowed_one_passes():
    lim = Limits()
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", lim)
    assert not origin_allowed("http://127.0.0.1:3000", "127.0.0.1:8000", lim)  # another local page
    assert not origin_allowed("https://evil.example", "127.0.0.1:8000", lim)
    assert not origin_allowed("null", "127.0.0.1:8000", lim)
    assert origin_allowed("https://ui.example", "127.0.0.1:8000", Limits(allowed_origins=("https://ui.example",)))


@pytest.mark.parametrize("headers,status,code", [
    ({"host": "127.0.0.1:1", "content-type": "application/json"}, None, None),
    ({"host": "127.0.0.1:1", "content-type": "Application/JSON; charset=utf-8"}, None, None),
    ({"host": "127.0.0.1:1"}, 415, "unsupported_media_type"),
    ({"host": "127.0.0.1:1", "content-type": "text/plain"}, 415, "unsupported_media_type"),
    ({"host": "127.0.0.1:1", "content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
    ({"host": "rebound.example:1", "content-type": "application/json"}, 403, "host_not_allowed"),
    ({"host": "127.0.0.1:1", "origin": "http://evil.example", "content-type": "application/json"}, 403,
     "origin_not_allowed"),
    ({"host": "127.0.0.1:1", "content-type": "application/json", "content-length": str(5 << 20)}, 413,
     "request_too_large"),
])
def test_check_refuses_what_a_browser_or_a_flood_would_send(headers, status, code):
    if status is None:
        check("POST", headers, Limits())
        return
    with pytest.raises(APIError) as e:
        check("POST", headers, Limits())
    assert (e.value.status, e.value.code) == (status, code)


def test_a_non_loopback_bind_is_warned_about():
    from fiddler.server.__main__ import bind_warning

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert bind_warning(host) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert "not a loopback address" in bind_warning(host), host


def test_the_real_server_refuses_foreign_hosts_origins_and_media_types():
    with running_server("--slots", "2", "--max-seq-len", "256", "--allowed-origins", "https://ui.example") as (_, p):
        body = b'{"prompt": "hi", "max_tokens": 2}'
        assert_error(request(p, "POST", "/v1/completions", raw=body, headers={}), 415, "unsupported_media_type")
        assert_error(request(p, "POST", "/v1/completions", raw=body, headers={"Content-Type": "text/plain"}), 415)
        assert_error(request(p, "POST", "/v1/completions", raw=body,
                             headers={"Content-Type": "application/json", "Host": "rebound.example"}), 403,
                     "host_not_allowed")
        assert_error(request(p, "GET", "/metrics", headers={"Host": "rebound.example"}), 403, "host_not_allowed")
        assert_error(request(p, "POST", "/v1/completions", raw=body,
                             headers={"Content-Type": "application/json", "Origin": "http://evil.example"}), 403,
                     "origin_not_allowed")
        for headers in ({"Content-Type": "application/json; charset=utf-8", "Host": f"localhost:{p}"},
                        {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{p}"},
                        {"Content-Type": "application/json", "Origin": "https://ui.example"}):
            assert request(p, "POST", "/v1/completions", raw=body, headers=headers)[0] == 200, headers
        m = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
             for line in request(p, "GET", "/metrics")[2].splitlines() if line and not line.startswith("#")}
        assert m['fiddler_requests_total{route="completions",outcome="error_415"}'] == 2
        assert m['fiddler_requests_total{route="completions",outcome="error_403"}'] == 2
        assert m['fiddler_requests_total{route="other",outcome="error_403"}'] == 1


# ---------------------------------------------------------------- the transport's bounds, on a trivial app

async def _ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def bounded_uvicorn(**limits):
    import uvicorn

    from fiddler.server.transport import ConnectionLimits, uvicorn_kwargs

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_ok_app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off", **uvicorn_kwargs(ConnectionLimits(**limits))))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + WAIT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < end, "uvicorn did not start"
            time.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        thread.join(WAIT_S)


def closed_by_server(s: socket.socket) -> bool:
    """True once the server has closed this connection (EOF or reset), without blocking."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1 << 16) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def wait_all_closed(socks, timeout: float = WAIT_S) -> None:
    end, open_ = time.monotonic() + timeout, list(socks)
    while open_:
        open_ = [s for s in open_ if not closed_by_server(s)]
        assert time.monotonic() < end, f"{len(open_)} of {len(socks)} connections still open after {timeout} s"
        time.sleep(0.05)


def get_ok(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    return answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")


@pytest.mark.realtime
def test_half_open_connections_are_closed_and_a_normal_request_still_answers():
    with bounded_uvicorn(header_timeout_s=1.0, body_timeout_s=1.0) as port:
        socks = []
        try:
            for i in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
                if i % 3 == 1:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never end
                elif i % 3 == 2:  # the body never comes
                    s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"pro")
                socks.append(s)
            assert get_ok(port)
            wait_all_closed(socks)
            assert get_ok(port)
        finally:
            for s in socks:
                s.close()


@pytest.mark.realtime
def test_connections_beyond_the_limit_are_closed_at_once():
    with bounded_uvicorn(header_timeout_s=WAIT_S * 2, max_connections=5) as port:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(5)]
        try:
            extra = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
            wait_all_closed([extra])
            assert not any(closed_by_server(s) for s in socks)  # their header deadline is far away
        finally:
            for s in socks:
                s.close()
        wait_until_served = time.monotonic() + WAIT_S
        while not get_ok(port):  # the slots free up as the server sees the closes
            assert time.monotonic() < wait_until_served
            time.sleep(0.05)


def test_oversized_headers_are_refused():
    with bounded_uvicorn(max_header_bytes=8 << 10) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
            answer = b""
            try:
                while chunk := s.recv(4096):
                    answer += chunk
            except ConnectionResetError:
                pass
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        assert get_ok(port)


def test_the_api_key_check():
    from fiddler.server.guard import key_accepted

    lim = Limits(api_key="s3cret")
    ok = {"host": "127.0.0.1:1", "content-type": "application/json"}
    check("POST", {**ok, "authorization": "Bearer s3cret"}, lim, "/v1/completions")
    check("GET", {"host": "127.0.0.1:1"}, lim, "/health")  # open: a probe needs no key
    for auth in (None, "Bearer wrong", "Basic s3cret", "Bearer", "s3cret"):
        with pytest.raises(APIError) as e:
            check("POST", {**ok, **({"authorization": auth} if auth else {})}, lim, "/v1/completions")
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")
    with pytest.raises(APIError):
        check("GET", {"host": "127.0.0.1:1"}, lim, "/metrics")
    assert key_accepted("bearer  s3cret ", "s3cret") and "s3cret" not in repr(lim)


@pytest.mark.slow
def test_a_server_with_an_api_key_answers_401_without_it_and_never_logs_it(monkeypatch):
    from tests.server_helpers import request, running_server

    key = "k-" + "7f3a9c" * 4
    monkeypatch.setenv("FIDDLER_API_KEY", key)
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    with running_server("--host", "127.0.0.1") as (proc, port):
        assert request(port, "POST", "/v1/completions", body)[0] == 401
        status, _h, err = request(port, "POST", "/v1/completions", body,
                                  headers={"Content-Type": "application/json", "Authorization": "Bearer nope"})
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        auth = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        status, _h, out = request(port, "POST", "/v1/completions", body, headers=auth)
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        assert request(port, "GET", "/health")[0] == 200
        assert request(port, "GET", "/v1/models")[0] == 401
        assert request(port, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == 200
    log = proc.stdout.read()
    assert "serving" in log and key not in log  # the server's own lines, without the key
