"""One etcd lease's whole life in one object, after etcd's Go ``clientv3/concurrency.Session``.

Why one object: a teacher's registration, a student's demand report and the autoscaler's
leadership all bind keys to a lease, and each needs the same things done right: grant it, refresh
it every ``ttl/3`` with a deadline on every call, tell "etcd is unreachable" (the lease may well
survive) apart from "the lease is gone" (its keys are deleted), know until when the lease is
*certainly* alive on the server, and revoke it on the way out so the keys vanish at once instead
of after a TTL. :class:`LeaseSession` does exactly that and nothing else; what to write under the
lease and what to do when it is lost is its owner's business (see ``registration.py`` and
``election.py``).

Use::

    async with LeaseSession(connection, ttl=10) as session:    # grant + keepalive task
        await session.put("/k", b"v")                          # bound to the lease
        await session.wait_lost()                               # the server dropped the lease
    # leaving the block revokes the lease (its keys go at once)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any

from discovery.aio import Backoff, cancel_and_wait, deadline
from discovery.base import RegistryError
from discovery.etcd.client import EtcdClient, EtcdConnection, EtcdFailure, describe_error, is_lease_lost

__all__ = ["LeaseLostError", "LeaseSession"]

log = logging.getLogger(__name__)

# The shortest refresh period, whatever the TTL.
_MIN_REFRESH = 0.2


class LeaseLostError(RegistryError):
    """The lease is gone on the server (it expired or was revoked), and so are the keys bound to
    it. Nothing to retry on this lease: grant a new one (a new session) and write the keys again."""


class LeaseSession:
    """Grant (or adopt) one lease, keep it alive every ``ttl/3`` seconds, notice its loss, revoke it.

    ``ttl`` is rounded up to whole seconds (etcd's unit). ``lease_id`` adopts an existing lease
    instead of granting one, to resume it after an outage (etcd keeps leases across restarts);
    :meth:`open` then raises :class:`LeaseLostError` if it is gone. ``call_timeout`` bounds each
    etcd call (default: the connection's).

    States, all readable at any time:

    * :attr:`reachable`: the last exchange about this lease succeeded. A failed refresh (or a
      failed write reported through :meth:`put`) makes it False and the background task retries
      with capped backoff, waking early when the channel reconnects; the next success makes it
      True again, with the same lease.
    * :attr:`alive`: the lease is certainly alive on the server now, because a refresh sent at
      time *t* returned *ttl* and *t + ttl* has not passed. Past that it may have expired even
      though nobody said so (a partition), so a leader must stop acting.
    * :attr:`lost`: the server said the lease is gone. Final: the task stops.

    Every change of these (and :meth:`orphan`/:meth:`close`) wakes :meth:`wait_changed`. Use
    from one event loop.
    """

    def __init__(
        self,
        connection: EtcdConnection,
        ttl: float,
        *,
        lease_id: int | None = None,
        call_timeout: float | None = None,
        name: str = "lease",
    ) -> None:
        if not (isinstance(ttl, (int, float)) and ttl > 0 and math.isfinite(ttl)):
            raise ValueError(f"lease ttl must be a positive number of seconds, not {ttl!r}")
        self._conn = connection
        self.requested_ttl = max(1, math.ceil(ttl))
        self.name = name
        self._call_timeout = call_timeout
        self._adopt = lease_id
        self._lease: int | None = None
        self._ttl = self.requested_ttl
        self._valid_until = 0.0
        self._reachable = False
        self._lost = False
        self._orphaned = False
        self._closed = False
        self._failure: EtcdFailure | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self.refreshes = 0  # successful keepalives, for tests and metrics

    # -- state ------------------------------------------------------------------------------------
    @property
    def lease_id(self) -> int | None:
        """The lease (None before :meth:`open` succeeded)."""
        return self._lease

    @property
    def ttl(self) -> int:
        """The TTL etcd granted (or the requested one before the grant)."""
        return self._ttl

    @property
    def reachable(self) -> bool:
        return self._reachable and not self._lost

    @property
    def alive(self) -> bool:
        return self._lease is not None and not self._lost and not self._closed and time.monotonic() < self._valid_until

    @property
    def valid_until(self) -> float:
        """``time.monotonic()`` up to which the lease is certainly alive (see :attr:`alive`)."""
        return self._valid_until

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def failure(self) -> EtcdFailure | None:
        """The latest failed exchange (None while reachable)."""
        return self._failure

    async def wait_changed(self, timeout: float | None = None) -> None:
        """Return when :attr:`reachable` or :attr:`lost` changes next, or after ``timeout`` seconds."""
        event = self._changed
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            async with deadline(timeout):
                await event.wait()

    async def wait_lost(self) -> None:
        """Return once the lease is lost or no longer kept alive by this session (orphaned or
        closed), like Go's ``Session.Done()``; at once if that already happened."""
        while not (self._lost or self._orphaned or self._closed):
            await self.wait_changed()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- life -------------------------------------------------------------------------------------
    async def open(self) -> LeaseSession:
        """Grant the lease (or adopt ``lease_id``) and start keeping it alive.

        Raises the etcd error when etcd cannot be reached (reported to the connection, so that
        the next try goes to the next endpoint), :class:`LeaseLostError` when the lease to adopt
        is gone, ``RegistryError`` when opened twice.
        """
        if self._lease is not None or self._closed or self._lost:
            raise RegistryError(f"{self.name}: a lease session opens once")
        client = self._conn.client()
        sent = time.monotonic()
        try:
            if self._adopt is not None:
                granted = await self._conn.call(
                    self._conn.keepalive_once(client, self._adopt, self._call_timeout), self._call_timeout
                )
                if granted <= 0:
                    self._lost = True
                    raise LeaseLostError(f"{self.name}: lease {self._adopt:x} expired or was revoked")
                lease = self._adopt
            else:
                grant = await self._conn.call(client.lease(self.requested_ttl), self._call_timeout)
                lease, granted = int(grant.id), int(grant.ttl) or self.requested_ttl
                self._ttl = granted
        except (asyncio.CancelledError, LeaseLostError):
            raise
        except Exception as e:
            if is_lease_lost(e):
                self._lost = True
                raise LeaseLostError(f"{self.name}: lease {self._adopt or 0:x} is gone ({describe_error(e)})") from e
            self._failure = EtcdFailure(client, e)
            self._conn.failed(client, e)
            raise
        self._lease = lease
        self._valid_until = sent + granted
        self._reachable = True
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name=f"etcd-lease {self.name}")
        return self

    async def refresh(self) -> int:
        """Refresh the lease once now; return the TTL left.

        Raises :class:`LeaseLostError` when the lease is gone, or the etcd error (after marking
        the session unreachable and reporting it to the connection).
        """
        sent = time.monotonic()
        left: int = await self._under_lease(
            lambda client, lease: self._conn.keepalive_once(client, lease, self._call_timeout), open_only=False)
        lease = self._lease
        assert lease is not None
        if left <= 0:
            self._mark_lost()
            raise LeaseLostError(f"lease not found: lease {lease:x} expired or was revoked")
        self.refreshes += 1
        self._valid_until = max(self._valid_until, sent + left)
        self._failure = None
        if not self._reachable:
            self._reachable = True
            self._notify()
        return left

    def report_failure(self, client: EtcdClient, error: BaseException) -> None:
        """An exchange under this lease failed: mark the session unreachable, tell the connection
        (failover), and make the background task retry with backoff until etcd answers again."""
        self._failure = EtcdFailure(client, error)
        self._conn.failed(client, error)
        if self._reachable:
            self._reachable = False
            self._notify()
        self._wake.set()

    def _mark_lost(self) -> None:
        if not self._lost:
            self._lost = True
            self._reachable = False
            self._notify()
        self._wake.set()

    async def _keep_alive(self) -> None:
        """Refresh every ttl/3 while reachable; after a failure, retry with backoff (waking early
        when the channel reconnects); stop when the lease is lost."""
        every = max(self._ttl / 3.0, _MIN_REFRESH)
        backoff = Backoff(cap=self._conn.retry_max_backoff)
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + every
        while not self._lost:
            if self._reachable:
                left = next_refresh - loop.time()
                if left > 0:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                        async with deadline(left):
                            await self._wake.wait()
                    continue  # the refresh is due, or a write failed or the lease was lost: look again
            else:
                failure = self._failure
                delay = backoff.next_delay()
                if failure is not None:
                    await self._conn.pause(failure.client, delay)
                else:
                    await asyncio.sleep(delay)
            try:
                await self.refresh()
            except LeaseLostError:
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # unreachable: refresh() recorded and reported it
                log.debug("%s: refreshing lease %x failed (%s)", self.name, self._lease or 0, describe_error(e))
            else:
                backoff.reset()
                next_refresh = loop.time() + every

    async def put(self, key: str, value: bytes) -> None:
        """Write ``key`` bound to the lease (it vanishes with the lease). On failure the session
        turns unreachable (or lost, raising :class:`LeaseLostError`) and the error is raised."""
        await self._write(lambda client: client.put(key.encode(), value, lease=self._lease))

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write every ``(key, value)`` bound to the lease in one transaction; failures as :meth:`put`."""
        if not items:
            return

        def txn(client: EtcdClient) -> Awaitable[Any]:
            puts = [client.transactions.put(k.encode(), v, lease=self._lease) for k, v in items]
            return client.transaction(compare=[], success=puts, failure=[])

        await self._write(txn)

    async def _write(self, make: Callable[[EtcdClient], Awaitable[Any]]) -> None:
        await self._under_lease(lambda client, _lease: make(client), open_only=True)

    async def _under_lease(self, make: Callable[[EtcdClient, int], Awaitable[Any]], *, open_only: bool) -> Any:
        """One etcd exchange under this lease, with the call deadline. A lost lease raises
        LeaseLostError (and marks the session lost); any other failure is reported (unreachable,
        failover, retry in the background) and re-raised. ``open_only`` also refuses a closed session."""
        lease = self._lease
        if lease is None or (open_only and self._closed):
            raise RegistryError(f"{self.name}: the lease session is not open")
        if self._lost:
            raise LeaseLostError(f"{self.name}: lease {lease:x} is lost")
        client = self._conn.client()
        try:
            return await self._conn.call(make(client, lease), self._call_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if is_lease_lost(e):
                self._mark_lost()
                raise LeaseLostError(f"{self.name}: lease {lease:x} is gone ({describe_error(e)})") from e
            self.report_failure(client, e)
            raise

    async def orphan(self) -> None:
        """Stop keeping the lease alive without revoking it (Go's ``Session.Orphan``): it expires
        within its TTL unless someone adopts it. Idempotent."""
        if not self._orphaned:
            self._orphaned = True
            self._notify()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("%s: lease keepalive failed", self.name, exc_info=task.exception())

    async def close(self) -> bool:
        """Stop keeping the lease alive and revoke it, so its keys go at once. Idempotent.

        Returns True if the lease was revoked now, False if there was nothing to revoke (never
        granted, already lost, already closed). Raises :class:`LeaseLostError` when etcd says it
        had already expired, and the etcd error when the revoke failed (the lease then expires
        within its TTL).
        """
        await self.orphan()
        if self._closed:
            return False
        self._closed = True
        lease = self._lease
        self._notify()
        if lease is None or self._lost:
            return False
        client = self._conn.client()
        try:
            await self._conn.call(client.revoke_lease(lease), self._call_timeout)
        except Exception as e:
            if is_lease_lost(e):
                self._lost = True
                raise LeaseLostError(f"{self.name}: lease {lease:x} had already expired") from e
            raise
        return True

    async def __aenter__(self) -> LeaseSession:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.close()
        except LeaseLostError:
            pass
        except Exception as e:  # the lease then expires by itself; the block's own error matters more
            log.warning(
                "%s: could not revoke lease %x (%s); it expires within %d s",
                self.name,
                self._lease or 0,
                describe_error(e),
                self._ttl,
            )
