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
* Hold: refresh the lease every ``ttl/3`` seconds and check that the key still carries our lease.
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
from typing import Any

import aetcd.rpc as etcd_rpc
import grpc

from discovery import keys
from discovery.aio import Backoff, StateLog, bounded, cancel_and_wait, describe
from discovery.base import Registry
from distill.autoscale.errors import ElectionError

__all__ = ["LeaderElection", "leader_key"]

log = logging.getLogger("distill.autoscale.election")


def leader_key(service: str) -> str:
    """The etcd key the leader of ``service`` holds."""
    return f"{keys.autoscaler_prefix(service)}leader"


class LeaderElection:
    """Campaign for, hold and give up the leadership of one service's autoscaler.

    ``registry`` must be an etcd registry (``open_registry("etcd://...")``); the election uses its
    client, so TLS, authentication and endpoint failover carry over. ``identity`` is what the key
    says while we lead (host-pid, or the pod name). ``ttl``: seconds of the lease, which bound how
    long a dead leader blocks a takeover. Use from one event loop; ``close()`` resigns.
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
        client_fn = getattr(registry, "client", None)
        if not callable(client_fn):
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
        self._lease: int | None = None
        self._last_lease: int | None = None  # the lease of our last term, to resume after an outage
        self._valid_until = 0.0
        self._lost = asyncio.Event()
        self._hold_task: asyncio.Task[None] | None = None
        self._closed = False
        self._slog = StateLog(log)
        self.terms = 0  # how many times this candidate became leader (for tests and metrics)

    # -- state --------------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while we hold the key and our lease is certainly alive on the server."""
        return self._lease is not None and time.monotonic() < self._valid_until

    async def wait_lost(self) -> None:
        """Return once leadership is lost (or at once if we do not lead)."""
        if self._lease is None:
            return
        await self._lost.wait()

    def _client(self) -> Any:
        return self._registry.client()  # type: ignore[attr-defined]

    async def publish(self, key: str, value: bytes) -> bool:
        """Put `key` under our leader lease (it vanishes with our leadership); False if we do not lead."""
        lease = self._lease
        if lease is None or not self.is_leader:
            return False
        await bounded(self._client().put(key.encode(), value, lease=lease), self.call_timeout)
        return True

    async def leader(self) -> str | None:
        """The identity in the leader key now (one read), None when nobody leads."""
        got = await bounded(self._client().get(self.key.encode()), self.call_timeout)
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
                got = await bounded(self._client().get(self.key.encode()), self.call_timeout)
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

    async def _resume(self, lease_id: int) -> bool:
        """The key still carries the lease we held before losing contact with etcd (etcd keeps
        leases across its restarts): refresh it and lead again without a gap."""
        sent = time.monotonic()
        remaining = await bounded(self._keepalive(lease_id), self.call_timeout)
        if remaining <= 0:
            return False
        self._lead(lease_id, sent + remaining, "resumed its lease")
        return True

    async def _try_acquire(self) -> bool:
        client = self._client()
        granted = await bounded(client.lease(self.ttl), self.call_timeout)
        lease_id, ttl = int(granted.id), int(granted.ttl) or self.ttl
        sent = time.monotonic()
        try:
            tx = client.transactions
            key = self.key.encode()
            won, _ = await bounded(
                client.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, self.identity.encode(), lease=lease_id)],
                    failure=[tx.get(key)],
                ),
                self.call_timeout,
            )
        except BaseException:
            await self._revoke(lease_id)
            raise
        if not won:
            await self._revoke(lease_id)  # someone was faster; do not leave a lease behind
            return False
        self._lead(lease_id, sent + ttl, "is the leader")
        return True

    def _lead(self, lease_id: int, valid_until: float, how: str) -> None:
        self._lease = self._last_lease = lease_id
        self._valid_until = valid_until
        self._lost.clear()
        self.terms += 1
        self._slog.change(
            "leader", logging.INFO, "autoscaler of %r: %s %s (lease %x)", self.service, self.identity, how, lease_id
        )
        self._hold_task = asyncio.get_running_loop().create_task(
            self._hold(lease_id), name=f"autoscaler-leader-{self.service}"
        )

    async def _hold(self, lease_id: int) -> None:
        """Keep the lease alive and check the key every ttl/3 s; mark leadership lost when the lease
        or the key is gone, or when no refresh succeeded for a whole ttl."""
        every = max(self.ttl / 3.0, 0.3)
        try:
            while True:
                await asyncio.sleep(every if time.monotonic() + every < self._valid_until else 0.2)
                if time.monotonic() >= self._valid_until:
                    self._step_down(lease_id, "no lease refresh succeeded for a whole ttl (etcd unreachable?)")
                    return
                sent = time.monotonic()
                try:
                    remaining = await bounded(self._keepalive(lease_id), self.call_timeout)
                    got = await bounded(self._client().get(self.key.encode()), self.call_timeout)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.debug("autoscaler of %r: lease refresh failed (%s); retrying", self.service, describe(e))
                    continue
                if remaining <= 0:
                    self._step_down(lease_id, "the leader lease expired")
                    return
                if got is None or int(got.lease) != lease_id:
                    self._step_down(lease_id, "the leader key was deleted or taken over")
                    return
                self._valid_until = sent + remaining
        finally:
            self._step_down(lease_id, "stopped holding the lease")

    def _step_down(self, lease_id: int, why: str) -> None:
        if self._lease != lease_id:
            return
        self._lease = None
        self._valid_until = 0.0
        self._lost.set()
        self._slog.change(
            "lost", logging.WARNING, "autoscaler of %r: %s lost the leadership: %s", self.service, self.identity, why
        )

    async def _keepalive(self, lease_id: int) -> int:
        """Refresh ``lease_id`` once; its new TTL (0: gone). Closes the keepalive stream itself
        (``aetcd``'s ``refresh_lease`` leaves it to the garbage collector)."""
        client = self._client()
        await client.connect()
        call = client.leasestub.LeaseKeepAlive(timeout=self.call_timeout, metadata=client.metadata)
        try:
            await call.write(etcd_rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise ConnectionError("etcd closed the lease keepalive stream without an answer")
        return int(reply.TTL)

    async def _revoke(self, lease_id: int) -> None:
        try:
            await bounded(self._client().revoke_lease(lease_id), self.call_timeout)
        except Exception as e:  # the lease then expires by itself within ttl
            log.debug("autoscaler of %r: revoking lease %x failed (%s)", self.service, lease_id, describe(e))

    # -- resign -------------------------------------------------------------------------------------
    async def resign(self) -> None:
        """Give up leadership now (revoke the lease, so the key goes at once). Idempotent."""
        task, self._hold_task = self._hold_task, None
        lease = self._lease
        self._lease = None  # stop acting as leader before anything below can yield
        self._valid_until = 0.0
        self._lost.set()
        if task is not None:
            await cancel_and_wait(task)
        self._last_lease = None
        if lease is not None:
            await self._revoke(lease)
            log.info("autoscaler of %r: %s resigned", self.service, self.identity)
        self._slog.state = None

    async def close(self) -> None:
        """Resign and refuse further campaigns."""
        self._closed = True
        await self.resign()
