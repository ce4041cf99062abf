"""When a periodic load or demand report is worth an etcd write.

Every write is a raft entry that etcd holds in memory until its next snapshot, and a watch event
for whoever watches the prefix. Teachers and students sample their figures about once a second,
but in steady state those figures only jitter: writing each sample costs 1,200 writes/s at 1,000
students x 200 teachers (docs/scale.md) and grows etcd's memory for nothing. So a report is
written when it says something new (a figure moved past its tolerance, a queue formed or
drained or moved by half, a drain began) and otherwise only every ``max_age_s``, which keeps ``updated_at`` a
usable liveness hint. A change that matters still reaches readers within one sampling interval.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from protos.registry_pb2 import StudentDemand, TeacherLoad

M = TypeVar("M", TeacherLoad, StudentDemand)

RATE_TOLERANCE = 0.10  # relative change in a samples/s figure worth a write
FRACTION_TOLERANCE = 0.05  # absolute change in a 0..1 fraction worth a write
DEFAULT_MAX_AGE_S = 10.0


def _rate_moved(a: float, b: float) -> bool:
    low, high = sorted((abs(a), abs(b)))
    return high >= 1.0 and high - low > RATE_TOLERANCE * high


def _count_moved(a: int, b: int) -> bool:
    """A queue forming or clearing always counts; otherwise a move by more than half the smaller
    count and by at least two, so a count jittering by one (3, 4, 3, ...) is not news."""
    if (a > 0) != (b > 0):
        return True
    return abs(a - b) > max(1, min(a, b) // 2)


def load_changed(old: TeacherLoad, new: TeacherLoad) -> bool:
    return (
        old.draining != new.draining
        or _count_moved(old.queue_depth, new.queue_depth)
        or _count_moved(old.in_flight, new.in_flight)
        or abs(old.busy_fraction - new.busy_fraction) >= FRACTION_TOLERANCE
        or _rate_moved(old.samples_per_s, new.samples_per_s)
        or _rate_moved(old.capacity_samples_per_s, new.capacity_samples_per_s)
    )


def demand_changed(old: StudentDemand, new: StudentDemand) -> bool:
    return (
        old.teachers_in_use != new.teachers_in_use
        or _count_moved(old.in_flight, new.in_flight)
        or abs(old.wait_fraction - new.wait_fraction) >= FRACTION_TOLERANCE
        or _rate_moved(old.samples_per_s, new.samples_per_s)
    )


class ReportGate(Generic[M]):
    """Remembers the last report written and says whether the next one is due."""

    def __init__(self, changed: Callable[[M, M], bool], max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        if max_age_s < 0:
            raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
        self._changed: Callable[[M, M], bool] = changed
        self._max_age_s = max_age_s
        self._last: M | None = None
        self._last_at = 0.0
        self.written = 0
        self.skipped = 0

    def due(self, report: M, now: float, force: bool = False) -> bool:
        """True (and `report` becomes the last one written) when it should be written now.

        ``force``: a fresh lease, after a loss or a restart of etcd, must carry a report at once.
        """
        if (force or self._last is None or now - self._last_at >= self._max_age_s
                or self._changed(self._last, report)):
            self._last, self._last_at = report, now
            self.written += 1
            return True
        self.skipped += 1
        return False
