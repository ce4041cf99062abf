"""One read of everything a registry holds, as plain types: what operator tools show.

Why here and not in ``distill top``: the view is the registry's to produce. Each backend reads its
own storage (etcd: one range read of ``/distill/v1/``, see :mod:`discovery.etcd.view`) and hands
out these types, so ``distill top`` renders a :class:`MeshView` without knowing the key layout and
a second backend only has to fill them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import registry_pb2

__all__ = ["AutoscalerRecord", "MeshView", "ServiceView", "TeacherRow"]


@dataclass(frozen=True)
class TeacherRow:
    """One registered teacher and its latest load (None until it publishes one)."""

    instance_id: str
    record: registry_pb2.TeacherRecord
    load: registry_pb2.TeacherLoad | None = None


@dataclass(frozen=True)
class AutoscalerRecord:
    """One record the service's autoscaler keeps (its leader, its last decision): its name and its
    raw value. The values have no fixed format here; the reader decides how to show them."""

    name: str
    value: bytes


@dataclass
class ServiceView:
    """Everything the registry holds for one service, at one revision."""

    name: str
    teachers: list[TeacherRow] = field(default_factory=list)
    students: list[registry_pb2.StudentDemand] = field(default_factory=list)
    autoscaler: list[AutoscalerRecord] = field(default_factory=list)
    unparsable: int = 0  # values under the service that did not parse (skipped)


@dataclass
class MeshView:
    """One snapshot of the registry: every service (sorted by name), the registry's address, the
    revision it reflects (0 where the backend has none) and when it was read (``time.time()``)."""

    registry: str
    revision: int
    taken_at: float
    services: list[ServiceView] = field(default_factory=list)
