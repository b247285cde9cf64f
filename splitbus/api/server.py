"""uvicorn's HTTP protocol with a deadline and a size bound on request headers (slow-loris).

uvicorn has no timeout for receiving a request: ``timeout_keep_alive`` covers only the idle
time between requests and is cancelled by the first byte that arrives (the first line of
``data_received``), and a new connection that sends nothing has no timer at all. A client that
opens connections and sends nothing, or one header byte at a time, holds them for good; ASGI
middleware cannot help, as it runs only once the headers are complete. So the protocol itself
arms a timer when a connection opens and when a request begins, and disarms it when the
headers are complete. The body has its own deadline in the app (408, splitbus/api/routes.py),
but only a route that reads the body enforces it: a 401, a 404 or ``/health`` answer without
reading, and a client could then drip the body it declared for good. So the protocol also arms
a body timer when the headers are complete (the app's deadline plus a grace, so the app's 408
goes out first where it reads) and disarms it when the message is complete. A response, however
long it streams, has no deadline.

Each close is counted (``splitbus_api_connections_closed_total{reason}``) and said in a WARNING at
most every ``CLOSES_LOG_EVERY_S``, with the count since the last: for the client such a close is a
reset with no response (openai's ``APIConnectionError``), and a legitimate client on a host too
loaded to send its request within the deadline looked exactly like one that was not served (a
benchmark client starved of CPU lost 64-124 of 200 requests this way, with nothing logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from splitbus.api import metrics

log = logging.getLogger(__name__)

BODY_GRACE_S = 2.0
"""How long past the app's body deadline the protocol waits before closing the connection."""
TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_BUSY_BODY = (
    b'{"error":{"message":"this API process holds as many connections as it serves (--max-connections); retry",'
    b'"type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}}'
)
TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    + f"content-length: {len(_BUSY_BODY)}\r\nconnection: close\r\n\r\n".encode()
    + _BUSY_BODY
)
CLOSES_LOG_EVERY_S = 10.0
"""The closes of one reason are logged at most this often (a slow-loris client opens thousands)."""


class _Closes:
    """The closes the guard made, per reason: counted, and logged in batches."""

    def __init__(self) -> None:
        self.unlogged: dict[str, int] = {}
        self.logged_at: dict[str, float] = {}

    def add(self, reason: str, why: str) -> None:
        metrics.CONNECTIONS_CLOSED.labels(reason).inc()
        self.unlogged[reason] = self.unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self.logged_at.get(reason, -CLOSES_LOG_EVERY_S) >= CLOSES_LOG_EVERY_S:
            count, self.unlogged[reason], self.logged_at[reason] = self.unlogged[reason], 0, now
            log.warning("closed %d connection%s %s; clients see a reset", count, "" if count == 1 else "s", why)


CLOSES = _Closes()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose request line and headers must arrive within ``header_timeout_s``
    and ``max_header_bytes``; otherwise the connection is closed (431 for the size)."""

    header_timeout_s = 10.0
    max_header_bytes = 64 * 1024
    body_timeout_s = 30.0 + BODY_GRACE_S
    max_connections = 16384
    open_connections = 0
    """Connections open in this process now (every instance counts itself in)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._refused = False
        self._counted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        GuardedHttpToolsProtocol.open_connections += 1
        self._counted = True
        if GuardedHttpToolsProtocol.open_connections > self.max_connections:
            self._refuse(TOO_MANY, "too_many_connections", f"over --max-connections {self.max_connections} (429)")
            return
        self._arm()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        if self._counted:
            GuardedHttpToolsProtocol.open_connections -= 1
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what a refused client still sends is dropped until the connection closes
        waiting = self._head_timer is not None
        super().data_received(data)
        if waiting and self._head_timer is not None:  # the headers are still incomplete
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(
                    TOO_LARGE, "header_too_large", f"whose headers went over {self.max_header_bytes} bytes (431)"
                )

    def _refuse(self, response: bytes, reason: str, why: str) -> None:
        """An error response, then a lingering close: end our side (FIN) and drop what still
        comes for a second, so the client reads the response instead of a reset from closing on
        unread data."""
        self._disarm()
        self._refused = True
        CLOSES.add(reason, why)
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a keep-alive connection's next request
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        # httptools calls on_message_complete right after this for a request without a body
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm_body()
        super().on_message_complete()

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            CLOSES.add("body_timeout", f"whose body did not arrive within {self.body_timeout_s:g}s")
            self.transport.close()

    def _arm(self) -> None:
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            CLOSES.add(
                "header_timeout", f"that sent no complete headers within {self.header_timeout_s:g}s (--header-timeout)"
            )
            self.transport.close()


def guarded_protocol(
    header_timeout_s: float, max_header_bytes: int, body_timeout_s: float, max_connections: int = 16384
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to pass as uvicorn's ``http``, with these bounds (``body_timeout_s``:
    the app's own body deadline, which the protocol's trails by ``BODY_GRACE_S``)."""
    bounds = {
        "header_timeout_s": header_timeout_s,
        "max_header_bytes": max_header_bytes,
        "body_timeout_s": body_timeout_s + BODY_GRACE_S,
        "max_connections": max_connections,
    }
    return type("GuardedHttpTools", (GuardedHttpToolsProtocol,), bounds)
