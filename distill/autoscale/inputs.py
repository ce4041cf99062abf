"""What the policy looks at: a :class:`ScaleSnapshot` of teachers (:class:`TeacherSample`) and
students (:class:`StudentSample`) at one moment.

Why plain frozen dataclasses and not the registry's messages: :func:`~distill.autoscale.policy.decide`
stays a pure function that tests drive over hours of simulated time without etcd;
:meth:`ScaleSnapshot.from_registry` is the one place that reads the registry's types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ScaleSnapshot", "StudentSample", "TeacherSample"]


@dataclass(frozen=True)
class TeacherSample:
    """One registered teacher as the policy sees it (from its ``TeacherLoad``).

    ``has_load`` is False while the teacher has published no load yet; ``managed`` is False for a
    teacher the backend did not start (registered by hand on some spare GPU): it serves students,
    so it counts toward the need, but the backend cannot stop it.
    """

    instance_id: str
    capacity: float = 0.0
    busy_fraction: float = 0.0
    queue_depth: int = 0
    in_flight: int = 0
    samples_per_s: float = 0.0
    draining: bool = False
    managed: bool = True
    has_load: bool = True


@dataclass(frozen=True)
class StudentSample:
    """One student's demand (from its ``StudentDemand``)."""

    student_id: str
    samples_per_s: float
    wait_fraction: float


@dataclass(frozen=True)
class ScaleSnapshot:
    """Everything :func:`decide` looks at, taken at one moment.

    Attributes:
        current: managed teachers the backend runs or was last asked to run (its target).
        teachers: registered teachers (managed or not), with their latest load.
        starting: start times (the clock of ``now``) of managed teachers not registered yet.
        students: students with their demand.
        error: why the registry data is missing (None when it is complete); the policy holds.
    """

    current: int
    teachers: tuple[TeacherSample, ...] = ()
    starting: tuple[float, ...] = ()
    students: tuple[StudentSample, ...] = ()
    error: str | None = None

    @classmethod
    def from_registry(
        cls,
        current: int,
        teachers: Mapping[str, object],
        demand: Iterable[object],
        *,
        starting: Iterable[float] = (),
        managed: Callable[[str], bool] | None = None,
    ) -> ScaleSnapshot:
        """Build from a discovery ``TeacherSet`` (``instance_id -> TeacherEntry``) and a list of
        ``StudentDemand`` messages. ``managed(instance_id)`` says whether the backend started a
        teacher (default: all are managed)."""
        samples = []
        for iid, entry in teachers.items():
            load = getattr(entry, "load", None)
            samples.append(
                TeacherSample(
                    instance_id=iid,
                    capacity=float(getattr(load, "capacity_samples_per_s", 0.0) or 0.0),
                    busy_fraction=float(getattr(load, "busy_fraction", 0.0) or 0.0),
                    queue_depth=int(getattr(load, "queue_depth", 0) or 0),
                    in_flight=int(getattr(load, "in_flight", 0) or 0),
                    samples_per_s=float(getattr(load, "samples_per_s", 0.0) or 0.0),
                    draining=bool(getattr(load, "draining", False)),
                    managed=True if managed is None else managed(iid),
                    has_load=load is not None,
                )
            )
        students = tuple(
            StudentSample(
                student_id=str(getattr(d, "student_id", "")),
                samples_per_s=max(0.0, float(getattr(d, "samples_per_s", 0.0))),
                wait_fraction=min(1.0, max(0.0, float(getattr(d, "wait_fraction", 0.0)))),
            )
            for d in demand
        )
        return cls(
            current=int(current),
            teachers=tuple(sorted(samples, key=lambda t: t.instance_id)),
            starting=tuple(starting),
            students=students,
        )
