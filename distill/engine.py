"""The reader's engine: an asyncio program on a background thread. Orchestration only: start-up,
epochs, reading ahead, owned tasks and close; a batch and its delivery are `distill.batches`, a
chunk's dispatch (hedging, retries) is `distill.dispatch`, the pool (`distill.pool`) keeps the
teachers, the router (`distill.router`) and its routing policy (`distill.routing`) choose among
them, the client (`distill.teacher_client`) speaks KServe.

The data path, in order:
  loader thread   next(loader) -> fields -> contiguous numpy arrays      (never on the event loop),
                  a batch per free read-ahead slot, at most `prefetch` not yet consumed besides
                  answered ones waiting for an earlier batch (at most `prefetch` more); the batches
                  read since the loop last looked arrive together (distill.readahead)
  read-ahead      a Job per batch; the chunks of the batches that arrived together go straight to
                  the teachers when the dispatcher is idle, those with the same input shapes in
                  shared calls (distill.bundles)
  dispatcher      one per service: take the oldest chunk, pick a teacher whose declared inputs
                  take the batch (none does: the batch is rejected, the teachers stay), split the
                  chunk to the teacher's max batch, take along queued chunks that may share the
                  call, hand them to the teacher's client (one ModelInfer, a deadline)
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
  delivery        completed jobs go to the reader's sink in loader order (or as they finish); the
                  reader hands one loop turn's batches to the training loop as one item

Exactly-once towards the training loop: a job is delivered once, when all its chunks have an
answer; duplicate answers (hedges, late retries) are dropped. At-least-once towards teachers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Coroutine, Mapping
from typing import Any, cast

from discovery import Registry, open_registry
from distill.batches import (
    Chunk,
    Delivery,
    Job,
    Sink,
    Submitted,
    extract_inputs,
    signature_of,
)
from distill.cache.errors import require_store
from distill.connector import grpc_connector
from distill.dispatch import Dispatcher
from distill.errors import BatchRejectedError
from distill.liveness import CallWatch
from distill.options import ReaderOptions
from distill.pool import Connect, TeacherPool
from distill.readahead import END_OF_LOADER, Failed, Feed, LoaderThread, ReadAhead, depth, pump
from distill.routing_keys import RoutePlan, RouteTable
from distill.routing_rows import check_routed_outputs, offer_routed, routed_rows_to_send
from distill.service import Service
from distill.stats import ConsumptionMeter, ReaderStats, RoutedRows, demand_report, reader_stats
from distill.types import FieldArray, OutputCache, ParameterValue, StoredRows

log = logging.getLogger("distill.reader")


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
        connect = connect or grpc_connector(options.client_tls, options.headers, options.transport)
        self._services = {s: Service(TeacherPool(s, options, connect, self._spawn_aux)) for s in options.services}
        for svc in self._services.values():
            svc.router.on_by_length = self._resize
        if options.prefetch is None:
            self._delivery.on_row_bytes = self._resize
        self._batch_rows = 0  # the most rows a batch of the loader's (or a submitted one) had
        self._registries: list[Registry] = []
        self._closing: list[contextlib.AbstractAsyncContextManager[Any]] = []
        self._loader = LoaderThread()
        self.epoch = 0
        self._epoch_task: asyncio.Task[None] | None = None
        self._slots = ReadAhead(0, self.read_ahead())  # no teachers known yet: prefetch, or PREFETCH
        self._submitted = 0  # batches taken by submit(), their sequence numbers
        self.cache: OutputCache | None = None  # opened in start() when options.cache is set
        self._watch = CallWatch(self._spawn_aux)  # calls in flight per teacher; late ones, hung teachers
        self._dispatcher = Dispatcher(options, self._delivery, self._watch, self._spawn, self._fatal)
        # route_by: each row to its own service (distill.routing_keys), its counters and demand shares.
        self.routes = (RouteTable(options.route_by, options.services, options.route_map, options.default_teacher)
                       if options.route_by is not None else None)
        self._routed = RoutedRows(options.services) if self.routes is not None else None
        self._delivery.routed = self.routes is not None

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
            self._spawn(self._dispatcher.run(svc), f"dispatch-{svc.name}")
            if opts.registry and not opts.static:
                routed = self._routed
                report = demand_report(opts.student_id, self._meter, svc.router,
                                       None if routed is None else functools.partial(routed.share, svc.name),
                                       None if routed is None else functools.partial(routed.counts, svc.name))
                demand = registry.publish_demand(svc.name, report, student_id=opts.student_id)
                await demand.__aenter__()
                self._closing.append(demand)
        if opts.offline and opts.cache is not None:
            # cache_mode="read" never waits for a teacher: a stored sample needs none, and a teacher
            # list left on the command line must not hold up (or fail) a fully stored replay. Teachers
            # that come are asked for the samples the store lacks.
            await self._open_cache(os.fspath(opts.cache))
            return
        for svc in self._services.values():
            await svc.pool.wait_first()
        if self.routes is not None:  # one dict of outputs per batch: the services must answer alike
            metas = {s: [t.meta for t in svc.router.teachers.values() if t.meta is not None]
                     for s, svc in self._services.items()}
            check_routed_outputs(opts, {s: found[0] for s, found in metas.items() if found})
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
        pins = {s: svc.pool.fingerprints for s, svc in self._services.items()}
        cache.fingerprints = lambda: {s: pin.pinned for s, pin in pins.items()}  # recorded in each shard
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
        self._dispatcher.epoch = self.epoch
        self._slots.close()  # the last pass's loader stops reading
        self._slots = ReadAhead(self.epoch, self.read_ahead(), gap=self._slots.gap)  # the same training loop
        self._delivery.reset(self.epoch, self._slots)
        for svc in self._services.values():
            svc.clear()
        if loader is not None:
            self._epoch_task = self._spawn(self._read(self.epoch, loader), f"epoch-{self.epoch}")
        return self.epoch

    def read_ahead(self) -> int:
        """Batches to read ahead now (`distill.readahead.depth`)."""
        rows = max((svc.router.by_length_rows() for svc in self._services.values()), default=0)
        return depth(self.opts.prefetch, self._delivery.row_bytes * self._batch_rows, rows, self._batch_rows,
                     self.opts.read_ahead_mb)

    def _resize(self) -> None:
        """The teachers that batch by length changed, or the batches grew: the pass in progress
        reads as far ahead as they want now (less, once such a teacher leaves)."""
        self._slots.resize(self.read_ahead())

    def begin_submissions(self) -> None:
        """Take batches from `submit` instead of a loader (called once, on the loop thread): one
        pass that never ends, each batch settled as soon as it is answered."""
        self.begin_epoch(None)
        self._delivery.ordered = False

    def submit(self, batch: Submitted, size: int, fields: dict[str, FieldArray], deadline_s: float,
               parameters: Mapping[str, ParameterValue] | None = None, *, plan: RoutePlan | None = None) -> None:
        """Send one batch the training loop made (on the loop thread), its future settled once: with
        the outputs, the teachers' refusal, or a timeout at `deadline_s`. `parameters`: the batch's
        own request parameters (None: the reader's); `plan`: its rows by service, with route_by."""
        job = Job(self.epoch, self._submitted, batch, size, fields, signature_of(fields), parameters=parameters)
        self._submitted += 1
        batch.timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, job, deadline_s)
        self._offer([job], [plan])

    def route(self, batch: Any, size: int, fields: dict[str, FieldArray]) -> RoutePlan | None:
        """A batch's rows by service with route_by (any thread), else None; RouteKeyError for a row
        that names no teacher."""
        return None if self.routes is None else self.routes.plan(self.routes.which(batch, size), fields)

    def _offer(self, jobs: list[Job], plans: list[RoutePlan | None] | None = None) -> None:
        """New batches (in order) to every service's dispatcher, all of a service's at once; with
        route_by (`plans`), each service gets its rows of each batch only."""
        if jobs and (rows := max(job.sent for job in jobs)) > self._batch_rows:
            self._batch_rows = rows
            if self.opts.prefetch is None:
                self._resize()
        if self._routed is not None and plans is not None:
            offer_routed(jobs, plans, self._routed, self._delivery,
                         {s: functools.partial(self._dispatcher.offer, svc) for s, svc in self._services.items()})
            return
        for svc in self._services.values():
            for job in jobs:
                job.remaining[svc.name] = job.sent
            self._dispatcher.offer(svc, [Chunk(job, svc.name, 0, job.sent) for job in jobs])

    def _expire(self, job: Job, deadline_s: float) -> None:
        if job.delivered or job.error is not None:
            return
        job.error = TimeoutError(
            f"submitted batch {job.seq} got no teacher answer within {deadline_s:g} s (retries and failover "
            "included); the teachers may be overloaded or gone: see reader.stats(), or submit it again")
        job.remaining = dict.fromkeys(job.remaining, 0)
        if job.routed is not None:
            job.routed.fail(job.error)
        self._delivery.maybe_complete(job)

    def consumed(self, epoch: int) -> None:
        """The training loop took a batch of `epoch`: one more may be read ahead. Thread-safe: the
        training loop's thread calls it directly, and wakes the loader thread only when it waits."""
        slots = self._slots
        if slots.epoch == epoch:
            slots.give_back()

    async def _read(self, epoch: int, loader: Any) -> None:
        loop = asyncio.get_running_loop()
        inputs = self.opts.inputs
        try:
            iterator = await self._loader.submit(loop, lambda: iter(loader))
        except Exception as e:
            self._finish_with_error(epoch, 0, e)
            return

        cache, key = self.cache, self.opts.key

        def next_batch() -> tuple[Any, int, dict[str, FieldArray], StoredRows | None, Any] | object:
            try:
                batch = next(iterator)
            except StopIteration:
                return END_OF_LOADER
            size, fields = extract_inputs(batch, inputs)
            if self.routes is not None:  # each row's service, here on the loader thread
                return batch, size, *routed_rows_to_send(self.routes, batch, size, fields, cache=cache, key=key)
            if cache is None:
                return batch, size, fields, None, None
            return batch, size, *cache.rows_to_send(batch, size, fields), None  # only misses go to a teacher

        # The loader thread reads ahead on its own, a batch per free read-ahead slot (distill.readahead),
        # and the batches it read since the last look arrive here together.
        slots = self._slots
        feed = Feed(loop)
        self._loader.run(functools.partial(pump, slots, next_batch, feed))
        seq = 0
        try:
            while True:
                fresh: list[Job] = []  # the batches of this bunch that go to teachers, offered together
                plans: list[RoutePlan | None] = []
                for item in await feed.get():
                    if epoch != self.epoch:
                        return
                    if isinstance(item, Failed) or item is END_OF_LOADER:
                        self._offer(fresh, plans)
                        if isinstance(item, Failed):  # the user's loader raised, or a batch could not be split
                            self._finish_with_error(epoch, seq, item.error)
                        else:
                            self._delivery.end_at(seq)
                        return
                    batch, size, fields, cached, plan = cast(tuple[Any, int, dict[str, FieldArray], Any, Any], item)
                    job = Job(epoch, seq, batch, size, fields, signature_of(fields), cached=cached)
                    seq += 1
                    if cached is not None:
                        settled = self._delivery.from_store(job, hard_labels=self.opts.fallback == "hard_labels")
                        if settled == "hard_labels":
                            self._dispatcher.fallback_batches += 1
                        if settled:
                            continue
                    if isinstance(plan, BatchRejectedError):
                        job.error, plan = plan, None
                    fresh.append(job)
                    plans.append(plan)
                self._offer(fresh, plans)
        finally:
            slots.close()  # the loader stops reading for this pass

    def _finish_with_error(self, epoch: int, seq: int, error: BaseException) -> None:
        self._delivery.fail_at(epoch, seq, error)

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

    @property
    def retries(self) -> int:
        """Chunks sent again after a failure, a refusal or a hung teacher."""
        return self._dispatcher.retries

    @property
    def hedges(self) -> int:
        """Late chunks raced on a second teacher."""
        return self._dispatcher.hedges

    @property
    def fallback_batches(self) -> int:
        """Batches that went on with hard labels (no teacher, or missing from the store)."""
        return self._dispatcher.fallback_batches

    @property
    def rejected_batches(self) -> int:
        """Batches the teachers refused."""
        return self._dispatcher.rejected_batches

    def stats(self) -> ReaderStats:
        return reader_stats(self._meter, {s: svc.router for s, svc in self._services.items()},
                            fallback_batches=self.fallback_batches, retries=self.retries, hedges=self.hedges,
                            rejected_batches=self.rejected_batches, hung_ejections=self.hung_ejections,
                            bundled=self._dispatcher.bundled, read_ahead=self._slots.size,
                            routed={} if self._routed is None else self._routed.snapshot(),
                            fingerprints={s: svc.pool.fingerprints.counters() for s, svc in self._services.items()},
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
        self._dispatcher.closed = self._watch.closed = True
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
        self._delivery.on_row_bytes = None  # the engine's method: a cycle through the engine
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
        self._dispatcher.close()
