"""The Engines workload (`benchmarks.engines`) end to end at its smallest settings, against
teacher-server's own `/v1/completions` as the engine (a real vLLM start is the engine clients'
tests' business): its entry point runs in the test's process and starts the teacher and gateway
processes, writes its JSON to a temporary directory, and the figures must be sane. Speed is the benchmark's business: no
figure is compared with the goal here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import engines
from tests.bench_runs import run_benchmark_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


def test_the_engines_workload_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    doc = run_benchmark_main(engines.main, ["--quick", "--engine", "teacher-server"], tmp_path, name="engines_quick")
    assert doc["engine"] == "teacher-server" and doc["settings"]["sequences"] == 8
    assert set(doc["summary"]) == {"direct", "gateway", "reader"}
    for variant, figures in doc["summary"].items():
        for name, value in figures.items():
            assert math.isfinite(value) and value > 0, (variant, name, value)
    for variant in ("gateway", "reader"):
        assert math.isfinite(doc["throughput_vs_direct"][variant]) and doc["throughput_vs_direct"][variant] > 0
        assert math.isfinite(doc["added_ms_per_sequence"][variant])
    assert all(len(reps) == 1 for reps in doc["per_rep"].values())
    sampled = doc["reader_calls_in_flight"]  # None when its passes were shorter than one sampling interval
    assert sampled is None or 0 <= sampled <= doc["settings"]["clients"], sampled
    direct = doc["direct_calls_in_flight"]  # sampled alike, on the direct client's own loop
    assert direct is None or 0 <= direct <= doc["settings"]["clients"], direct
    assert doc["machine"]["cpu_count"] >= 1
    assert "vs direct" in doc["stdout"]  # the printed table
