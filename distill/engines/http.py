"""One HTTP connection pool to one engine, and what its answers mean as the mesh's call verdicts.

An engine (vLLM, SGLang) speaks JSON over HTTP, not KServe v2 over gRPC. The routing, hedging,
failover and exactly-once logic of the reader read only the type of the error a call ends with
(`distill.call_errors`), so each HTTP outcome maps to the verdict the gRPC client gives for the
same situation:
  400, 422                  RequestRejectedError (INVALID_ARGUMENT): the engine refused this input
  429, 503                  TeacherOverloadedError (RESOURCE_EXHAUSTED): back off, never eject
  401, 403                  TeacherRefusedError (UNAUTHENTICATED / PERMISSION_DENIED)
  404                       TeacherCallError NOT_FOUND (a wrong path prefix or model name)
  other statuses            TeacherCallError INTERNAL (5xx) or UNKNOWN
  refused, reset, closed    TeacherCallError UNAVAILABLE (a request that failed on a pooled connection
                            before any answer is first sent once more, on a new one)
  past the deadline         TeacherCallError DEADLINE_EXCEEDED
  a call after close()      TeacherGoneError
The engine's own message (`{"error": {"message": ...}}`, or its text) is carried as the details.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import msgspec
import orjson

from distill.call_errors import (
    MalformedAnswerError,
    RequestRejectedError,
    TeacherCallError,
    TeacherGoneError,
    TeacherOverloadedError,
    TeacherRefusedError,
)
from distill.config import ClientTLS

__all__ = ["EngineHTTP", "http_error", "parse_json", "ssl_context", "typed_json"]

MAX_DETAILS = 2000
KEEPALIVE_S = 4.0
"""How long an idle pooled connection is kept: shorter than the servers' own idle timeouts (uvicorn's,
under vLLM and SGLang, is 5 s), so the pool seldom offers a connection the server has closed."""


class _StaleConnectionError(Exception):
    """A request failed on a pooled connection before any answer: the server closed it while idle."""
"""How much of an engine's error message a verdict carries."""


def ssl_context(tls: ClientTLS | None, registered_tls: bool) -> ssl.SSLContext | None:
    """The TLS settings towards an engine: the reader's CA and client certificate when it has TLS
    settings, the system's roots when only the record says TLS, None for plain HTTP."""
    if tls is None:
        return ssl.create_default_context() if registered_tls else None
    context = ssl.create_default_context(cafile=tls.ca)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context


def parse_json(raw: bytes) -> Any:
    """An engine's JSON answer as Python objects. orjson first: an answer holds a map of top-k
    log-probs for every scored token and is parsed on the reader's or the gateway's event loop,
    where the standard library's parser costs the engine's own cores on a shared machine. Servers
    written in Python may send `NaN` and `Infinity` (a model's non-finite log-prob), which strict
    JSON and orjson refuse: such a body is read by the standard library, which takes them.
    ValueError when neither can."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def typed_json(kind: Any, layout: str) -> Callable[[bytes], Any]:
    """A reader of answer bodies straight into `kind` (msgspec structs), in one pass: only the
    fields `kind` names are built, map keys typed as ints arrive as ints, and the rest (such as the
    text an engine writes beside every top-k entry) is skipped unread. A body with `NaN` or
    `Infinity`, which strict parsers refuse, is read by the standard library (as `parse_json` reads
    it after orjson has refused it) and converted. MalformedAnswerError naming the JSON path
    when a body does not have `layout` (e.g. "vLLM's layout"); ValueError when it is not JSON."""
    decoder = msgspec.json.Decoder(kind)

    def read(raw: bytes) -> Any:
        try:
            return decoder.decode(raw)
        except msgspec.ValidationError as e:
            raise MalformedAnswerError(f"the answer does not have {layout}: {e}") from None
        except msgspec.DecodeError:
            pass
        try:
            return msgspec.convert(json.loads(raw), kind, str_keys=True)
        except msgspec.ValidationError as e:
            raise MalformedAnswerError(f"the answer does not have {layout}: {e}") from None

    return read


def _details(status: int, text: str) -> str:
    """The engine's message from an error body: OpenAI's `{"error": {"message"}}`, FastAPI's
    `{"detail"}`, `{"error": "..."}` or `{"message"}`, else the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    message: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or body.get("detail") or body.get("message")
    if not message:
        message = text.strip() or f"HTTP {status}"
    return str(message)[:MAX_DETAILS]


def http_error(status: int, text: str, what: str) -> TeacherCallError:
    """The verdict for an engine's answer with HTTP `status` and body `text` to call `what`."""
    details = _details(status, text)
    if status in (400, 422):
        return RequestRejectedError(grpc.StatusCode.INVALID_ARGUMENT, details)
    if status in (429, 503):
        return TeacherOverloadedError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"HTTP {status}: {details}")
    if status in (401, 403):
        code = grpc.StatusCode.UNAUTHENTICATED if status == 401 else grpc.StatusCode.PERMISSION_DENIED
        return TeacherRefusedError(code, f"HTTP {status}: {details}", what)
    if status == 404:
        return TeacherCallError(grpc.StatusCode.NOT_FOUND, f"HTTP 404 for {what}: {details} (check the engine's "
                                                           "path prefix and model name)")
    code = grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.UNKNOWN
    return TeacherCallError(code, f"HTTP {status}: {details}")


class EngineHTTP:
    """The connection pool to one engine at `base` (`http[s]://host:port[/prefix]`); every call has
    a deadline and ends with a JSON body or a verdict (module docstring). The session is made on
    the first call, on the event loop that uses it, and closed by `close()`."""

    def __init__(self, base: str, ssl_ctx: ssl.SSLContext | None = None, server_name: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.base = base.rstrip("/")
        self._ssl: ssl.SSLContext | bool = ssl_ctx if ssl_ctx is not None else False
        self._server_name = server_name
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise TeacherGoneError(f"the client of {self.base} was closed: the teacher left")
        if self._session is None:
            # One pool per engine; no overall limit: the router bounds the calls in flight.
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                                  json_serialize=lambda o: json.dumps(o, separators=(",", ":")))
        return self._session

    async def call(self, method: str, route: str, timeout: float, body: Any = None,
                   decode: Callable[[bytes], Any] = parse_json) -> Any:
        """`method` `route` with JSON `body`; a 2xx's body read by `decode` (JSON into Python objects
        unless told otherwise; a ValueError from it is a MalformedAnswerError), else a verdict.

        A pooled connection the server closed while idle fails the next request before any answer
        (the server never saw it): that request is sent once more on a new connection, within the
        same deadline. Every call here is a scoring or a read, so sending it again is harmless."""
        deadline = time.monotonic() + timeout
        try:
            return await self._call(method, route, timeout, body, decode)
        except _StaleConnectionError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"{method} {self.base}{route} did not answer within {timeout:g} s") from None
            try:
                return await self._call(method, route, left, body, decode)
            except _StaleConnectionError:
                raise TeacherCallError(grpc.StatusCode.UNAVAILABLE,
                                       f"{self.base}{route} dropped the connection twice: {e}") from None

    async def _call(self, method: str, route: str, timeout: float, body: Any,
                    decode: Callable[[bytes], Any]) -> Any:
        session = self._open()
        url = self.base + route
        extra: dict[str, Any] = {"server_hostname": self._server_name} if self._server_name else {}
        answered = False
        try:
            async with session.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout),
                                       **extra) as resp:
                answered = True
                raw = await resp.read()
                if resp.status >= 300:
                    raise http_error(resp.status, raw.decode(errors="replace"), f"{method} {route}")
        except (TimeoutError, asyncio.TimeoutError):
            raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{method} {url} did not answer within {timeout:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {url}: {e}") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as e:
            if not answered and not isinstance(e, aiohttp.ClientPayloadError):
                raise _StaleConnectionError(str(e)) from None
            raise TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"{url} dropped the connection: {e}") from None
        except RuntimeError as e:  # the session was closed under the call
            if self._closed:
                raise TeacherGoneError(f"the client of {self.base} was closed: the teacher left") from None
            raise TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"{url}: {e}") from None
        except aiohttp.ClientError as e:
            raise TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"{url}: {e}") from None
        try:
            return decode(raw)
        except MalformedAnswerError:
            raise
        except ValueError:
            raise MalformedAnswerError(f"{method} {url} answered {len(raw)} bytes that are not JSON: "
                                       f"{raw[:200]!r}") from None

    async def healthy(self, route: str, timeout: float) -> bool:
        """Whether GET `route` answers 2xx; a refused or dropped connection raises TeacherCallError."""
        session = self._open()
        extra: dict[str, Any] = {"server_hostname": self._server_name} if self._server_name else {}
        try:
            async with session.get(self.base + route, timeout=aiohttp.ClientTimeout(total=timeout), **extra) as resp:
                await resp.read()
                return resp.status < 300
        except (TimeoutError, asyncio.TimeoutError):
            raise TeacherCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"GET {self.base}{route} did not answer within {timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise TeacherCallError(grpc.StatusCode.UNAVAILABLE, f"{self.base}{route}: {e}") from None

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
