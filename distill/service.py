"""One teacher service as the dispatcher sees it: its pool of teachers and its queue of chunks."""

from __future__ import annotations

import asyncio
from collections import deque

from distill.batches import Chunk
from distill.pool import TeacherPool

__all__ = ["Service"]


class Service:
    """One teacher service: its pool of teachers and its queue of chunks (ordinary, and suspects:
    chunks a teacher refused once, sent alone)."""

    def __init__(self, pool: TeacherPool) -> None:
        self.name = pool.service
        self.pool = pool
        self.router = pool.router
        self.queue: deque[Chunk] = deque()
        self.suspects: deque[Chunk] = deque()
        self.suspect_out: Chunk | None = None  # the one suspect chunk being dispatched or in flight
        self.arrived = asyncio.Event()
        self.idle = False  # the dispatcher waits for a chunk: nothing is queued or being placed

    def push(self, chunk: Chunk, front: bool = False) -> None:
        if chunk.suspect:
            (self.suspects.appendleft if front else self.suspects.append)(chunk)
        else:
            (self.queue.appendleft if front else self.queue.append)(chunk)
        self.arrived.set()

    async def pop(self) -> Chunk:
        """The next chunk: a waiting suspect when none is out, else the oldest ordinary chunk."""
        while True:
            if self.suspects and self.suspect_out is None:
                self.suspect_out = self.suspects.popleft()
                return self.suspect_out
            if self.queue:
                return self.queue.popleft()
            self.arrived.clear()
            self.idle = True
            try:
                await self.arrived.wait()
            finally:
                self.idle = False

    def release(self, chunk: Chunk) -> None:
        """`chunk` is no longer out (answered, failed, dropped): the next suspect may go."""
        if self.suspect_out is chunk:
            self.suspect_out = None
            self.arrived.set()

    def clear(self) -> None:
        self.queue.clear()
        self.suspects.clear()
        self.suspect_out = None
