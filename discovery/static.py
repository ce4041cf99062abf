"""A fixed list of teachers (``--distill_teachers host:port,host:port`` / ``static://...``).

Why a backend at all: the student's code path stays the same whether teachers are discovered or
listed by hand, so the router is tested once. The records carry only ``endpoint`` and
``instance_id`` (= the item as listed); the student asks each teacher for its model metadata itself.
Registering with a static registry does nothing (there is nowhere to register).

An item may name an engine the student calls in its own protocol: ``vllm://HOST:PORT`` (vLLM's
OpenAI server) or ``sglang://HOST:PORT`` (SGLang's native API), optionally with an HTTP path prefix
(``vllm://HOST:PORT/PREFIX``); its record then carries ``protocol`` and ``path``. A bare
``HOST:PORT`` (or ``kserve://HOST:PORT``) is a KServe v2 gRPC teacher. Engines and KServe teachers
mix in one list: ``vllm://10.0.0.7:8000,10.0.0.8:9898``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from discovery import keys
from discovery.address import Endpoint, RegistryAddress, parse_endpoint
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

__all__ = ["ENGINE_PROTOCOLS", "StaticRegistry", "StaticTeacher", "parse_teachers"]

ENGINE_PROTOCOLS = ("vllm", "sglang")
"""The engines an item of a static list may name by scheme (``vllm://HOST:PORT``)."""
_FORM = "[vllm://|sglang://]HOST:PORT[/PREFIX][,...] (e.g. vllm://10.0.0.7:8000,10.0.0.8:9898)"


@dataclass(frozen=True)
class StaticTeacher:
    """One item of a static list: where the teacher listens, the protocol it speaks ("": KServe v2
    gRPC) and, for an engine, its HTTP path prefix."""

    endpoint: Endpoint
    protocol: str = ""
    path: str = ""

    def __str__(self) -> str:
        return f"{self.protocol}://{self.endpoint}{self.path}" if self.protocol else str(self.endpoint)

    def record(self) -> TeacherRecord:
        return TeacherRecord(instance_id=str(self), endpoint=str(self.endpoint), protocol=self.protocol,
                             path=self.path)


def parse_teachers(text: str) -> tuple[StaticTeacher, ...]:
    """A static list (``static://`` prefix allowed), each item ``[PROTOCOL://]HOST:PORT[/PREFIX]``;
    duplicates dropped, order kept. ValueError saying what is wrong and the accepted form."""
    body = text.strip()
    if body.lower().startswith("static://"):
        body = body[len("static://"):]
        if not body.strip(" /"):
            raise ValueError(f"no endpoints after the scheme in {text!r}; expected static://{_FORM}")
    out: list[StaticTeacher] = []
    for part in body.split(","):
        item = part.strip()
        scheme, sep, rest = item.partition("://")
        protocol, path = "", ""
        if sep:
            protocol = scheme.lower()
            if protocol not in (*ENGINE_PROTOCOLS, "kserve"):
                raise ValueError(f"unknown teacher scheme {scheme + '://'!r} in {item!r}; expected {_FORM}")
            item, _, tail = rest.partition("/")
            if tail.strip("/"):
                if protocol == "kserve":
                    raise ValueError(f"{part.strip()!r}: a KServe gRPC teacher has no path prefix; expected {_FORM}")
                path = "/" + tail.strip("/")
            protocol = "" if protocol == "kserve" else protocol
        try:
            endpoint = parse_endpoint(item)
        except ValueError as e:
            raise ValueError(f"bad teacher {part.strip()!r}: {e}; expected {_FORM}") from None
        teacher = StaticTeacher(endpoint, protocol, path)
        if teacher not in out:
            out.append(teacher)
    return tuple(out)

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
        teachers: tuple[StaticTeacher, ...]
        if isinstance(endpoints, RegistryAddress):
            if backend(endpoints.scheme).shared:  # static://, or another scheme listed as a fixed list
                raise ValueError(f"StaticRegistry needs a static:// address, not {str(endpoints)!r}")
            teachers = tuple(StaticTeacher(ep) for ep in endpoints.endpoints)
        elif isinstance(endpoints, str):
            teachers = parse_teachers(endpoints)
        else:
            out: list[StaticTeacher] = []
            for item in endpoints:
                for t in (StaticTeacher(item),) if isinstance(item, Endpoint) else parse_teachers(item):
                    if t not in out:
                        out.append(t)
            teachers = tuple(out)
        if not teachers:
            raise ValueError("StaticRegistry needs at least one host:port")
        self.listed = teachers
        self.endpoints = tuple(t.endpoint for t in teachers)
        entries = {str(t): TeacherEntry(t.record()) for t in teachers}
        self._set = TeacherSet(entries, revision=0)
        self._watches: set[TeacherWatch] = set()
        self._closed = False

    @classmethod
    def from_address(cls, address: RegistryAddress, **options: Any) -> StaticRegistry:
        """A static list has no options (no connection, no credentials): any given are ignored."""
        return cls(address)

    @property
    def address(self) -> str:
        return f"static://{','.join(str(t) for t in self.listed)}"

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
