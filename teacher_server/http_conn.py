"""The HTTP listener's bound on connections: at most --http-max-connections held at once.

aiohttp holds every connection it accepts for as long as the client keeps it (3,000 clients
trickling one byte every 10 s held 3,000 descriptors, and with a common 1,024-descriptor limit a
few more would lock every new client out, gRPC's included). Here the listener's protocol factory
counts aiohttp's live connections: one beyond the cap gets a ready-made 503 (``Retry-After: 1``,
``Connection: close``) and is closed, without a request handler, a parser or a log line per
connection; the connections already held are served on. Idle connections and slow bodies are
bounded by --http-idle-timeout and --http-request-timeout (`HTTPFrontEnd`, `http_body`), so held
connections are also given back.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import cast

from aiohttp import web

from teacher_server.http_codec import error_body

__all__ = ["listen"]

log = logging.getLogger(__name__)
BUSY_LINGER_S = 1.0  # how long a refused connection stays open for its client to read the 503


def busy_response(cap: int) -> bytes:
    body = error_body(f"the teacher holds its --http-max-connections ({cap}) HTTP connections; retry "
                      "shortly or on another teacher")
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _Busy(asyncio.Protocol):
    """One connection over the cap: the 503 at once, then closed (after a short linger, so the
    client reads the answer rather than a reset caused by the request bytes it is still sending)."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._closer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport instance: uvloop's (the CLI's
        # loop) are their own classes with the same methods, so no isinstance check here.
        stream = cast(asyncio.Transport, transport)
        stream.write(self._answer)
        if stream.can_write_eof():
            stream.write_eof()
        self._closer = asyncio.get_running_loop().call_later(BUSY_LINGER_S, stream.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it is refused whatever it says

    def connection_lost(self, exc: Exception | None) -> None:
        if self._closer is not None:
            self._closer.cancel()


class _HeadDeadline(asyncio.Protocol):
    """aiohttp's request handler for one connection, closed unless its first request head (up to the
    blank line) arrives within `timeout_s` of connecting. Everything is passed through unchanged."""

    def __init__(self, handler: asyncio.Protocol, timeout_s: float) -> None:
        self._handler = handler
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for a blank line split across reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, transport.close)
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            if b"\r\n\r\n" in self._tail + data[:3] or b"\r\n\r\n" in data:
                self._disarm()
            else:
                self._tail = (self._tail + data)[-3:] if len(data) < 3 else data[-3:]
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def listen(runner: web.AppRunner, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 max_connections: int, *, head_timeout_s: float) -> asyncio.Server:
    """Serve `runner`'s application on host:port, holding at most `max_connections` connections,
    each closed unless its first request's head arrives within `head_timeout_s`."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    answer = busy_response(max_connections)
    refused = 0

    def protocol() -> asyncio.BaseProtocol:
        nonlocal refused
        if len(server.connections) >= max_connections:
            refused += 1
            if refused == 1 or refused % 1000 == 0:  # a flood of them is one line per thousand
                log.warning("HTTP connection refused with 503: --http-max-connections (%d) held (%d refused so "
                            "far)", max_connections, refused)
            return _Busy(answer)
        return _HeadDeadline(server(), head_timeout_s)

    return await asyncio.get_running_loop().create_server(protocol, host, port, ssl=ssl_context,
                                                          reuse_port=False)
