"""Which teacher takes a chunk next: the dispatcher's wait for a teacher that can.

A chunk may wait: for a free slot, for a teacher's metadata (another teacher may yet take a batch
the first one's inputs refuse), or for a teacher that can compute what it asks for. Each wait is
bounded by the reader's `no_teacher_timeout`; what ends it says what happens to the chunk.
"""

from __future__ import annotations

import time

from distill.batches import Chunk
from distill.capabilities import Needs, NoCapableTeacherError, unanswerable
from distill.pool import TeacherPool
from distill.teacher_state import TeacherState

__all__ = ["acquire"]


async def acquire(pool: TeacherPool, service: str, chunk: Chunk, needs: Needs,
                  no_teacher_timeout: float) -> TeacherState | str | NoCapableTeacherError | None:
    """A teacher of `pool` with a free slot that takes `chunk`'s inputs and can compute `needs`; a
    refused chunk goes to another teacher than the one that refused it while one is usable.

    None after `no_teacher_timeout` with no usable teacher (or every teacher refused); a message
    when no teacher's declared inputs take the batch (its fault, not theirs); an error when no live
    teacher can compute it (`distill.capabilities.unanswerable`)."""
    router = pool.router
    started = time.monotonic()
    while True:
        exclude = set(chunk.tried) if chunk.sends else set()
        if chunk.refusals and any(u.key not in chunk.refusals for u in router.usable()):
            exclude |= set(chunk.refusals)
        t = router.pick(frozenset(exclude), chunk.size, needs)
        if t is not None:
            reason = router.misfit(t, chunk.job.signature)
            if reason is None:
                return t
            if router.fits_another(t, chunk.job.signature):
                router.mark_incompatible(t, reason)  # the odd one out: it serves something else
                continue
            if router.metadata_pending() and time.monotonic() - started < no_teacher_timeout:
                await router.wait_change(0.05)  # another teacher's metadata may yet take the batch
                continue
            return f"teacher {t.endpoint} (model {t.meta.model_name if t.meta else '?'!r}): {reason}"
        waited = router.no_teacher_for()
        if (error := unanswerable(service, chunk, needs, router.teachers.values())) is not None:
            return error
        # Only teachers that cannot answer it are usable: it waits for one that can, as for any teacher.
        if (waited == 0 and not any(u.can(needs) for u in router.usable())
                and (waited := time.monotonic() - started) >= no_teacher_timeout):
            return unanswerable(service, chunk, needs, router.teachers.values(), waited)
        if waited >= no_teacher_timeout or pool.refused_all():
            return None
        await router.wait_change(None if waited == 0 else no_teacher_timeout - waited + 0.01)
