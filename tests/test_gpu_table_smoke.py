"""benchmarks/gpu_table.sh, the GPU run's script, under SMOKE=1 on the CPU: each stage runs its own
command at smoke sizes, results and logs go to the smoke directory (never benchmarks/results/),
and a stage that fails is named at the end with a non-zero exit, the others still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(420)  # a stage is a fresh process that builds a model and loads torch
def test_the_smoke_runs_each_stage_on_the_cpu_and_names_the_ones_that_failed(tmp_path: Path) -> None:
    env = {**os.environ, "SMOKE": "1", "SMOKE_DIR": str(tmp_path / "smoke"), "PY": sys.executable,
           "SHAPES": str(tmp_path / "shapes")}
    env.pop("DISTILL_BENCH_RESULTS", None)
    proc = subprocess.run(["bash", "benchmarks/gpu_table.sh", "no_such_stage", "host_bound"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    for line in ("unknown stage no_such_stage", "failed: no_such_stage", "== host_bound: exit 0"):
        assert line in out, out[-3000:]
    results = tmp_path / "smoke" / "results"
    host = json.loads((results / "host_bound_gpu.json").read_text())
    assert host["device"] == "cpu"
    assert host["reps"] == 1  # the smoke's size, after the stage's own REPS
    assert (tmp_path / "shapes" / "qwen2.5-tiny" / "config.json").is_file()  # the smoke's shape, not 1.5B
    assert (tmp_path / "smoke" / "logs" / "host_bound.log").is_file()
