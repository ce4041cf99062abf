"""Load and demand reports are written when they say something new, not at every sample."""

from __future__ import annotations

import pytest

from discovery.reports import ReportGate, demand_changed, load_changed
from protos import registry_pb2

Load = registry_pb2.TeacherLoad
Demand = registry_pb2.StudentDemand
STEADY = Load(queue_depth=0, in_flight=5, samples_per_s=1000.0, busy_fraction=0.60, capacity_samples_per_s=2000.0)


@pytest.mark.parametrize(
    ("new", "material"),
    [
        (Load(queue_depth=0, in_flight=6, samples_per_s=1050.0, busy_fraction=0.62, capacity_samples_per_s=2050.0),
         False),  # jitter
        (Load(queue_depth=1, in_flight=5, samples_per_s=1000.0, busy_fraction=0.60, capacity_samples_per_s=2000.0),
         True),  # a queue forms
        (Load(queue_depth=0, in_flight=9, samples_per_s=1000.0, busy_fraction=0.60, capacity_samples_per_s=2000.0),
         True),  # in flight nearly doubles
        (Load(queue_depth=0, in_flight=5, samples_per_s=1200.0, busy_fraction=0.60, capacity_samples_per_s=2000.0),
         True),  # rate +20 %
        (Load(queue_depth=0, in_flight=5, samples_per_s=1000.0, busy_fraction=0.70, capacity_samples_per_s=2000.0),
         True),  # busier
        (Load(queue_depth=0, in_flight=5, samples_per_s=1000.0, busy_fraction=0.60, capacity_samples_per_s=1500.0),
         True),  # capacity re-measured
        (Load(queue_depth=0, in_flight=5, samples_per_s=1000.0, busy_fraction=0.60, capacity_samples_per_s=2000.0,
              draining=True), True),
    ],
)
def test_load_changed(new: registry_pb2.TeacherLoad, material: bool) -> None:
    assert load_changed(STEADY, new) is material
    assert load_changed(new, new) is False


def test_a_count_jittering_by_one_is_not_news_but_a_real_move_is() -> None:
    def load(in_flight: int, queue: int = 0) -> registry_pb2.TeacherLoad:
        return Load(queue_depth=queue, in_flight=in_flight, samples_per_s=1000.0, busy_fraction=0.6)

    assert not load_changed(load(3), load(4)) and not load_changed(load(4), load(3))
    assert not load_changed(load(8), load(11))
    assert load_changed(load(4), load(8)) and load_changed(load(8), load(4))
    assert load_changed(load(1), load(3))
    assert load_changed(load(4, queue=0), load(4, queue=1)) and load_changed(load(4, queue=1), load(4, queue=0))


def test_demand_changed() -> None:
    base = Demand(samples_per_s=500.0, wait_fraction=0.10, in_flight=4, teachers_in_use=2)
    assert not demand_changed(base, Demand(samples_per_s=520.0, wait_fraction=0.12, in_flight=5, teachers_in_use=2))
    assert demand_changed(base, Demand(samples_per_s=0.0, wait_fraction=0.10, in_flight=4, teachers_in_use=2))
    assert demand_changed(base, Demand(samples_per_s=500.0, wait_fraction=0.30, in_flight=4, teachers_in_use=2))
    assert demand_changed(base, Demand(samples_per_s=500.0, wait_fraction=0.10, in_flight=4, teachers_in_use=3))
    # Rates below one sample/s are all "idle".
    assert not demand_changed(Demand(samples_per_s=0.2), Demand(samples_per_s=0.9))


def test_gate_writes_the_first_report_changes_and_stale_ones_and_forced_ones() -> None:
    gate: ReportGate[registry_pb2.TeacherLoad] = ReportGate(load_changed, max_age_s=10.0)
    assert gate.due(STEADY, now=0.0)
    assert not gate.due(STEADY, now=1.0)
    assert not gate.due(STEADY, now=9.9)
    assert gate.due(STEADY, now=10.0)  # old enough: written again as a liveness hint
    assert gate.due(STEADY, now=10.5, force=True)  # a new lease needs its report at once
    busier = Load(queue_depth=3, in_flight=5, samples_per_s=1000.0, busy_fraction=1.0, capacity_samples_per_s=2000.0)
    assert gate.due(busier, now=11.0)
    assert not gate.due(busier, now=12.0)
    assert (gate.written, gate.skipped) == (4, 3)
    with pytest.raises(ValueError, match="max_age_s"):
        ReportGate(load_changed, max_age_s=-1)

