"""What every request must pass before a route sees it (a pure ASGI middleware, so streamed responses and
disconnects pass through untouched): a Host that names this server, no foreign Origin, the API key where the
server has one (every route but /health), POST bodies declared as application/json and no larger than the
body limit.

Why: any web page can make a browser POST to 127.0.0.1:8000, and a DNS-rebinding page can read the answers
(its own name resolving to 127.0.0.1, so Host carries that name); an IP-literal or localhost Host cannot be
rebound, so those always pass. A browser sends Origin with every cross-origin POST; the server's own origin is
the one its Host names. A JSON Content-Type is not a "simple" one, so a browser must ask first (CORS preflight),
which this server never grants. The body limit bounds what one request can make the server hold and parse.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from .protocol import APIError

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a full context of text, JSON-escaped, is far below this


@dataclass(frozen=True)
class Limits:
    """max_body_bytes: the largest request body; allowed_hosts: Host names served besides IP literals and
    localhost ("*": any); allowed_origins: browser origins allowed besides the server's own ("*": any);
    api_key: the key every route but /health needs as `Authorization: Bearer <key>` (None: none; never
    printed: it is left out of repr)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)


OPEN_PATHS = ("/health",)  # answered without the API key: a load balancer's or a supervisor's probe


def key_accepted(authorization: str, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, given = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _hostname(authority: str) -> str:
    """The host of a Host header or an origin's netloc, without its port ("[::1]:8000" -> "::1")."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def host_allowed(host: str, limits: Limits) -> bool:
    name = _hostname(host).lower().rstrip(".")
    if "*" in limits.allowed_hosts or name == "localhost" or name in limits.allowed_hosts:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def origin_allowed(origin: str, host: str, limits: Limits) -> bool:
    if "*" in limits.allowed_origins or origin in limits.allowed_origins:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host.lower()


def check(method: str, headers: dict[str, str], limits: Limits, path: str = "") -> None:
    """Raise the APIError a request's headers earn, if any."""
    host = headers.get("host", "")
    if host and not host_allowed(host, limits):
        raise APIError(403, f"Host {host!r} is not this server's (start it with --allowed-hosts to serve that name)",
                       "invalid_request_error", "host_not_allowed")
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(origin, host, limits):
        raise APIError(403, f"Origin {origin!r} is not allowed (start the server with --allowed-origins to allow it)",
                       "invalid_request_error", "origin_not_allowed")
    if limits.api_key is not None and path not in OPEN_PATHS and \
            not key_accepted(headers.get("authorization", ""), limits.api_key):
        raise APIError(401, "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                       "invalid_request_error", "invalid_api_key")
    if method == "POST":
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise APIError(415, f"POST needs Content-Type: application/json, got {media or 'none'!r}",
                           "invalid_request_error", "unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limits.max_body_bytes:
            raise too_large(limits)


def too_large(limits: Limits) -> APIError:
    return APIError(413, f"the request body exceeds {limits.max_body_bytes} bytes (--max-body-bytes)",
                    "invalid_request_error", "request_too_large")


class Guard:
    """ASGI middleware: refuses what `check` refuses (an OpenAI-shaped error, reported to on_error), and
    makes reading more than max_body_bytes of a body raise the 413 APIError (for bodies without a length)."""

    def __init__(self, app, limits: Limits, on_error: Callable[[str, APIError], None]):
        self.app, self.limits, self.on_error = app, limits, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            check(scope["method"], headers, self.limits, scope["path"])
        except APIError as e:
            self.on_error(scope["path"], e)
            body = json.dumps(e.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            await send({"type": "http.response.start", "status": e.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limits.max_body_bytes:
                    raise too_large(self.limits)
            return message

        await self.app(scope, bounded_receive, send)
