"""The scaling policy, table-driven and over simulated time (no etcd, no processes, no clock).

The simulation below is a small plant model of the mesh: ``n`` ready teachers of capacity ``c``
serve students whose *true* demand is ``d_i`` samples/s. Below saturation every student gets what
it wants and waits a little (latency); above it, the supply is shared and each student waits for
the fraction it is missing, with the teachers fully busy and queueing. Teachers the policy adds
become ready ``start_delay`` seconds later, as real ones do.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.autoscale.errors import PolicyConfigError
from distill.autoscale.policy import (
    Decision,
    PolicyConfig,
    PolicyState,
    ScaleSnapshot,
    StudentSample,
    TeacherSample,
    decide,
)

CAP = 1000.0  # samples/s of one fully busy teacher
CFG = PolicyConfig(min_teachers=1, max_teachers=8, up_window=2, down_window=60, max_step=8)


def observe(
    n_ready: int, demands: list[float], *, capacity: float = CAP, noise: float = 0.0, rng: random.Random | None = None
) -> tuple[tuple[TeacherSample, ...], tuple[StudentSample, ...]]:
    """What the registry would show for ``n_ready`` teachers and students of true ``demands``."""
    rng = rng or random.Random(0)

    def jitter(x: float) -> float:
        return x * (1 + rng.uniform(-noise, noise)) if noise else x

    supply = n_ready * capacity
    total = sum(demands)
    if n_ready == 0:
        students = tuple(StudentSample(f"s{i}", 0.0, 1.0) for i, _ in enumerate(demands))
        return (), students
    if total <= supply:
        share, wait, busy, queue = 1.0, 0.02, total / supply, 0
    else:
        share = supply / total
        wait, busy, queue = 1 - share, 1.0, 3
    students = tuple(
        StudentSample(f"s{i}", jitter(d * share), min(1.0, max(0.0, jitter(wait) if wait > 0.02 else wait)))
        for i, d in enumerate(demands)
    )
    teachers = tuple(
        TeacherSample(f"t{i}", capacity=jitter(capacity), busy_fraction=min(1.0, jitter(busy)), queue_depth=queue)
        for i in range(n_ready)
    )
    return teachers, students


@dataclass
class Sim:
    """A pool driven by the policy once per second."""

    config: PolicyConfig
    demand: Callable[[float], list[float]]
    current: int
    start_delay: float = 5.0
    noise: float = 0.0
    seed: int = 0
    ready_at: list[float] = field(default_factory=list)
    state: PolicyState = field(default_factory=PolicyState)
    log: list[tuple[float, Decision]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ready_at = [-1e9] * self.current
        self.rng = random.Random(self.seed)

    def step(self, t: float) -> Decision:
        ready = sum(1 for r in self.ready_at if r <= t)
        starting = tuple(r - self.start_delay for r in self.ready_at if r > t)
        teachers, students = observe(ready, self.demand(t), noise=self.noise, rng=self.rng)
        snap = ScaleSnapshot(current=self.current, teachers=teachers, starting=starting, students=students)
        d = decide(snap, self.config, self.state, t)
        self.state = d.new_state
        self.log.append((t, d))
        if d.desired > self.current:
            self.ready_at += [t + self.start_delay] * (d.desired - self.current)
        elif d.desired < self.current:
            self.ready_at.sort(reverse=True)  # stop teachers still starting first
            del self.ready_at[: self.current - d.desired]
        self.current = d.desired
        return d

    def run(self, start: float, end: float) -> None:
        t = start
        while t < end:
            self.step(t)
            t += 1.0

    def changes(self) -> list[tuple[float, int, int]]:
        out, prev = [], None
        for t, d in self.log:
            if prev is not None and d.desired != prev:
                out.append((t, prev, d.desired))
            prev = d.desired
        return out

    def ready(self, t: float) -> int:
        return sum(1 for r in self.ready_at if r <= t)


def need(total_demand: float, config: PolicyConfig = CFG) -> int:
    return math.ceil(total_demand * (1 + config.headroom) / (CAP * config.target_utilisation))


# ---- over simulated time ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("demands", "start"),
    [([700.0], 1), ([1500.0, 1500.0], 4), ([900.0, 900.0, 900.0], 4), ([350.0] * 8, 4), ([3000.0], 4)],
    ids=["one-student", "two-students", "three-students", "eight-small", "one-big"],
)
def test_steady_load_right_sized_makes_no_change_for_five_minutes(demands: list[float], start: int) -> None:
    assert start == need(sum(demands))
    sim = Sim(CFG, lambda t: demands, current=start, noise=0.05, seed=len(demands))
    sim.run(0, 300)
    assert sim.changes() == [], [d.reason for _, d in sim.log if d.action != "hold"]
    assert all(d.action == "hold" for _, d in sim.log)


def test_steady_load_over_provisioned_scales_down_once_then_stays() -> None:
    sim = Sim(CFG, lambda t: [1300.0], current=6, noise=0.05)
    sim.run(0, 300)
    changes = sim.changes()
    assert len(changes) == 1, changes
    t, before, after = changes[0]
    assert (before, after) == (6, need(1300.0))
    assert 60 <= t <= 62  # only after the whole down window


def test_demand_step_up_reaches_the_need_in_one_step() -> None:
    sim = Sim(CFG, lambda t: [900.0] if t < 30 else [900.0, 900.0, 900.0], current=2, start_delay=5, noise=0.03)
    sim.run(0, 120)
    changes = sim.changes()
    assert changes == [(changes[0][0], 2, need(2700.0))], changes
    t_up = changes[0][0]
    assert 30 <= t_up <= 33  # the up window (2 s) plus one period
    assert sim.ready(t_up + 5) == need(2700.0)


def test_demand_step_up_with_unmeasured_backlog_is_capped_then_settles() -> None:
    """A student that only ever waits (its true demand is unknown) is inflated at most
    max_demand_factor; the pool grows in steps of that size but never overshoots the max."""
    cfg = dataclasses.replace(CFG, max_teachers=6)
    sim = Sim(cfg, lambda t: [1e9], current=1, start_delay=3)
    sim.run(0, 60)
    assert sim.current == 6
    assert all(b < a for _, b, a in sim.changes())  # only ever up


def test_demand_drop_waits_for_the_down_window_then_scales_down() -> None:
    sim = Sim(CFG, lambda t: [900.0] * 4 if t < 20 else [900.0], current=need(3600.0), noise=0.03)
    sim.run(0, 200)
    changes = sim.changes()
    assert len(changes) == 1, changes
    t, before, after = changes[0]
    assert (before, after) == (5, 2)
    assert 20 + 60 <= t <= 20 + 60 + 2


def test_demand_gone_goes_to_min_and_never_to_zero_with_min_one() -> None:
    sim = Sim(CFG, lambda t: [900.0] if t < 10 else [], current=2)
    sim.run(0, 200)
    assert sim.current == 1
    assert min(d.desired for _, d in sim.log) == 1


def test_scale_to_zero_only_with_min_zero_and_no_students() -> None:
    cfg = dataclasses.replace(CFG, min_teachers=0)
    sim = Sim(cfg, lambda t: [500.0] if t < 10 else [], current=1)
    sim.run(0, 100)
    assert sim.current == 0
    # A student appears again: one teacher is started to serve it, once the up window has passed.
    snap = ScaleSnapshot(current=0, students=(StudentSample("s", 0.0, 1.0),))
    state, decisions = sim.state, []
    for t in range(100, 104):
        d = decide(snap, cfg, state, float(t))
        state = d.new_state
        decisions.append(d)
    assert [d.desired for d in decisions] == [0, 0, 1, 1]
    assert decisions[2].action == "up" and decisions[2].cause == "no-teacher"


def test_teacher_crash_is_replaced_without_overreacting() -> None:
    """One of three ready teachers dies; the backend (like the local one) starts a replacement.
    The estimate of demand does not move, so the policy neither adds a fourth nor shrinks."""
    demands = [800.0, 800.0]
    sim = Sim(CFG, lambda t: demands, current=need(1600.0), start_delay=8, noise=0.03)
    assert sim.current == 2
    sim.run(0, 30)
    sim.ready_at[0] = 30 + 8  # crashed at t=30, its replacement is ready at t=38
    sim.run(30, 120)
    assert sim.changes() == []
    crash_window = [d for t, d in sim.log if 30 <= t < 38]
    assert all(d.demand == pytest.approx(1600.0, rel=0.1) for d in crash_window)


def test_capacity_drop_without_self_healing_backend_is_replaced() -> None:
    """A backend that lowered its count after a crash (current 2) while students stall on the
    remaining teachers: the policy asks for the need again."""
    teachers, students = observe(2, [1200.0, 1200.0])
    snap = ScaleSnapshot(current=2, teachers=teachers, students=students)
    d = decide(snap, dataclasses.replace(CFG, up_window=0), PolicyState(), 0.0)
    assert d.desired == need(2400.0) == 3 and d.action == "up" and d.cause == "demand"


def test_slow_start_counts_starting_teachers_and_never_doubles_up() -> None:
    sim = Sim(CFG, lambda t: [900.0] * 4, current=1, start_delay=40)  # slow model load
    sim.run(0, 120)
    changes = sim.changes()
    assert changes == [(changes[0][0], 1, need(3600.0))], changes
    held = [d for t, d in sim.log if changes[0][0] < t < changes[0][0] + 40]
    assert held and all(d.desired == need(3600.0) for d in held)
    # The estimate is absolute (the same need every period while they start), so the target holds.
    assert all(d.needed == need(3600.0) and d.cause in ("covered", "starting") for d in held)


def test_starting_teachers_block_further_scale_up_until_timeout() -> None:
    cfg = dataclasses.replace(CFG, up_window=0, start_timeout=30)
    teachers, students = observe(1, [1e9])  # a backlog whose size is unknown
    base = ScaleSnapshot(current=3, teachers=teachers, students=students, starting=(100.0, 100.0))
    d = decide(base, cfg, PolicyState(), 110.0)
    assert d.desired == 3 and d.cause == "starting"
    d = decide(base, cfg, PolicyState(), 131.0)  # they never became ready: no longer counted
    assert d.desired > 3 and d.action == "up"


def test_one_sample_spike_does_not_scale_up() -> None:
    def demand(t: float) -> list[float]:
        return [5000.0] if t == 50 else [600.0]

    sim = Sim(CFG, demand, current=1)
    sim.run(0, 120)
    assert sim.changes() == []


def test_waiting_students_with_idle_teachers_do_not_scale_up() -> None:
    """Students that wait on something else (network, their own loader) are not helped by more
    teachers: busy fraction and queues say the teachers are not the bottleneck."""
    teachers = tuple(TeacherSample(f"t{i}", capacity=CAP, busy_fraction=0.3) for i in range(2))
    students = (StudentSample("s", 600.0, 0.6),)
    state = PolicyState()
    for t in range(10):
        d = decide(ScaleSnapshot(current=2, teachers=teachers, students=students), CFG, state, float(t))
        state = d.new_state
        assert d.desired == 2


@given(
    demands=st.lists(st.floats(50.0, 3000.0), min_size=1, max_size=6),
    start=st.integers(1, 8),
    noise=st.floats(0.0, 0.05),
    seed=st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None)
def test_constant_load_never_oscillates(demands: list[float], start: int, noise: float, seed: int) -> None:
    """Under any constant load, from any starting size, the count moves in one direction only."""
    sim = Sim(CFG, lambda t: demands, current=start, start_delay=4, noise=noise, seed=seed)
    sim.run(0, 400)
    directions = {after > before for _, before, after in sim.changes()}
    assert len(directions) <= 1, sim.changes()
    final = sim.current
    assert final <= max(start, need(sum(demands)) + 1)


# ---- single decisions, table-driven ---------------------------------------------------------------

T2, S2 = observe(2, [1200.0, 1200.0])  # two teachers, saturated by two students


NO_WINDOWS = dataclasses.replace(CFG, up_window=0, down_window=0)


@dataclass(frozen=True)
class Case:
    name: str
    snapshot: ScaleSnapshot
    desired: int
    cause: str
    config: PolicyConfig = NO_WINDOWS
    contains: str = ""


CASES = [
    Case("registry down holds", ScaleSnapshot(current=3, error="etcd unreachable"), 3, "no-data", contains="etcd"),
    Case("registry down still enforces min", ScaleSnapshot(current=0, error="timeout"), 1, "bounds"),
    Case(
        "registry down never scales to zero",
        ScaleSnapshot(current=2, error="x"),
        2,
        "no-data",
        config=PolicyConfig(min_teachers=0, down_window=0),
    ),
    Case("no students goes to min", ScaleSnapshot(current=4), 1, "bounds", contains="no students"),
    Case(
        "no students, min 0: zero",
        ScaleSnapshot(current=4),
        0,
        "idle",
        config=PolicyConfig(min_teachers=0, down_window=0),
    ),
    Case("above max comes down at once", ScaleSnapshot(current=12, teachers=T2, students=S2), 8, "bounds"),
    Case("saturated pool grows to the need", ScaleSnapshot(current=2, teachers=T2, students=S2), 3, "demand"),
    Case(
        "max bounds the step up",
        ScaleSnapshot(current=1, teachers=observe(1, [9000.0])[0], students=observe(1, [9000.0])[1]),
        3,
        "bounds",
        config=dataclasses.replace(CFG, up_window=0, max_step=2),
        contains="at most 2 more",
    ),
    Case(
        "gpu budget bounds the need",
        ScaleSnapshot(current=2, teachers=T2, students=(StudentSample("s", 2000.0, 0.5),) * 3),
        3,
        "bounds",
        config=dataclasses.replace(CFG, up_window=0, gpu_budget=6, gpus_per_teacher=2),
    ),
    Case(
        "teachers without load reports: wait",
        ScaleSnapshot(current=1, teachers=(TeacherSample("t", has_load=False),), students=S2),
        1,
        "no-data",
    ),
    Case(
        "no capacity measured yet: hold",
        ScaleSnapshot(current=1, teachers=(TeacherSample("t", capacity=0.0),), students=S2),
        1,
        "no-capacity",
    ),
    Case(
        "capacity hint sizes before measurement",
        ScaleSnapshot(
            current=1, teachers=(TeacherSample("t", capacity=0.0, busy_fraction=1.0, queue_depth=4),), students=S2
        ),
        3,
        "demand",
        config=dataclasses.replace(CFG, up_window=0, capacity_hint=CAP),
    ),
    Case(
        "external teachers count toward the need",
        ScaleSnapshot(
            current=2,
            teachers=(*T2, TeacherSample("ext", capacity=CAP, busy_fraction=1.0, queue_depth=3, managed=False)),
            students=S2,
        ),
        2,
        "covered",
    ),
    Case(
        "draining teachers are not capacity",
        ScaleSnapshot(
            current=2, teachers=(*T2, TeacherSample("d", capacity=CAP, busy_fraction=1.0, draining=True)), students=S2
        ),
        3,
        "demand",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_single_decisions(case: Case) -> None:
    d = decide(case.snapshot, case.config, PolicyState(), 0.0)
    assert (d.desired, d.cause) == (case.desired, case.cause), d.reason
    assert case.contains in d.reason
    assert d.reason.startswith(("scale up", "scale down", "hold"))


def test_decide_is_pure() -> None:
    snap = ScaleSnapshot(current=2, teachers=T2, students=S2)
    state = PolicyState(history=((0.0, 2),), since=0.0)
    a = decide(snap, CFG, state, 5.0)
    b = decide(snap, CFG, state, 5.0)
    assert a == b
    assert state == PolicyState(history=((0.0, 2),), since=0.0)


def test_history_is_bounded_by_the_windows() -> None:
    state = PolicyState()
    snap = ScaleSnapshot(current=2, teachers=T2, students=S2)
    for t in range(1000):
        state = decide(snap, CFG, state, float(t)).new_state
    assert len(state.history) <= CFG.down_window + 2


def test_from_registry_reads_teacher_sets_and_demand() -> None:
    from discovery.base import TeacherEntry, TeacherSet
    from protos import registry_pb2

    rec = registry_pb2.TeacherRecord(instance_id="a", endpoint="127.0.0.1:1")
    load = registry_pb2.TeacherLoad(capacity_samples_per_s=500, busy_fraction=0.5, queue_depth=2, draining=True)
    teachers = TeacherSet({"a": TeacherEntry(rec, load), "b": TeacherEntry(rec, None)})
    demand = [registry_pb2.StudentDemand(student_id="s", samples_per_s=100, wait_fraction=1.5)]
    snap = ScaleSnapshot.from_registry(3, teachers, demand, starting=[1.0], managed={"a"}.__contains__)
    a, b = snap.teachers
    assert (a.capacity, a.busy_fraction, a.queue_depth, a.draining, a.managed) == (500, 0.5, 2, True, True)
    assert (b.has_load, b.managed) == (False, False)
    assert snap.students == (StudentSample("s", 100.0, 1.0),)
    assert snap.starting == (1.0,)


# ---- configuration errors -------------------------------------------------------------------------

BAD = [
    ({"min_teachers": 5, "max_teachers": 3}, "greater than max_teachers"),
    ({"min_teachers": -1}, "negative"),
    ({"max_teachers": 0}, "at least 1"),
    ({"target_utilisation": 0}, "target_utilisation"),
    ({"target_utilisation": 1.5}, "target_utilisation"),
    ({"target_utilisation": 0.95}, "busy_threshold"),
    ({"stall_threshold": 1.0}, "stall_threshold"),
    ({"down_window": -5}, "negative"),
    ({"up_window": float("nan")}, "finite"),
    ({"max_step": 0}, "max_step"),
    ({"max_teachers": 2.5}, "whole number"),
    ({"min_teachers": True}, "finite number"),
    ({"gpu_budget": 1, "gpus_per_teacher": 2}, "fewer than min_teachers"),
    ({"start_timeout": 0}, "start_timeout"),
    ({"max_demand_factor": 0.5}, "max_demand_factor"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[m + "-" + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_config_is_rejected_with_a_clear_message(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]
    assert issubclass(PolicyConfigError, ValueError)


def test_gpu_budget_lowers_the_effective_max() -> None:
    assert PolicyConfig(max_teachers=8, gpu_budget=6, gpus_per_teacher=2).upper == 3
    assert PolicyConfig(max_teachers=2, gpu_budget=6).upper == 2


def test_default_config_scales_up_on_the_first_pressured_sample() -> None:
    cfg = PolicyConfig(max_teachers=8)  # defaults: no up window
    teachers, students = observe(1, [2500.0])
    d = decide(ScaleSnapshot(current=1, teachers=teachers, students=students), cfg, PolicyState(), 0.0)
    assert (d.action, d.desired) == ("up", 4), d.reason  # ceil(2500 / (1000 * 0.8))


def test_no_second_scale_up_while_new_teachers_settle() -> None:
    """Teachers that just registered: the students' 10 s figures still show the old shortage."""
    cfg = PolicyConfig(max_teachers=8, settle=10.0)
    state = PolicyState()
    teachers, students = observe(1, [2500.0])
    # t=0: scale up; t=1..4: the three new teachers start; t=5: they registered.
    d = decide(ScaleSnapshot(current=1, teachers=teachers, students=students), cfg, state, 0.0)
    assert d.desired == 4
    for t in range(1, 5):
        d = decide(ScaleSnapshot(current=4, teachers=teachers, students=students, starting=(0.0,) * 3),
                   cfg, d.new_state, float(t))
        assert d.desired == 4, d.reason
    # Registered, but lagging figures still look like pressure (and a low capacity reading asks for more).
    laggy, _ = observe(4, [2500.0], capacity=600.0)
    _, still_waiting = observe(1, [2500.0])
    for t in range(5, 14):
        d = decide(ScaleSnapshot(current=4, teachers=tuple(dataclasses.replace(x, queue_depth=3) for x in laggy),
                                 students=still_waiting), cfg, d.new_state, float(t))
        assert d.desired == 4 and d.cause == "starting", (t, d.reason)
    # Past the settle period, real remaining pressure scales up again.
    d = decide(ScaleSnapshot(current=4, teachers=tuple(dataclasses.replace(x, queue_depth=3) for x in laggy),
                             students=still_waiting), cfg, d.new_state, 15.0)
    assert d.action == "up", d.reason


def test_scale_down_held_by_the_down_window_says_so() -> None:
    cfg = PolicyConfig(max_teachers=8, down_window=30, max_step=8)
    state = PolicyState()
    teachers, students = observe(4, [2500.0])
    for t in range(0, 31, 5):
        state = decide(ScaleSnapshot(current=4, teachers=teachers, students=students), cfg, state, float(t)).new_state
    teachers, students = observe(4, [400.0])
    d = None
    for t in range(31, 70):
        d = decide(ScaleSnapshot(current=4, teachers=teachers, students=students), cfg, state, float(t))
        state = d.new_state
        if d.action == "down":
            break
    assert d is not None and d.action == "down" and d.desired == 1, d.reason if d else None
    assert "fewer per step" not in d.reason
