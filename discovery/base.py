"""The discovery interface every backend implements, and the value types it hands out.

Why an interface: students must not care whether teachers come from etcd or from a fixed
``--distill_teachers`` list, and tests of the router should be able to feed it snapshots without
running etcd. So the student side only ever sees :class:`TeacherSet` snapshots coming out of
:meth:`Registry.watch`, and the teacher side only ever holds a :class:`Registration`.

Contracts that all backends keep:

* ``watch()`` yields *full* snapshots (never deltas), newest first-come: a slow consumer skips
  intermediate snapshots instead of queueing them, so it always acts on the current set.
* ``register()`` / ``publish_demand()`` never raise into the caller because the registry is
  unreachable; they retry in the background. Programming errors (bad names) still raise at once.
* Everything is asyncio and must be used from one event loop.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

from discovery.address import RegistryAddress
from discovery.aio import cancel_and_wait, deadline
from discovery.election import Election
from discovery.errors import RegistryError, RegistryUnavailableError
from discovery.view import MeshView
from protos import registry_pb2

__all__ = [
    "Registration",
    "Registry",
    "RegistryError",
    "RegistryUnavailableError",
    "TeacherEntry",
    "TeacherSet",
    "TeacherWatch",
]

log = logging.getLogger("discovery")

_RegT = TypeVar("_RegT", bound="Registration")
_RegistryT = TypeVar("_RegistryT", bound="Registry")

TeacherRecord = registry_pb2.TeacherRecord
TeacherLoad = registry_pb2.TeacherLoad
StudentDemand = registry_pb2.StudentDemand


@dataclass(frozen=True)
class TeacherEntry:
    """One live teacher: its registration record and its latest published load (None until the
    first load report arrives, or when the teacher publishes none).

    The protobuf messages are shared between snapshots; treat them as read-only.
    """

    record: TeacherRecord
    load: TeacherLoad | None = None

    @property
    def endpoint(self) -> str:
        return str(self.record.endpoint)


class TeacherSet(Mapping[str, TeacherEntry]):
    """An immutable snapshot of a service's live teachers: ``instance_id -> TeacherEntry``.

    ``revision`` is the registry revision the snapshot reflects (etcd's store revision; 0 for
    static lists). Two snapshots compare equal when they hold the same entries, whatever their
    revisions, so consumers can cheaply skip snapshots that changed nothing they use.
    """

    __slots__ = ("_entries", "_revision")

    def __init__(self, entries: Mapping[str, TeacherEntry] | None = None, revision: int = 0) -> None:
        self._entries: Mapping[str, TeacherEntry] = MappingProxyType(dict(entries or {}))
        self._revision = int(revision)

    @property
    def revision(self) -> int:
        return self._revision

    def __getitem__(self, instance_id: str) -> TeacherEntry:
        return self._entries[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def endpoints(self) -> dict[str, str]:
        """``instance_id -> endpoint`` for every teacher."""
        return {iid: e.endpoint for iid, e in self._entries.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{iid}@{e.endpoint}" for iid, e in sorted(self._entries.items()))
        return f"TeacherSet(revision={self._revision}, [{inner}])"


class Registration(abc.ABC):
    """A lease-bound publication (a teacher's record, or a student's demand) that keeps itself
    alive. Use as an async context manager; leaving it withdraws the keys at once.

    In the etcd backend it is a thin user of :class:`discovery.etcd.lease.LeaseSession`, modelled
    on etcd's Go ``concurrency.Session``: one object owns the lease's whole life.
    """

    @property
    @abc.abstractmethod
    def key(self) -> str:
        """The main key this publication owns (``.../teachers/<id>`` or ``.../students/<id>``)."""

    @property
    @abc.abstractmethod
    def registered(self) -> bool:
        """True while the last exchange with the registry confirmed the keys are live."""

    @property
    @abc.abstractmethod
    def lease_id(self) -> int | None:
        """The current lease (changes after re-registration); None before the first grant."""

    @abc.abstractmethod
    async def wait_registered(self, timeout: float | None = None) -> bool:
        """Wait until ``registered`` is True; return it (False after ``timeout`` seconds)."""

    @abc.abstractmethod
    async def deregister(self) -> None:
        """Withdraw now (revoke the lease) and stop keeping it alive. Idempotent; never raises
        because the registry is unreachable (the keys then expire with the lease TTL).

        A draining teacher calls this *before* finishing in-flight work, so students stop
        routing to it while it completes what it already accepted."""

    async def __aenter__(self: _RegT) -> _RegT:
        await self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.deregister()

    @abc.abstractmethod
    async def _start(self) -> None:
        """Begin registering (called by ``__aenter__``); must not raise for an unreachable registry."""


class TeacherWatch:
    """Async iterator of :class:`TeacherSet` snapshots for one service.

    A background producer (owned by this object, cancelled by :meth:`aclose` and by the registry's
    ``close()``) keeps the newest snapshot; ``__anext__`` returns the newest one the consumer has
    not seen yet, waiting if there is none. The first ``__anext__`` waits at most
    ``connect_timeout`` seconds for the first snapshot and raises :class:`RegistryUnavailableError`
    otherwise. After that, an unreachable registry never raises: the consumer keeps its last
    snapshot while the producer reconnects. Iteration stops after ``aclose()``.
    """

    def __init__(
        self,
        service: str,
        producer: Callable[[TeacherWatch], Coroutine[Any, Any, None]],
        *,
        connect_timeout: float,
        describe: str,
        on_close: Callable[[TeacherWatch], None] | None = None,
    ) -> None:
        self.service = service
        self._producer = producer
        self._connect_timeout = float(connect_timeout)
        self._describe = describe
        self._on_close = on_close
        self._task: asyncio.Task[None] | None = None
        self._latest: TeacherSet | None = None
        self._version = 0
        self._seen = 0
        self._changed = asyncio.Event()
        self._closed = False
        self._first_deadline: float | None = None
        self._last_error: str | None = None

    # -- producer side ----------------------------------------------------------------------------
    def publish(self, snapshot: TeacherSet) -> None:
        """Make ``snapshot`` the newest one (called by the producer)."""
        if self._closed:
            return
        self._latest = snapshot
        self._version += 1
        self._changed.set()

    def note_error(self, error: BaseException | str) -> None:
        """Remember the latest connection problem, for the message of a RegistryUnavailableError."""
        self._last_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    # -- consumer side ----------------------------------------------------------------------------
    @property
    def current(self) -> TeacherSet | None:
        """The newest snapshot so far (None before the first), without waiting."""
        return self._latest

    @property
    def closed(self) -> bool:
        return self._closed

    def _ensure_started(self) -> None:
        if self._task is None and not self._closed:
            self._first_deadline = time.monotonic() + self._connect_timeout
            self._task = asyncio.get_running_loop().create_task(
                self._producer(self), name=f"discovery-watch-{self.service}"
            )
            self._task.add_done_callback(lambda _t: self._changed.set())

    def __aiter__(self) -> TeacherWatch:
        return self

    async def __anext__(self) -> TeacherSet:
        self._ensure_started()
        while self._version == self._seen:
            if self._closed:
                raise StopAsyncIteration
            task = self._task
            if task is not None and task.done():
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]  # a producer bug: surface it
                raise StopAsyncIteration
            self._changed.clear()
            if self._latest is None:
                assert self._first_deadline is not None
                remaining = self._first_deadline - time.monotonic()
                if remaining <= 0:
                    await self.aclose()
                    detail = f" (last error: {self._last_error})" if self._last_error else ""
                    raise RegistryUnavailableError(
                        f"no answer from {self._describe} within {self._connect_timeout:g} s while "
                        f"watching service {self.service!r}{detail}. Check the registry address "
                        "(etcd://HOST:PORT[,HOST:PORT]) and that etcd is running and reachable from "
                        "this machine."
                    )
                try:
                    async with deadline(remaining):
                        await self._changed.wait()
                except asyncio.TimeoutError:
                    pass
            else:
                await self._changed.wait()
        self._seen = self._version
        assert self._latest is not None
        return self._latest

    async def aclose(self) -> None:
        """Stop the producer and end iteration. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._changed.set()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("discovery watch of %r failed", self.service, exc_info=task.exception())
        if self._on_close is not None:
            self._on_close(self)

    async def __aenter__(self) -> TeacherWatch:
        self._ensure_started()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Registry(abc.ABC):
    """Where teachers announce themselves and students find them. See the module docstring.

    Beyond that, what operators and the autoscaler read and hold: :meth:`view` (everything, for
    ``distill top``), :meth:`autoscaler_decision` and :meth:`election`. A backend without shared
    state (a static list) raises :class:`~discovery.errors.RegistryUnsupportedError` from those.
    A new backend subclasses this and adds itself to :mod:`discovery.backends`.
    """

    @classmethod
    def from_address(cls: type[_RegistryT], address: RegistryAddress, **options: Any) -> _RegistryT:
        """The registry ``open_registry`` returns for ``address`` (its backend's scheme), with
        the backend's ``options`` (TLS, credentials, timeouts)."""
        return cls(address, **options)  # type: ignore[call-arg]  # each backend's constructor takes its address

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address this registry reads (``etcd://h1:2379,h2:2379``), for messages and views."""

    @abc.abstractmethod
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
        """Announce a teacher under ``service`` for as long as the returned context is open.

        The record is bound to a lease of ``ttl`` seconds that is kept alive in the background, so
        a teacher that dies disappears within ``ttl``; ``load()`` (called on the event loop, keep it
        cheap) is sampled every ``load_interval`` seconds and published under the same lease when
        it changed materially or ``max_report_age`` seconds passed (see discovery/reports.py).
        """

    @abc.abstractmethod
    def watch(self, service: str, *, connect_timeout: float | None = None, loads: bool = True) -> TeacherWatch:
        """Full snapshots of the live teacher set of ``service``; see :class:`TeacherWatch`.

        ``loads=False`` watches membership only (every entry's ``load`` is None). Students route on
        their own measurements and learn of a drain from the deregistration, so they pass it: each
        teacher's 1 Hz load report would otherwise reach every student (see docs/scale.md).
        """

    @abc.abstractmethod
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
        """Sample ``demand_fn()`` every ``interval`` seconds and publish it under
        ``students/<student_id>`` (``student_id`` defaults to ``demand_fn().student_id``), bound to a
        lease like :meth:`register`, when it changed materially or ``max_report_age`` seconds
        passed. The autoscaler sizes the teacher pool from these."""

    @abc.abstractmethod
    async def teachers(self, service: str) -> TeacherSet:
        """One read of the current teacher set (no watch)."""

    @abc.abstractmethod
    async def loads(self, service: str) -> dict[str, TeacherLoad]:
        """One read of the teachers' latest loads: ``instance_id -> TeacherLoad``."""

    @abc.abstractmethod
    async def demand(self, service: str) -> list[StudentDemand]:
        """One read of all students' latest demand on ``service``."""

    @abc.abstractmethod
    async def autoscaler_decision(self, service: str) -> dict[str, Any] | None:
        """The last decision the leading autoscaler of ``service`` published (its JSON record, as
        ``distill top`` shows it); None when there is none or it is not a JSON object."""

    @abc.abstractmethod
    async def view(self, services: Sequence[str] = ()) -> MeshView:
        """One consistent read of every service (or only ``services``): teachers with their loads,
        students' demand, the autoscaler's records. ``RegistryUnavailableError`` when unreachable."""

    @abc.abstractmethod
    def election(
        self,
        service: str,
        *,
        identity: str,
        ttl: float = 5.0,
        poll_interval: float = 0.5,
        call_timeout: float = 3.0,
    ) -> Election:
        """A leader election for ``service`` (one active autoscaler), held as ``identity``:
        ``ttl`` seconds bound how long a dead leader blocks a takeover; candidates look at the
        leader every ``poll_interval`` seconds. See :mod:`discovery.election`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close watches, withdraw registrations and release connections. Idempotent."""

    async def __aenter__(self: _RegistryT) -> _RegistryT:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
