"""The dynamic batcher: many clients' requests become few model executions.

Requests queue in arrival order. An idle instance takes the oldest request and keeps adding
whole requests while they fit in `max_batch_size`, waiting for more at most
`max_queue_delay_us` counted from the oldest request's arrival (so a request that already
waited for a busy instance is not delayed again). Requests are never split across batches.
A request whose caller went away (deadline, cancel) before it was scheduled is dropped
unexecuted. The queue is bounded: past `BatchingConfig.queue_bound` waiting requests (rows, where a
padded request is split), submit() refuses.

Only compatible requests share a batch (Triton's default): their client-sized (-1) dimensions
agree, so concatenation cannot fail because of another client's request. A model that declares
padded sequence inputs (`spec.TensorSpec.pad_value`) lets requests of different lengths share a
batch; they are padded to the longest (`work.batch_input`), so to keep that waste small a batch
takes only requests in the oldest request's power-of-two length bucket (lengths 9..16 together,
17..32 together, ...), and when more requests are queued than one batch holds, it takes those of
the closest lengths instead (any bucket). A padded model's batches are bounded in tokens, not
sequences: samples x padded length within `BatchingConfig.token_budget` (`max_batch_tokens`, by
default `max_batch_size` x `TYPICAL_LENGTH` = 64 positions), so a batch of short sequences holds
more of them than `max_batch_size` and one of long sequences fewer; the model's cost (and its
memory) follows tokens. And a request joins a batch only if the batch's padding efficiency
(useful / computed positions) stays at least `min_padding_efficiency` (0.85): with few requests
queued, a batch waits out the delay or runs smaller rather than pad a wide spread of lengths. On a
GPU, where a forward pass costs tens of milliseconds whatever its size, the batcher fits that cost
from the batches run and pads more where it pays (`teacher_server.batch_cost`, `BatchRules.admits`).
`length_buckets=False` turns these length rules off (any lengths, oldest first): the baseline
that shows what they save. Every batch starts with the oldest request, so none waits behind
younger ones for more than the batches ahead of it.

Outputs go back asynchronously (`BatchingConfig.async_outputs`, by default for models on a GPU): an instance's
thread only launches a batch (`ModelInstance.launch`: device work and host copies enqueued) and
the worker hands it the next one at once, while the instance's finishing stage
(`teacher_server.finishing`) waits for the copies and encodes; a task per launched batch answers
its requests when that is done. Each instance holds at most two batches launched and not
answered (plus one staged ahead, where batches are staged), so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from teacher_server import staging
from teacher_server.batch_cost import BatchCost, BatchCostFigures
from teacher_server.batch_rules import BatchingConfig, BatchRules, compatible
from teacher_server.instance import BatchResult, ModelInstance
from teacher_server.outputs import EncodedOutput
from teacher_server.staging import Stager
from teacher_server.work import Work

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The batcher's queue is at max_queue_size; the caller should retry elsewhere or later."""


class BatcherClosedError(Exception):
    """The batcher stopped before the request ran."""


@dataclass
class Timing:
    """What a request's answer says besides its outputs: its time queued, its batch's compute
    time and size, and its rows whose outputs are not finite (`BatchOutputs.nonfinite`)."""

    queue_ns: int
    compute_ns: int
    batch_size: int
    nonfinite: tuple[int, ...] = ()


@dataclass(eq=False)
class _Pending:
    work: Work
    future: asyncio.Future[tuple[list[EncodedOutput], Timing]]
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


BatchListener = Callable[[int, int, int], None]
"""Called as listener(samples, requests, compute_ns) after every executed batch."""

TokenListener = Callable[[int, int], None]
"""Called as listener(useful, computed) after every executed batch of a padded model: positions
the requests needed, and positions computed including padding."""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _fail(batch: list[_Pending], error: BaseException) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(error)


class DynamicBatcher:
    """Schedules queued requests onto model instances; lives on one event loop."""

    def __init__(self, instances: list[ModelInstance], config: BatchingConfig, stage_ahead: bool | None = None) -> None:
        """`stage_ahead`: form each instance's next batch and build its inputs on the device while
        the current batch runs (`teacher_server.staging`); None: where that overlaps (CUDA)."""
        if not instances:
            raise ValueError("the batcher needs at least one model instance")
        self._instances = instances
        self._config = config
        accelerated = any(inst.model.device.type != "cpu" for inst in instances)
        # asynchronous outputs where they overlap device work (BatchingConfig.async_outputs None)
        self._async_outputs = config.async_outputs if config.async_outputs is not None else accelerated
        self._rules = BatchRules(config)
        self._queue_bound = config.queue_bound(instances[0].model.io.padded)
        self._cost = BatchCost()  # padded models: the device's cost of a batch, fitted from those run
        self._cost_aware = config.cost_aware_floor if config.cost_aware_floor is not None else accelerated
        self._stagers = {inst.index: Stager(inst.model.device, inst.index) for inst in instances
                         if (staging.wanted(inst.model.device) if stage_ahead is None else stage_ahead)}
        self._queue: collections.deque[_Pending] = collections.deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._workers: list[asyncio.Task[None]] = []
        self._executing = 0
        self._answering: set[asyncio.Task[None]] = set()  # launched batches awaiting their finish
        self._listeners: list[BatchListener] = []
        self._token_listeners: list[TokenListener] = []
        self._closed = False

    def on_batch(self, listener: BatchListener) -> None:
        self._listeners.append(listener)

    def on_tokens(self, listener: TokenListener) -> None:
        self._token_listeners.append(listener)

    @property
    def instances(self) -> list[ModelInstance]:
        """The model instances it schedules onto."""
        return list(self._instances)

    @property
    def stagers(self) -> list[Stager]:
        """The instances' stagers (none where batches are not staged ahead)."""
        return list(self._stagers.values())

    @property
    def cost(self) -> BatchCost:
        """The fit of what a batch costs the device (padded models; empty for others)."""
        return self._cost

    @property
    def padding_floor(self) -> float:
        """The padding-efficiency floor batches are formed with now (padded models, length buckets on)."""
        if not self._config.length_buckets:
            return 0.0
        return self._rules.padding_floor(self._fixed_positions())

    def _fixed_positions(self) -> float:
        """What one more batch costs the device, in positions, as the batch rules count it (0 when
        the rules are as set)."""
        return self._cost.fixed_positions if self._cost_aware else 0.0

    def cost_figures(self) -> BatchCostFigures:
        """The batch cost fit and the floor in use, for the metrics (read from the scrape thread)."""
        fit = self._cost.current
        return BatchCostFigures(fit.fixed_s if fit else 0.0, fit.per_position_s if fit else 0.0, self.padding_floor)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def executing(self) -> int:
        """Batches handed to instances and not yet answered (being launched, computing or finished)."""
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
        return (await self.submit_rows([work]))[0]

    async def submit_rows(self, works: list[Work]) -> list[tuple[list[EncodedOutput], Timing]]:
        """Queue the rows of one request (`rows.RowSplitter`) at once, each free to join any batch,
        and wait for all their outputs, in order. Admitted whole or refused whole: the queue bound
        is checked once, so a request's rows may take the queue past it by fewer than one request.
        If one row fails, or the caller goes away, the rows not yet run are dropped unexecuted."""
        if self._closed:
            raise BatcherClosedError("the batcher is closed")
        if len(self._queue) >= self._queue_bound:
            raise QueueFullError(f"queue is full ({self._queue_bound} requests waiting); retry on another teacher")
        loop = asyncio.get_running_loop()
        pending = [_Pending(w, loop.create_future()) for w in works]
        self._queue.extend(pending)
        self._wake()
        if len(pending) == 1:
            return [await pending[0].future]
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except BaseException:
            for p in pending:
                p.future.cancel()
            raise

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
        deadline_ns = first.enqueued_ns + self._config.max_queue_delay_us * 1000
        try:
            while not self._take_compatible(batch):
                remaining_ns = deadline_ns - time.perf_counter_ns()
                if remaining_ns <= 0:
                    break
                await self._wait_arrival(remaining_ns / 1e9)
        except asyncio.CancelledError:
            _fail(batch, BatcherClosedError("the server stopped before this request ran"))
            raise
        return batch

    def _take_compatible(self, batch: list[_Pending]) -> bool:
        """Move queued requests compatible with batch[0] into the batch while they fit; drop the
        dead ones. True when the batch is full (the next compatible request does not fit), so
        waiting for more is pointless.

        Oldest first, from batch[0]'s length bucket. When the queued requests of a padded model
        are more than one batch holds, the batch instead takes the run of them, in length order
        and across buckets, that fills it with the least padding (`BatchRules.closest_lengths`):
        full batches, padded far less than oldest-first pads them."""
        first = batch[0].work
        if self._rules.full(batch):
            return True
        if not self._queue:
            return False
        buckets = self._config.length_buckets
        live = collections.deque(p for p in self._queue if not p.future.done())
        pool = [p for p in live if p.work.shape_key == first.shape_key]
        floor = self.padding_floor
        fixed = self._fixed_positions()
        taken, full = self._rules.oldest_first(batch, [p for p in pool if compatible(first, p.work, buckets)],
                                               floor, fixed)
        if buckets and first.length is not None and len(pool) > len(taken) and self._rules.oldest_first(batch, pool)[1]:
            closest = self._rules.closest_lengths(batch, pool, floor, fixed)
            if closest:
                taken, full = closest, True
        chosen = set(map(id, taken))
        batch.extend(taken)
        self._queue = collections.deque(p for p in live if id(p) not in chosen)
        return full or self._rules.full(batch)

    async def _worker(self, inst: ModelInstance) -> None:
        """Hand batches to `inst` for as long as the batcher runs. A batch is formed once the
        instance has a slot for it: with asynchronous outputs the instance may hold two batches
        launched and not finished (one being finished while the next computes), one otherwise;
        with a stager, one more, formed and staged while the instance runs (at most one batch
        waits staged); `BatchingConfig.batches_ahead`, when set, is the number of slots instead.
        The worker goes on as soon as the instance's thread has launched a batch; the batch is
        answered by its own task once finished (`_answer`). If the server stops, the requests of a
        batch formed and not launched are answered UNAVAILABLE."""
        stager = self._stagers.get(inst.index)
        slots = asyncio.Semaphore(self._config.batches_ahead
                                  or (2 if self._async_outputs else 1) + (stager is not None))
        nxt: asyncio.Future[list[_Pending]] | None = None
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(self._next_ready(stager, slots))
                batch = await nxt
                nxt = asyncio.ensure_future(self._next_ready(stager, slots)) if stager is not None else None
                await self._launch(inst, batch, slots)
        finally:
            if nxt is not None:
                if nxt.done() and not nxt.cancelled() and nxt.exception() is None:
                    _fail(nxt.result(), BatcherClosedError("the server stopped before this request ran"))
                nxt.cancel()  # its own handler fails a batch it had already taken
                with contextlib.suppress(BaseException):
                    await nxt

    async def _next_ready(self, stager: Stager | None, slots: asyncio.Semaphore) -> list[_Pending]:
        """The instance's next batch, formed once it has a slot for it, and staged with a stager."""
        await slots.acquire()
        try:
            batch = await self._next_batch()
            if stager is not None:
                await self._stage(stager, batch)
        except BaseException:
            slots.release()
            raise
        return batch

    async def _stage(self, stager: Stager, batch: list[_Pending]) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(stager.executor, stager.stage, [p.work for p in batch])
        except asyncio.CancelledError:
            _fail(batch, BatcherClosedError("the server stopped before this request ran"))
            raise
        except Exception:
            log.exception("staging a batch of %d requests failed; the instance gathers its inputs itself", len(batch))

    async def _launch(self, inst: ModelInstance, batch: list[_Pending], slots: asyncio.Semaphore) -> None:
        """Have `inst`'s thread launch one batch; a task of its own answers it once finished. The
        batch's slot is given back when it is answered (or failed)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter_ns()
        self._executing += 1
        try:
            done = await loop.run_in_executor(inst.executor, inst.launch, [p.work for p in batch],
                                              self._async_outputs)
        except BaseException as e:
            self._executing -= 1
            slots.release()
            if isinstance(e, asyncio.CancelledError):
                _fail(batch, BatcherClosedError("the server stopped before this batch finished"))
                raise
            if not isinstance(e, Exception):
                raise
            log.exception("model instance %d failed on a batch of %d requests", inst.index, len(batch))
            _fail(batch, e)
            return
        task = asyncio.create_task(self._answer(inst, batch, done, started, slots),
                                   name=f"batcher-answer-{inst.index}")
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, inst: ModelInstance, batch: list[_Pending], done: Future[BatchResult], started: int,
                      slots: asyncio.Semaphore) -> None:
        """Wait for a launched batch to be finished and answer its requests, then the listeners."""
        try:
            result = await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            _fail(batch, BatcherClosedError("the server stopped before this batch finished"))
            raise
        except Exception as e:
            log.exception("model instance %d failed finishing a batch of %d requests", inst.index, len(batch))
            _fail(batch, e)
            return
        finally:
            self._executing -= 1
            slots.release()
        samples = sum(p.work.batch_size for p in batch)
        nonfinite = result.nonfinite or [()] * len(batch)
        for p, outs, bad in zip(batch, result.per_request, nonfinite, strict=True):
            if not p.future.done():
                p.future.set_result((outs, Timing(started - p.enqueued_ns, result.compute_ns, samples, bad)))
        for listener in self._listeners:
            listener(samples, len(batch), result.compute_ns)
        if batch[0].work.length is not None:
            useful = sum(p.work.tokens for p in batch)
            computed = samples * max(p.work.length or 0 for p in batch)
            known = self._cost.current is not None
            self._cost.observe(computed, result.device_ns / 1e9)
            if not known and (fit := self._cost.current) is not None:
                log.info("a batch costs the device %.1f ms + %.3g s a position (%.0f positions' worth); "
                         "padding floor %.3f", fit.fixed_s * 1e3, fit.per_position_s, fit.fixed_positions,
                         self.padding_floor)
            for token_listener in self._token_listeners:
                token_listener(useful, computed)

    async def close(self) -> int:
        """Stop the workers and fail whatever is still queued or running (drain first for a clean
        stop). Returns how many instances were left running a batch: their callers have been
        answered, but the forward pass itself cannot be interrupted."""
        self._closed = True
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        answering = list(self._answering)
        for t in answering:
            t.cancel()
        await asyncio.gather(*answering, return_exceptions=True)
        while (p := self._pop_live()) is not None:
            p.future.set_exception(BatcherClosedError("the server stopped before this request ran"))
        for stager in self._stagers.values():
            await asyncio.to_thread(stager.close)
        abandoned = 0
        for inst in self._instances:
            if inst.busy:
                log.warning("model instance %d is still running a batch; leaving it behind", inst.index)
                inst.close(wait=False)
                abandoned += 1
            else:
                await asyncio.to_thread(inst.close)
        return abandoned
