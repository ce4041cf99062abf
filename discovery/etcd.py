"""The etcd backend: lease-bound registrations and snapshot watches on top of ``aetcd``.

Why etcd: leases give us liveness for free (a teacher that dies without a word disappears when its
lease expires), watches give sub-second propagation, and revisions let a watcher that lost its
stream resume exactly where it stopped instead of re-reading everything.

What this module adds over the raw client:

* ``register()`` owns a lease's whole life, like Go's ``concurrency.Session``: grant, put, keep
  alive every ``ttl/3``, notice a lost lease and register again, publish load under the same lease,
  revoke on exit. It never raises because etcd is down; it retries with capped exponential backoff
  and logs once per state change.
* ``watch()`` turns etcd's event stream into full snapshots: one consistent read of the teachers
  and their loads, then a watch from the next revision; bursts are coalesced; a dropped stream is
  resumed from the last revision seen; a compacted revision (or a different etcd cluster) triggers
  a full reload; a periodic full read guards against anything missed.
* Several endpoints fail over in order; TLS and user/password authentication are passed to the
  gRPC channel (``aetcd`` 1.0 has no TLS of its own, hence :class:`EtcdClient`).
* Every etcd call carries a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.rpc as etcd_rpc
import aetcd.utils
import aetcd.watcher
import grpc
from google.protobuf.message import DecodeError

from discovery import keys
from discovery.address import (
    DEFAULT_ETCD_PORT,
    Endpoint,
    RegistryAddress,
    parse_address,
    parse_endpoints,
)
from discovery.aio import Backoff, StateLog, cancel_and_wait, deadline
from discovery.base import (
    Registration,
    Registry,
    RegistryError,
    RegistryUnavailableError,
    StudentDemand,
    TeacherEntry,
    TeacherLoad,
    TeacherRecord,
    TeacherSet,
    TeacherWatch,
)
from discovery.reports import ReportGate, demand_changed, load_changed

__all__ = ["EtcdClient", "EtcdRegistry"]

log = logging.getLogger("discovery.etcd")

_T = TypeVar("_T")
_R = TypeVar("_R", TeacherLoad, StudentDemand)

# gRPC channel settings: reconnect quickly after an etcd restart (the default backoff grows to 120 s),
# and detect a dead connection under a long-lived watch stream with HTTP/2 pings. etcd's server
# enforces a 5 s minimum ping interval and no pings without an active stream.
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}

# Snapshot pacing: membership changes reach consumers after at most this long...
_MIN_PUBLISH_INTERVAL = 0.05
# ...while load-only changes (every teacher, every second) are folded into fewer snapshots.
_LOAD_PUBLISH_INTERVAL = 0.25
# How long close() lets gRPC deliver the completions of the RPCs it cancelled.
_CLOSE_DRAIN = 0.05
# Extra time beyond the gRPC deadline before asyncio gives up on a call (covers connect + auth).
_CALL_SLACK = 1.0


class EtcdClient(aetcd.Client):
    """``aetcd.Client`` with TLS, IPv6 endpoints and no leaked channel when authentication fails.

    ``aetcd`` 1.0 always opens an insecure channel to ``f"{host}:{port}"``; this subclass opens a
    secure one when ``root_certificates`` or a client certificate is given and brackets IPv6 hosts.
    The TLS material and the resulting ``credentials`` stay readable as attributes.
    """

    _is_connecting: bool

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float | None = None,
        options: dict[str, Any] | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
    ) -> None:
        super().__init__(
            host=endpoint.host,
            port=endpoint.port,
            username=username,
            password=password,
            timeout=timeout,  # aetcd annotates int; any number works
            options=options,
        )
        self.endpoint = endpoint
        self.username = username
        self.root_certificates = root_certificates
        self.private_key = private_key
        self.certificate_chain = certificate_chain
        self.tls = any(x is not None for x in (root_certificates, private_key, certificate_chain))
        self.credentials: grpc.ChannelCredentials | None = (
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain) if self.tls else None
        )

    @property
    def target(self) -> str:
        return str(self.endpoint)

    async def connect(self) -> None:
        """Open the channel (and authenticate); same contract as ``aetcd.Client.connect``."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            async with deadline(self._connect_wait_timeout):
                await self._connected.wait()
            return
        self._is_connecting = True
        channel: grpc.aio.Channel | None = None
        try:
            opts = list(self._options.items())
            if self.credentials is not None:
                channel = grpc.aio.secure_channel(self.target, self.credentials, options=opts)
            else:
                channel = grpc.aio.insecure_channel(self.target, options=opts)
            metadata = None
            if self._username is not None and self._password is not None:
                auth = etcd_rpc.AuthStub(channel)
                try:
                    resp = await auth.Authenticate(
                        etcd_rpc.AuthenticateRequest(name=self._username, password=self._password),
                        timeout=self._timeout,
                    )
                except grpc.aio.AioRpcError as e:
                    aetcd.exceptions._handle_exception(e)
                metadata = (("token", resp.token),)
                self.auth_stub = auth
            self.channel = channel
            self.metadata = metadata
            self.kvstub = etcd_rpc.KVStub(channel)
            self.clusterstub = etcd_rpc.ClusterStub(channel)
            self.leasestub = etcd_rpc.LeaseStub(channel)
            self.maintenancestub = etcd_rpc.MaintenanceStub(channel)
            self._watcher = aetcd.watcher.Watcher(etcd_rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata)
            channel = None  # owned by the client now
            self._connected.set()
        finally:
            self._is_connecting = False
            if channel is not None:
                await channel.close()


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None


def _endpoints_of(spec: str | Endpoint | RegistryAddress | Iterable[str | Endpoint]) -> tuple[Endpoint, ...]:
    if isinstance(spec, RegistryAddress):
        if spec.scheme != "etcd":
            raise ValueError(f"EtcdRegistry needs an etcd:// address, not {str(spec)!r}")
        return spec.endpoints
    if isinstance(spec, Endpoint):
        return (spec,)
    if isinstance(spec, str):
        if "://" in spec:
            return _endpoints_of(parse_address(spec))
        return parse_endpoints(spec, default_port=DEFAULT_ETCD_PORT)
    out: list[Endpoint] = []
    for item in spec:
        for ep in _endpoints_of(item):
            if ep not in out:
                out.append(ep)
    if not out:
        raise ValueError("EtcdRegistry needs at least one endpoint")
    return tuple(out)


def _describe_error(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if text != type(e).__name__ else text


def _gated_report(
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


def _is_lease_lost(e: BaseException) -> bool:
    return "lease not found" in str(e).lower()


def _is_auth_error(e: BaseException) -> bool:
    if isinstance(e, aetcd.exceptions.UnauthenticatedError):
        return True
    if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED:
        return True
    text = str(e).lower()
    return "invalid auth token" in text or "user name is empty" in text


class _Connection:
    """The client for the current endpoint, with failover to the next one.

    Everyone shares one client (one gRPC channel, one watch stream). A caller whose call failed
    reports it with :meth:`failed`; with several endpoints the next call then goes to the next
    endpoint. After an authentication error the client is rebuilt to get a fresh token.
    """

    def __init__(self, endpoints: tuple[Endpoint, ...], factory: Callable[[Endpoint], EtcdClient]) -> None:
        self.endpoints = endpoints
        self._factory = factory
        self._index = 0
        self._client: EtcdClient | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.closed = False

    def client(self) -> EtcdClient:
        if self.closed:
            raise RegistryError("the registry is closed")
        if self._client is None:
            self._client = self._factory(self.endpoints[self._index])
        return self._client

    def is_current(self, client: EtcdClient) -> bool:
        return client is self._client

    def failed(self, client: EtcdClient, error: BaseException) -> None:
        if client is not self._client or self.closed:
            return  # someone else already moved on
        rebuild = _is_auth_error(error)
        if len(self.endpoints) > 1:
            self._index = (self._index + 1) % len(self.endpoints)
            log.info(
                "etcd endpoint %s failed (%s); trying %s next",
                client.endpoint,
                _describe_error(error),
                self.endpoints[self._index],
            )
            rebuild = True
        if rebuild:
            self._client = None
            task = asyncio.get_running_loop().create_task(self._close_client(client))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _close_client(client: EtcdClient) -> None:
        try:
            async with deadline(5.0):
                await client.close()
        except Exception as e:  # closing a broken channel may complain; nothing to do about it
            log.debug("closing etcd client for %s: %s", client.endpoint, _describe_error(e))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)
        for task in list(self._retiring):
            await asyncio.wait([task])
        if client is not None:
            # Closing cancels the channel's RPCs; gRPC reports each cancellation on this loop a
            # moment later. Let that happen now rather than after the caller's loop is closed.
            await asyncio.sleep(_CLOSE_DRAIN)


class _WatchState:
    """The teachers and loads of one service as known to one watch, plus revisions per prefix."""

    def __init__(self, service: str, warned: set[bytes]) -> None:
        self.service = service
        self.teachers: dict[str, TeacherRecord] = {}
        self.loads: dict[str, TeacherLoad] = {}
        self.rev: dict[str, int] = {"teachers": 0, "load": 0}
        self.cluster_id: int | None = None
        self.membership_dirty = False
        self.load_dirty = False
        self._warned = warned

    @property
    def revision(self) -> int:
        return max(self.rev.values())

    def reset(self, revision: int, cluster_id: int, teacher_kvs: Iterable[Any], load_kvs: Iterable[Any]) -> None:
        teachers = _parse_all(self.service, "teachers", teacher_kvs, self._warned)
        loads = _parse_all(self.service, "load", load_kvs, self._warned)
        if teachers != self.teachers:
            self.membership_dirty = True
        if loads != self.loads:
            self.load_dirty = True
        self.teachers, self.loads = teachers, loads
        self.rev = {"teachers": revision, "load": revision}
        self.cluster_id = cluster_id

    def apply(self, kind: str, event: aetcd.Event) -> None:
        kv = event.kv
        if kv.mod_revision <= self.rev[kind]:
            return  # already reflected by a later full read
        self.rev[kind] = kv.mod_revision
        split = keys.split_key(self.service, kv.key)
        if split is None or split[0] != kind:
            return
        name = split[1]
        table: dict[str, Any] = self.teachers if kind == "teachers" else self.loads
        if event.kind == aetcd.EventKind.DELETE:
            self._warned.discard(kv.key)
            if table.pop(name, None) is not None:
                self._mark(kind)
            return
        msg = _parse(self.service, kind, name, kv.key, kv.value, warned=self._warned)
        if msg is None:
            if table.pop(name, None) is not None:
                self._mark(kind)
        elif table.get(name) != msg:
            table[name] = msg
            self._mark(kind)

    def _mark(self, kind: str) -> None:
        if kind == "teachers":
            self.membership_dirty = True
        else:
            self.load_dirty = True

    def snapshot(self) -> TeacherSet:
        self.membership_dirty = self.load_dirty = False
        return TeacherSet(
            {iid: TeacherEntry(rec, self.loads.get(iid)) for iid, rec in self.teachers.items()},
            self.revision,
        )


def _parse(service: str, kind: str, name: str, key: bytes, value: bytes, *, warned: set[bytes]) -> Any:
    """Decode one value; None (with one warning per key) if it is not a usable message."""
    cls = {"teachers": TeacherRecord, "load": TeacherLoad, "students": StudentDemand}[kind]
    msg = cls()
    problem = None
    try:
        msg.ParseFromString(value)
    except (DecodeError, RuntimeError, ValueError) as e:
        problem = f"does not parse as {msg.DESCRIPTOR.full_name} ({e})"
    else:
        if kind == "teachers" and not msg.endpoint:
            problem = "is a TeacherRecord without an endpoint"
    if problem is not None:
        if key not in warned:
            warned.add(key)
            log.warning(
                "skipping etcd key %s of service %r: its value (%d bytes) %s",
                key.decode("utf-8", "replace"),
                service,
                len(value),
                problem,
            )
        return None
    warned.discard(key)
    id_field = "student_id" if kind == "students" else "instance_id"
    if not getattr(msg, id_field):
        setattr(msg, id_field, name)
    return msg


def _parse_all(service: str, kind: str, kvs: Iterable[Any], warned: set[bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        split = keys.split_key(service, kv.key)
        if split is None or split[0] != kind:
            continue
        msg = _parse(service, kind, split[1], kv.key, kv.value, warned=warned)
        if msg is not None:
            out[split[1]] = msg
    return out


class _WatchEnded(Exception):
    """The etcd watch stream ended without an error (the client was closed or switched)."""


async def _pump(kind: str, stream: aetcd.Watch, queue: asyncio.Queue[Any]) -> None:
    try:
        async for event in stream:
            queue.put_nowait((kind, event))
        queue.put_nowait(_WatchEnded(f"the {kind} watch stream ended"))
    except Exception as e:
        queue.put_nowait(e)


class _EtcdRegistration(Registration):
    """One lease and the keys bound to it; see :meth:`EtcdRegistry.register`."""

    def __init__(
        self,
        registry: EtcdRegistry,
        *,
        what: str,
        key: str,
        fixed: Sequence[tuple[str, bytes]],
        periodic: tuple[str, Callable[[bool], bytes | None]] | None,
        ttl: float,
        interval: float,
    ) -> None:
        self._registry = registry
        self._what = what
        self._key = key
        self._fixed = list(fixed)
        self._periodic = periodic
        self._ttl = max(1, math.ceil(ttl))
        self._interval = float(interval)
        self._task: asyncio.Task[None] | None = None
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
        self._registry._track(self)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"discovery-lease {self._key}")
        # Wait for the first attempt, so that normally the key exists once `async with` is entered;
        # bounded, because a teacher must start serving even when etcd is unreachable.
        waiter = asyncio.ensure_future(self._attempted.wait())
        try:
            await asyncio.wait(
                [waiter, self._task],
                timeout=min(self._registry.timeout, 2.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            waiter.cancel()

    async def _put_all(self, client: EtcdClient, lease: int) -> None:
        puts = [client.transactions.put(k.encode(), v, lease=lease) for k, v in self._fixed]
        if self._periodic is not None:
            value = self._periodic_value(force=True)
            if value is not None:
                puts.append(client.transactions.put(self._periodic[0].encode(), value, lease=lease))
        if puts:
            await self._registry._call(client.transaction(compare=[], success=puts, failure=[]))

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
                _describe_error(e),
            )
            return None
        self._fn_log.change("ok", logging.DEBUG, "%s: the load/demand function works", self._what)
        return value

    async def _run(self) -> None:
        reg = self._registry
        backoff = Backoff(cap=reg.retry_max_backoff)
        lease: int | None = None
        granted = self._ttl
        reason = "first"
        while True:
            client = reg._connection.client()
            try:
                if lease is not None and reason == "unreachable":
                    # Back after an outage: the lease may have survived (etcd restores leases on
                    # restart). Keep it if so, else fall through to a new one.
                    if await reg._call(reg._keepalive_once(client, lease)) <= 0:
                        lease, reason = None, "lost"
                        self._lease = None
                    else:
                        await self._put_all(client, lease)
                if lease is None:
                    grant = await reg._call(client.lease(self._ttl))
                    lease, granted = int(grant.id), int(grant.ttl) or self._ttl
                    self._lease = lease
                    await self._put_all(client, lease)
                self.registrations += 1
                self._set_registered(True)
                msg = {
                    "first": "registered %s (lease %x, ttl %d s)",
                    "lost": "re-registered %s after its lease was lost (new lease %x, ttl %d s)",
                    "unreachable": "etcd reachable again; %s is registered (lease %x, ttl %d s)",
                }[reason]
                self._slog.change("registered", logging.INFO, msg, self._what, lease, granted)
                self._attempted.set()
                backoff.reset()
                await self._keep_alive(client, lease, granted)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._set_registered(False)
                self._attempted.set()
                if _is_lease_lost(e):
                    lease, reason = None, "lost"
                    self._lease = None
                    self._slog.change("lost", logging.WARNING, "%s: lease lost; registering again", self._what)
                    await asyncio.sleep(backoff.next_delay())
                    continue
                reason = "unreachable" if lease is not None else reason
                self._slog.change(
                    "unreachable",
                    logging.WARNING,
                    "etcd unreachable at %s for %s (%s); retrying with backoff up to %g s",
                    client.endpoint,
                    self._what,
                    _describe_error(e),
                    reg.retry_max_backoff,
                )
                reg._connection.failed(client, e)
                await reg._pause(client, backoff.next_delay())

    async def _keep_alive(self, client: EtcdClient, lease: int, granted: int) -> None:
        """Refresh the lease every ttl/3 and publish the periodic value; return never (raises)."""
        reg = self._registry
        keepalive_every = max(granted / 3.0, 0.2)
        loop = asyncio.get_running_loop()
        next_keepalive = loop.time() + keepalive_every
        next_publish = loop.time() + self._interval
        while True:
            wake = min(next_keepalive, next_publish) if self._periodic is not None else next_keepalive
            await asyncio.sleep(max(0.0, wake - loop.time()))
            now = loop.time()
            if now >= next_keepalive:
                if await reg._call(reg._keepalive_once(client, lease)) <= 0:
                    raise RegistryError(f"lease not found: lease {lease:x} expired or was revoked")
                next_keepalive = loop.time() + keepalive_every
            if self._periodic is not None and now >= next_publish:
                value = self._periodic_value(force=False)
                if value is not None:
                    await reg._call(client.put(self._periodic[0].encode(), value, lease=lease))
                next_publish = max(next_publish + self._interval, loop.time() + self._interval / 2)

    async def deregister(self) -> None:
        if self._done:
            return
        self._done = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            if not self._task.cancelled() and self._task.exception() is not None:
                log.error("%s: registration task failed", self._what, exc_info=self._task.exception())
        lease, self._lease = self._lease, None
        self._set_registered(False)
        self._registered_event.set()  # release waiters; `registered` stays False
        try:
            if lease is not None:
                client = self._registry._connection.client()
                await self._registry._call(client.revoke_lease(lease))
                log.info("deregistered %s (lease %x revoked)", self._what, lease)
        except Exception as e:
            if _is_lease_lost(e):
                log.info("deregistered %s (its lease had already expired)", self._what)
            else:
                log.warning(
                    "could not revoke the lease of %s (%s); its keys expire within %d s",
                    self._what,
                    _describe_error(e),
                    self._ttl,
                )
        finally:
            self._registry._untrack(self)


class EtcdRegistry(Registry):
    """The etcd-backed :class:`~discovery.base.Registry`.

    ``endpoints``: ``"host:port"``, ``"h1:2379,h2:2379"``, ``"etcd://..."``, an ``Endpoint`` or a
    list of these; tried in order, failing over to the next on errors. ``ca_cert`` (PEM file) turns
    on TLS; ``cert_key`` + ``cert_cert`` add a client certificate. ``username`` + ``password`` use
    etcd's authentication. ``timeout`` bounds every etcd call; ``connect_timeout`` bounds how long a
    student's ``watch`` (and nothing else) waits for etcd before raising
    :class:`RegistryUnavailableError`. ``resync_interval``: seconds between full re-reads of a
    watched service. ``retry_max_backoff``: the cap of the retry backoff.

    Bind it to one event loop: create, use and ``close()`` it inside the same ``asyncio.run``.
    """

    def __init__(
        self,
        endpoints: str | Endpoint | RegistryAddress | Iterable[str | Endpoint],
        *,
        ca_cert: str | Path | None = None,
        cert_key: str | Path | None = None,
        cert_cert: str | Path | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 5.0,
        connect_timeout: float = 10.0,
        resync_interval: float = 30.0,
        retry_max_backoff: float = 5.0,
        grpc_options: dict[str, Any] | None = None,
    ) -> None:
        self.endpoints = _endpoints_of(endpoints)
        if (username is None) != (password is None):
            raise ValueError("etcd authentication needs both username and password (or neither)")
        if (cert_key is None) != (cert_cert is None):
            raise ValueError("a TLS client certificate needs both cert_key and cert_cert (or neither)")
        for name, value in (
            ("timeout", timeout),
            ("connect_timeout", connect_timeout),
            ("resync_interval", resync_interval),
            ("retry_max_backoff", retry_max_backoff),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value!r}")
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.resync_interval = float(resync_interval)
        self.retry_max_backoff = float(retry_max_backoff)
        self.username = username
        self._password = password
        self._root_certificates = _read(ca_cert, "ca_cert")
        self._private_key = _read(cert_key, "cert_key")
        self._certificate_chain = _read(cert_cert, "cert_cert")
        self._options = {**_CHANNEL_OPTIONS, **(grpc_options or {})}
        self._connection = _Connection(self.endpoints, self._make_client)
        self._watches: set[TeacherWatch] = set()
        self._registrations: set[_EtcdRegistration] = set()
        self._warned: set[bytes] = set()
        self._closed = False

    def __repr__(self) -> str:
        eps = ",".join(str(e) for e in self.endpoints)
        return f"EtcdRegistry(etcd://{eps})"

    # -- plumbing -------------------------------------------------------------------------------
    def _make_client(self, endpoint: Endpoint) -> EtcdClient:
        return EtcdClient(
            endpoint,
            username=self.username,
            password=self._password,
            timeout=self.timeout,
            options=self._options,
            root_certificates=self._root_certificates,
            private_key=self._private_key,
            certificate_chain=self._certificate_chain,
        )

    def client(self) -> EtcdClient:
        """The ``aetcd`` client of the current endpoint (created on first use), for etcd operations
        this module does not wrap (compaction, maintenance). Shared: do not close it."""
        return self._connection.client()

    async def _call(self, aw: Awaitable[_T], timeout: float | None = None) -> _T:
        """Await one etcd call with a deadline (gRPC has its own; this also covers connecting)."""
        async with deadline((timeout or self.timeout) + _CALL_SLACK):
            return await aw

    async def _pause(self, client: EtcdClient, delay: float) -> None:
        """Sleep ``delay`` seconds before a retry, but wake up early when the channel reconnects.

        Polls the channel state rather than awaiting ``channel_ready()``: an abandoned
        connectivity watch lives on in gRPC's core and completes after the event loop is gone.
        """
        loop = asyncio.get_running_loop()
        until = loop.time() + delay
        channel = client.channel
        was_ready = True
        while True:
            if channel is not None and self._connection.is_current(client) and client.channel is channel:
                try:
                    ready = channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY
                except Exception:  # a closed channel: just sleep
                    ready, channel = False, None
                if ready and not was_ready:
                    return  # etcd is back: retry now
                was_ready = ready
            left = until - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.1))

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryError("this registry is closed")

    def _track(self, reg: _EtcdRegistration) -> None:
        self._registrations.add(reg)

    def _untrack(self, reg: _EtcdRegistration) -> None:
        self._registrations.discard(reg)

    async def _keepalive_once(self, client: EtcdClient, lease: int) -> int:
        """Refresh ``lease`` once; return its new TTL (0: the lease is gone).

        ``aetcd``'s ``refresh_lease`` leaves its keepalive stream to the garbage collector, which
        may finish it after the event loop is closed; this one cancels the stream when done.
        """
        await self._call(client.connect())
        call = client.leasestub.LeaseKeepAlive(timeout=self.timeout, metadata=client.metadata)
        try:
            await call.write(etcd_rpc.LeaseKeepAliveRequest(ID=lease))
            reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise RegistryError("etcd closed the lease keepalive stream without an answer")
        return int(reply.TTL)

    async def _range(self, client: EtcdClient, prefixes: Sequence[str]) -> tuple[int, int, list[list[Any]]]:
        """One consistent read of several prefixes: (revision, cluster_id, kvs per prefix)."""
        await self._call(client.connect())
        ops = []
        for p in prefixes:
            key = p.encode()
            req = etcd_rpc.RangeRequest(key=key, range_end=aetcd.utils.prefix_range_end(key))
            ops.append(etcd_rpc.RequestOp(request_range=req))
        resp = await self._call(
            client.kvstub.Txn(
                etcd_rpc.TxnRequest(compare=[], success=ops, failure=[]),
                timeout=self.timeout,
                metadata=client.metadata,
            )
        )
        kvs = [list(r.response_range.kvs) for r in resp.responses]
        return int(resp.header.revision), int(resp.header.cluster_id), kvs

    async def _header(self, client: EtcdClient, prefix: str) -> tuple[int, int]:
        """(revision, cluster_id) from a count-only read: cheap proof that history continues."""
        await self._call(client.connect())
        key = prefix.encode()
        resp = await self._call(
            client.kvstub.Range(
                etcd_rpc.RangeRequest(key=key, range_end=aetcd.utils.prefix_range_end(key), count_only=True),
                timeout=self.timeout,
                metadata=client.metadata,
            )
        )
        return int(resp.header.revision), int(resp.header.cluster_id)

    async def _oneshot(self, what: str, fn: Callable[[EtcdClient], Awaitable[_T]]) -> _T:
        self._check_open()
        errors: list[str] = []
        attempts, reauthenticated = len(self.endpoints), False
        while len(errors) < attempts:
            client = self._connection.client()
            try:
                return await fn(client)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                errors.append(f"{client.endpoint}: {_describe_error(e)}")
                self._connection.failed(client, e)
                if _is_auth_error(e) and not reauthenticated:
                    attempts, reauthenticated = attempts + 1, True  # an expired token: once more
        raise RegistryUnavailableError(
            f"could not {what} ({'; '.join(errors)}). Check the registry address "
            "(etcd://HOST:PORT[,HOST:PORT]) and that etcd is running and reachable."
        )

    # -- teachers -------------------------------------------------------------------------------
    def register(
        self,
        service: str,
        record: TeacherRecord,
        *,
        ttl: float = 10.0,
        load: Callable[[], TeacherLoad] | None = None,
        load_interval: float = 1.0,
        max_report_age: float = 10.0,
    ) -> Registration:
        """See :meth:`Registry.register`. The record is copied now; ``load()`` results get their
        ``instance_id`` and ``updated_at`` filled in when left empty."""
        self._check_open()
        if not isinstance(record, TeacherRecord):
            raise TypeError(f"record must be a registry_pb2.TeacherRecord, not {type(record).__name__}")
        iid = keys.validate_name("teacher instance_id", record.instance_id)
        if not record.endpoint:
            raise ValueError(f"teacher {iid!r}: record.endpoint must be set (host:port students dial)")
        _positive("ttl", ttl)
        _positive("load_interval", load_interval)
        tkey = keys.teacher_key(service, iid)
        periodic = None
        if load is not None:

            def set_id(msg: TeacherLoad) -> None:
                msg.instance_id = msg.instance_id or iid

            gate: ReportGate[TeacherLoad] = ReportGate(load_changed, max_report_age)
            periodic = (keys.load_key(service, iid), _gated_report(load, TeacherLoad, "load()", gate, set_id))
        return _EtcdRegistration(
            self,
            what=f"teacher {iid!r} of service {service!r}",
            key=tkey,
            fixed=[(tkey, bytes(record.SerializeToString()))],
            periodic=periodic,
            ttl=ttl,
            interval=load_interval,
        )

    # -- students -------------------------------------------------------------------------------
    def watch(
        self,
        service: str,
        *,
        connect_timeout: float | None = None,
        resync_interval: float | None = None,
        loads: bool = True,
    ) -> TeacherWatch:
        """See :meth:`Registry.watch`; ``resync_interval`` overrides the registry's for this watch."""
        self._check_open()
        keys.service_prefix(service)
        resync = self.resync_interval if resync_interval is None else float(resync_interval)
        _positive("resync_interval", resync)
        watch = TeacherWatch(
            service,
            lambda w: self._produce(w, service, resync, loads),
            connect_timeout=self.connect_timeout if connect_timeout is None else connect_timeout,
            describe=f"etcd at {','.join(str(e) for e in self.endpoints)}",
            on_close=self._watches.discard,
        )
        self._watches.add(watch)
        return watch

    async def _produce(self, watch: TeacherWatch, service: str, resync_interval: float, loads: bool = True) -> None:
        """The watch loop: read, watch, apply, publish; resume, reload or re-sync as needed."""
        state = _WatchState(service, set())
        prefixes = {"teachers": keys.teachers_prefix(service), "load": keys.load_prefix(service)}
        kinds = ("teachers", "load") if loads else ("teachers",)
        backoff = Backoff(cap=self.retry_max_backoff)
        slog = StateLog(log)
        need_reload = True
        published: list[TeacherSet | None] = [None]
        while True:
            client = self._connection.client()
            streams: list[aetcd.Watch] = []
            pumps: list[asyncio.Task[None]] = []
            try:
                if not need_reload:
                    revision, cluster_id = await self._header(client, prefixes["teachers"])
                    if cluster_id != state.cluster_id or revision < state.revision:
                        log.info(
                            "watch of %r: etcd history does not continue from revision %d "
                            "(now %d, cluster %x, was %x); reading everything again",
                            service,
                            state.revision,
                            revision,
                            cluster_id,
                            state.cluster_id or 0,
                        )
                        need_reload = True
                if need_reload:
                    revision, cluster_id, kvs = await self._range(client, [prefixes[k] for k in kinds])
                    state.reset(revision, cluster_id, kvs[0], kvs[1] if loads else [])
                    need_reload = False
                    self._publish(watch, state, published, force=published[0] is None)
                queue: asyncio.Queue[Any] = asyncio.Queue()
                for kind in kinds:
                    stream = await self._call(
                        client.watch_prefix(prefixes[kind].encode(), start_revision=state.rev[kind] + 1)
                    )
                    streams.append(stream)
                    pumps.append(asyncio.get_running_loop().create_task(_pump(kind, stream, queue)))
                was = slog.state
                slog.change(
                    "watching",
                    logging.INFO if was is not None else logging.DEBUG,
                    "watching service %r at etcd %s from revision %d",
                    service,
                    client.endpoint,
                    state.revision + 1,
                )
                backoff.reset()
                await self._consume(watch, state, queue, published, time.monotonic() + resync_interval)
                need_reload = True  # periodic re-sync: a full read, then a fresh watch
            except aetcd.RevisionCompactedError as e:
                log.info(
                    "watch of %r: revision %d is compacted (%s); reading everything again",
                    service,
                    state.revision + 1,
                    e,
                )
                need_reload = True
            except asyncio.CancelledError:
                raise
            except Exception as e:
                watch.note_error(e)
                slog.change(
                    "down",
                    logging.WARNING,
                    "watch of %r at etcd %s interrupted (%s); keeping the last snapshot and "
                    "retrying with backoff up to %g s",
                    service,
                    client.endpoint,
                    _describe_error(e),
                    self.retry_max_backoff,
                )
                self._connection.failed(client, e)
                await self._pause(client, backoff.next_delay())
            finally:
                for task in pumps:
                    await cancel_and_wait(task)
                for stream in streams:
                    try:
                        async with deadline(1.0):
                            await stream.cancel()
                    except Exception as e:
                        log.debug("cancelling an etcd watch: %s", _describe_error(e))

    @staticmethod
    def _publish(watch: TeacherWatch, state: _WatchState, published: list[TeacherSet | None], force: bool) -> None:
        snap = state.snapshot()
        if force or snap != published[0]:
            published[0] = snap
            watch.publish(snap)

    async def _consume(
        self,
        watch: TeacherWatch,
        state: _WatchState,
        queue: asyncio.Queue[Any],
        published: list[TeacherSet | None],
        resync_at: float,
    ) -> None:
        """Apply events in batches and publish paced snapshots until a re-sync is due."""
        last_publish = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= resync_at:
                return
            due = resync_at
            if state.membership_dirty:
                due = min(due, last_publish + _MIN_PUBLISH_INTERVAL)
            elif state.load_dirty:
                due = min(due, last_publish + _LOAD_PUBLISH_INTERVAL)
            items: list[Any] = []
            if due > now:
                try:
                    async with deadline(due - now):
                        items.append(await queue.get())
                except asyncio.TimeoutError:
                    pass
            while not queue.empty():
                items.append(queue.get_nowait())
            for item in items:
                if isinstance(item, BaseException):
                    if state.membership_dirty or state.load_dirty:
                        self._publish(watch, state, published, force=False)
                    raise item
                state.apply(*item)
            now = time.monotonic()
            if (state.membership_dirty and now >= last_publish + _MIN_PUBLISH_INTERVAL) or (
                state.load_dirty and now >= last_publish + _LOAD_PUBLISH_INTERVAL
            ):
                self._publish(watch, state, published, force=False)
                last_publish = now

    def publish_demand(
        self,
        service: str,
        demand_fn: Callable[[], StudentDemand],
        *,
        ttl: float = 10.0,
        interval: float = 1.0,
        student_id: str | None = None,
        max_report_age: float = 10.0,
    ) -> Registration:
        """See :meth:`Registry.publish_demand`. ``updated_at`` is filled in when left 0."""
        self._check_open()
        _positive("ttl", ttl)
        _positive("interval", interval)
        if student_id is None:
            first = demand_fn()
            if not isinstance(first, StudentDemand):
                raise TypeError(f"demand_fn() returned {type(first).__name__}, not a StudentDemand")
            student_id = first.student_id
        sid = keys.validate_name("student_id", student_id)
        skey = keys.student_key(service, sid)

        def set_id(msg: StudentDemand) -> None:
            msg.student_id = msg.student_id or sid

        gate: ReportGate[StudentDemand] = ReportGate(demand_changed, max_report_age)
        demand_bytes = _gated_report(demand_fn, StudentDemand, "demand_fn()", gate, set_id)

        return _EtcdRegistration(
            self,
            what=f"student {sid!r} of service {service!r}",
            key=skey,
            fixed=[],
            periodic=(skey, demand_bytes),
            ttl=ttl,
            interval=interval,
        )

    # -- one-shot reads -------------------------------------------------------------------------
    async def teachers(self, service: str) -> TeacherSet:
        tp, lp = keys.teachers_prefix(service), keys.load_prefix(service)

        async def read(client: EtcdClient) -> TeacherSet:
            revision, cluster_id, (tkvs, lkvs) = await self._range(client, [tp, lp])
            state = _WatchState(service, self._warned)
            state.reset(revision, cluster_id, tkvs, lkvs)
            return state.snapshot()

        return await self._oneshot(f"read the teachers of {service!r}", read)

    async def loads(self, service: str) -> dict[str, TeacherLoad]:
        lp = keys.load_prefix(service)

        async def read(client: EtcdClient) -> dict[str, TeacherLoad]:
            _, _, (kvs,) = await self._range(client, [lp])
            return _parse_all(service, "load", kvs, self._warned)

        return await self._oneshot(f"read the teacher loads of {service!r}", read)

    async def demand(self, service: str) -> list[StudentDemand]:
        sp = keys.students_prefix(service)

        async def read(client: EtcdClient) -> list[StudentDemand]:
            _, _, (kvs,) = await self._range(client, [sp])
            parsed = _parse_all(service, "students", kvs, self._warned)
            return [parsed[k] for k in sorted(parsed)]

        return await self._oneshot(f"read the student demand of {service!r}", read)

    # -- lifecycle ------------------------------------------------------------------------------
    async def close(self) -> None:
        """Close every watch, deregister every registration (revoking leases), close the client."""
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            await watch.aclose()
        for reg in list(self._registrations):
            await reg.deregister()
        await self._connection.close()


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
