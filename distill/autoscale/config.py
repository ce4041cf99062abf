"""The policy's bounds and tuning (:class:`PolicyConfig`): one frozen dataclass that is the
documentation, the defaults and the validation of every value :func:`~distill.autoscale.policy.decide`
uses. The command line (:mod:`distill.autoscale.cli`) builds it from its flags; the meaning of each
value in the sizing rules is in :mod:`distill.autoscale.policy`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from distill.autoscale.errors import PolicyConfigError

__all__ = ["PolicyConfig"]


@dataclass(frozen=True)
class PolicyConfig:
    """Bounds and tuning of :func:`decide`; checked on construction (:class:`PolicyConfigError`).

    Attributes:
        min_teachers: never fewer managed teachers (0 allows scaling to zero without students).
        max_teachers: never more managed teachers.
        target_utilisation: the busy fraction a teacher should run at after sizing (0 < u <= 1).
        headroom: extra capacity on top of the estimated demand (0.1 = 10 %).
        stall_threshold: mean student wait fraction above which students count as waiting.
        busy_threshold: mean teacher busy fraction at or above which teachers count as busy. Keep
            it above ``target_utilisation``: the gap is what keeps a steady load from oscillating.
        queue_threshold: a mean queue (requests waiting per teacher) that also counts as busy; it
            reacts faster than the busy fraction, which is a 10 s average.
        up_window: seconds a higher recommendation must persist before scaling up (0: at once).
        down_window: seconds demand must stay low before scaling down.
        settle: seconds after the last started teacher registered during which no further scale-up
            happens: the students' wait figures are 10 s averages and still show the shortage the
            new teachers just fixed.
        max_step: most teachers added or removed by one decision.
        start_timeout: seconds a started teacher counts as capacity before it registers.
        gpu_budget: accelerators the pool may use in all (None: no limit).
        gpus_per_teacher: accelerators one teacher uses (with ``gpu_budget``).
        capacity_hint: samples/s per teacher to assume before any teacher has measured its own.
        max_demand_factor: largest factor by which waiting inflates a student's demand estimate.
    """

    min_teachers: int = 1
    max_teachers: int = 8
    target_utilisation: float = 0.8
    headroom: float = 0.0
    stall_threshold: float = 0.1
    busy_threshold: float = 0.9
    queue_threshold: float = 2.0
    up_window: float = 0.0
    down_window: float = 60.0
    settle: float = 10.0
    max_step: int = 4
    start_timeout: float = 120.0
    gpu_budget: int | None = None
    gpus_per_teacher: int = 1
    capacity_hint: float = 0.0
    max_demand_factor: float = 10.0

    def __post_init__(self) -> None:
        def bad(msg: str) -> PolicyConfigError:
            return PolicyConfigError(msg)

        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f"{f.name} must be a finite number, not {value!r}")
            if value < 0:
                raise bad(f"{f.name} must not be negative, not {value!r}")
        for name in ("min_teachers", "max_teachers", "max_step", "gpus_per_teacher"):
            if not isinstance(getattr(self, name), int):
                raise bad(f"{name} must be a whole number, not {getattr(self, name)!r}")
        if self.gpu_budget is not None and not isinstance(self.gpu_budget, int):
            raise bad(f"gpu_budget must be a whole number, not {self.gpu_budget!r}")
        if self.max_teachers < 1:
            raise bad(f"max_teachers must be at least 1, not {self.max_teachers}")
        if self.min_teachers > self.max_teachers:
            raise bad(
                f"min_teachers ({self.min_teachers}) is greater than max_teachers ({self.max_teachers}); "
                "the pool cannot satisfy both"
            )
        if not 0 < self.target_utilisation <= 1:
            raise bad(f"target_utilisation must be in (0, 1], not {self.target_utilisation}")
        if not self.stall_threshold < 1:
            raise bad(f"stall_threshold must be in [0, 1), not {self.stall_threshold}")
        if not 0 < self.busy_threshold <= 1:
            raise bad(f"busy_threshold must be in (0, 1], not {self.busy_threshold}")
        if self.busy_threshold < self.target_utilisation:
            raise bad(
                f"busy_threshold ({self.busy_threshold}) is below target_utilisation "
                f"({self.target_utilisation}): a pool sized to the target would count as busy and keep "
                "growing; raise busy_threshold or lower target_utilisation"
            )
        if self.max_step < 1:
            raise bad(f"max_step must be at least 1, not {self.max_step}")
        if self.gpus_per_teacher < 1:
            raise bad(f"gpus_per_teacher must be at least 1, not {self.gpus_per_teacher}")
        if self.start_timeout <= 0:
            raise bad(f"start_timeout must be positive, not {self.start_timeout}")
        if self.max_demand_factor < 1:
            raise bad(f"max_demand_factor must be at least 1, not {self.max_demand_factor}")
        if self.gpu_budget is not None and self.gpu_budget // self.gpus_per_teacher < self.min_teachers:
            raise bad(
                f"gpu_budget {self.gpu_budget} fits {self.gpu_budget // self.gpus_per_teacher} teacher(s) of "
                f"{self.gpus_per_teacher} GPU(s), fewer than min_teachers ({self.min_teachers})"
            )

    @property
    def upper(self) -> int:
        """The effective maximum: ``max_teachers``, lowered by the GPU budget when there is one."""
        if self.gpu_budget is None:
            return self.max_teachers
        return min(self.max_teachers, self.gpu_budget // self.gpus_per_teacher)
