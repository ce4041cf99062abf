"""W4 autoscaling benchmark: its settings and the oracle (see `benchmarks.autoscale` for the why)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from benchmarks.common import EMULATED_MODEL_NAME as MODEL_NAME
from benchmarks.common import EMULATED_MODEL_REF as MODEL_REF
from benchmarks.common import EMULATED_TEACHER_MS_ENV as TEACHER_MS_ENV
from benchmarks.common import W1_BATCH as BATCH

__all__ = ["BATCH", "MODEL_NAME", "MODEL_REF", "TEACHER_MS_ENV", "Settings"]

GOAL_REACH_S = 10.0
GOAL_OVERSHOOT = 0
GOAL_FLAPS = 0
GOAL_THROUGHPUT = 0.95
_CEIL_SLACK = 1e-6


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON so that a result can be reproduced."""

    phases_s: tuple[float, ...] = (30.0, 40.0, 50.0)
    students: tuple[int, ...] = (1, 3, 1)
    reps: int = 1
    sample_s: float = 0.5
    rate_window_s: float = 1.0  # trailing window of the per-student samples/s in the timeline
    teacher_ms: float = 20.0
    student_ms: float = 25.0
    batch: int = BATCH
    fixed_pool: int = 0  # 0: the oracle's peak
    # autoscaler flags (see the module docstring for why these values)
    target_utilisation: float = 0.9
    busy_threshold: float = 0.9
    stall_threshold: float = 0.1
    up_window_s: float = 2.0
    down_window_s: float = 20.0
    period_s: float = 1.0
    max_step: int = 4
    min_teachers: int = 1
    max_teachers: int = 6
    grace_s: float = 10.0
    autoscaler_log_level: str = "INFO"
    # teachers
    server_threads: int = 1  # the emulated accelerator needs no CPU threads
    max_queue_delay_us: int = 500  # teacher-server default
    warmup_timeout_s: float = 120.0
    quick: bool = False
    keep_logs: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        """Back from ``asdict`` (or its JSON, where the tuples became lists)."""
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**values)

    @property
    def student_rate(self) -> float:
        """Samples/s one student consumes at full speed (it never waits)."""
        return self.batch * 1000.0 / self.student_ms

    @property
    def teacher_capacity(self) -> float:
        """Samples/s one emulated teacher serves when fully busy (nominal: 20 ms per batch)."""
        return self.batch * 1000.0 / self.teacher_ms

    def needed(self, students: int) -> int:
        """The oracle: the fewest teachers at which `students` never wait."""
        return max(self.min_teachers, math.ceil(students * self.student_rate / self.teacher_capacity - _CEIL_SLACK))

    @property
    def oracle(self) -> list[int]:
        return [self.needed(n) for n in self.students]

    @property
    def pool_size(self) -> int:
        return self.fixed_pool or max(self.oracle)
