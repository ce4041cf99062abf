"""benchmarks.routing (W8) end to end at its smallest: a routing reader and two readers each fed its
own rows against two real teacher-server processes; every figure written and sane (the routed
outputs are checked against the experts inside the benchmark)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import routing
from tests.bench_runs import run_benchmark_main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)  # the bound its benchmark had in a process of its own
def test_w8_measures_the_routed_reader_and_the_split_readers(tmp_path: Path) -> None:
    doc = run_benchmark_main(routing.main, ["--quick", "--reps", "1", "--batches", "40"], tmp_path,
                             name="routing_quick")
    assert doc["workload"] == "W8" and doc["settings"]["batches"] == 40 and doc["settings"]["reps"] == 1
    rates = doc["median_rows_per_s"]
    assert set(rates) == {"routed", "split"} and all(math.isfinite(v) and v > 0 for v in rates.values()), rates
    assert len(doc["ratios"]) == 1 and doc["ratio_routed_vs_split"] > 0
    in_flight = doc["calls_in_flight"]  # sampled every 10 batches: 4 looks per reader here
    assert {v: set(by_service) for v, by_service in in_flight.items()} == {
        "routed": {"math", "code"}, "split": {"math", "code"}}, in_flight
    assert all(isinstance(n, float) and 0 <= n <= 64 for by_service in in_flight.values()
               for n in by_service.values()), in_flight
    cpu = doc["cpu_us_per_row"]  # this process's and the two teachers' CPU per row, per side
    assert {v: set(parts) for v, parts in cpu.items()} == {"routed": {"readers", "teachers"},
                                                          "split": {"readers", "teachers"}}, cpu
    assert all(0 < us < 1e6 for parts in cpu.values() for us in parts.values()), cpu
    assert doc["machine"] and "routed / split" in doc["stdout"] and "calls in flight per expert" in doc["stdout"]
    assert "CPU µs per row" in doc["stdout"]
    per_call = doc["rows_per_call"]  # each expert's rows over the calls it answered in a pass
    assert {v: set(by_service) for v, by_service in per_call.items()} == {
        "routed": {"math", "code"}, "split": {"math", "code"}}, per_call
    assert all(1 <= n <= 64 for by_service in per_call.values() for n in by_service.values()), per_call
