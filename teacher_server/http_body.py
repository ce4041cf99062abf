"""Reading an HTTP request body without letting one client stall the teacher.

A body is bounded on the wire by --max-message-mb (413 beyond it). A compressed body
(``Content-Encoding: gzip`` or ``deflate``) is inflated here, not by aiohttp (whose parser would
inflate on the event loop): on a worker thread, in slices of ``INFLATE_SLICE``, the size checked
as it grows, so a "decompression bomb" (1.5 MB on the wire, 1.5 GB inflated) costs at most
--max-message-mb of work and memory, off the loop, before its 413. The expansion is bounded too:
past ``INFLATE_FLOOR`` a body may inflate to at most ``MAX_INFLATE_RATIO`` times its wire size
(real tensors and JSON compress far less than that; a bomb is refused after a fraction of the
limit's work). At most ``INFLATE_WORKERS`` bodies inflate at once; the others wait their turn
without holding the loop. A body must arrive within --http-request-timeout (408 beyond it).

Every route that takes a body reads it through a `BodyReader` (the KServe v2 routes and any later
ones), so all get the same bounds.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from discovery.aio import deadline

__all__ = ["BodyReader", "BodyRefused", "inflate"]

INFLATE_SLICE = 1 << 20  # bytes inflated per step, the size checked after each
INFLATE_FLOOR = 16 << 20  # bodies inflating to this much are never refused for their ratio
MAX_INFLATE_RATIO = 100  # beyond the floor: inflated bytes per compressed byte
INFLATE_WORKERS = 2

# zlib's wbits: gzip (header and trailer); deflate as HTTP means it (a zlib stream), raw deflate
# taken too, as clients send both.
_GZIP, _ZLIB, _RAW = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS
_ENCODINGS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": _ZLIB}


class BodyRefused(Exception):
    """A body the teacher will not read: `status` (413, 415, 400) and a message saying what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _too_large(what: str, limit: int) -> BodyRefused:
    return BodyRefused(413, f"request body of {what} exceeds --max-message-mb ({limit} bytes); "
                            "send smaller batches or raise --max-message-mb on the teacher")


def inflate(data: bytes, encoding: str, limit: int, max_ratio: int = MAX_INFLATE_RATIO) -> bytes:
    """`data` inflated, refusing (BodyRefused 413) as soon as it passes `limit` bytes or, past
    ``INFLATE_FLOOR``, `max_ratio` times ``len(data)``; 400 for bytes that do not inflate.
    Blocking: call it on a worker thread (zlib lets go of the GIL while it inflates)."""
    wbits = _ENCODINGS[encoding]
    if wbits == _ZLIB and data and data[0] & 0x0F != 8:  # no zlib header: raw deflate
        wbits = _RAW
    by_ratio = max(INFLATE_FLOOR, len(data) * max_ratio)
    allowed = min(limit, by_ratio)
    out = bytearray()
    pending = data
    try:
        while pending:  # one gzip member after another (concatenated members are one gzip body)
            inflater = zlib.decompressobj(wbits)
            while pending and not inflater.eof:
                out += inflater.decompress(pending, min(INFLATE_SLICE, allowed - len(out) + 1))
                if len(out) > allowed:
                    if allowed == limit:
                        raise _too_large(f"more than {limit} bytes once inflated ({encoding})", limit)
                    raise BodyRefused(413, f"request body inflates to more than {max_ratio} times its "
                                           f"{len(data)} compressed bytes ({encoding}): refused as a "
                                           "decompression bomb; send it uncompressed")
                pending = inflater.unconsumed_tail
            if not inflater.eof:
                raise BodyRefused(400, f"request body ends inside its {encoding} stream; send the whole body")
            pending = inflater.unused_data if wbits == _GZIP else b""
    except zlib.error as e:
        raise BodyRefused(400, f"request body is not valid {encoding} ({e}); send it as "
                               "Content-Encoding says, or uncompressed") from None
    return bytes(out)


class BodyReader:
    """Reads request bodies within the bounds above; one per HTTP front end (its inflate slots)."""

    def __init__(self, max_body_bytes: int, timeout_s: float | None = None) -> None:
        self.max_body = max_body_bytes
        self.timeout_s = timeout_s  # how long a body may take to arrive (--http-request-timeout)
        self._inflating = asyncio.Semaphore(INFLATE_WORKERS)

    async def read(self, request: web.Request) -> bytes:
        """The body, inflated when it says it is compressed; BodyRefused when it is out of bounds."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "", *_ENCODINGS):
            raise BodyRefused(415, f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or "
                                   "an uncompressed body")
        size = request.content_length
        if size is not None and size > self.max_body:
            raise _too_large(f"{size} bytes", self.max_body)
        try:
            async with deadline(self.timeout_s):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large("a larger body", self.max_body) from None
        except TimeoutError:
            raise BodyRefused(408, f"request body did not arrive within --http-request-timeout ({self.timeout_s:g} s); "
                                   "send it at once, or raise --http-request-timeout on the teacher") from None
        if encoding in ("identity", ""):
            return body
        async with self._inflating:
            return await asyncio.to_thread(inflate, body, encoding, self.max_body)

