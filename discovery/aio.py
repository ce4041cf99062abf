"""Small asyncio helpers shared by discovery and the autoscaler.

Timeouts use ``asyncio.timeout`` (via :data:`deadline`), not ``asyncio.wait_for``: before Python
3.12, ``wait_for`` drops a cancellation that arrives just as the awaited call completes, and a
background task that ignores its cancellation makes ``close()`` hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

_T = TypeVar("_T")


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has finished.

    Unlike ``task.cancel(); await task``, this neither swallows a cancellation of the *calling*
    task nor raises the cancelled task's ``CancelledError`` or exception into the caller (inspect
    ``task.exception()`` afterwards if it matters). The cancellation is repeated every second:
    library code that loses a cancellation (``asyncio.wait_for`` before Python 3.12 does, when
    the awaited future completes at the same moment) must not make shutdown hang.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=1.0)


def raise_if_cancel_lost() -> None:
    """Raise ``CancelledError`` if the current task was asked to cancel and the request was lost.

    ``grpc.aio`` loses a cancellation that reaches a task in the loop turn its call's response
    arrives in: the call returns the response (or fails with an OK-status error) and the task goes
    on. A loop that runs until it is cancelled (``distill top`` until Ctrl-C) calls this after each
    RPC, or one lost Ctrl-C leaves it running for good. Not for code inside an ``except
    CancelledError`` cleanup, where the request is pending by design.
    """
    cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError()


if sys.version_info >= (3, 11):
    deadline = asyncio.timeout
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def deadline(delay: float | None) -> AsyncIterator[None]:
        """``asyncio.timeout`` for Python 3.10: raise ``TimeoutError`` after ``delay`` seconds."""
        task = asyncio.current_task()
        assert task is not None
        fired = False

        def fire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        handle = None if delay is None else asyncio.get_running_loop().call_later(max(delay, 0), fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise asyncio.TimeoutError() from None
            raise
        finally:
            if handle is not None:
                handle.cancel()


async def bounded(aw: Awaitable[_T], timeout: float) -> _T:
    """Await ``aw`` for at most ``timeout`` seconds (``TimeoutError`` after that), via :data:`deadline`."""
    async with deadline(timeout):
        return await aw


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
    """Exponential backoff with jitter: ``initial``, doubling up to ``cap`` seconds.

    Jitter (+-20 %) keeps a fleet of teachers from reconnecting in lockstep after an etcd restart.
    """

    def __init__(self, initial: float = 0.1, cap: float = 5.0, factor: float = 2.0) -> None:
        self.initial = float(initial)
        self.cap = max(float(cap), self.initial)
        self.factor = float(factor)
        self._next = self.initial

    def reset(self) -> None:
        self._next = self.initial

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * self.factor)
        return delay * random.uniform(0.8, 1.2)


class StateLog:
    """Log a message only when the state it describes changes.

    A teacher that cannot reach etcd for an hour retries hundreds of times; its log should say so
    once ("etcd unreachable, retrying") and once more when that changes ("registered again").
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self.state: str | None = None

    def change(self, state: str, level: int, msg: str, *args: object) -> bool:
        """Log ``msg`` at ``level`` if ``state`` differs from the last one; return whether it did."""
        if state == self.state:
            return False
        self.state = state
        self._logger.log(level, msg, *args, stacklevel=2)
        return True
