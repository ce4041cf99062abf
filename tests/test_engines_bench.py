"""The Engines workload (`benchmarks.engines`) end to end at its smallest settings, against
teacher-server's own `/v1/completions` as the engine (a real vLLM start is the engine clients'
tests' business): its entry point runs as a subprocess, writes its JSON to a temporary directory
(``DISTILL_BENCH_RESULTS``), and the figures must be sane. Speed is the benchmark's business: no
figure is compared with the goal here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


def test_the_engines_workload_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), DISTILL_BENCH_RESULTS=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engines", "--quick", "--engine", "teacher-server"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "engines_quick.json").read_text())
    assert doc["engine"] == "teacher-server" and doc["settings"]["sequences"] == 8
    assert set(doc["summary"]) == {"direct", "gateway", "reader"}
    for variant, figures in doc["summary"].items():
        for name, value in figures.items():
            assert math.isfinite(value) and value > 0, (variant, name, value)
    for variant in ("gateway", "reader"):
        assert math.isfinite(doc["throughput_vs_direct"][variant]) and doc["throughput_vs_direct"][variant] > 0
        assert math.isfinite(doc["added_ms_per_sequence"][variant])
    assert all(len(reps) == 1 for reps in doc["per_rep"].values())
    assert doc["machine"]["cpu_count"] >= 1
    assert "vs direct" in proc.stdout  # the printed table
