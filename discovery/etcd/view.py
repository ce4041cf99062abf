"""The whole mesh from etcd in one read: raw keys under ``/distill/v1/`` grouped into a
:class:`~discovery.view.MeshView` (what ``distill top`` shows).

Why one range read of the whole prefix (or of the wanted services' prefixes, in one transaction)
rather than the registry's per-service reads: one request gives a consistent snapshot (one etcd
revision) of every service, and it discovers the services at the same time. The values are the
registry's protobuf messages; a value that does not parse is counted and skipped, never fatal (the
view is what you look at when things look wrong). The autoscaler's records are kept as raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf.message import DecodeError, Message

from discovery import keys
from discovery.view import AutoscalerRecord, ServiceView, TeacherRow
from protos import registry_pb2

__all__ = ["parse_kvs", "view_prefixes"]


def _parse(cls: type[Message], value: bytes) -> Any | None:
    msg = cls()
    try:
        msg.ParseFromString(value)
    except (DecodeError, RuntimeError, ValueError):
        return None
    return msg


def view_prefixes(services: Sequence[str] = ()) -> list[str]:
    """The key prefixes one read of ``services`` covers (the whole ``/distill/v1/`` for all)."""
    return [keys.service_prefix(s) for s in services] if services else [f"{keys.ROOT}/"]


def parse_kvs(kvs: Iterable[tuple[bytes, bytes]], only: Sequence[str] = ()) -> list[ServiceView]:
    """Group ``(key, value)`` pairs under ``/distill/v1/`` into services (optionally only ``only``).

    Pure (no etcd), so the view's logic is testable on its own. Keys of unknown kinds are ignored;
    a teacher's load joins its record by instance id; a load without a record is dropped (the
    teacher is going away: records and loads share a lease, the record is deleted first).
    """
    root = f"{keys.ROOT}/"
    services: dict[str, ServiceView] = {}
    loads: dict[str, dict[str, registry_pb2.TeacherLoad]] = {}
    records: dict[str, dict[str, registry_pb2.TeacherRecord]] = {}
    for raw_key, value in kvs:
        key = raw_key.decode("utf-8", "replace")
        if not key.startswith(root):
            continue
        service, _, rest = key[len(root) :].partition("/")
        if not service or not rest or (only and service not in only):
            continue
        view = services.setdefault(service, ServiceView(service))
        kind, _, name = rest.partition("/")
        if kind == "autoscaler":
            view.autoscaler.append(AutoscalerRecord(name, value))
            continue
        if not name or "/" in name:
            continue
        if kind == "teachers":
            rec = _parse(registry_pb2.TeacherRecord, value)
            if rec is None or not rec.endpoint:
                view.unparsable += 1
            else:
                records.setdefault(service, {})[name] = rec
        elif kind == "load":
            load = _parse(registry_pb2.TeacherLoad, value)
            if load is None:
                view.unparsable += 1
            else:
                loads.setdefault(service, {})[name] = load
        elif kind == "students":
            demand = _parse(registry_pb2.StudentDemand, value)
            if demand is None:
                view.unparsable += 1
            else:
                if not demand.student_id:
                    demand.student_id = name
                view.students.append(demand)
    for service, recs in records.items():
        view = services[service]
        view.teachers = [TeacherRow(iid, rec, loads.get(service, {}).get(iid)) for iid, rec in recs.items()]
        view.teachers.sort(key=lambda t: (t.record.endpoint, t.instance_id))
    for view in services.values():
        view.students.sort(key=lambda d: d.student_id)
        view.autoscaler.sort(key=lambda a: a.name)
    return [services[s] for s in sorted(services)]
