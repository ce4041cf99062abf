"""Choosing a teacher for each chunk, and learning how much each teacher can take.

Per teacher the router keeps: requests in flight, an adaptive in-flight limit, an EWMA of chunk
latency, and a failure streak. Which of the teachers with a free slot takes a chunk is the routing
policy's choice (``distill.routing``; by default power-of-two choices on expected completion time,
``routing=`` selects another); health and limits stay here, whatever the policy.

The in-flight limit follows the latency gradient: it grows by about one per round trip while
latency stays near the best seen (the teacher still has headroom: its batcher absorbs more),
and shrinks when latency climbs (requests only queue there), the faster the further it climbed.
Latency here is the EWMA of the answers' latencies, and the best seen is the lowest a slower
average has been, from the fifth answer on: one answer's latency includes the student's own delays
(its event loop busy with the answers of other teachers and services, the training loop holding
the GIL), which a single sample (or a first call that was alone at the teacher) compared with the
luckiest one would read as a queue at the teacher. EDL kept one request in flight per
teacher; a dynamic-batching teacher needs several to stay busy across network round trips. A
teacher that batches padded rows by length is the exception: it needs many rows queued to fill its
batches, and a padded request waits for its slowest row, which the gradient would read as
overload. Such a teacher says so (`TeacherMetadata.batches_by_length`), and its limit counts rows,
not requests, however they are cut into calls (a student's batches of 16 rows, or bundles of
several): from a quarter of `RouterConfig.by_length_rows`, each answer within half the reader's
`timeout` adds its own rows (twice the rows a round trip) up to all of them, however long the
answer took within that, and each slower one takes a tenth off (a CPU teacher draining 512 long
rows would take longer than the 10 s default); overload answers halve it. Other teachers' floor is
`RouterConfig.min_limit`. The gradient measures latency against the best seen, not the usual
level: against a saturated CV teacher a deeper queue is backlog that new teachers then inherit,
which is why a teacher that wants a deep queue has to say so.

Failures eject a teacher with exponential backoff (connection and deadline errors), or mark it
incompatible (wrong model, an answer that contradicts its own metadata, or refusing inputs that
other teachers accept), logged once with the reason. Overload (RESOURCE_EXHAUSTED, or a CANCELLED
the student did not cause) never ejects: the teacher's limit halves and it takes no new chunk for
a short, growing cool-down, while it stays usable. A teacher that refuses one request (bad input,
a model that raises on it) is not judged at all: that is the request's fault until another
teacher accepts the same input. An ejected teacher gets real work again only after
a cheap readiness probe answers in time: a hung teacher (stopped process, dead GPU, partition)
accepts connections but never answers, and without the probe every retry would cost a deadline.
A teacher that keeps losing hedge races is treated as slow: its limit halves, and after
`lost_races_eject` lost races in a row it is ejected like a failing one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Mapping

import grpc

from discovery.aio import deadline
from distill.capabilities import Needs, Offers, describe_offers
from distill.config import RouterConfig
from distill.routing import PolicySpec, RouteRequest, RoutingPolicy, make_policy
from distill.teacher_client import InferenceClient
from distill.teacher_state import TeacherState
from distill.types import Signature, TeacherMetadata

__all__ = ["Router", "RouterConfig", "Signature"]

log = logging.getLogger(__name__)

_EJECT_CODES = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
}
_MISMATCH_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
}
_OVERLOAD_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}

class Router:
    """Teachers of one service; lives on the engine's event loop."""

    def __init__(self, service: str, config: RouterConfig | None = None, policy: PolicySpec = "power_of_two",
                 deadline_s: float | None = None) -> None:
        self.service = service
        self.config = config or RouterConfig()
        # A chunk's deadline at one teacher (the reader's `timeout`): a teacher that batches by length
        # holds its rows in flight only while its answers come within half of it.
        self.deadline_s = deadline_s
        self.policy: RoutingPolicy = make_policy(policy, self.config.stale_after_s)
        self.teachers: dict[str, TeacherState] = {}
        self._changed = asyncio.Event()
        self._no_teacher_since: float | None = time.monotonic()
        # Called when the teachers that batch by length change (one joins with its metadata, its
        # metadata arrives later, or it leaves or turns incompatible): the engine reads as far ahead as
        # they want. Only for such a teacher: a pool of thousands that do not would otherwise recount
        # the pool at every join.
        self.on_by_length: Callable[[], None] | None = None

    # ---- membership ------------------------------------------------------------------------
    def add(self, key: str, endpoint: str, client: InferenceClient, meta: TeacherMetadata | None) -> TeacherState:
        t = TeacherState(key, endpoint, client, self.config.initial_limit, meta)
        self.teachers[key] = t
        self._met(t)
        return t

    def remove(self, key: str) -> TeacherState | None:
        t = self.teachers.pop(key, None)
        if t is not None:
            counted = self._by_length(t)
            t.removed = True
            self.notify()
            if counted:
                self._by_length_changed()
        return t

    def set_metadata(self, t: TeacherState, meta: TeacherMetadata) -> None:
        counted = self._by_length(t)
        if t.meta is not None and t.meta != meta and t.incompatible is not None:
            log.info("teacher %s of service %r registered new metadata; checking it again", t.endpoint,
                     self.service)
            t.incompatible = None
        t.meta = meta
        t.checked.clear()
        self._met(t, counted)

    def _met(self, t: TeacherState, counted: bool = False) -> None:
        """`t` joined or its metadata arrived: bring its limit within its floor and ceiling (rows
        or calls, as it batches), wake the choosers, and tell the engine when it batches by length,
        or did (`counted`)."""
        if self._by_length(t) and not counted:  # its limit counts rows from now: a quarter to start
            t.limit = max(t.limit, self.config.by_length_rows / 4)
        t.limit = min(max(t.limit, self.floor(t)), self.ceiling(t))
        self.notify()
        if counted or self._by_length(t):
            self._by_length_changed()

    def _by_length_changed(self) -> None:
        if self.on_by_length is not None:
            self.on_by_length()

    @staticmethod
    def _by_length(t: TeacherState) -> bool:
        """Whether `t` counts as a member that batches padded rows by length."""
        return not t.removed and t.incompatible is None and t.by_length

    def floor(self, t: TeacherState) -> float:
        """The least limit the latency gradient leaves `t`: `min_limit` calls (a teacher that batches
        by length has no gradient: its rows grow with every answer in time, see `succeeded`)."""
        return 1.0 if t.by_length else self.config.min_limit

    def ceiling(self, t: TeacherState) -> float:
        """The most the gradient grows `t`'s limit to: `by_length_rows` rows for a teacher that
        batches by length (rows, not latency, set its limit), `max_limit` calls for any other."""
        return float(self.config.by_length_rows if t.by_length else self.config.max_limit)

    def set_offers(self, t: TeacherState, offers: Offers) -> None:
        """`t`'s record declares what it can compute (on joining, or a new record): chunks waiting for
        a capable teacher look again."""
        if offers != t.offers:
            t.offers = offers
            self.notify()

    def mark_incompatible(self, t: TeacherState, reason: str) -> None:
        if t.incompatible is None:
            log.error("teacher %s of service %r ejected: %s", t.endpoint, self.service, reason)
        counted = self._by_length(t)
        t.incompatible = reason
        self.notify()
        if counted:
            self._by_length_changed()

    def misfit(self, t: TeacherState, signature: Signature) -> str | None:
        """Why teacher `t`'s declared inputs do not take a batch of this signature; None if they do."""
        if signature in t.checked:
            return None
        assert t.meta is not None
        for name, dtype, shape in signature:
            want = t.meta.inputs.get(name)
            if want is None:
                return f"it has no input {name!r} (its inputs: {sorted(t.meta.inputs)})"
            if not want.accepts(dtype, shape):
                return (f"input {name!r} is {dtype}{list(shape)} per sample here, the teacher expects "
                        f"{want.datatype}{list(want.shape)}")
        t.checked.add(signature)
        return None

    def metadata_pending(self) -> bool:
        """Whether some member's metadata is still on its way (asked, no answer or error yet)."""
        return any(t.meta is None and not t.removed and not t.last_error for t in self.teachers.values())

    def fits_another(self, t: TeacherState, signature: Signature) -> bool:
        """Whether a teacher other than `t` (with metadata, not incompatible) declares inputs that take
        this signature: then `t` is the odd one out, not the batch."""
        return any(o is not t and o.meta is not None and o.incompatible is None and not o.removed
                   and self.misfit(o, signature) is None for o in self.teachers.values())

    def by_length_rows(self) -> int:
        """Rows this student keeps in flight to its members that batch padded rows by length,
        `RouterConfig.by_length_rows` each (usable or not: an ejected one comes back): what the
        reader reads ahead for them when `prefetch` is not set."""
        return self.config.by_length_rows * sum(1 for t in self.teachers.values() if self._by_length(t))

    # ---- choosing ---------------------------------------------------------------------------
    def notify(self) -> None:
        self._changed.set()
        self.usable()  # the no-teacher clock starts the moment the last usable teacher goes

    def usable(self) -> list[TeacherState]:
        now = time.monotonic()
        ts = [t for t in self.teachers.values() if t.usable(now)]
        if ts:
            self._no_teacher_since = None
        elif self._no_teacher_since is None:
            self._no_teacher_since = now
        return ts

    def no_teacher_for(self) -> float:
        """Seconds without any usable teacher (0 while there is one)."""
        self.usable()
        return 0.0 if self._no_teacher_since is None else time.monotonic() - self._no_teacher_since

    def pick(self, exclude: frozenset[str] = frozenset(), rows: int = 0, needs: Needs | None = None
             ) -> TeacherState | None:
        """A teacher with a free slot, chosen by the routing policy among those not in `exclude` whose
        offers cover `needs` (`distill.capabilities`; None: any); None when all are full, unusable or
        unable. `rows`: the chunk's size, for the policy."""
        free = [t for t in self.usable() if t.has_slot() and t.key not in exclude and (needs is None or t.can(needs))]
        if not free:
            return None
        return self.policy.choose(free, RouteRequest(self.service, rows))

    async def wait_change(self, timeout: float | None) -> None:
        """Until a slot frees, membership changes, or an ejection ends (or `timeout`)."""
        now = time.monotonic()
        cooled = [t for t in self.teachers.values() if 0 < t.cool_until <= now]
        for t in cooled:  # a cool-down that ended since the caller's pick: pick again now
            t.cool_until = 0.0
        if cooled:
            return
        pending = [until - now for t in self.teachers.values() if not t.removed
                   for until in (t.ejected_until, t.cool_until) if until > now]
        if pending:
            timeout = min(pending) if timeout is None else min(timeout, *pending)
        self._changed.clear()
        if timeout is None:  # the common wait, for a slot: no deadline to keep
            await self._changed.wait()
            return
        # deadline (asyncio.timeout), not wait_for: on Python 3.11, wait_for returns normally when
        # the event is set in the same loop turn as the waiter is cancelled, swallowing the
        # cancellation, and the engine's dispatch loop then waits forever at close.
        try:
            async with deadline(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass

    # ---- outcomes ---------------------------------------------------------------------------
    def started(self, t: TeacherState, rows: int = 1) -> None:
        """A call of `rows` rows was sent to `t` (`ended` gives them back, whatever its outcome)."""
        t.in_flight += 1
        t.rows_in_flight += rows

    def ended(self, t: TeacherState, rows: int) -> None:
        """A call of `rows` rows to `t` is over (after its outcome was accounted, or cancelled)."""
        t.rows_in_flight -= rows
        if t.by_length:
            self._changed.set()  # rows are its slots

    def succeeded(self, t: TeacherState, latency_s: float, samples: int) -> None:
        was_full = t.in_flight >= max(1, int(t.limit))
        t.in_flight -= 1
        t.ok += 1
        t.samples += samples
        t.streak = 0
        t.races_lost = 0
        t.overloads = 0
        t.strikes = 0
        t.last_result = time.monotonic()
        t.timed_answer(latency_s)
        floor = self.floor(t)
        if t.by_length:
            if self.deadline_s is not None and latency_s > 0.5 * self.deadline_s:
                # Its queue is deeper than the deadline allows (a slow device, or several students):
                # fewer rows, before the requests at the back of it miss the deadline.
                t.limit = max(1.0, t.limit * 0.9)
            else:  # an answer in time: its rows again and as many more (twice the rows a round trip)
                t.limit = min(self.ceiling(t), t.limit + samples)
        elif t.limit < floor:  # an overload answer or an ejection took it below: one call back an answer
            t.limit = min(floor, t.limit + 1.0)
        elif t.best_s == math.inf:  # no baseline yet: the limit holds
            pass
        elif t.ewma_s <= 1.5 * t.best_s:
            if was_full:  # grow only a limit that was actually reached: headroom must be demonstrated
                t.limit = min(self.ceiling(t), t.limit + 1.0 / max(t.limit, 1.0))
        elif t.ewma_s > 2.5 * t.best_s:  # a queue: the further above, the faster it shrinks
            t.limit = max(floor, t.limit * min(0.9, max(0.7, 2.5 * t.best_s / t.ewma_s)))
        self._changed.set()  # a slot is free; a success leaves the no-teacher clock as it is

    def failed(self, t: TeacherState, code: grpc.StatusCode | None, message: str) -> None:
        """Account a failed chunk; the caller re-routes it."""
        if code is not None and code in _OVERLOAD_CODES:
            self.overloaded(t, code, message)
            return
        t.in_flight -= 1
        t.errors += 1
        t.last_error = f"{code.name if code else 'ERROR'}: {message}"[:300]
        if code in _MISMATCH_CODES:
            self.mark_incompatible(t, f"it refused the request ({t.last_error})")
        else:
            self._eject(t)
        self.notify()

    def overloaded(self, t: TeacherState, code: grpc.StatusCode, message: str) -> None:
        """The teacher shed this chunk (RESOURCE_EXHAUSTED, or a CANCELLED the student did not cause):
        halve its limit and give it a short, growing cool-down; it stays usable, never ejected."""
        t.in_flight -= 1
        t.overloads += 1
        t.overloaded_count += 1
        t.last_error = f"{code.name}: {message}"[:300]
        t.limit = max(1.0, t.limit / 2)
        pause = min(self.config.overload_backoff_max_s,
                    self.config.overload_backoff_base_s * 2 ** min(t.overloads - 1, 30))
        t.cool_until = time.monotonic() + pause * random.uniform(0.8, 1.2)
        if t.overloads == 1:
            log.info("teacher %s of service %r is overloaded (%s); sending it less", t.endpoint, self.service,
                     t.last_error)
        self.notify()

    def rejected(self, t: TeacherState, message: str) -> None:
        """The teacher refused this request's input: no judgement of the teacher yet (that comes if
        another teacher accepts the same input: `refused_what_another_accepted`)."""
        t.in_flight -= 1
        t.errors += 1
        t.last_error = message[:300]
        self.notify()

    def refused_what_another_accepted(self, t: TeacherState) -> None:
        """Another teacher accepted an input `t` refused: after `reject_strikes` in a row `t` is the
        odd one out and is marked incompatible."""
        t.strikes += 1
        if t.strikes >= self.config.reject_strikes and not t.removed:
            self.mark_incompatible(t, f"it refused {t.strikes} requests in a row that other teachers accepted "
                                      f"(last: {t.last_error})")

    def answer_malformed(self, t: TeacherState, message: str) -> None:
        """The teacher's answer contradicts the request or its own metadata: incompatible, named in the
        log, until it registers new metadata."""
        t.in_flight -= 1
        t.errors += 1
        t.last_error = f"malformed answer: {message}"[:300]
        self.mark_incompatible(t, f"its answer does not match its metadata: {message}")

    def hung(self, t: TeacherState, detail: str) -> None:
        """A chunk at `t` is late and `t` does not answer a readiness probe either: eject it now,
        instead of at the chunk's deadline."""
        if t.needs_probe or t.removed:
            return
        t.last_error = f"hung: a chunk is late and {detail}"[:300]
        self._eject(t)
        self.notify()

    def abandoned(self, t: TeacherState) -> None:
        """A call to a teacher found hung was given up; the teacher is already judged."""
        t.in_flight -= 1
        self.notify()

    def _eject(self, t: TeacherState) -> None:
        t.ejections += 1
        t.streak += 1
        t.limit = 1.0
        t.needs_probe = True
        backoff = self.backoff(t)
        t.ejected_until = time.monotonic() + backoff
        if t.streak == 1:
            log.warning("teacher %s of service %r failed (%s); its work goes elsewhere until it answers a "
                        "readiness probe (first in %.2fs)", t.endpoint, self.service, t.last_error, backoff)

    def not_ready(self, t: TeacherState, detail: str) -> float:
        """`t` cannot be asked for its metadata yet (not listening, its model still loading): one more
        failure in its streak; returns when to ask again, on the ejection back-off."""
        t.streak += 1
        t.last_error = detail[:300]
        return self.backoff(t)

    def backoff(self, t: TeacherState) -> float:
        base = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** max(0, t.streak - 1))
        return base * random.uniform(0.8, 1.2)

    def probed(self, t: TeacherState, ok: bool, detail: str = "") -> None:
        """Outcome of a readiness probe of an ejected teacher: back in service, or wait longer."""
        if ok:
            t.needs_probe = False
            t.ejected_until = 0.0
            # What we knew of its latency predates the failure (often a different process on the
            # same port): start it afresh at the median, or a stale estimate starves it of the
            # very work that would correct it.
            t.forget_latency()
            log.info("teacher %s of service %r answers again; back in service", t.endpoint, self.service)
        else:
            t.streak += 1
            t.last_error = detail[:300] or t.last_error
            t.ejected_until = time.monotonic() + self.backoff(t)
        self.notify()

    def cancelled(self, t: TeacherState) -> None:
        """A chunk we gave up on ourselves (the reader closing, an epoch abandoned): no judgement."""
        t.in_flight -= 1
        self.notify()

    def lost_race(self, t: TeacherState) -> None:
        """Another teacher answered this chunk first (a hedge race): treat `t` as slow."""
        t.in_flight -= 1
        t.races_lost += 1
        t.limit = max(1.0, t.limit / 2)
        if t.races_lost >= self.config.lost_races_eject:
            t.races_lost = 0
            t.last_error = f"lost {self.config.lost_races_eject} hedge races in a row"
            self._eject(t)
        self.notify()

    def late_delay(self, deadline_s: float) -> float:
        """When a chunk counts as late. Adaptive: 4x the pool's median latency, at least 0.25 s and at
        most half the deadline, so healthy variance never counts but a hung teacher costs < 1 s."""
        known = sorted(t.ewma_s for t in self.teachers.values() if t.ewma_s > 0)
        typical = known[len(known) // 2] if known else 0.25
        return min(max(0.25, 4 * typical), deadline_s / 2)

    def hedge_delay(self, deadline_s: float, hedge_s: float | None, adaptive: bool) -> float | None:
        """When a late chunk is raced on a second teacher: the fixed `hedge_s`, the adaptive late
        delay, or never."""
        if hedge_s is not None or not adaptive:
            return hedge_s
        return self.late_delay(deadline_s)

    def snapshot(self) -> Mapping[str, dict[str, object]]:
        now = time.monotonic()
        return {
            t.endpoint: {
                "in_flight": t.in_flight, "rows_in_flight": t.rows_in_flight, "limit": round(t.limit, 2),
                "limit_counts": "rows" if t.by_length else "calls",
                "latency_ms": round(t.ewma_s * 1000, 2),
                "ok": t.ok, "errors": t.errors, "samples": t.samples, "usable": t.usable(now),
                "last_error": t.last_error, "state": t.describe(), "ejections": t.ejections,
                "overloaded": t.overloaded_count, "offers": describe_offers(t.offers),
            }
            for t in self.teachers.values()
        }
