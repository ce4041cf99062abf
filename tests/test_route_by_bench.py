"""benchmarks.routing (W8) end to end at its smallest: a routing reader and two readers each fed its
own rows against two real teacher-server processes; every figure written and sane (the routed
outputs are checked against the experts inside the benchmark)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_w8_measures_the_routed_reader_and_the_split_readers(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISTILL_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.routing", "--quick", "--reps", "1", "--batches", "40"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "routing_quick.json").read_text())
    assert doc["workload"] == "W8" and doc["settings"]["batches"] == 40 and doc["settings"]["reps"] == 1
    rates = doc["median_rows_per_s"]
    assert set(rates) == {"routed", "split"} and all(math.isfinite(v) and v > 0 for v in rates.values()), rates
    assert len(doc["ratios"]) == 1 and doc["ratio_routed_vs_split"] > 0
    assert doc["machine"] and "routed / split" in proc.stdout
