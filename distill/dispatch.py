"""A chunk's way to a teacher and back: the engine's dispatch, with hedging and retries.

One `Dispatcher` per engine, one `run` task per teacher service. For each chunk: take the oldest
(a "suspect", refused once, goes alone), pick a teacher whose declared inputs take the batch (none
does: the batch is rejected, the teachers stay), split the chunk to the teacher's max batch, send it
(one ModelInfer, a deadline) and judge the outcome by the client's error type:
  answer        copy the outputs into the batch's tensors (``distill.batches.Delivery``)
  failure       the chunk goes back to the head of the queue: another teacher takes it
  rejection     retried once, alone, on another teacher; refused twice, only its batch fails
  overload      the teacher cools down with a smaller limit; the chunk goes elsewhere
  late          past the hedge delay it is raced on a second teacher, and its teacher gets a readiness
                probe (``distill.liveness``): no answer means hung, so the chunk is re-sent now
Duplicate answers (hedges, late retries) are dropped: a chunk is filled once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc

from distill.batches import Chunk, Delivery
from distill.liveness import CallWatch
from distill.options import ReaderOptions
from distill.pool import Spawn, TeacherPool, spawn_closed
from distill.router import TeacherState
from distill.teacher_client import (
    ChunkRequest,
    MalformedAnswerError,
    RequestRejectedError,
    TeacherCallError,
    TeacherGoneError,
    TeacherOverloadedError,
)
from distill.timeline import Timeline

__all__ = ["Dispatcher", "Service"]

log = logging.getLogger("distill.reader")


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


def _ignore(error: BaseException) -> None:
    """The fatal-error handler of a closed engine's dispatcher: nobody listens any more."""


class Dispatcher:
    """Sends chunks to teachers and settles their outcomes; lives on the engine's event loop.

    `spawn` starts an owned data-path task (a call; its failure ends the epoch), `fatal` ends the
    epoch with an error (no teacher at all). `epoch` is the engine's current pass: chunks of other
    passes are dropped. The counters feed ``reader.stats()``.
    """

    def __init__(self, options: ReaderOptions, delivery: Delivery, watch: CallWatch, spawn: Spawn,
                 fatal: Callable[[BaseException], None]) -> None:
        self.opts = options
        self.delivery = delivery
        self.watch = watch
        self._spawn = spawn
        self._fatal = fatal
        self.epoch = 0
        self.closed = False
        self.fallback_batches = 0
        self.rejected_batches = 0
        self.retries = 0
        self.hedges = 0
        self.timeline = Timeline()

    def close(self) -> None:
        """Stop acting, and drop the engine's methods (a reference cycle through the engine)."""
        self.closed = True
        self._spawn = spawn_closed
        self._fatal = _ignore
        self.timeline.close()

    def _dropped(self, svc: Service, chunk: Chunk) -> bool:
        """Whether nobody needs this chunk any more (answered, an old epoch, its batch settled)."""
        job = chunk.job
        return (chunk.done or job.epoch != self.epoch or job.error is not None
                or job.outputs.get(svc.name, {}) is None)

    def offer(self, svc: Service, chunk: Chunk) -> None:
        """A new chunk of `svc`: sent at once when the dispatcher is idle and a teacher takes it as it
        is (a free slot, inputs it declares, within its batch limit), else queued for the dispatcher.
        Sending at once skips waking the dispatcher's task for every batch; with nothing queued or
        being placed, the order of sends is the same."""
        if svc.idle and not svc.queue and not svc.suspects and not chunk.suspect and not self.closed:
            router = svc.router
            t = router.pick(frozenset(), chunk.size)
            if t is not None and router.misfit(t, chunk.job.signature) is None:
                assert t.meta is not None
                limit = t.meta.max_batch_size
                if self.opts.teacher_batch_size:
                    limit = min(limit, self.opts.teacher_batch_size)
                if chunk.size <= limit:
                    self._send(svc, chunk, t)
                    return
        svc.push(chunk)

    async def run(self, svc: Service) -> None:
        """Hand out `svc`'s chunks to its teachers until cancelled (one task per service)."""
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

    async def _acquire(self, svc: Service, chunk: Chunk) -> TeacherState | str | None:
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

    def _reject(self, svc: Service, chunk: Chunk, reason: str) -> None:
        """Fail this chunk's batch alone (the teachers stay): an error in its place in the training
        loop, or with fallback="hard_labels" the batch without this service's outputs."""
        svc.release(chunk)
        if chunk.job.epoch == self.epoch and self.delivery.reject(
                chunk, reason, hard_labels=self.opts.fallback == "hard_labels"):
            self.rejected_batches += 1

    def _no_teacher(self, svc: Service, chunk: Chunk) -> None:
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
        self.delivery.maybe_complete(job)

    def _send(self, svc: Service, chunk: Chunk, t: TeacherState) -> None:
        # Counted now, not when the call task first runs: the dispatcher hands out every queued chunk
        # without yielding, and would otherwise see the teacher's slots free for all of them.
        svc.router.started(t)
        task = self._spawn(self._call(svc, chunk, t), "chunk")
        chunk.sends.add(task)
        chunk.tried.add(t.key)
        self.watch.track(t, task)
        task.add_done_callback(functools.partial(self._call_done, svc, chunk, t))
        # The late check and the hedge are entries of one timeline, not a loop timer each per chunk.
        self.timeline.call_later(svc.router.late_delay(self.opts.timeout), self.watch.late, svc.pool, t, task)
        delay = svc.router.hedge_delay(self.opts.timeout, self.opts.hedge_s, self.opts.adaptive_hedge)
        if delay is not None and len(chunk.tried) == 1:
            self.timeline.call_later(delay, self._hedge, svc, chunk)

    def _hedge(self, svc: Service, chunk: Chunk) -> None:
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
            parameters=self.opts.request_parameters, owned=self.delivery.whole(chunk),
        )

    def _call_done(self, svc: Service, chunk: Chunk, t: TeacherState, task: asyncio.Task[None]) -> None:
        """A call ended (one done-callback does all of it): it is no longer one of the chunk's sends
        nor in flight at `t`; a call cancelled before or while it ran is accounted (it lost a hedge
        race, or we gave up on it)."""
        chunk.sends.discard(task)
        self.watch.untrack(t, task)
        if not task.cancelled():
            return
        if self.watch.was_abandoned(task):  # its teacher hung: re-send the chunk now
            svc.router.abandoned(t)
            if not self.closed:
                self._retry(svc, chunk)
            return
        svc.release(chunk)
        if chunk.done and chunk.winner != t.key:
            svc.router.outpaced(t)
            if not self.closed:
                svc.pool.probe_if_ejected(t)
        else:
            svc.router.cancelled(t)

    async def _call(self, svc: Service, chunk: Chunk, t: TeacherState) -> None:
        """One chunk at one teacher (already counted in flight by `_send`)."""
        router = svc.router
        started = time.perf_counter()
        request = self._request(chunk, t)
        try:
            outputs = await t.client.infer(request, self.opts.timeout)
            self.delivery.check_fits(chunk, outputs)
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
        self.delivery.fill(chunk, outputs, owned=request.owned)

    def _retry(self, svc: Service, chunk: Chunk) -> None:
        if chunk.done or chunk.job.epoch != self.epoch:
            svc.release(chunk)
            return
        if any(s is not asyncio.current_task() and not s.done() for s in chunk.sends):
            return  # a hedge of it is still out
        self.retries += 1
        chunk.tried.clear()
        svc.release(chunk)
        svc.push(chunk, front=True)

    def _refused(self, svc: Service, chunk: Chunk, t: TeacherState, message: str) -> None:
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
