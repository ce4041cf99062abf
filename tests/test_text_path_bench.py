"""benchmarks.text_path (W9) end to end at its smallest: one teacher-server process scores the same
texts sent as text and as its own ids through readers; every figure written and sane (the text
path's tokens and scores are checked against the ids path inside the benchmark)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import text_path
from tests.bench_runs import run_benchmark_main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)  # the bound its benchmark had in a process of its own
def test_w9_measures_the_text_path_and_the_ids_path(tmp_path: Path) -> None:
    doc = run_benchmark_main(text_path.main, ["--quick", "--reps", "1", "--batches", "4"], tmp_path,
                             name="text_path_quick")
    assert doc["workload"] == "W9" and doc["settings"]["batches"] == 4 and doc["settings"]["reps"] == 1
    assert doc["settings"]["tokens_per_pass"] > 4 * 8, "every text is scored in several tokens"
    rates = doc["median_rows_per_s"]
    assert set(rates) == {"text", "ids"} and all(math.isfinite(v) and v > 0 for v in rates.values()), rates
    assert len(doc["ratios"]) == 1 and doc["ratio_text_vs_ids"] > 0
    assert 0 <= doc["largest_score_difference"] <= 0.05, "both paths score the same tokens alike"
    assert doc["machine"] and "text / ids" in doc["stdout"]
