"""The reader's engine: an asyncio program on a background thread. Orchestration only: epochs,
dispatch (with hedging and retry); a batch and its delivery are `distill.batches`, the pool
(`distill.pool`) keeps the teachers, the router (`distill.router`) chooses among them and times
late chunks, the client (`distill.teacher_client`) speaks KServe.

The data path, in order:
  loader thread   next(loader) -> fields -> contiguous numpy arrays      (never on the event loop)
  read-ahead      a Job per batch, at most `prefetch` not yet consumed
  dispatcher      one per service: take the oldest chunk, pick a teacher whose declared inputs
                  take the batch (none does: the batch is rejected, the teachers stay), split the
                  chunk to the teacher's max batch, hand it to the teacher's client (one
                  ModelInfer, a deadline)
  on answer       the client checked it against the request and the teacher's metadata (a teacher
                  that lies is marked incompatible); copy the outputs into the job's tensors
  on failure      put the chunk back at the head of the queue: another teacher takes it
  on rejection    the teacher refused this input (bad input, a model that raises on it): retry it
                  once, alone, on another teacher ("suspect" lane: one suspect in flight per
                  service, so an innocent chunk that shared the poison's batch on the teacher is
                  never batched with it again); refused twice, the batch fails with the teachers'
                  messages and only that batch is lost
  on overload     the teacher cools down briefly with a smaller limit; the chunk goes elsewhere
  when late       past the hedge delay a chunk is raced on another teacher, and its teacher gets a
                  readiness probe: no answer means hung, so it is ejected and its chunks re-sent
                  now rather than at their deadline
  delivery        completed jobs go to the reader's sink in loader order (or as they finish)

Exactly-once towards the training loop: a job is delivered once, when all its chunks have an
answer; duplicate answers (hedges, late retries) are dropped. At-least-once towards teachers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, cast

import grpc

from discovery import Registry, open_registry
from distill.batches import END_OF_LOADER, Chunk, Delivery, Job, LoaderThread, Sink, extract_inputs
from distill.cache.errors import require_store
from distill.liveness import CallWatch
from distill.options import ReaderOptions
from distill.pool import Connect, TeacherPool
from distill.router import TeacherState
from distill.stats import ConsumptionMeter, ReaderStats, demand_report, reader_stats
from distill.teacher_client import (
    ChunkRequest,
    MalformedAnswerError,
    RequestRejectedError,
    TeacherCallError,
    TeacherGoneError,
    TeacherOverloadedError,
    grpc_connector,
)
from distill.types import FieldArray, OutputCache, StoredRows

log = logging.getLogger("distill.reader")


class _Service:
    """One teacher service: its pool of teachers, chunk queue and background tasks."""

    def __init__(self, pool: TeacherPool) -> None:
        self.name = pool.service
        self.pool = pool
        self.router = pool.router
        self.queue: deque[Chunk] = deque()
        self.suspects: deque[Chunk] = deque()
        self.suspect_out: Chunk | None = None  # the one suspect chunk being dispatched or in flight
        self.arrived = asyncio.Event()

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
            await self.arrived.wait()

    def release(self, chunk: Chunk) -> None:
        """`chunk` is no longer out (answered, failed, dropped): the next suspect may go."""
        if self.suspect_out is chunk:
            self.suspect_out = None
            self.arrived.set()

    def clear(self) -> None:
        self.queue.clear()
        self.suspects.clear()
        self.suspect_out = None


class Engine:
    """Lives on the reader's event loop thread; the DistillReader talks to it thread-safely.

    `connect` opens a client per teacher endpoint (default: a gRPC `TeacherClient` with the reader's
    TLS settings); tests pass an in-memory one to drive the engine without servers.
    """

    def __init__(self, options: ReaderOptions, sink: Sink, meter: ConsumptionMeter,
                 connect: Connect | None = None) -> None:
        self.opts = options
        self._delivery = Delivery(sink, ordered=options.ordered, services=tuple(options.services),
                                  pin_memory=options.pin_memory)
        self._meter = meter
        self._tasks: set[asyncio.Task[Any]] = set()
        connect = connect or grpc_connector(options.client_tls, options.headers)
        self._services = {s: _Service(TeacherPool(s, options, connect, self._spawn_aux)) for s in options.services}
        self._registries: list[Registry] = []
        self._closing: list[contextlib.AbstractAsyncContextManager[Any]] = []
        self._loader = LoaderThread()
        self.epoch = 0
        self._epoch_task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(options.prefetch)
        self.fallback_batches = 0
        self.rejected_batches = 0
        self.retries = 0
        self.hedges = 0
        self.cache: OutputCache | None = None  # opened in start() when options.cache is set
        self._watch = CallWatch(self._spawn_aux)  # calls in flight per teacher; late ones, hung teachers
        self._closed = False

    # ---- start-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Find teachers, check they serve what was asked, start dispatching; raises on mismatch."""
        opts = self.opts
        if opts.cache is not None and opts.cache_mode == "read":  # nothing to read: say so before finding teachers
            await self._loader.submit(asyncio.get_running_loop(), functools.partial(
                require_store, os.fspath(opts.cache)))
        for svc in self._services.values():
            registry = self._registry_for(svc.name)
            # Membership only: routing uses the reader's own latency figures, and a drain shows as the
            # teacher's deregistration; load reports would reach every student 1/s per teacher.
            watch = registry.watch(svc.name, connect_timeout=min(opts.no_teacher_timeout, 30.0), loads=False)
            first = await watch.__anext__()  # RegistryUnavailableError surfaces here, at start
            svc.pool.apply(first)
            self._spawn(svc.pool.follow(watch), f"watch-{svc.name}")
            self._spawn(self._dispatch(svc), f"dispatch-{svc.name}")
            if opts.registry and not opts.static:
                demand = registry.publish_demand(svc.name, demand_report(opts.student_id, self._meter, svc.router),
                                                 student_id=opts.student_id)
                await demand.__aenter__()
                self._closing.append(demand)
        if opts.offline:
            # cache_mode="read" never waits for a teacher: a stored sample needs none, and a teacher
            # list left on the command line must not hold up (or fail) a fully stored replay. Teachers
            # that come are asked for the samples the store lacks.
            await self._open_cache(os.fspath(opts.cache))
            return
        for svc in self._services.values():
            await svc.pool.wait_first()
        if opts.cache is not None:
            await self._open_cache(os.fspath(opts.cache))

    async def _open_cache(self, path: str) -> None:
        """Open the teacher-output store (on the loader thread: it reads files). Its namespace is built
        from the first teacher's metadata; reading only (or with no teacher), the store's own must
        match the options, and a teacher serves this reader only if what it answers would carry
        the store's namespace (its answers join stored rows in one batch)."""
        from distill.cache.reader_side import ReaderCache, teacher_mismatch

        meta = None if self.opts.offline else next(
            (t.meta for svc in self._services.values() for t in svc.router.teachers.values() if t.meta is not None),
            None)
        loop = asyncio.get_running_loop()
        cache = await self._loader.submit(loop, lambda: ReaderCache.open(path, self.opts, meta))
        self.cache = self._delivery.cache = cache
        if meta is None:
            for svc in self._services.values():
                svc.pool.admit(functools.partial(teacher_mismatch, self.opts, cache.store.namespace))

    def _registry_for(self, service: str) -> Registry:
        if self.opts.static is not None:
            reg = open_registry(f"static://{self.opts.static[service]}")
        else:
            if not self._registries:
                assert self.opts.registry is not None
                self._registries.append(open_registry(self.opts.registry, **self.opts.registry_options))
            return self._registries[0]
        self._registries.append(reg)
        return reg

    # ---- epochs -----------------------------------------------------------------------------
    def begin_epoch(self, loader: Any) -> int:
        """Start reading a new pass over `loader` (called on the loop thread); returns its epoch id."""
        if self._epoch_task is not None:
            self._epoch_task.cancel()
        self.epoch += 1
        self._slots = asyncio.Semaphore(self.opts.prefetch)
        self._delivery.reset(self.epoch)
        for svc in self._services.values():
            svc.clear()
        self._epoch_task = self._spawn(self._read(self.epoch, loader), f"epoch-{self.epoch}")
        return self.epoch

    def consumed(self, epoch: int) -> None:
        """The training loop took a batch of `epoch`: one more may be read ahead."""
        if epoch == self.epoch:
            self._slots.release()

    async def _read(self, epoch: int, loader: Any) -> None:
        loop = asyncio.get_running_loop()
        inputs = self.opts.inputs
        try:
            iterator = await self._loader.submit(loop, lambda: iter(loader))
        except Exception as e:
            self._finish_with_error(epoch, 0, e)
            return

        cache = self.cache

        def next_batch() -> tuple[Any, int, dict[str, FieldArray], StoredRows | None] | object:
            try:
                batch = next(iterator)
            except StopIteration:
                return END_OF_LOADER
            size, fields = extract_inputs(batch, inputs)
            if cache is None:
                return batch, size, fields, None
            return batch, size, *cache.rows_to_send(batch, size, fields)  # only misses go to a teacher

        seq = 0
        while True:
            await self._slots.acquire()
            if epoch != self.epoch:
                return
            try:
                item = await self._loader.submit(loop, next_batch)
            except Exception as e:  # the user's loader raised, or a batch could not be split
                self._finish_with_error(epoch, seq, e)
                return
            if epoch != self.epoch:
                return
            if item is END_OF_LOADER:
                self._delivery.end_at(seq)
                return
            batch, size, fields, cached = cast(tuple[Any, int, dict[str, FieldArray], Any], item)
            job = Job(epoch, seq, batch, size, fields,
                      tuple((n, f.datatype, f.sample_shape) for n, f in fields.items()), cached=cached)
            seq += 1
            if cached is not None:
                settled = self._delivery.from_store(job, hard_labels=self.opts.fallback == "hard_labels")
                if settled == "hard_labels":
                    self.fallback_batches += 1
                if settled:
                    continue
            for svc in self._services.values():
                job.remaining[svc.name] = job.sent
                svc.push(Chunk(job, svc.name, 0, job.sent))

    def _finish_with_error(self, epoch: int, seq: int, error: BaseException) -> None:
        self._delivery.fail_at(epoch, seq, error)

    # ---- dispatch -----------------------------------------------------------------------------
    def _dropped(self, svc: _Service, chunk: Chunk) -> bool:
        """Whether nobody needs this chunk any more (answered, an old epoch, its batch settled)."""
        job = chunk.job
        return (chunk.done or job.epoch != self.epoch or job.error is not None
                or job.outputs.get(svc.name, {}) is None)

    async def _dispatch(self, svc: _Service) -> None:
        while True:
            chunk = await svc.pop()
            if self._dropped(svc, chunk):
                svc.release(chunk)
                continue
            teacher = await self._acquire(svc, chunk)
            if isinstance(teacher, str):  # no teacher declares inputs that take this batch
                self._reject(svc, chunk, teacher)
                continue
            if teacher is None:
                self._no_teacher(svc, chunk)
                continue
            if self._dropped(svc, chunk):  # settled while we waited for a teacher
                svc.release(chunk)
                continue
            assert teacher.meta is not None
            limit = teacher.meta.max_batch_size
            if self.opts.teacher_batch_size:
                limit = min(limit, self.opts.teacher_batch_size)
            if chunk.size > limit:
                rest = Chunk(chunk.job, svc.name, chunk.start + limit, chunk.stop, refusals=dict(chunk.refusals),
                             suspect=chunk.suspect)
                chunk.stop = chunk.start + limit
                svc.push(rest, front=True)
            self._send(svc, chunk, teacher)

    async def _acquire(self, svc: _Service, chunk: Chunk) -> TeacherState | str | None:
        """A teacher with a free slot that accepts this chunk's inputs; a refused chunk goes to another
        teacher than the one that refused it while one is usable. None after no_teacher_timeout; a
        message when no teacher's declared inputs take the batch (the batch's fault, not theirs)."""
        router = svc.router
        started = time.monotonic()
        while True:
            exclude = set(chunk.tried) if chunk.sends else set()
            if chunk.refusals and any(u.key not in chunk.refusals for u in router.usable()):
                exclude |= set(chunk.refusals)
            t = router.pick(frozenset(exclude), chunk.size)
            if t is not None:
                reason = router.misfit(t, chunk.job.signature)
                if reason is None:
                    return t
                if router.fits_another(t, chunk.job.signature):
                    router.mark_incompatible(t, reason)  # the odd one out: it serves something else
                    continue
                if router.metadata_pending() and time.monotonic() - started < self.opts.no_teacher_timeout:
                    await router.wait_change(0.05)  # another teacher's metadata may yet take the batch
                    continue
                return f"teacher {t.endpoint} (model {t.meta.model_name if t.meta else '?'!r}): {reason}"
            waited = router.no_teacher_for()
            if waited >= self.opts.no_teacher_timeout or svc.pool.refused_all():
                return None
            await router.wait_change(None if waited == 0 else self.opts.no_teacher_timeout - waited + 0.01)

    def _reject(self, svc: _Service, chunk: Chunk, reason: str) -> None:
        """Fail this chunk's batch alone (the teachers stay): an error in its place in the training
        loop, or with fallback="hard_labels" the batch without this service's outputs."""
        svc.release(chunk)
        if chunk.job.epoch == self.epoch and self._delivery.reject(
                chunk, reason, hard_labels=self.opts.fallback == "hard_labels"):
            self.rejected_batches += 1

    def _no_teacher(self, svc: _Service, chunk: Chunk) -> None:
        svc.release(chunk)
        if self.opts.fallback != "hard_labels" or svc.pool.refused_all():
            self._fatal(svc.pool.no_teacher_error())
            return
        job = chunk.job
        if job.outputs.get(svc.name, {}) is not None:
            self.fallback_batches += 1
            log.warning("no teacher for service %r: batch %d goes on with hard labels", svc.name, job.seq)
        job.outputs[svc.name] = None
        job.remaining[svc.name] = 0
        self._delivery.maybe_complete(job)

    def _send(self, svc: _Service, chunk: Chunk, t: TeacherState) -> None:
        # Counted now, not when the call task first runs: the dispatcher hands out every queued chunk
        # without yielding, and would otherwise see the teacher's slots free for all of them.
        svc.router.started(t)
        task = self._spawn(self._call(svc, chunk, t), "chunk")
        chunk.sends.add(task)
        chunk.tried.add(t.key)
        self._watch.track(t, task)
        task.add_done_callback(chunk.sends.discard)
        task.add_done_callback(functools.partial(self._call_cancelled, svc, chunk, t))
        loop = asyncio.get_running_loop()
        loop.call_later(svc.router.late_delay(self.opts.timeout), self._watch.late, svc.pool, t, task)
        delay = svc.router.hedge_delay(self.opts.timeout, self.opts.hedge_s, self.opts.adaptive_hedge)
        if delay is not None and len(chunk.tried) == 1:
            loop.call_later(delay, self._hedge, svc, chunk)

    def _hedge(self, svc: _Service, chunk: Chunk) -> None:
        """The chunk is late: if another teacher has a free slot, race it there."""
        if chunk.done or chunk.job.epoch != self.epoch or not chunk.sends or chunk.suspect:
            return  # a suspect (refused once) is never raced: it may make a second teacher raise
        t = svc.router.pick(frozenset(chunk.tried), chunk.size)
        if t is None or svc.router.misfit(t, chunk.job.signature) is not None:
            return
        assert t.meta is not None
        if chunk.size > t.meta.max_batch_size:
            return
        self.hedges += 1
        self._send(svc, chunk, t)

    def _request(self, chunk: Chunk, t: TeacherState) -> ChunkRequest:
        assert t.meta is not None
        job = chunk.job
        return ChunkRequest(
            model_name=t.meta.model_name, model_version=self.opts.model_version,
            request_id=f"{job.epoch}:{job.seq}:{chunk.start}", inputs=job.fields, start=chunk.start,
            stop=chunk.stop, outputs=tuple(self.opts.outputs or t.meta.outputs), declared=t.meta.outputs,
            parameters=self.opts.request_parameters,
        )

    def _call_cancelled(self, svc: _Service, chunk: Chunk, t: TeacherState, task: asyncio.Task[None]) -> None:
        """Account a call cancelled before or while it ran: it lost a hedge race, or we gave up on it."""
        if not task.cancelled():
            return
        if self._watch.was_abandoned(task):  # its teacher hung: re-send the chunk now
            svc.router.abandoned(t)
            if not self._closed:
                self._retry(svc, chunk)
            return
        svc.release(chunk)
        if chunk.done and chunk.winner != t.key:
            svc.router.outpaced(t)
            if not self._closed:
                svc.pool.probe_if_ejected(t)
        else:
            svc.router.cancelled(t)

    async def _call(self, svc: _Service, chunk: Chunk, t: TeacherState) -> None:
        """One chunk at one teacher (already counted in flight by `_send`)."""
        router = svc.router
        started = time.perf_counter()
        try:
            outputs = await t.client.infer(self._request(chunk, t), self.opts.timeout)
            self._delivery.check_fits(chunk, outputs)
        except RequestRejectedError as e:
            router.rejected(t, str(e))
            self._refused(svc, chunk, t, str(e))
            return
        except TeacherOverloadedError as e:
            router.overloaded(t, e.code, e.details)
            self._retry(svc, chunk)
            return
        except TeacherCallError as e:
            router.failed(t, e.code, e.details)
            svc.pool.probe_if_ejected(t)
            self._retry(svc, chunk)
            return
        except TeacherGoneError:  # the teacher left and its channel closed under this call
            router.failed(t, grpc.StatusCode.UNAVAILABLE, "channel closed: the teacher left")
            self._retry(svc, chunk)
            return
        except MalformedAnswerError as e:
            router.lied(t, str(e))
            self._retry(svc, chunk)
            return
        router.succeeded(t, time.perf_counter() - started, chunk.size)
        for key in chunk.refusals:  # it refused what this teacher accepted
            refuser = router.teachers.get(key)
            if refuser is not None and refuser is not t:
                router.struck(refuser)
        chunk.refusals.clear()
        svc.release(chunk)
        if chunk.done:
            return
        chunk.done = True
        chunk.winner = t.key
        for other in list(chunk.sends):
            if other is not asyncio.current_task():
                other.cancel()
        self._delivery.fill(chunk, outputs)

    def _retry(self, svc: _Service, chunk: Chunk) -> None:
        if chunk.done or chunk.job.epoch != self.epoch:
            svc.release(chunk)
            return
        if any(s is not asyncio.current_task() and not s.done() for s in chunk.sends):
            return  # a hedge of it is still out
        self.retries += 1
        chunk.tried.clear()
        svc.release(chunk)
        svc.push(chunk, front=True)

    def _refused(self, svc: _Service, chunk: Chunk, t: TeacherState, message: str) -> None:
        """Teacher `t` refused this chunk's input. The first refusal sends it, alone, to one other
        teacher; a second fails its batch with both teachers' words."""
        if chunk.done or chunk.job.epoch != self.epoch:
            svc.release(chunk)
            return
        chunk.refusals[t.key] = f"{t.endpoint} said {message}"
        if any(s is not asyncio.current_task() and not s.done() for s in chunk.sends):
            return  # a hedge of it is still out: its answer decides
        if len(chunk.refusals) >= 2 or chunk.suspect:
            self._reject(svc, chunk, "the teachers refused it: " + "; ".join(chunk.refusals.values()))
            return
        log.info("teacher %s refused rows %d..%d of batch %d (%s); trying them once on another teacher",
                 t.endpoint, chunk.start, chunk.stop - 1, chunk.job.seq, message)
        self.retries += 1
        chunk.tried.clear()
        svc.release(chunk)
        chunk.suspect = True
        svc.push(chunk, front=True)

    def _fatal(self, error: BaseException) -> None:
        self._delivery.sink.error(self.epoch, error)
        if self._epoch_task is not None:
            self._epoch_task.cancel()
        for svc in self._services.values():
            svc.clear()

    # ---- stats, demand, close -----------------------------------------------------------------
    @property
    def hung_ejections(self) -> int:
        """Teachers found hung by a late call's readiness probe."""
        return self._watch.hung_ejections

    def stats(self) -> ReaderStats:
        return reader_stats(self._meter, {s: svc.router for s, svc in self._services.items()},
                            fallback_batches=self.fallback_batches, retries=self.retries, hedges=self.hedges,
                            rejected_batches=self.rejected_batches, hung_ejections=self.hung_ejections,
                            **(self.cache.counters() if self.cache is not None else {}))

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """An owned task on the data path (reading, dispatch, a chunk), cancelled on close; its
        failure ends the epoch with the error."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _spawn_aux(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """An owned auxiliary task (probe, metadata, closing a departed teacher's channel), cancelled
        on close; its failure is logged, since the teacher it served is at worst unusable."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._aux_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("reader task %s failed", task.get_name(), exc_info=error)
            self._fatal(error)

    def _aux_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning("reader task %s failed: %r", task.get_name(), error)

    async def close(self) -> None:
        """Cancel everything, withdraw demand, close channels and registries."""
        self._closed = self._watch.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.remove_done_callback(self._task_done)
            task.remove_done_callback(self._aux_done)
        # Cancelled again every second until each has ended: grpc.aio loses a cancellation that
        # reaches a call in the loop turn its answer arrives in, and a task that goes on must not
        # hold close for good (a registry watch would).
        pending = set(tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        for task in tasks:  # retrieved, so a task that failed while closing is not logged later
            if not task.cancelled():
                task.exception()
        # A cancelled task keeps its CancelledError, whose traceback holds the task's frames and so
        # the engine: a cycle through `_epoch_task` unless it is dropped too.
        self._tasks.clear()
        self._epoch_task = None
        for cm in reversed(self._closing):
            with contextlib.suppress(Exception):
                await cm.__aexit__(None, None, None)
        for svc in self._services.values():
            await svc.pool.close()
        for reg in self._registries:
            with contextlib.suppress(Exception):
                await reg.close()
        if self.cache is not None:  # write what is queued and seal the shard, off the loop
            cache, self.cache = self.cache, None
            self._delivery.cache = None
            await asyncio.get_running_loop().run_in_executor(None, cache.close)
        self._loader.close()
        # Last, the references from the engine's parts back to it and to the teachers (see
        # CallWatch.close): the engine and the teachers' channels then go by reference counting.
        self._watch.close()
