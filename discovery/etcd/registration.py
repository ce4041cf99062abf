"""A teacher's record or a student's demand, kept in etcd for as long as its owner lives.

A thin user of :class:`~discovery.etcd.lease.LeaseSession`: the session owns the lease (grant,
keepalive, loss, revoke); a registration writes its keys under it, publishes its periodic report
(load or demand, gated so that only news is written), writes everything again when etcd answers
after an outage, and starts a new session when the lease is lost. It never raises because etcd is
down; it retries with capped exponential backoff and logs once per state change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from discovery.aio import Backoff, StateLog, cancel_and_wait, deadline
from discovery.base import Registration, StudentDemand, TeacherLoad
from discovery.etcd.client import EtcdConnection, describe_error
from discovery.etcd.lease import LeaseLostError, LeaseSession
from discovery.reports import ReportGate

__all__ = ["EtcdRegistration", "gated_report"]

# One logger for the whole etcd backend's registration messages, as before the package split.
log = logging.getLogger("discovery.etcd")

_R = TypeVar("_R", TeacherLoad, StudentDemand)


def gated_report(
    fn: Callable[[], _R], kind: type[_R], what: str, gate: ReportGate[_R], set_id: Callable[[_R], None]
) -> Callable[[bool], bytes | None]:
    """The periodic value of a load or demand registration: ``fn()`` checked, passed through
    ``gate`` (None: nothing new to write; ``force``: write anyway), then a copy with its id and
    ``updated_at`` filled in when left empty, serialized."""

    def report(force: bool) -> bytes | None:
        value = fn()
        if not isinstance(value, kind):
            raise TypeError(f"{what} returned {type(value).__name__}, not a {kind.__name__}")
        if not gate.due(value, time.monotonic(), force):
            return None
        msg = kind()
        msg.CopyFrom(value)
        set_id(msg)
        msg.updated_at = msg.updated_at or time.time()
        return bytes(msg.SerializeToString())

    return report


class EtcdRegistration(Registration):
    """One lease session at a time and the keys bound to it; see ``EtcdRegistry.register``.

    ``fixed``: keys written once per lease (and again after an outage); ``periodic``: a key and the
    function giving its value every ``interval`` seconds (None: nothing new). ``start_timeout``
    bounds how long entering the context waits for the first attempt. ``on_start``/``on_close``
    let the registry track open registrations (to withdraw them on its own close).
    """

    def __init__(
        self,
        connection: EtcdConnection,
        *,
        what: str,
        key: str,
        fixed: Sequence[tuple[str, bytes]],
        periodic: tuple[str, Callable[[bool], bytes | None]] | None,
        ttl: float,
        interval: float,
        start_timeout: float,
        on_start: Callable[[EtcdRegistration], None] | None = None,
        on_close: Callable[[EtcdRegistration], None] | None = None,
    ) -> None:
        self._conn = connection
        self._what = what
        self._key = key
        self._fixed = list(fixed)
        self._periodic = periodic
        self._ttl = ttl
        self._interval = float(interval)
        self._start_timeout = float(start_timeout)
        self._on_start = on_start
        self._on_close = on_close
        self._task: asyncio.Task[None] | None = None
        self._session: LeaseSession | None = None
        self._lease: int | None = None
        self._registered = False
        self._registered_event = asyncio.Event()
        self._attempted = asyncio.Event()
        self._done = False
        self._slog = StateLog(log)
        self._fn_log = StateLog(log)
        self.registrations = 0  # successful (re-)registrations, for tests and metrics

    @property
    def key(self) -> str:
        return self._key

    @property
    def registered(self) -> bool:
        return self._registered

    @property
    def lease_id(self) -> int | None:
        return self._lease

    async def wait_registered(self, timeout: float | None = None) -> bool:
        if not self._registered and not self._done:
            try:
                async with deadline(timeout):
                    await self._registered_event.wait()
            except asyncio.TimeoutError:
                pass
        return self._registered

    def _set_registered(self, value: bool) -> None:
        self._registered = value
        if value:
            self._registered_event.set()
        else:
            self._registered_event.clear()

    async def _start(self) -> None:
        if self._task is not None or self._done:
            return
        if self._on_start is not None:
            self._on_start(self)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"discovery-lease {self._key}")
        # Wait for the first attempt, so that normally the key exists once `async with` is entered;
        # bounded, because a teacher must start serving even when etcd is unreachable.
        waiter = asyncio.ensure_future(self._attempted.wait())
        try:
            await asyncio.wait(
                [waiter, self._task],
                timeout=min(self._start_timeout, 2.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            waiter.cancel()

    def _periodic_value(self, force: bool) -> bytes | None:
        """The report to write now, or None (nothing new to say, or the function failed)."""
        assert self._periodic is not None
        try:
            value = self._periodic[1](force)
        except Exception as e:
            self._fn_log.change(
                "failing",
                logging.WARNING,
                "%s: the load/demand function raised %s; skipping its publication until it works",
                self._what,
                describe_error(e),
            )
            return None
        self._fn_log.change("ok", logging.DEBUG, "%s: the load/demand function works", self._what)
        return value

    def _all_items(self) -> list[tuple[str, bytes]]:
        items = list(self._fixed)
        if self._periodic is not None:
            value = self._periodic_value(force=True)
            if value is not None:
                items.append((self._periodic[0], value))
        return items

    def _note_unreachable(self, session: LeaseSession) -> None:
        self._set_registered(False)
        self._attempted.set()
        failure = session.failure
        self._slog.change(
            "unreachable",
            logging.WARNING,
            "etcd unreachable at %s for %s (%s); retrying with backoff up to %g s",
            failure.endpoint if failure is not None else "?",
            self._what,
            failure if failure is not None else "no answer",
            self._conn.retry_max_backoff,
        )

    async def _run(self) -> None:
        """One lease session after another: open, hold until the lease is lost, start over."""
        backoff = Backoff(cap=self._conn.retry_max_backoff)
        reason = "first"
        while True:
            session = LeaseSession(self._conn, self._ttl, name=self._what)
            try:
                await session.open()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failure = session.failure
                if failure is not None:
                    self._note_unreachable(session)
                    await self._conn.pause(failure.client, backoff.next_delay())
                else:  # not an etcd answer (a closed registry, a bug): say so, once
                    self._set_registered(False)
                    self._attempted.set()
                    self._slog.change(
                        "broken",
                        logging.WARNING,
                        "%s: cannot open a lease (%s); retrying",
                        self._what,
                        describe_error(e),
                    )
                    await asyncio.sleep(backoff.next_delay())
                continue
            self._session = session
            self._lease = session.lease_id
            await self._hold(session, reason, backoff)
            # The lease is lost: its keys are gone. Register again under a new one.
            self._lease = None
            self._set_registered(False)
            self._attempted.set()
            await session.orphan()
            self._slog.change("lost", logging.WARNING, "%s: lease lost; registering again", self._what)
            reason = "lost"
            await asyncio.sleep(backoff.next_delay())

    async def _hold(self, session: LeaseSession, reason: str, backoff: Backoff) -> None:
        """Write the keys, publish the periodic value, write everything again after an outage;
        return when the lease is lost."""
        loop = asyncio.get_running_loop()
        written = False
        next_publish = 0.0
        while not session.lost:
            if not session.reachable:
                self._note_unreachable(session)
                written, reason = False, "unreachable"
                await session.wait_changed()
                continue
            if not written:
                try:
                    await session.put_all(self._all_items())
                except LeaseLostError:
                    return
                except Exception:  # the session is unreachable now and retries; see above
                    continue
                written = True
                self.registrations += 1
                self._set_registered(True)
                msg = {
                    "first": "registered %s (lease %x, ttl %d s)",
                    "lost": "re-registered %s after its lease was lost (new lease %x, ttl %d s)",
                    "unreachable": "etcd reachable again; %s is registered (lease %x, ttl %d s)",
                }[reason]
                self._slog.change("registered", logging.INFO, msg, self._what, session.lease_id, session.ttl)
                self._attempted.set()
                backoff.reset()
                next_publish = loop.time() + self._interval
                continue
            if self._periodic is None:
                await session.wait_changed()
                continue
            await session.wait_changed(max(0.0, next_publish - loop.time()))
            if loop.time() < next_publish or not session.reachable:
                continue
            value = self._periodic_value(force=False)
            if value is not None:
                try:
                    await session.put(self._periodic[0], value)
                except LeaseLostError:
                    return
                except Exception:  # unreachable: the session retries, and we write everything after
                    continue
            next_publish = max(next_publish + self._interval, loop.time() + self._interval / 2)

    async def deregister(self) -> None:
        if self._done:
            return
        self._done = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            if not self._task.cancelled() and self._task.exception() is not None:
                log.error("%s: registration task failed", self._what, exc_info=self._task.exception())
        session, self._session = self._session, None
        self._lease = None
        self._set_registered(False)
        self._registered_event.set()  # release waiters; `registered` stays False
        try:
            if session is not None and await session.close():
                log.info("deregistered %s (lease %x revoked)", self._what, session.lease_id)
        except LeaseLostError:
            log.info("deregistered %s (its lease had already expired)", self._what)
        except Exception as e:
            log.warning(
                "could not revoke the lease of %s (%s); its keys expire within %d s",
                self._what,
                describe_error(e),
                session.ttl if session is not None else self._ttl,
            )
        finally:
            if self._on_close is not None:
                self._on_close(self)
