"""The scaling policy: a pure function from what the registry says to a teacher count.

Why a pure function: the policy is where oscillation, slow reactions and over-spending come from
(Ray Serve's users complain about exactly these), so it must be testable over hours of simulated
time in milliseconds, without etcd, processes or clocks. :func:`decide` takes a
:class:`ScaleSnapshot` (teachers with their measured capacity, busy fraction and queue depth;
teachers still starting; students with their consumed samples/s and wait fraction), a
:class:`PolicyConfig` and the previous :class:`PolicyState`, and returns a :class:`Decision`: the
desired count, a sentence saying why, and the next state. Time comes in as ``now``. The inputs
live in :mod:`distill.autoscale.inputs`, the configuration in :mod:`distill.autoscale.config`
(both re-exported here); this module is the decision.

How it sizes the pool
---------------------
*Demand.* A student that waits on teachers consumes less than it wants, so its consumption
understates its demand. Its training loop spends ``1 - wait_fraction`` of the time computing, so
with instant teachers it would run at ``samples_per_s / (1 - wait_fraction)``: that is its
estimated demand (the inflation is capped by ``max_demand_factor``, because a loop that only waits
says nothing about how fast it could go). The estimate does not depend on the pool size, so
re-estimating while teachers are added gives the same answer: no creeping, no overshoot.

*Need.* ``needed = ceil(demand * (1 + headroom) / (capacity * target_utilisation))`` teachers,
where ``capacity`` is the median measured samples/s of one fully busy teacher (what the teachers
publish in ``TeacherLoad``; the last known value when none reports one, then ``capacity_hint``).
Teachers registered by someone else (``managed=False``) count toward the need; the backend runs
the rest.

*Up.* Only when students wait (mean ``wait_fraction`` above ``stall_threshold``) *and* the
teachers are busy (mean ``busy_fraction`` at least ``busy_threshold``, or a mean queue of at least
``queue_threshold`` requests): more teachers cannot help students that wait on something else.
One step goes straight to the need (at most ``max_step`` more, at most the maximum). While
teachers the backend started are not yet registered (and younger than ``start_timeout``), the
pressure the students report is the pressure *without* them, so further scale-ups wait for them:
no double scale-up during a slow start.

*Down.* Only while there is no pressure, sized from the consumption actually served (from the
estimate while students still wait on something else; it is never lower). After scaling down to
``n``, the teachers run at most ``target_utilisation`` busy, which is below ``busy_threshold``, so
the new size cannot trigger a scale-up by itself: a steady load never oscillates.

*Stabilisation* is Kubernetes HPA's: every period records a recommendation; the policy scales up
to the *lowest* recommendation of the last ``up_window`` seconds and down to the *highest* of the
last ``down_window`` seconds. So a scale-down happens only after demand stayed low for the whole
down window, and a one-sample spike does not scale up. Until the history covers a window, the
current count stands in for the missing part, so a restarted controller does not act on its
first sample.

*Bounds*: ``min_teachers``, ``max_teachers`` and ``gpu_budget // gpus_per_teacher`` always apply.
*Missing data* (registry unreachable): hold the current count and say so; never scale to zero for
lack of data. Zero teachers only when ``min_teachers`` is 0 and there are no students.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

from distill.autoscale.config import PolicyConfig
from distill.autoscale.inputs import ScaleSnapshot, StudentSample, TeacherSample

__all__ = [
    "Action",
    "Decision",
    "PolicyConfig",
    "PolicyState",
    "ScaleSnapshot",
    "StudentSample",
    "TeacherSample",
    "decide",
]

Action = Literal["up", "down", "hold"]

# Ratios computed from noisy rates land a hair above an integer (2.0000001 teachers); this much
# below the next integer still rounds down.
_CEIL_SLACK = 1e-6


@dataclass(frozen=True)
class PolicyState:
    """What :func:`decide` remembers between calls; start with ``PolicyState()``.

    ``history``: ``(time, recommendation)`` pairs within the longer stabilisation window.
    ``since``: time of the first decision (the history covers ``now - since`` seconds).
    ``capacity``: the last measured per-teacher capacity, used while no teacher reports one (the
    only teacher crashed, say).
    ``settle_until``: no scale-up before this time (see ``PolicyConfig.settle``).
    """

    history: tuple[tuple[float, int], ...] = ()
    since: float | None = None
    capacity: float = 0.0
    settle_until: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The outcome of one :func:`decide` call.

    ``desired`` is the managed teacher count to run; ``reason`` a sentence for the log; ``action``
    up/down/hold; ``cause`` a short stable tag (for logs that only report changes, and metrics);
    ``demand``, ``served``, ``capacity`` and ``needed`` the figures the decision used (``needed``
    is the total teacher count the demand calls for, None when it could not be computed);
    ``recommendation`` this period's count before stabilisation; ``figures`` the means it looked at
    (``stall``, ``busy``, ``queue``) and the pool (``ready``, ``external``, ``starting``).

    Causes: ``demand``, ``covered`` (students wait but the pool covers the need), ``steady``,
    ``stabilising`` (a change waits for its window), ``starting``, ``bounds``, ``idle`` (no
    students), ``no-teacher``, ``no-capacity``, ``no-data``.
    """

    desired: int
    reason: str
    new_state: PolicyState
    action: Action = "hold"
    cause: str = "steady"
    demand: float = 0.0
    served: float = 0.0
    capacity: float = 0.0
    needed: int | None = None
    recommendation: int = 0
    figures: dict[str, float] = field(default_factory=dict)


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _CEIL_SLACK))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True)
class _Recommendation:
    """One period's count before stabilisation, its cause tag and the sentence that says why."""

    count: int
    cause: str
    reason: str
    needed: int | None = None


@dataclass(frozen=True)
class _Pool:
    """What the snapshot says of the pool and the students, reduced to the figures a decision reads."""

    students: int
    ready: int
    external: int
    starting: int
    starting_late: int
    served: float
    demand: float
    stall: float
    reports_load: bool
    busy: float
    queue: float
    capacity_state: float  # the median measured capacity, else the last known one (kept in the state)
    capacity: float  # capacity_state, else the configured hint

    @classmethod
    def measure(cls, snapshot: ScaleSnapshot, cfg: PolicyConfig, state: PolicyState, now: float) -> _Pool:
        students = snapshot.students
        ready = [t for t in snapshot.teachers if not t.draining]
        starting = sum(1 for s in snapshot.starting if now - s < cfg.start_timeout)
        floor = 1.0 / cfg.max_demand_factor
        loaded = [t for t in ready if t.has_load]
        measured = [t.capacity for t in ready if t.capacity > 0]
        capacity_state = statistics.median(measured) if measured else state.capacity
        return cls(
            students=len(students),
            ready=len(ready),
            external=sum(1 for t in ready if not t.managed),
            starting=starting,
            starting_late=len(snapshot.starting) - starting,
            served=sum(s.samples_per_s for s in students),
            demand=sum(s.samples_per_s / max(1.0 - s.wait_fraction, floor) for s in students),
            stall=statistics.fmean(s.wait_fraction for s in students) if students else 0.0,
            reports_load=bool(loaded),
            busy=statistics.fmean(t.busy_fraction for t in loaded) if loaded else 0.0,
            queue=statistics.fmean(t.queue_depth for t in loaded) if loaded else 0.0,
            capacity_state=capacity_state,
            capacity=capacity_state or cfg.capacity_hint,
        )

    def figures(self) -> dict[str, float]:
        return {"stall": self.stall, "busy": self.busy, "queue": self.queue, "ready": float(self.ready),
                "external": float(self.external), "starting": float(self.starting)}

    def describe(self, cfg: PolicyConfig) -> str:
        text = _plural(self.ready, "ready teacher")
        if self.starting:
            text += f", {self.starting} starting"
        if self.starting_late:
            text += f", {self.starting_late} not ready after {cfg.start_timeout:g} s"
        if self.external:
            text += f" ({self.external} not managed)"
        return text


def _recommend(pool: _Pool, cfg: PolicyConfig, current: int, now: float, settle_until: float) -> _Recommendation:
    """This period's count from the pool's figures (the module docstring's Demand, Need, Up, Down)."""
    desc = pool.describe(cfg)
    if not pool.students:
        return _Recommendation(0, "idle", f"no students; {desc}", needed=0)
    if pool.ready and not pool.reports_load and pool.capacity <= 0:
        return _Recommendation(current, "no-data", f"{desc} but no load report yet; waiting for one")
    if not pool.ready and not pool.starting and current < 1:  # the teacher started also measures the capacity
        return _Recommendation(1, "no-teacher", "students but no teacher: starting one")
    if pool.capacity <= 0:
        return _Recommendation(current, "no-capacity", f"{desc}; no teacher has measured its capacity yet", needed=None)

    def need(samples_per_s: float) -> int:
        return max(1, _ceil(samples_per_s * (1.0 + cfg.headroom) / (pool.capacity * cfg.target_utilisation)))

    needed_est = need(pool.demand)
    sizing = (
        f"{_plural(pool.students, 'student')} want ~{pool.demand:.0f} samples/s (served {pool.served:.0f}, "
        f"wait {pool.stall:.0%}); one teacher ~{pool.capacity:.0f} samples/s at {cfg.target_utilisation:.0%} target"
    )
    if cfg.headroom:
        sizing += f" + {cfg.headroom:.0%} headroom"
    busy_text = f"teachers {pool.busy:.0%} busy, queue {pool.queue:.1f}"
    teachers_busy = pool.reports_load and (pool.busy >= cfg.busy_threshold or pool.queue >= cfg.queue_threshold)
    if pool.stall > cfg.stall_threshold and teachers_busy:
        return _under_pressure(pool, cfg, current=current, now=now, settle_until=settle_until, needed=needed_est,
                               sizing=sizing, busy_text=busy_text, desc=desc)

    # No pressure: size down from what is served; while students still wait (on something other
    # than busy teachers, or on teachers that just joined), from the estimate, which is never lower.
    if pool.stall <= cfg.stall_threshold:
        why_calm, needed = "students do not wait", need(pool.served)
    else:
        why_calm, needed = f"students wait but {busy_text}", needed_est
    managed_need = needed - pool.external
    if managed_need < current:
        return _Recommendation(managed_need, "demand", f"{why_calm}; need {needed} ({sizing}; {desc})", needed)
    return _Recommendation(current, "steady", f"{why_calm}; {desc} for a need of {needed} ({sizing})", needed)


def _under_pressure(pool: _Pool, cfg: PolicyConfig, *, current: int, now: float, settle_until: float,
                    needed: int, sizing: str, busy_text: str, desc: str) -> _Recommendation:
    """Students wait on busy teachers: go to the need, unless started teachers are still coming up."""
    managed_need = needed - pool.external
    if managed_need > current and pool.starting:
        return _Recommendation(
            current, "starting",
            f"students wait and {busy_text}, but {pool.starting} started teacher(s) are not ready yet; "
            f"judging again once they are ({desc}; {sizing})", needed)
    if managed_need > current and now < settle_until:
        return _Recommendation(
            current, "starting",
            f"students wait and {busy_text}, but teachers joined within the last {cfg.settle:g} s and the "
            f"students' figures still lag; judging again in {settle_until - now:.0f} s ({desc}; {sizing})", needed)
    if managed_need > current:
        return _Recommendation(
            managed_need, "demand", f"students wait and {busy_text}: need {needed} ({sizing}; {desc})", needed)
    return _Recommendation(
        current, "covered",
        f"students wait and {busy_text}, but {current + pool.external} teacher(s) cover the need of {needed} "
        f"({sizing}; {desc})", needed)


def _stabilise(rec: _Recommendation, cfg: PolicyConfig, *, current: int, history: tuple[tuple[float, int], ...],
               since: float, now: float) -> tuple[_Recommendation, int, Action, tuple[tuple[float, int], ...]]:
    """Bound the recommendation, then apply the windows and the step limit (the module docstring's
    Stabilisation and Bounds): the recommendation as recorded, the count to run, the action, and the
    history with this period in it."""
    lo, hi = cfg.min_teachers, cfg.upper
    count, cause, reason = rec.count, rec.cause, rec.reason
    if not lo <= count <= hi:
        reason, cause = f"{reason}; {count} bounded to [{lo}, {hi}]", "bounds"
        count = max(lo, min(hi, count))
    hist = (*history, (now, count))
    up_recs = [r for t, r in hist if t >= now - cfg.up_window]
    down_recs = [r for t, r in hist if t >= now - cfg.down_window]
    if now - since < cfg.up_window:
        up_recs.append(current)  # history too short to prove the need persisted
    if now - since < cfg.down_window:
        down_recs.append(current)
    up_rec, down_rec = min(up_recs), max(down_recs)
    if up_rec > current:
        desired = min(up_rec, current + cfg.max_step)
    elif down_rec < current:
        desired = max(down_rec, current - cfg.max_step)
    else:
        desired = current
    if not lo <= desired <= hi:  # the count itself is out of bounds (a changed --min/--max)
        if cause != "bounds":
            reason = f"{reason}; {desired} bounded to [{lo}, {hi}]"
        cause, desired = "bounds", max(lo, min(hi, desired))
    elif desired == current and count != current:
        window, direction = (cfg.up_window, "up") if count > current else (cfg.down_window, "down")
        reason = f"{reason}; {count} recommended, holding {current} until that persists for the {window:g} s "
        reason += f"{direction} window"
        cause = "stabilising"
    action: Action = "hold"
    if desired > current:
        action = "up"
        if desired < count:
            reason = f"{reason}; at most {cfg.max_step} more per step"
    elif desired < current:
        action = "down"
        if desired == current - cfg.max_step and desired > count:
            reason = f"{reason}; at most {cfg.max_step} fewer per step"
        elif desired > count:
            reason = f"{reason}; {desired} is the highest need of the last {cfg.down_window:g} s down window"
    head = {"up": f"scale up {current} -> {desired}", "down": f"scale down {current} -> {desired}"}.get(
        action, f"hold {desired}")
    return _Recommendation(count, cause, f"{head}: {reason}", rec.needed), desired, action, hist


def decide(snapshot: ScaleSnapshot, config: PolicyConfig, state: PolicyState, now: float) -> Decision:
    """The managed teacher count to run now, and why. Pure: same inputs, same output.

    Three steps: measure the pool (`_Pool.measure`), recommend this period's count from it
    (`_recommend`), then stabilise that recommendation over the windows and bounds (`_stabilise`).
    """
    cfg = config
    current = max(0, int(snapshot.current))
    since = now if state.since is None else state.since
    horizon = now - max(cfg.up_window, cfg.down_window)
    history = tuple((t, r) for t, r in state.history if t >= horizon)
    # While started teachers come up, and `settle` seconds after, the students' figures lag.
    starting_now = any(now - s < cfg.start_timeout for s in snapshot.starting)
    settle_until = max(state.settle_until, now + cfg.settle) if starting_now else state.settle_until
    if snapshot.error is not None:  # missing data: hold, never scale for lack of it
        pool = None
        rec = _Recommendation(current, "no-data",
                              f"registry data unavailable ({snapshot.error}); keeping the pool as it is")
    else:
        pool = _Pool.measure(snapshot, cfg, state, now)
        rec = _recommend(pool, cfg, current, now, settle_until)
    final, desired, action, hist = _stabilise(rec, cfg, current=current, history=history, since=since, now=now)
    return Decision(
        desired=desired,
        reason=final.reason,
        new_state=PolicyState(history=hist, since=since,
                              capacity=state.capacity if pool is None else pool.capacity_state,
                              settle_until=settle_until),
        action=action,
        cause=final.cause,
        demand=0.0 if pool is None else pool.demand,
        served=0.0 if pool is None else pool.served,
        capacity=0.0 if pool is None else pool.capacity,
        needed=final.needed,
        recommendation=final.count,
        figures={} if pool is None else pool.figures(),
    )
