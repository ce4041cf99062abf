"""Small asyncio helpers of the autoscaler (not public API)."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

_T = TypeVar("_T")


async def bounded(aw: Awaitable[_T], timeout: float) -> _T:
    """Await ``aw`` for at most ``timeout`` seconds (``TimeoutError`` after that).

    ``asyncio.timeout`` where it exists: before Python 3.12, ``asyncio.wait_for`` can drop a
    cancellation that arrives as the awaited call completes, and a lost cancellation hangs close().
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover - Python 3.10


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has finished, without raising its outcome here.

    The cancellation is repeated every second, so that library code which swallows one cannot make
    shutdown hang.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=1.0)


def describe(e: BaseException) -> str:
    """``Type: message`` for a log line (gRPC errors as ``CODE: details``)."""
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"
        except Exception:  # not a grpc error after all
            pass
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Backoff:
    """Exponential backoff with +-20 % jitter: ``initial`` seconds, doubling up to ``cap``."""

    def __init__(self, initial: float = 0.2, cap: float = 5.0) -> None:
        self.initial, self.cap = float(initial), float(cap)
        self._next = self.initial

    def reset(self) -> None:
        self._next = self.initial

    def next_delay(self) -> float:
        delay, self._next = self._next, min(self.cap, self._next * 2)
        return delay * random.uniform(0.8, 1.2)


class StateLog:
    """Log only when the described state changes: a controller that cannot reach etcd for an hour
    says so once, and once more when it can again."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self.state: str | None = None

    def change(self, state: str, level: int, msg: str, *args: object) -> bool:
        if state == self.state:
            return False
        self.state = state
        self._logger.log(level, msg, *args, stacklevel=2)
        return True
