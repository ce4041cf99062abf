"""Callbacks due at given times, on one event-loop timer instead of a timer each.

Every chunk sent gets a late check (and, with hedging, a hedge check) a fraction of a second
later; almost all of them find the chunk answered long before. An event-loop timer per check is an
allocation, a timer-heap insertion and a callback run per chunk; here a check is one entry in a
Python heap, and the loop's single timer is moved only when a check is due sooner than it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

__all__ = ["Timeline"]

log = logging.getLogger("distill.reader")


class Timeline:
    """Lives on one event loop (the one running when `call_later` is first called); `close` drops
    every pending callback."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()  # ties keep the order of scheduling; callbacks are never compared
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` in `delay` seconds (event loop thread)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        when = loop.time() + delay
        heapq.heappush(self._heap, (when, next(self._order), fn, args))
        if when < self._armed_at:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = loop.call_at(when, self._fire)
        self._armed_at = when

    def _fire(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        loop = self._loop
        assert loop is not None
        heap = self._heap
        now = loop.time() + 0.001  # the loop's clock ticks in milliseconds: what is due within one is due
        try:
            while heap and heap[0][0] <= now:
                _, _, fn, args = heapq.heappop(heap)
                try:
                    fn(*args)
                except Exception:  # one check's failure must not stop the others (as with loop timers)
                    log.exception("a scheduled reader check failed")
        finally:
            if heap and heap[0][0] < self._armed_at:
                self._arm(loop, heap[0][0])

    def __len__(self) -> int:
        return len(self._heap)

    def close(self) -> None:
        """Drop every pending callback and the loop's timer (they hold the engine's parts)."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._armed_at = math.inf
        self._heap.clear()
