"""benchmarks.reader_overhead end to end: the reader (sharing calls, one call per batch, and one
batch a message on a stream) and NVIDIA's generic asyncio client against one real teacher-server,
every variant measured, the teacher's CPU included."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import reader_overhead
from tests.bench_runs import run_benchmark_main


@pytest.mark.timeout(300)  # the bound its benchmark had in a process of its own
def test_the_benchmark_measures_the_reader_both_ways_and_the_generic_client(tmp_path: Path) -> None:
    doc = run_benchmark_main(reader_overhead.main, ["--quick", "--reps", "1", "--batches", "200"], tmp_path,
                             name="reader_overhead_quick")
    rates = doc["median_batches_per_s"]
    assert set(rates) == {"reader", "reader_per_batch", "reader_per_batch_stream", "tritonclient"}
    assert all(v > 0 for v in rates.values())
    assert doc["ratio_reader_vs_tritonclient"] > 0 and doc["ratio_reader_per_batch_vs_tritonclient"] > 0
    assert doc["ratio_reader_per_batch_stream_vs_tritonclient"] > 0 and doc["ratio_stream_vs_call"] > 0
    assert set(doc["median_teacher_cpu_us_per_batch"]) == set(rates)
    assert all(v > 0 for v in doc["median_teacher_cpu_us_per_batch"].values())  # the teacher worked every pass
    assert 0.0 <= doc["bundled_share"][0] <= 1.0
