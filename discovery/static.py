"""A fixed list of teachers (``--distill_teachers host:port,host:port`` / ``static://...``).

Why a backend at all: the student's code path stays the same whether teachers are discovered or
listed by hand, so the router is tested once. The records carry only ``endpoint`` and
``instance_id`` (= the endpoint); the student asks each teacher for its model metadata itself.
Registering with a static registry does nothing (there is nowhere to register).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from discovery import keys
from discovery.address import Endpoint, RegistryAddress, parse_address, parse_endpoints
from discovery.backends import backend, shared_forms
from discovery.base import (
    Registration,
    Registry,
    RegistryError,
    StudentDemand,
    TeacherEntry,
    TeacherLoad,
    TeacherRecord,
    TeacherSet,
    TeacherWatch,
)
from discovery.election import Election
from discovery.errors import ElectionError, RegistryUnsupportedError
from discovery.view import MeshView

__all__ = ["StaticRegistry"]

log = logging.getLogger("discovery.static")


class _NoopRegistration(Registration):
    """What ``register``/``publish_demand`` return for a static list: nothing is published, so
    ``registered`` is always False and ``wait_registered`` returns False at once."""

    def __init__(self, key: str, what: str) -> None:
        self._key = key
        self._what = what

    @property
    def key(self) -> str:
        return self._key

    @property
    def registered(self) -> bool:
        return False

    @property
    def lease_id(self) -> int | None:
        return None

    async def wait_registered(self, timeout: float | None = None) -> bool:
        return False

    async def _start(self) -> None:
        log.debug("static registry: not publishing %s (a static list has nowhere to publish)", self._what)

    async def deregister(self) -> None:
        return None


class StaticRegistry(Registry):
    """Teachers from a fixed ``host:port`` list; see the module docstring."""

    def __init__(self, endpoints: str | RegistryAddress | Iterable[str | Endpoint]) -> None:
        if isinstance(endpoints, RegistryAddress):
            if backend(endpoints.scheme).shared:  # static://, or another scheme listed as a fixed list
                raise ValueError(f"StaticRegistry needs a static:// address, not {str(endpoints)!r}")
            eps: tuple[Endpoint, ...] = endpoints.endpoints
        elif isinstance(endpoints, str):
            eps = parse_address(endpoints).endpoints if "://" in endpoints else parse_endpoints(endpoints)
        else:
            out: list[Endpoint] = []
            for item in endpoints:
                for ep in (item,) if isinstance(item, Endpoint) else parse_endpoints(item):
                    if ep not in out:
                        out.append(ep)
            eps = tuple(out)
        if not eps:
            raise ValueError("StaticRegistry needs at least one host:port")
        self.endpoints = eps
        entries = {}
        for ep in eps:
            rec = TeacherRecord(instance_id=str(ep), endpoint=str(ep))
            entries[str(ep)] = TeacherEntry(rec)
        self._set = TeacherSet(entries, revision=0)
        self._watches: set[TeacherWatch] = set()
        self._closed = False

    @classmethod
    def from_address(cls, address: RegistryAddress, **options: Any) -> StaticRegistry:
        """A static list has no options (no connection, no credentials): any given are ignored."""
        return cls(address)

    @property
    def address(self) -> str:
        return f"static://{','.join(str(e) for e in self.endpoints)}"

    def __repr__(self) -> str:
        return f"StaticRegistry({self.address})"

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryError("this registry is closed")

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
        self._check_open()
        iid = keys.validate_name("teacher instance_id", record.instance_id)
        return _NoopRegistration(keys.teacher_key(service, iid), f"teacher {iid!r}")

    def watch(self, service: str, *, connect_timeout: float | None = None, loads: bool = True) -> TeacherWatch:
        """One snapshot with every listed teacher, then nothing until closed. ``service`` is only
        validated: a static list serves whatever service the student asks for."""
        self._check_open()
        keys.service_prefix(service)
        snapshot = self._set

        async def produce(w: TeacherWatch) -> None:
            w.publish(snapshot)
            await asyncio.Event().wait()  # until cancelled by aclose()/close()

        watch = TeacherWatch(
            service,
            produce,
            connect_timeout=1.0 if connect_timeout is None else connect_timeout,
            describe="the static teacher list",
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
        self._check_open()
        sid = student_id if student_id is not None else demand_fn().student_id
        return _NoopRegistration(keys.student_key(service, sid), f"demand of student {sid!r}")

    async def teachers(self, service: str) -> TeacherSet:
        self._check_open()
        return self._set

    async def loads(self, service: str) -> dict[str, TeacherLoad]:
        self._check_open()
        return {}

    async def demand(self, service: str) -> list[StudentDemand]:
        self._check_open()
        return []

    async def autoscaler_decision(self, service: str) -> dict[str, Any] | None:
        self._check_open()
        return None

    async def view(self, services: Sequence[str] = ()) -> MeshView:
        raise RegistryUnsupportedError(
            f"{self.address} is a fixed teacher list: it keeps no loads, demand or autoscaler records "
            f"to show; read a registry such as {shared_forms()}"
        )

    def election(
        self,
        service: str,
        *,
        identity: str,
        ttl: float = 5.0,
        poll_interval: float = 0.5,
        call_timeout: float = 3.0,
    ) -> Election:
        raise ElectionError(
            f"leader election needs an etcd registry (etcd://HOST:PORT), not {self!r}: "
            "a static teacher list has no shared state to elect a leader in"
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            await watch.aclose()
