"""One active autoscaler per service: a leader election on etcd.

Why: two controllers sizing the same pool fight (one adds teachers, the other's stale view removes
them), yet a single controller is a single point of failure. So every controller campaigns; one
leads, the others wait and take over when it goes away.

How (plain etcd primitives, the recipe of etcd's own ``concurrency.Election``):

* The leader key is ``/distill/v1/<service>/autoscaler/leader`` (the prefix ``discovery.keys``
  reserves for us); its value is the leader's identity.
* Campaign: grant a lease of ``ttl`` seconds, then one transaction *put-if-absent*:
  ``if create_revision(key) == 0 then put(key, identity, lease) else get(key)``. Exactly one
  candidate's transaction succeeds; etcd serialises them.
* Hold: a :class:`~discovery.etcd.lease.LeaseSession` refreshes the lease every ``ttl/3``
  seconds; the election checks as often that the key still carries our lease.
  Leadership is trusted only until ``time of the last successful refresh + ttl``: past that the
  lease may have expired on the server and someone else may lead, so :attr:`is_leader` turns
  False even before we hear about it (no split brain because of a partition).
* Resign (``resign()``/``close()``): revoke the lease; the key disappears at once and a waiting
  candidate takes over within its poll interval. A leader that dies without resigning (SIGKILL,
  machine gone) is replaced when its lease expires, within ``ttl`` + the poll interval.
* Losing contact with etcd is not losing to someone else: a leader whose lease validity ran out
  stops acting and campaigns again; if the key still carries its lease (etcd keeps leases across a
  restart), it refreshes that lease and resumes. Only a *different* identity in the key tells a
  candidate that someone else leads (``campaign(on_follow=...)``).
* Waiting candidates poll the key every ``poll_interval`` seconds (a read, no lease held) instead
  of watching it: polling survives etcd restarts and reconnections without any resume logic, and
  half a second is well below the lease TTL that bounds takeover anyway.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from discovery import keys
from discovery.aio import Backoff, StateLog, bounded, cancel_and_wait, describe
from discovery.base import Registry
from discovery.election import Election
from discovery.errors import ElectionError
from discovery.etcd.client import EtcdClient
from discovery.etcd.lease import LeaseLostError, LeaseSession

__all__ = ["ElectionError", "LeaderElection", "leader_key"]

# The autoscaler's election keeps the logger name it has always had, so that log settings for
# ``distill.autoscale`` keep covering it.
log = logging.getLogger("distill.autoscale.election")


def leader_key(service: str) -> str:
    """The etcd key the leader of ``service`` holds."""
    return f"{keys.autoscaler_prefix(service)}leader"


@runtime_checkable
class LeaseHost(Protocol):
    """What an election needs of its registry: the etcd registry's client and its lease sessions.

    A protocol rather than the registry class, so that `discovery.etcd.registry` can build
    elections without the two modules importing each other."""

    def client(self) -> EtcdClient: ...

    def session(
        self, ttl: float, *, lease_id: int | None = None, call_timeout: float | None = None, name: str = "lease"
    ) -> LeaseSession: ...


class LeaderElection(Election):
    """Campaign for, hold and give up the leadership of one service's autoscaler.

    ``registry`` must be an etcd registry (``open_registry("etcd://...")``); the election opens
    its lease sessions on it, so TLS, authentication and endpoint failover carry over.
    ``identity`` is what the key says while we lead (host-pid, or the pod name). ``ttl``: seconds
    of the lease, which bound how long a dead leader blocks a takeover. Use from one event loop;
    ``close()`` resigns.
    """

    def __init__(
        self,
        registry: Registry,
        service: str,
        *,
        identity: str,
        ttl: float = 5.0,
        poll_interval: float = 0.5,
        call_timeout: float = 3.0,
    ) -> None:
        if not isinstance(registry, LeaseHost):
            raise ElectionError(
                f"leader election needs an etcd registry (etcd://HOST:PORT), not {registry!r}: "
                "a static teacher list has no shared state to elect a leader in"
            )
        if not ttl >= 2:
            raise ElectionError(f"election ttl must be at least 2 seconds (etcd leases are whole seconds), not {ttl}")
        if not poll_interval > 0:
            raise ElectionError(f"poll_interval must be positive, not {poll_interval}")
        keys.validate_name("autoscaler identity", identity)
        self._registry = registry
        self.service = service
        self.key = leader_key(service)
        self.identity = identity
        self.ttl = math.ceil(ttl)
        self.poll_interval = float(poll_interval)
        self.call_timeout = float(call_timeout)
        self._session: LeaseSession | None = None  # the lease of the current term
        self._last_lease: int | None = None  # the lease of our last term, to resume after an outage
        self._lost = asyncio.Event()
        self._hold_task: asyncio.Task[None] | None = None
        self._closed = False
        self._slog = StateLog(log)
        self.terms = 0  # how many times this candidate became leader (for tests and metrics)
        self.polls = 0  # reads of the leader key while campaigning (for tests and metrics)

    # -- state --------------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while we hold the key and our lease is certainly alive on the server."""
        return self._session is not None and self._session.alive

    @property
    def lease_id(self) -> int | None:
        """The lease of the current term (None while not leading)."""
        return None if self._session is None else self._session.lease_id

    async def wait_lost(self) -> None:
        """Return once leadership is lost (or at once if we do not lead)."""
        if self._session is None:
            return
        await self._lost.wait()

    async def publish(self, name: str, value: bytes) -> bool:
        """Put ``<autoscaler prefix>/<name>`` under our leader lease (it vanishes with our
        leadership); False if we do not lead."""
        session = self._session
        if session is None or not self.is_leader:
            return False
        key = keys.autoscaler_prefix(self.service) + keys.validate_name("autoscaler record name", name)
        await bounded(session.put(key, value), self.call_timeout)
        return True

    async def leader(self) -> str | None:
        """The identity in the leader key now (one read), None when nobody leads."""
        got = await bounded(self._registry.client().get(self.key.encode()), self.call_timeout)
        return None if got is None else bytes(got.value).decode("utf-8", "replace")

    # -- campaign -----------------------------------------------------------------------------------
    async def campaign(self, on_follow: Callable[[str], Awaitable[None]] | None = None) -> None:
        """Wait until we lead. Never raises because etcd is unreachable: it retries, logging once
        per state change. Cancel it to stop campaigning.

        ``on_follow(holder)`` is awaited whenever the key shows a *different* leader than last
        seen: the moment we know someone else manages the pool (merely losing contact with etcd
        does not tell us that, and must not make us drop the pool)."""
        if self._closed:
            raise ElectionError("this election is closed")
        if self.is_leader:
            return
        backoff = Backoff(cap=max(self.poll_interval, 2.0))
        followed: str | None = None
        while True:
            try:
                got = await bounded(self._registry.client().get(self.key.encode()), self.call_timeout)
                self.polls += 1
                holder = None if got is None else bytes(got.value).decode("utf-8", "replace")
                if got is None:
                    if await self._try_acquire():
                        return
                elif (
                    holder == self.identity
                    and int(got.lease) == self._last_lease
                    and await self._resume(int(got.lease))
                ):
                    return
                elif holder is not None and holder != followed:
                    followed = holder
                    self._slog.change(
                        f"follow:{holder}",
                        logging.INFO,
                        "autoscaler of %r: %s leads; %s waits to take over",
                        self.service,
                        holder,
                        self.identity,
                    )
                    if on_follow is not None and holder != self.identity:
                        try:
                            await on_follow(holder)
                        except Exception:  # the hook's failure is not an etcd problem; keep campaigning
                            log.exception("autoscaler of %r: on_follow(%r) failed", self.service, holder)
                backoff.reset()
                await asyncio.sleep(self.poll_interval)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._slog.change(
                    "unreachable",
                    logging.WARNING,
                    "autoscaler of %r: cannot reach etcd to campaign (%s); retrying",
                    self.service,
                    describe(e),
                )
                await asyncio.sleep(backoff.next_delay())

    def _new_session(self, lease_id: int | None = None) -> LeaseSession:
        return self._registry.session(
            self.ttl, lease_id=lease_id, call_timeout=self.call_timeout, name=f"autoscaler of {self.service!r}"
        )

    async def _resume(self, lease_id: int) -> bool:
        """The key still carries the lease we held before losing contact with etcd (etcd keeps
        leases across its restarts): adopt it in a new session and lead again without a gap."""
        session = self._new_session(lease_id)
        try:
            await bounded(session.open(), self.call_timeout)
        except LeaseLostError:
            return False
        self._lead(session, "resumed its lease")
        return True

    async def _try_acquire(self) -> bool:
        session = self._new_session()
        await bounded(session.open(), self.call_timeout)
        try:
            client = self._registry.client()
            tx = client.transactions
            key = self.key.encode()
            won, _ = await bounded(
                client.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, self.identity.encode(), lease=session.lease_id)],
                    failure=[tx.get(key)],
                ),
                self.call_timeout,
            )
        except BaseException:
            await self._revoke(session)
            raise
        if not won:
            await self._revoke(session)  # someone was faster; do not leave a lease behind
            return False
        self._lead(session, "is the leader")
        return True

    def _lead(self, session: LeaseSession, how: str) -> None:
        self._session = session
        self._last_lease = session.lease_id
        self._lost.clear()
        self.terms += 1
        self._slog.change(
            "leader",
            logging.INFO,
            "autoscaler of %r: %s %s (lease %x)",
            self.service,
            self.identity,
            how,
            session.lease_id or 0,
        )
        self._hold_task = asyncio.get_running_loop().create_task(
            self._hold(session), name=f"autoscaler-leader-{self.service}"
        )

    async def _hold(self, session: LeaseSession) -> None:
        """Check the key every ttl/3 s while the session keeps the lease alive; mark leadership
        lost when the lease or the key is gone, or when no refresh succeeded for a whole ttl."""
        every = max(self.ttl / 3.0, 0.3)
        next_check = time.monotonic() + every
        try:
            while True:
                wait = min(next_check, session.valid_until) - time.monotonic()
                if wait > 0:
                    await session.wait_changed(wait)
                if session.lost:
                    self._step_down(session, "the leader lease expired")
                    return
                if not session.alive:
                    self._step_down(session, "no lease refresh succeeded for a whole ttl (etcd unreachable?)")
                    return
                if time.monotonic() < next_check:
                    continue
                next_check = time.monotonic() + every
                try:
                    got = await bounded(self._registry.client().get(self.key.encode()), self.call_timeout)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.debug("autoscaler of %r: leader key check failed (%s); retrying", self.service, describe(e))
                    continue
                if got is None or int(got.lease) != session.lease_id:
                    self._step_down(session, "the leader key was deleted or taken over")
                    return
        finally:
            self._step_down(session, "stopped holding the lease")
            # Stop refreshing, but do not revoke: after an outage the key may still carry this
            # lease, and campaign() resumes it (resign() revokes what it still leads with).
            await session.orphan()

    def _step_down(self, session: LeaseSession, why: str) -> None:
        if self._session is not session:
            return
        self._session = None
        self._lost.set()
        self._slog.change(
            "lost", logging.WARNING, "autoscaler of %r: %s lost the leadership: %s", self.service, self.identity, why
        )

    async def _revoke(self, session: LeaseSession) -> None:
        try:
            await session.close()
        except Exception as e:  # the lease then expires by itself within ttl
            log.debug(
                "autoscaler of %r: revoking lease %x failed (%s)", self.service, session.lease_id or 0, describe(e)
            )

    # -- resign -------------------------------------------------------------------------------------
    async def resign(self) -> None:
        """Give up leadership now (revoke the lease, so the key goes at once). Idempotent."""
        task, self._hold_task = self._hold_task, None
        session, self._session = self._session, None  # stop acting as leader before anything below can yield
        self._lost.set()
        if task is not None:
            await cancel_and_wait(task)
        self._last_lease = None
        if session is not None:
            await self._revoke(session)
            log.info("autoscaler of %r: %s resigned", self.service, self.identity)
        self._slog.state = None

    async def close(self) -> None:
        """Resign and refuse further campaigns."""
        self._closed = True
        await self.resign()
