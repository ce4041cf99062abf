"""The etcd-backed :class:`~discovery.base.Registry`: the facade over connection, leases and watches.

It validates arguments, builds the keys (:mod:`discovery.keys`) and the gated reports, and hands
the work to the package's parts: :class:`~discovery.etcd.client.EtcdConnection` (failover,
deadlines), :class:`~discovery.etcd.registration.EtcdRegistration` over a
:class:`~discovery.etcd.lease.LeaseSession` (teachers and students), and
:func:`~discovery.etcd.watch.produce_snapshots` (students' watches). It owns them all and closes
them in ``close()``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from discovery import keys
from discovery.address import Endpoint, RegistryAddress
from discovery.base import (
    Registration,
    Registry,
    RegistryError,
    StudentDemand,
    TeacherLoad,
    TeacherRecord,
    TeacherSet,
    TeacherWatch,
)
from discovery.election import Election
from discovery.etcd.client import CHANNEL_OPTIONS, EtcdClient, EtcdConnection, endpoints_of, read_file
from discovery.etcd.election import LeaderElection
from discovery.etcd.lease import LeaseSession
from discovery.etcd.registration import EtcdRegistration, gated_report
from discovery.etcd.view import parse_kvs, view_prefixes
from discovery.etcd.watch import WatchState, parse_all, produce_snapshots
from discovery.reports import ReportGate, demand_changed, load_changed
from discovery.view import MeshView

__all__ = ["EtcdRegistry"]


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
        self.endpoints = endpoints_of(endpoints)
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
        self._root_certificates = read_file(ca_cert, "ca_cert")
        self._private_key = read_file(cert_key, "cert_key")
        self._certificate_chain = read_file(cert_cert, "cert_cert")
        self._options = {**CHANNEL_OPTIONS, **(grpc_options or {})}
        self._connection = EtcdConnection(
            self.endpoints, self._make_client, timeout=self.timeout, retry_max_backoff=self.retry_max_backoff
        )
        self._watches: set[TeacherWatch] = set()
        self._registrations: set[EtcdRegistration] = set()
        self._warned: set[bytes] = set()
        self._closed = False

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(str(e) for e in self.endpoints)

    def __repr__(self) -> str:
        return f"EtcdRegistry({self.address})"

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
        this package does not wrap (compaction, maintenance, the leader key). Shared: do not close it."""
        return self._connection.client()

    def session(
        self, ttl: float, *, lease_id: int | None = None, call_timeout: float | None = None, name: str = "lease"
    ) -> LeaseSession:
        """A new :class:`LeaseSession` on this registry's connection (TLS, authentication and
        endpoint failover included): ``async with registry.session(ttl=5) as s: ...`` grants a
        lease, keeps it alive and revokes it on exit. ``lease_id`` adopts an existing lease."""
        self._check_open()
        return LeaseSession(self._connection, ttl, lease_id=lease_id, call_timeout=call_timeout, name=name)

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryError("this registry is closed")

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
            periodic = (keys.load_key(service, iid), gated_report(load, TeacherLoad, "load()", gate, set_id))
        return self._registration(
            what=f"teacher {iid!r} of service {service!r}",
            key=tkey,
            fixed=[(tkey, bytes(record.SerializeToString()))],
            periodic=periodic,
            ttl=ttl,
            interval=load_interval,
        )

    def _registration(
        self,
        *,
        what: str,
        key: str,
        fixed: list[tuple[str, bytes]],
        periodic: tuple[str, Callable[[bool], bytes | None]] | None,
        ttl: float,
        interval: float,
    ) -> EtcdRegistration:
        return EtcdRegistration(
            self._connection,
            what=what,
            key=key,
            fixed=fixed,
            periodic=periodic,
            ttl=ttl,
            interval=interval,
            start_timeout=self.timeout,
            on_start=self._registrations.add,
            on_close=self._registrations.discard,
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
        conn = self._connection
        watch = TeacherWatch(
            service,
            lambda w: produce_snapshots(conn, w, service, resync, loads),
            connect_timeout=self.connect_timeout if connect_timeout is None else connect_timeout,
            describe=f"etcd at {','.join(str(e) for e in self.endpoints)}",
            on_close=self._watches.discard,
        )
        self._watches.add(watch)
        return watch

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
        demand_bytes = gated_report(demand_fn, StudentDemand, "demand_fn()", gate, set_id)
        return self._registration(
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
            revision, cluster_id, (tkvs, lkvs) = await self._connection.read_prefixes(client, [tp, lp])
            state = WatchState(service, self._warned)
            state.reset(revision, cluster_id, tkvs, lkvs)
            return state.snapshot()

        self._check_open()
        return await self._connection.oneshot(f"read the teachers of {service!r}", read)

    async def loads(self, service: str) -> dict[str, TeacherLoad]:
        lp = keys.load_prefix(service)

        async def read(client: EtcdClient) -> dict[str, TeacherLoad]:
            _, _, (kvs,) = await self._connection.read_prefixes(client, [lp])
            return parse_all(service, "load", kvs, self._warned)

        self._check_open()
        return await self._connection.oneshot(f"read the teacher loads of {service!r}", read)

    async def demand(self, service: str) -> list[StudentDemand]:
        sp = keys.students_prefix(service)

        async def read(client: EtcdClient) -> list[StudentDemand]:
            _, _, (kvs,) = await self._connection.read_prefixes(client, [sp])
            parsed = parse_all(service, "students", kvs, self._warned)
            return [parsed[k] for k in sorted(parsed)]

        self._check_open()
        return await self._connection.oneshot(f"read the student demand of {service!r}", read)

    async def autoscaler_decision(self, service: str) -> dict[str, Any] | None:
        """The last decision the leading autoscaler published for ``service`` (its JSON record, as
        ``distill top`` shows it), or None when no autoscaler has published one or it is not JSON."""
        key = (keys.autoscaler_prefix(service) + "decision").encode()

        async def read(client: EtcdClient) -> dict[str, Any] | None:
            got = await client.get(key)
            if got is None:
                return None
            try:
                record = json.loads(got.value)
            except ValueError:
                return None
            return record if isinstance(record, dict) else None

        self._check_open()
        return await self._connection.oneshot(f"read the autoscaler decision of {service!r}", read)

    async def view(self, services: Sequence[str] = ()) -> MeshView:
        """See :meth:`Registry.view`: one transaction over ``/distill/v1/`` (or the services'
        prefixes), grouped by :func:`~discovery.etcd.view.parse_kvs`."""
        only = [keys.validate_name("service name", s) for s in services]

        async def read(client: EtcdClient) -> MeshView:
            revision, _, parts = await self._connection.read_prefixes(client, view_prefixes(only))
            kvs = [(kv.key, kv.value) for part in parts for kv in part]
            return MeshView(self.address, revision, time.time(), parse_kvs(kvs, only))

        self._check_open()
        return await self._connection.oneshot(f"read the registry at {self.address}", read)

    def election(
        self,
        service: str,
        *,
        identity: str,
        ttl: float = 5.0,
        poll_interval: float = 0.5,
        call_timeout: float = 3.0,
    ) -> Election:
        """A :class:`~discovery.etcd.election.LeaderElection` on this registry's connection."""
        return LeaderElection(
            self, service, identity=identity, ttl=ttl, poll_interval=poll_interval, call_timeout=call_timeout
        )

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
