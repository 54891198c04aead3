"""Connection limits of the HTTP server, below the app: a deadline for a request's headers and a cap on open
connections (uvicorn has neither: a connection that sends nothing, or half its headers, was held for ever, so
idle connections alone could take every file descriptor).

`limited_protocol(base, header_timeout_s=..., max_connections=...)` subclasses uvicorn's HTTP protocol class
(h11's or httptools'; only what both have is used: connection_made, data_received, connection_lost,
on_response_complete, `cycle`, `transport`, `connections`, `loop`):

- header deadline: from the moment a connection opens, and again each time a response on it completes, the next
  request's headers must all arrive within header_timeout_s. If they do not, a connection that sent part of a
  request gets a 408 and is closed; one that sent nothing is closed (as nginx does; an idle kept-alive
  connection is closed sooner by uvicorn's keep-alive timeout). The body has its own deadline in the app
  (api_server.parse_body), which can still answer with JSON; the rest of a body no handler reads counts here,
  after its response.
- connection cap: a connection opened while max_connections are open gets a 503 and is closed at once, before
  anything is read, so the cap holds however many clients try.
"""
from __future__ import annotations

import json


def raw_error_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response (OpenAI's error JSON, `Connection: close`), for writing straight to a transport."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


def limited_protocol(base: type, *, header_timeout_s: float | None, max_connections: int | None) -> type:
    """`base` (uvicorn's HTTP protocol class) with the header deadline and the connection cap; None turns either
    off."""
    timeout_response = raw_error_response(408, "Request Timeout", f"the request's headers did not arrive within "
                                          f"{header_timeout_s:g} s" if header_timeout_s else "", "request_timeout")
    busy_response = raw_error_response(503, "Service Unavailable", f"this server has {max_connections} connections "
                                       f"open, its limit (--limit-concurrency); try again later", "too_many_connections")

    class LimitedProtocol(base):
        _refused = False
        _header_timer = None
        _bytes_since_armed = 0

        def connection_made(self, transport) -> None:
            if max_connections is not None and len(self.connections) >= max_connections:
                self._refused = True
                transport.write(busy_response)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._bytes_since_armed += len(data)
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if header_timeout_s is None:
                return
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._bytes_since_armed = 0
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_deadline)

        def _header_deadline(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if (cycle is not None and not cycle.response_complete) or self.transport.is_closing():
                return   # a request is in flight (its headers came) or the connection is closing anyway
            if self._bytes_since_armed:
                self.transport.write(timeout_response)
            self.transport.close()

    LimitedProtocol.__name__ = LimitedProtocol.__qualname__ = f"Limited{base.__name__}"
    return LimitedProtocol
