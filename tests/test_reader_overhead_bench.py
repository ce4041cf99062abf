"""benchmarks.reader_overhead end to end: the reader (sharing calls, and one call per batch) and
NVIDIA's generic asyncio client against one real teacher-server, every variant measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_benchmark_measures_the_reader_both_ways_and_the_generic_client(tmp_path: Path) -> None:
    env = {**os.environ, "DISTILL_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.reader_overhead", "--quick", "--reps", "1",
                           "--batches", "200"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "reader_overhead_quick.json").read_text())
    rates = doc["median_batches_per_s"]
    assert set(rates) == {"reader", "reader_per_batch", "tritonclient"} and all(v > 0 for v in rates.values())
    assert doc["ratio_reader_vs_tritonclient"] > 0 and doc["ratio_reader_per_batch_vs_tritonclient"] > 0
    assert 0.0 <= doc["bundled_share"][0] <= 1.0
