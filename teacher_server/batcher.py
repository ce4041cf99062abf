"""The dynamic batcher: many clients' requests become few model executions.

Requests queue in arrival order. An idle instance takes the oldest request and keeps adding
whole requests while they fit in `max_batch_size`, waiting for more at most
`max_queue_delay_us` counted from the oldest request's arrival (so a request that already
waited for a busy instance is not delayed again). Requests are never split across batches.
A request whose caller went away (deadline, cancel) before it was scheduled is dropped
unexecuted. The queue is bounded: past `max_queue_size` waiting requests, submit() refuses.

The scheduling runs on the instances' own threads, as Triton's scheduler threads do: the event
loop only appends to the queue and resolves futures. An instance that finishes a batch forms and
starts its next one at once, without waiting for the loop (busy parsing other requests' bytes)
to come round; the loop hears of each finished batch through one `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from teacher_server.instance import BatchResult, ModelInstance, Work
from teacher_server.model import EncodedOutput

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


class DynamicBatcher:
    """Queues requests from one event loop and runs them, batched, on the instances' threads."""

    def __init__(self, instances: list[ModelInstance], config: BatchingConfig) -> None:
        if not instances:
            raise ValueError("the batcher needs at least one model instance")
        self._instances = instances
        self._config = config
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()  # guards _queue, _executing and _closed
        self._serving: list[concurrent.futures.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executing = 0
        self._listeners: list[BatchListener] = []
        self._closed = False

    def on_batch(self, listener: BatchListener) -> None:
        """`listener` runs on the event loop after every executed batch."""
        self._listeners.append(listener)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def executing(self) -> int:
        """Batches running on instances right now."""
        return self._executing

    def start(self) -> None:
        if self._serving:
            return
        self._loop = asyncio.get_running_loop()
        self._serving = [inst.executor.submit(self._serve, inst) for inst in self._instances]

    async def submit(self, work: Work) -> tuple[list[EncodedOutput], Timing]:
        """Queue one request and wait for its encoded outputs."""
        pending = _Pending(work, asyncio.get_running_loop().create_future())
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the batcher is closed")
            if len(self._queue) >= self._config.max_queue_size:
                raise QueueFullError(
                    f"queue is full ({self._config.max_queue_size} requests waiting); retry on another teacher"
                )
            self._queue.append(pending)
            self._cond.notify()
        return await pending.future

    # ---- on the instance threads -----------------------------------------------------------
    def _pop_live(self) -> _Pending | None:
        # done() read from this thread: a request cancelled a moment ago may still run (its
        # result is then dropped on the loop); never the reverse.
        while self._queue:
            p = self._queue.popleft()
            if not p.future.done():
                return p
        return None

    def _next_batch(self) -> list[_Pending] | None:
        """The next batch, or None once closed (with the lock held only while waiting or popping)."""
        with self._cond:
            first = self._pop_live()
            while first is None:
                if self._closed:
                    return None
                self._cond.wait()
                first = self._pop_live()
            batch = [first]
            if self._config.enabled:
                self._fill(batch)
            self._executing += 1
            return batch

    def _fill(self, batch: list[_Pending]) -> None:
        size = batch[0].work.batch_size
        limit = self._config.max_batch_size
        deadline_ns = batch[0].enqueued_ns + self._config.max_queue_delay_us * 1000
        while size < limit and not self._closed:
            if self._queue:
                nxt = self._queue[0]
                if nxt.future.done():
                    self._queue.popleft()
                    continue
                if size + nxt.work.batch_size > limit:
                    return
                batch.append(self._queue.popleft())
                size += nxt.work.batch_size
                continue
            remaining_ns = deadline_ns - time.perf_counter_ns()
            if remaining_ns <= 0:
                return
            self._cond.wait(remaining_ns / 1e9)

    def _serve(self, inst: ModelInstance) -> None:
        assert self._loop is not None
        while (batch := self._next_batch()) is not None:
            started = time.perf_counter_ns()
            try:
                result = inst.run([p.work for p in batch])
            except Exception as e:
                log.exception("model instance %d failed on a batch of %d requests", inst.index, len(batch))
                self._to_loop(self._fail, batch, e)
                continue
            finally:
                with self._cond:
                    self._executing -= 1
            self._to_loop(self._deliver, batch, result, started)

    def _to_loop(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting for these answers any more
            log.debug("event loop closed; dropped the results of a batch")

    # ---- back on the event loop ------------------------------------------------------------
    def _deliver(self, batch: list[_Pending], result: BatchResult, started: int) -> None:
        samples = sum(p.work.batch_size for p in batch)
        for p, outs in zip(batch, result.per_request, strict=True):
            if not p.future.done():
                p.future.set_result((outs, Timing(started - p.enqueued_ns, result.compute_ns, samples)))
        for listener in self._listeners:
            listener(samples, len(batch), result.compute_ns)

    @staticmethod
    def _fail(batch: list[_Pending], error: BaseException) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(error)

    async def close(self) -> None:
        """Let running batches finish, then fail whatever is still queued (drain first for a clean stop)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.gather(*(asyncio.wrap_future(f) for f in self._serving), return_exceptions=True)
        self._serving = []
        await asyncio.sleep(0)  # deliver what the last batches handed to the loop
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        self._fail(left, BatcherClosedError("the server stopped before this request ran"))
        for inst in self._instances:
            await asyncio.to_thread(inst.close)
