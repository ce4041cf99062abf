"""The dynamic batcher: many clients' requests become few model executions.

Requests queue in arrival order. An idle instance takes the oldest request and keeps adding
whole requests while they fit in `max_batch_size`, waiting for more at most
`max_queue_delay_us` counted from the oldest request's arrival (so a request that already
waited for a busy instance is not delayed again). Requests are never split across batches.
A request whose caller went away (deadline, cancel) before it was scheduled is dropped
unexecuted. The queue is bounded: past `max_queue_size` waiting requests, submit() refuses.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from teacher_server.instance import ModelInstance
from teacher_server.outputs import EncodedOutput
from teacher_server.work import Work

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The batcher's queue is at max_queue_size; the caller should retry elsewhere or later."""


class BatcherClosedError(Exception):
    """The batcher stopped before the request ran."""


@dataclass
class Timing:
    queue_ns: int
    compute_ns: int
    batch_size: int


@dataclass(eq=False)
class _Pending:
    work: Work
    future: asyncio.Future[tuple[list[EncodedOutput], Timing]]
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = 256
    max_queue_delay_us: int = 500
    max_queue_size: int = 512
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")


BatchListener = Callable[[int, int, int], None]
"""Called as listener(samples, requests, compute_ns) after every executed batch."""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class DynamicBatcher:
    """Schedules queued requests onto model instances; lives on one event loop."""

    def __init__(self, instances: list[ModelInstance], config: BatchingConfig) -> None:
        if not instances:
            raise ValueError("the batcher needs at least one model instance")
        self._instances = instances
        self._config = config
        self._queue: collections.deque[_Pending] = collections.deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._workers: list[asyncio.Task[None]] = []
        self._executing = 0
        self._listeners: list[BatchListener] = []
        self._closed = False

    def on_batch(self, listener: BatchListener) -> None:
        self._listeners.append(listener)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def executing(self) -> int:
        """Batches running on instances right now."""
        return self._executing

    def start(self) -> None:
        if self._workers:
            return
        self._workers = [
            asyncio.create_task(self._worker(inst), name=f"batcher-instance-{inst.index}")
            for inst in self._instances
        ]

    async def submit(self, work: Work) -> tuple[list[EncodedOutput], Timing]:
        """Queue one request and wait for its encoded outputs."""
        if self._closed:
            raise BatcherClosedError("the batcher is closed")
        if len(self._queue) >= self._config.max_queue_size:
            raise QueueFullError(
                f"queue is full ({self._config.max_queue_size} requests waiting); retry on another teacher"
            )
        pending = _Pending(work, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._wake()
        return await pending.future

    def _wake(self) -> None:
        for w in self._waiters:
            _resolve(w)
        self._waiters.clear()

    async def _wait_arrival(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        timer = None
        if timeout_s is not None:
            timer = loop.call_later(timeout_s, _resolve, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()

    def _pop_live(self) -> _Pending | None:
        while self._queue:
            p = self._queue.popleft()
            if not p.future.done():
                return p
        return None

    async def _next_batch(self) -> list[_Pending]:
        first = self._pop_live()
        while first is None:
            await self._wait_arrival(None)
            first = self._pop_live()
        batch = [first]
        if not self._config.enabled:
            return batch
        size = first.work.batch_size
        limit = self._config.max_batch_size
        deadline_ns = first.enqueued_ns + self._config.max_queue_delay_us * 1000
        while size < limit:
            if self._queue:
                nxt = self._queue[0]
                if nxt.future.done():
                    self._queue.popleft()
                    continue
                if size + nxt.work.batch_size > limit:
                    break
                batch.append(self._queue.popleft())
                size += nxt.work.batch_size
                continue
            remaining_ns = deadline_ns - time.perf_counter_ns()
            if remaining_ns <= 0:
                break
            await self._wait_arrival(remaining_ns / 1e9)
        return batch

    async def _worker(self, inst: ModelInstance) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            started = time.perf_counter_ns()
            self._executing += 1
            try:
                result = await loop.run_in_executor(inst.executor, inst.run, [p.work for p in batch])
            except asyncio.CancelledError:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(BatcherClosedError("the server stopped before this batch finished"))
                raise
            except Exception as e:
                log.exception("model instance %d failed on a batch of %d requests", inst.index, len(batch))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            finally:
                self._executing -= 1
            samples = sum(p.work.batch_size for p in batch)
            for p, outs in zip(batch, result.per_request, strict=True):
                if not p.future.done():
                    p.future.set_result((outs, Timing(started - p.enqueued_ns, result.compute_ns, samples)))
            for listener in self._listeners:
                listener(samples, len(batch), result.compute_ns)

    async def close(self) -> int:
        """Stop the workers and fail whatever is still queued or running (drain first for a clean
        stop). Returns how many instances were left running a batch: their callers have been
        answered, but the forward pass itself cannot be interrupted."""
        self._closed = True
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        while (p := self._pop_live()) is not None:
            p.future.set_exception(BatcherClosedError("the server stopped before this request ran"))
        abandoned = 0
        for inst in self._instances:
            if inst.busy:
                log.warning("model instance %d is still running a batch; leaving it behind", inst.index)
                inst.close(wait=False)
                abandoned += 1
            else:
                await asyncio.to_thread(inst.close)
        return abandoned
