"""Reading ahead: the user's loader on a thread of its own, bounded by read-ahead slots, its
batches handed to the event loop in bunches.

Three threads meet here, and every hand-over between two of them is a wake-up (a futex, a
context switch, the GIL changing hands), which on a fast loader costs more than the batch itself.
So the loader thread runs ahead on its own (`pump`): it takes read-ahead slots itself, reads as
many batches as it holds slots for, and pushes each into a `Feed`, which wakes the event loop only
when it is not already due to drain it. The training loop gives slots back (`ReadAhead.give_back`)
and, while it takes batches faster than one per `SLOW_TAKE_S`, wakes the loader only once a quarter
of the slots are free again, not for every batch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["END_OF_LOADER", "PREFETCH", "SLOW_TAKE_S", "Failed", "Feed", "LoaderThread", "ReadAhead", "depth",
           "pump"]

PREFETCH = 4
"""Batches read ahead when `prefetch` is not set and no teacher batches by length (`depth`)."""

SLOW_TAKE_S = 0.01
"""A training loop that takes batches this far apart or more (a moving average) wakes the loader for
every slot it gives back: a slot left free is a teacher call not made until the next batch is taken,
which at these gaps costs more than what the batches read together would save by sharing calls
(`distill.bundles`: the fixed cost of a call, on either side) and than the wake-up itself. Faster
loops wake it once a quarter of the slots are free, so that the batches it then reads reach the
event loop together and share calls. Until the gaps are known (a pass's first two batches, when no
earlier pass measured them), the loop counts as slow: a slot left free then can be a call missing
at the teachers until a second answer comes back, while waking the loader costs a wake-up."""

_GAP_WEIGHT = 0.125  # of the latest gap in the moving average of the gaps between two takes


def depth(prefetch: int | None, batch_bytes: float, by_length_rows: int, batch_rows: int,
          read_ahead_mb: float) -> int:
    """Batches to read ahead: `prefetch` when set; else `PREFETCH`, or more where a service's
    teachers batch padded rows by length: the router keeps `RouterConfig.by_length_rows` rows in
    flight to each (they fill their batches from the rows queued, so a few batches in flight
    leave them small, poorly matched batches), so the reader reads `by_length_rows` (the most any
    service wants) rows ahead, in batches of `batch_rows`, the most rows one has had. A large pool
    of such teachers would have the reader hold thousands of batches, answered ones waiting for a
    slower training loop among them, so `read_ahead_mb` bounds what they hold, counted at
    `batch_bytes`, the most bytes a row of an answered batch has held (its inputs and outputs)
    times `batch_rows`. Until a batch is answered (`batch_bytes` 0), `PREFETCH`: a loader's
    batches are not taken back once read, and a teacher's outputs (full logits of a large
    vocabulary, or top-k) can be a thousand times its inputs."""
    if prefetch is not None:
        return prefetch
    if batch_bytes == 0:
        return PREFETCH
    fits = int(read_ahead_mb * 2**20 // batch_bytes)
    return max(PREFETCH, min(-(-by_length_rows // batch_rows), fits))


END_OF_LOADER = object()


class Failed:
    """What the loader raised, in the place of the batch it could not give."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class LoaderThread:
    """Pulls batches from the user's loader on a daemon thread, so a blocking loader never blocks the
    event loop and never keeps the interpreter from exiting. Jobs run one at a time, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # put/get in C
        self._thread = threading.Thread(target=self._run, name="distill-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, job: Callable[[], None]) -> None:
        """Run `job` on the loader thread, after the jobs before it; nobody waits for it."""
        self._jobs.put(job)

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """`fn()` on the loader thread; its result (or error) as a future of `loop`."""
        fut: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # delivered to the awaiting coroutine
                _deliver(loop, _set_exception, fut, e)
            else:
                _deliver(loop, _set_result, fut, result)

        self._jobs.put(run)
        return fut

    def close(self) -> None:
        self._jobs.put(None)


def _deliver(loop: asyncio.AbstractEventLoop, setter: Callable[[asyncio.Future[Any], Any], None],
             fut: asyncio.Future[Any], value: Any) -> None:
    """Hand a loader result to the loop; if the reader closed meanwhile, nobody waits for it."""
    try:
        loop.call_soon_threadsafe(setter, fut, value)
    except RuntimeError:  # the event loop is closed
        pass


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class ReadAhead:
    """The read-ahead slots of one pass: taken on the loader thread before it reads a batch, given
    back from the training loop's thread when it takes one. A loader with no slot sleeps until
    `wake_at` slots are free (a quarter of them), so a loader faster than a fast training loop is
    woken once per few batches; a loop that takes a batch every `SLOW_TAKE_S` or slower wakes it for
    each slot. `close` ends the pass: the loader's `take` then returns 0.

    With ordered delivery an answered batch may wait for an earlier one still at the teachers;
    `waiting` lends such a batch's slot back while it waits, for up to `size` of them, so one slow
    batch does not keep the batches behind it from being read and sent. The slot is owed again
    once the batch is delivered.

    While the training loop is slow (`SLOW_TAKE_S`), a delivered batch it has not taken yet lends
    its slot too (`waiting`), for up to `wake_at` of them: the next batch is read as soon as an
    answer is delivered, not after three threads have passed the word along (the training loop's
    takes the batch and gives the slot back, the loader's reads the next one, the event loop's
    sends it), which on cores the teachers keep busy leaves a call missing at the teachers for
    milliseconds after each answer. The slot is owed again once the batch is taken. A fast loop
    takes its batches before that matters, and lending there would only break up the bunches of
    batches the loader reads together, which share calls. So a pass holds at most `size` batches
    unanswered or delivered and not yet taken, plus `wake_at` delivered ones, plus at most `size`
    answered ones waiting for their turn: `2 * size + wake_at` in all.
    """

    def __init__(self, epoch: int, slots: int, gap: float | None = None) -> None:
        """`gap`: the moving average of the seconds between two takes that an earlier pass of the
        same training loop measured (its `gap`); None: not yet timed."""
        self.epoch = epoch
        self.size = slots
        self._free = slots
        self._waiting_batches = 0  # answered batches waiting for an earlier one (ordered delivery)
        self._queued = 0  # delivered batches the training loop has not taken yet
        self._lent = 0  # the slots lent: min(_waiting_batches, size), + min(_queued, wake_at) while slow
        self._wake_at = max(1, slots // 4)
        self._gap = gap  # moving average of the seconds between two give_back() calls
        self._last: float | None = None
        self._lock = threading.Lock()
        self._wakeup = threading.Lock()  # held while nobody is to be woken; released to wake the loader
        self._wakeup.acquire()
        self._waiting = False
        self.closed = False

    def take(self) -> int:
        """All the free slots (at least one), waiting for them; 0 once the pass is closed. Loader thread."""
        while True:
            with self._lock:
                if self.closed:
                    return 0
                if self._free > 0:
                    n, self._free = self._free, 0
                    return n
                self._waiting = True
            self._wakeup.acquire()

    @property
    def gap(self) -> float | None:
        """The moving average of the seconds between two takes; None until two batches were taken."""
        return self._gap

    def give_back(self) -> None:
        """One slot back (any thread); wakes a waiting loader once `wake_at` slots are free, or at
        once when batches are taken `SLOW_TAKE_S` apart or more (`_wake_if_due`)."""
        now = time.perf_counter()
        with self._lock:
            if self._last is not None:  # the first gap sets the average
                gap = now - self._last
                self._gap = gap if self._gap is None else self._gap + (gap - self._gap) * _GAP_WEIGHT
            self._last = now
            self._free += 1
            if self._queued:  # the batch taken had lent its slot since it was delivered: owed again
                self._queued -= 1
            self._lend()  # (and the loop may have turned fast or slow)
            self._wake_if_due()

    def _wake_if_due(self, at_once: bool = False) -> None:
        """Wake a waiting loader for a free slot: `at_once`, or once `wake_at` slots are free, or
        while batches are taken `SLOW_TAKE_S` apart or more, or not yet timed (lock held)."""
        if self._free > 0 and (at_once or self._free >= self._wake_at or self._slow()):
            self._wake()

    def _wake(self) -> None:
        """Release a loader waiting in `take` (lock held)."""
        if self._waiting:
            self._waiting = False
            self._wakeup.release()

    def resize(self, size: int) -> None:
        """Hold `size` slots from now on (any thread). Growing frees the new slots at once and wakes a
        waiting loader; shrinking takes slots back as the training loop returns them (the batches
        already read stay), so the loader reads again only once fewer than `size` are out."""
        with self._lock:
            if size == self.size:
                return
            self._free += size - self.size
            self.size = size
            self._wake_at = max(1, size // 4)
            self._lend()
            self._wake_if_due(at_once=True)

    def waiting(self, batches: int, delivered: int = 0) -> None:
        """`batches` answered batches now wait for an earlier one to be delivered (ordered delivery),
        and `delivered` more went to the training loop since the last call (the event loop's
        thread; before the loop can take them). Slots are lent meanwhile: the waiting batches',
        up to `size`, and while the loop is slow the delivered ones' until `give_back`, up to
        `wake_at`. A waiting loader is woken at once for a free slot when more batches wait (a
        slot lent to one starts a call at once), else as `give_back` would wake it."""
        with self._lock:
            more = batches > self._waiting_batches
            self._waiting_batches = batches
            self._queued += delivered
            self._lend()
            self._wake_if_due(at_once=more)

    def _slow(self) -> bool:
        """Whether batches are taken `SLOW_TAKE_S` apart or more, or not yet timed (lock held)."""
        return self._gap is None or self._gap >= SLOW_TAKE_S

    def _lend(self) -> None:
        """Lend min(waiting batches, size) slots, and min(delivered batches, wake_at) while the loop
        is slow, taking back what is lent beyond that (lock held)."""
        delivered = min(self._queued, self._wake_at) if self._slow() else 0
        lent = min(self._waiting_batches, self.size) + delivered
        self._free += lent - self._lent
        self._lent = lent

    def close(self) -> None:
        """End the pass: a loader waiting for a slot returns at once (any thread)."""
        with self._lock:
            self.closed = True
            self._wake()


class Feed:
    """Batches from the loader thread to the event loop. `push` wakes the loop only when `get`
    waits and has not been woken yet, so batches read in a row reach the loop in one wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: Any) -> None:
        """Any thread."""
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _deliver(self._loop, _set_result, waiter, None)

    async def get(self) -> list[Any]:
        """Everything pushed so far (at least one item), waiting for it. Event loop thread."""
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
                waiter = self._waiter = self._loop.create_future()
            await waiter


def pump(slots: ReadAhead, next_batch: Callable[[], Any], feed: Feed) -> None:
    """The loader thread's job for one pass: a batch per read-ahead slot, each pushed as soon as it is
    read, until the loader ends (END_OF_LOADER) or raises (`Failed`), or the pass is closed."""
    while (n := slots.take()) > 0:
        for _ in range(n):
            if slots.closed:
                return
            try:
                item = next_batch()
            except BaseException as e:  # the loader's (or the inputs') error, in the batch's place
                feed.push(Failed(e))
                return
            feed.push(item)
            if item is END_OF_LOADER:
                return
