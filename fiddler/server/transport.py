"""uvicorn's HTTP/1.1 protocol (h11) with the bounds it lacks: a request's headers must arrive within
header_timeout_s of the connection (or of its first byte, on a kept-alive connection), its body within
body_timeout_s of the headers, and at most max_connections are open at once (one more is closed at once).
uvicorn itself bounds only the idle time between kept-alive requests and the headers' size
(h11_max_incomplete_event_size); a client that opens connections and sends half a request kept them open
for good. Imports uvicorn: only the server's command line uses this module."""

from __future__ import annotations

from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 512
    max_header_bytes: int = 32 << 10
    keep_alive_s: float = 5.0


def bounded_h11(limits: ConnectionLimits) -> type:
    """An H11Protocol class that enforces `limits` (uvicorn.Config(http=...) takes the class)."""

    class BoundedH11(H11Protocol):
        _timer = None
        _reading_body = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.transport.close()  # refused before a byte is read: a flood holds no more than the limit
                return
            self._arm(limits.header_timeout_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if not self._reading_body:  # the headers are in: the body's deadline starts
                    self._reading_body = True
                    self._arm(limits.body_timeout_s)
            elif state is h11.IDLE:
                if self._timer is None:  # part of the next request's headers on a kept-alive connection
                    self._arm(limits.header_timeout_s)
            else:  # the request is in (the app has it), or the connection is done
                self._reading_body = False
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedH11


def uvicorn_kwargs(limits: ConnectionLimits) -> dict:
    """uvicorn.Config's arguments for these limits."""
    return {"http": bounded_h11(limits), "h11_max_incomplete_event_size": limits.max_header_bytes,
            "timeout_keep_alive": limits.keep_alive_s}
