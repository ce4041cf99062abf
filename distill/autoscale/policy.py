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


def decide(snapshot: ScaleSnapshot, config: PolicyConfig, state: PolicyState, now: float) -> Decision:
    """The managed teacher count to run now, and why. Pure: same inputs, same output."""
    cfg = config
    current = max(0, int(snapshot.current))
    lo, hi = cfg.min_teachers, cfg.upper
    since = now if state.since is None else state.since
    horizon = now - max(cfg.up_window, cfg.down_window)
    history = tuple((t, r) for t, r in state.history if t >= horizon)
    # While started teachers come up, and `settle` seconds after, the students' figures lag.
    starting_now = any(now - s < cfg.start_timeout for s in snapshot.starting)
    settle_until = max(state.settle_until, now + cfg.settle) if starting_now else state.settle_until

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    def finish(
        rec: int,
        cause: str,
        reason: str,
        *,
        capacity_state: float = state.capacity,
        demand: float = 0.0,
        served: float = 0.0,
        capacity: float = 0.0,
        needed: int | None = None,
        figures: dict[str, float] | None = None,
    ) -> Decision:
        if clamp(rec) != rec:
            reason = f"{reason}; {rec} bounded to [{lo}, {hi}]"
            cause = "bounds"
            rec = clamp(rec)
        hist = (*history, (now, rec))
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
        if clamp(desired) != desired:  # the count itself is out of bounds (a changed --min/--max)
            if cause != "bounds":
                reason = f"{reason}; {desired} bounded to [{lo}, {hi}]"
            cause, desired = "bounds", clamp(desired)
        elif desired == current and rec != current:
            window = cfg.up_window if rec > current else cfg.down_window
            direction = "up" if rec > current else "down"
            reason = f"{reason}; {rec} recommended, holding {current} until that persists for the {window:g} s "
            reason += f"{direction} window"
            cause = "stabilising"
        action: Action = "hold"
        if desired > current:
            action = "up"
            if desired < rec:
                reason = f"{reason}; at most {cfg.max_step} more per step"
        elif desired < current:
            action = "down"
            if desired == current - cfg.max_step and desired > rec:
                reason = f"{reason}; at most {cfg.max_step} fewer per step"
            elif desired > rec:
                reason = f"{reason}; {desired} is the highest need of the last {cfg.down_window:g} s down window"
        verb = {"up": f"scale up {current} -> {desired}", "down": f"scale down {current} -> {desired}"}
        head = verb.get(action, f"hold {desired}")
        return Decision(
            desired=desired,
            reason=f"{head}: {reason}",
            new_state=PolicyState(history=hist, since=since, capacity=capacity_state, settle_until=settle_until),
            action=action,
            cause=cause,
            demand=demand,
            served=served,
            capacity=capacity,
            needed=needed,
            recommendation=rec,
            figures=figures or {},
        )

    # -- missing data: hold ----------------------------------------------------------------------
    if snapshot.error is not None:
        return finish(current, "no-data", f"registry data unavailable ({snapshot.error}); keeping the pool as it is")

    students = snapshot.students
    ready = [t for t in snapshot.teachers if not t.draining]
    external = sum(1 for t in ready if not t.managed)
    starting_live = [s for s in snapshot.starting if now - s < cfg.start_timeout]
    starting_late = len(snapshot.starting) - len(starting_live)

    served = sum(s.samples_per_s for s in students)
    floor = 1.0 / cfg.max_demand_factor
    demand = sum(s.samples_per_s / max(1.0 - s.wait_fraction, floor) for s in students)
    stall = statistics.fmean(s.wait_fraction for s in students) if students else 0.0
    loaded = [t for t in ready if t.has_load]
    busy = statistics.fmean(t.busy_fraction for t in loaded) if loaded else 0.0
    queue = statistics.fmean(t.queue_depth for t in loaded) if loaded else 0.0
    measured = [t.capacity for t in ready if t.capacity > 0]
    capacity_state = statistics.median(measured) if measured else state.capacity
    capacity = capacity_state or cfg.capacity_hint
    figures = {
        "stall": stall,
        "busy": busy,
        "queue": queue,
        "ready": float(len(ready)),
        "external": float(external),
        "starting": float(len(starting_live)),
    }

    def done(rec: int, cause: str, reason: str, needed: int | None = None) -> Decision:
        return finish(
            rec,
            cause,
            reason,
            capacity_state=capacity_state,
            demand=demand,
            served=served,
            capacity=capacity,
            needed=needed,
            figures=figures,
        )

    pool = f"{_plural(len(ready), 'ready teacher')}"
    if starting_live:
        pool += f", {len(starting_live)} starting"
    if starting_late:
        pool += f", {starting_late} not ready after {cfg.start_timeout:g} s"
    if external:
        pool += f" ({external} not managed)"

    # -- no students: nothing to serve ------------------------------------------------------------
    if not students:
        return done(0, "idle", f"no students; {pool}", needed=0)

    if ready and not loaded and capacity <= 0:
        return done(current, "no-data", f"{pool} but no load report yet; waiting for one", needed=None)

    # -- students but no teacher at all: start one (it also measures the capacity) ---------------
    if not ready and not starting_live and current < 1:
        return done(1, "no-teacher", "students but no teacher: starting one", needed=None)

    # -- capacity unknown: wait for a teacher to measure it ---------------------------------------
    if capacity <= 0:
        return done(current, "no-capacity", f"{pool}; no teacher has measured its capacity yet")

    def need(samples_per_s: float) -> int:
        return max(1, _ceil(samples_per_s * (1.0 + cfg.headroom) / (capacity * cfg.target_utilisation)))

    needed_est = need(demand)
    needed_served = need(served)
    teachers_busy = bool(loaded) and (busy >= cfg.busy_threshold or queue >= cfg.queue_threshold)
    pressure = stall > cfg.stall_threshold and teachers_busy
    sizing = (
        f"{_plural(len(students), 'student')} want ~{demand:.0f} samples/s (served {served:.0f}, wait {stall:.0%}); "
        f"one teacher ~{capacity:.0f} samples/s at {cfg.target_utilisation:.0%} target"
    )
    if cfg.headroom:
        sizing += f" + {cfg.headroom:.0%} headroom"
    busy_text = f"teachers {busy:.0%} busy, queue {queue:.1f}"

    if pressure:
        managed_need = needed_est - external
        if managed_need > current and starting_live:
            return done(
                current,
                "starting",
                f"students wait and {busy_text}, but {len(starting_live)} started teacher(s) are not ready yet; "
                f"judging again once they are ({pool}; {sizing})",
                needed=needed_est,
            )
        if managed_need > current and now < settle_until:
            return done(
                current,
                "starting",
                f"students wait and {busy_text}, but teachers joined within the last {cfg.settle:g} s and the "
                f"students' figures still lag; judging again in {settle_until - now:.0f} s ({pool}; {sizing})",
                needed=needed_est,
            )
        if managed_need > current:
            return done(
                managed_need,
                "demand",
                f"students wait and {busy_text}: need {needed_est} ({sizing}; {pool})",
                needed=needed_est,
            )
        return done(
            current,
            "covered",
            f"students wait and {busy_text}, but {current + external} teacher(s) cover the need of {needed_est} "
            f"({sizing}; {pool})",
            needed=needed_est,
        )

    # No pressure: size down from what is served; while students still wait (on something other
    # than busy teachers, or on teachers that just joined), from the estimate, which is never lower.
    if stall <= cfg.stall_threshold:
        why_calm, needed = "students do not wait", needed_served
    else:
        why_calm, needed = f"students wait but {busy_text}", needed_est
    managed_need = needed - external
    if managed_need < current:
        return done(managed_need, "demand", f"{why_calm}; need {needed} ({sizing}; {pool})", needed=needed)
    return done(current, "steady", f"{why_calm}; {pool} for a need of {needed} ({sizing})", needed=needed)
