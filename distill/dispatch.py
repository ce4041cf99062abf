"""A chunk's way to a teacher and back: the engine's dispatch, with hedging and retries.

One `Dispatcher` per engine, one `run` task per teacher service. For each chunk: take the oldest
(a "suspect", refused once, goes alone), pick a teacher whose declared inputs take the batch
(``distill.acquire``; none does: the batch is rejected, the teachers stay), split the chunk to
the teacher's max batch, take along the chunks that may share its call (``distill.bundles``),
send them (one ModelInfer, a deadline) and judge the outcome by the client's error type:
  answer        copy the outputs into the batch's tensors (``distill.batches.Delivery``)
  failure       the chunk goes back to the head of the queue: another teacher takes it
  rejection     retried once, alone, on another teacher; refused twice, only its batch fails (a
                bundle's chunks are each sent again alone first, nothing held against them)
  overload      the teacher cools down with a smaller limit; the chunk goes elsewhere
  late          past the hedge delay it is raced on a second teacher, and its teacher gets a readiness
                probe (``distill.liveness``): no answer means hung, so the chunk is re-sent now
Duplicate answers (hedges, late retries) are dropped: a chunk is filled once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterable

import grpc

from distill.acquire import acquire
from distill.batches import Chunk, Delivery
from distill.bundles import bundle_pieces, fits_with, split_outputs
from distill.call_errors import (
    MalformedAnswerError,
    RequestRejectedError,
    TeacherCallError,
    TeacherGoneError,
    TeacherOverloadedError,
)
from distill.capabilities import Needs, NoCapableTeacherError, needs_of
from distill.errors import BatchRejectedError, InputRefusal
from distill.liveness import CallWatch
from distill.options import ReaderOptions
from distill.outputs import default_outputs
from distill.pool import Spawn, spawn_closed
from distill.service import Service
from distill.teacher_client import ChunkRequest
from distill.teacher_state import TeacherState
from distill.timeline import Timeline

__all__ = ["Dispatcher"]

log = logging.getLogger("distill.reader")


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
        # What a completed batch with rows of inf or NaN becomes (`Delivery.fill`): the options' to say.
        delivery.refuse_nonfinite = options.nonfinite == "error"
        delivery.hard_labels = options.fallback == "hard_labels"
        self.watch = watch
        self._spawn = spawn
        self._fatal = fatal
        self.epoch = 0
        self.closed = False
        self.fallback_batches = 0
        self.rejected_batches = 0
        self.retries = 0
        self.hedges = 0
        self.bundled = 0  # chunks that shared a call with another chunk
        self.timeline = Timeline()
        self._bundles: dict[asyncio.Task[None], list[Chunk]] = {}  # calls that carry several chunks

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

    def _limit(self, t: TeacherState) -> int:
        assert t.meta is not None
        limit = t.meta.max_batch_size
        if self.opts.teacher_batch_size:
            limit = min(limit, self.opts.teacher_batch_size)
        return limit

    def offer(self, svc: Service, chunks: list[Chunk]) -> None:
        """New chunks of `svc` (batches that arrived together, in order): sent at once when the
        dispatcher is idle and a teacher takes them as they are (a free slot, inputs it declares,
        within its batch limit), else queued for the dispatcher. Sending at once skips waking the
        dispatcher's task for every batch; with nothing queued or being placed, the order of sends
        is the same. Chunks with the same inputs share a call (`distill.bundles`), at most their
        rows over the usable teachers each, so a bunch still spreads over the teachers."""
        at = 0
        if svc.idle and not svc.queue and not svc.suspects and not self.closed:
            router = svc.router
            share = self._share(svc, chunks, sys.maxsize)
            while at < len(chunks):
                first = chunks[at]
                t = router.pick(frozenset(), first.size, self._needs(first))
                if t is None or router.misfit(t, first.job.signature) is not None:
                    break
                limit = self._limit(t)
                if first.size > limit:
                    break
                cap = min(limit, max(share, first.size))
                end = at + 1
                rows = first.size
                while end < len(chunks) and rows + chunks[end].size <= cap and fits_with(first, chunks[end]):
                    rows += chunks[end].size
                    end += 1
                self._send(svc, chunks[at:end], t)
                at = end
        for chunk in chunks[at:]:
            svc.push(chunk)

    def _share(self, svc: Service, waiting: Iterable[Chunk], budget: int) -> int:
        """The rows one call may carry: the waiting chunks' rows (counted up to `budget` per teacher)
        over the usable teachers, so no call takes more than its teacher's share of the waiting work
        even when only one teacher has a free slot; 0 without bundling (a call per chunk)."""
        if not self.opts.bundle:
            return 0
        teachers = max(1, len(svc.router.usable()))
        total = 0
        for c in waiting:
            if total >= budget * teachers:
                break
            total += c.size
        return -(-total // teachers)

    def _take_queued(self, svc: Service, first: Chunk, limit: int) -> list[Chunk]:
        """`first` and the queued chunks after it that may share its call (`distill.bundles`)."""
        chunks = [first]
        if not svc.queue or first.size >= limit:
            return chunks
        cap = min(limit, max(first.size, self._share(svc, itertools.chain([first], svc.queue), limit)))
        rows = first.size
        while svc.queue:
            nxt = svc.queue[0]
            if self._dropped(svc, nxt):
                svc.queue.popleft()
                continue
            if rows + nxt.size > cap or not fits_with(first, nxt):
                break
            chunks.append(svc.queue.popleft())
            rows += nxt.size
        return chunks

    async def run(self, svc: Service) -> None:
        """Hand out `svc`'s chunks to its teachers until cancelled (one task per service)."""
        while True:
            chunk = await svc.pop()
            if self._dropped(svc, chunk):
                svc.release(chunk)
                continue
            teacher = await acquire(svc.pool, svc.name, chunk, self._needs(chunk), self.opts.no_teacher_timeout)
            if isinstance(teacher, str):  # no teacher declares inputs that take this batch
                self._reject(svc, chunk, teacher)
                continue
            if isinstance(teacher, NoCapableTeacherError):  # none can compute what it asks for
                self._reject(svc, chunk, str(teacher), teacher)
                continue
            if teacher is None:
                self._no_teacher(svc, chunk)
                continue
            if self._dropped(svc, chunk):  # settled while we waited for a teacher
                svc.release(chunk)
                continue
            limit = self._limit(teacher)
            if chunk.size > limit:
                rest = Chunk(chunk.job, svc.name, chunk.start + limit, chunk.stop, refusals=dict(chunk.refusals),
                             suspect=chunk.suspect)
                chunk.stop = chunk.start + limit
                svc.push(rest, front=True)
            self._send(svc, self._take_queued(svc, chunk, limit), teacher)

    def _reject(self, svc: Service, chunk: Chunk, reason: str, error: BatchRejectedError | None = None) -> None:
        """Fail this chunk's batch alone (the teachers stay): an error (`error`, else one naming
        `reason`) in its place in the training loop, or with fallback="hard_labels" the batch without
        this service's outputs."""
        svc.release(chunk)
        if chunk.job.epoch == self.epoch and self.delivery.reject(
                chunk, reason, hard_labels=self.opts.fallback == "hard_labels", error=error):
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

    def _send(self, svc: Service, chunks: list[Chunk], t: TeacherState) -> None:
        """One call to `t` carrying `chunks` (one, or a bundle of several)."""
        # Counted now, not when the call task first runs: the dispatcher hands out every queued chunk
        # without yielding, and would otherwise see the teacher's slots free for all of them.
        rows = sum(c.size for c in chunks)
        svc.router.started(t, rows)
        task = self._spawn(self._call(svc, chunks, t), "chunk")
        if len(chunks) > 1:
            self._bundles[task] = chunks
            self.bundled += len(chunks)
        self.watch.track(t, task)
        task.add_done_callback(functools.partial(self._call_done, svc, chunks, t, rows))
        # The late check and the hedge are entries of one timeline, not a loop timer each per chunk.
        self.timeline.call_later(svc.router.late_delay(self.opts.timeout), self.watch.late, svc.pool, t, task)
        first_sends = []
        for chunk in chunks:
            chunk.sends.add(task)
            chunk.tried.add(t.key)
            if len(chunk.tried) == 1:
                first_sends.append(chunk)
        delay = svc.router.hedge_delay(self.opts.timeout, self.opts.hedge_s, self.opts.adaptive_hedge)
        if delay is not None and first_sends:
            self.timeline.call_later(delay, self._hedge, svc, first_sends)

    def _hedge(self, svc: Service, chunks: list[Chunk]) -> None:
        """The chunks of a call are late: if another teacher has a free slot, race the ones still
        unanswered there, together (one slot, as they came). When every other teacher is full, look
        again a hedge delay later: a late call holding several batches is worth the wait."""
        late = [c for c in chunks if not c.done and c.job.epoch == self.epoch and c.sends and not c.suspect]
        if not late or self.closed:  # a suspect (refused once) is never raced: it may make a second teacher raise
            return
        rows = sum(c.size for c in late)
        tried = frozenset().union(*(c.tried for c in late))
        t = svc.router.pick(tried, rows, self._needs(late[0]))
        if t is None:
            delay = svc.router.hedge_delay(self.opts.timeout, self.opts.hedge_s, self.opts.adaptive_hedge)
            if delay is not None and any(u.key not in tried for u in svc.router.usable()):
                self.timeline.call_later(delay, self._hedge, svc, late)
            return
        if svc.router.misfit(t, late[0].job.signature) is not None:
            return
        limit = self._limit(t)
        while late and rows > limit:
            rows -= late.pop().size
        if not late:
            return
        self.hedges += len(late)
        self._send(svc, late, t)

    def _needs(self, chunk: Chunk) -> Needs:
        """What `chunk` asks a teacher to compute (computed once per parameter mapping and inputs)."""
        job = chunk.job
        return needs_of(self.opts.request_parameters if job.parameters is None else job.parameters, job.fields)

    def _request(self, chunks: list[Chunk], t: TeacherState) -> ChunkRequest:
        assert t.meta is not None
        first = chunks[0]
        job = first.job
        if len(chunks) == 1:
            start, stop, pieces, rid = first.start, first.stop, None, f"{job.epoch}:{job.seq}:{first.start}"
        else:  # a bundle: the rows of several batches; its answer is cut apart and copied out
            start, stop, pieces = 0, sum(c.size for c in chunks), bundle_pieces(chunks)
            rid = f"{job.epoch}:{job.seq}:{first.start}+{len(chunks) - 1}"
        return ChunkRequest(
            model_name=t.meta.model_name, model_version=self.opts.model_version, request_id=rid, inputs=job.fields,
            start=start, stop=stop, outputs=tuple(self.opts.outputs or default_outputs(t.meta.outputs, job.text)),
            declared=t.meta.outputs,
            parameters=self.opts.request_parameters if job.parameters is None else job.parameters,
            owned=len(chunks) == 1 and self.delivery.whole(first),
            pieces=pieces,
        )

    def _call_done(self, svc: Service, chunks: list[Chunk], t: TeacherState, rows: int,
                   task: asyncio.Task[None]) -> None:
        """A call ended (one done-callback does all of it): it is no longer one of its chunks' sends
        nor in flight at `t`, nor are its `rows`; a call cancelled before or while it ran is
        accounted (it lost a hedge race, or we gave up on it)."""
        for chunk in chunks:
            chunk.sends.discard(task)
        self._bundles.pop(task, None)
        self.watch.untrack(t, task)
        svc.router.ended(t, rows)
        if not task.cancelled():
            return
        if self.watch.was_abandoned(task):  # its teacher hung: re-send the chunks now
            svc.router.abandoned(t)
            if not self.closed:
                self._retry_all(svc, chunks)
            return
        for chunk in chunks:
            svc.release(chunk)
        if all(chunk.done and chunk.winner != t.key for chunk in chunks):
            svc.router.lost_race(t)
            if not self.closed:
                svc.pool.probe_if_ejected(t)
        else:
            svc.router.cancelled(t)

    def _finished(self, task: asyncio.Task[None]) -> bool:
        """Whether nothing `task` carries is still wanted (a bundle is cancelled only then)."""
        chunks = self._bundles.get(task)
        return chunks is None or all(c.done for c in chunks)

    async def _call(self, svc: Service, chunks: list[Chunk], t: TeacherState) -> None:
        """One call at one teacher (already counted in flight by `_send`), for one chunk or a bundle."""
        router = svc.router
        started = time.perf_counter()
        request = self._request(chunks, t)
        try:
            outputs = await t.client.infer(request, self.opts.timeout)
            parts = [outputs] if len(chunks) == 1 else split_outputs(outputs, chunks)
            for chunk, part in zip(chunks, parts, strict=True):
                self.delivery.check_fits(chunk, part)
        except RequestRejectedError as e:
            router.rejected(t, str(e))
            if len(chunks) == 1:
                self._refused(svc, chunks[0], t, str(e), e.refusal)
            else:  # which batch it refused is unknown: each goes again alone, nothing held against it
                log.info("teacher %s refused a request of %d batches (%s); sending each alone", t.endpoint,
                         len(chunks), e)
                for chunk in chunks:
                    chunk.alone = True
                self._retry_all(svc, chunks)
            return
        except TeacherOverloadedError as e:
            router.overloaded(t, e.code, e.details)
            self._retry_all(svc, chunks)
            return
        except TeacherCallError as e:
            router.failed(t, e.code, e.details)
            svc.pool.probe_if_ejected(t)
            self._retry_all(svc, chunks)
            return
        except TeacherGoneError:  # the teacher left and its channel closed under this call
            router.failed(t, grpc.StatusCode.UNAVAILABLE, "channel closed: the teacher left")
            self._retry_all(svc, chunks)
            return
        except MalformedAnswerError as e:
            router.answer_malformed(t, str(e))
            self._retry_all(svc, chunks)
            return
        router.succeeded(t, time.perf_counter() - started, request.size)
        me = asyncio.current_task()
        for chunk, part in zip(chunks, parts, strict=True):
            for key in chunk.refusals:  # it refused what this teacher accepted
                refuser = router.teachers.get(key)
                if refuser is not None and refuser is not t:
                    router.refused_what_another_accepted(refuser)
            chunk.refusals.clear()
            svc.release(chunk)
            if chunk.done:
                continue
            chunk.done = True
            chunk.winner = t.key
            for other in list(chunk.sends):
                if other is not me and self._finished(other):
                    other.cancel()
            self.rejected_batches += self.delivery.fill(chunk, part, owned=request.owned)

    def _retry_all(self, svc: Service, chunks: list[Chunk]) -> None:
        for chunk in reversed(chunks):  # pushed at the head: the first goes first again
            self._retry(svc, chunk)

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

    def _refused(self, svc: Service, chunk: Chunk, t: TeacherState, message: str,
                 refusal: InputRefusal | None = None) -> None:
        """Teacher `t` refused this chunk's input (with the facts of it, when it sent them). The first
        refusal sends it, alone, to one other teacher; a second fails its batch with both teachers'
        words and the facts."""
        if chunk.done or chunk.job.epoch != self.epoch:
            svc.release(chunk)
            return
        chunk.refusals[t.key] = f"{t.endpoint} said {message}"
        if refusal is not None:  # the request held this chunk's rows alone: its row 0 is the chunk's start
            index = (chunk.start + refusal.index[0], *refusal.index[1:]) if refusal.index else ()
            chunk.refusal = dataclasses.replace(refusal, index=index)
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
