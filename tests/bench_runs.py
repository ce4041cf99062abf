"""Running a benchmark's quick form as its user does, for the smoke tests: ``python -m
benchmarks.<module> <args>`` in a fresh process, its JSON written to a temporary directory
(``DISTILL_BENCH_RESULTS``), so the measured files in benchmarks/results are never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_benchmark(module: str, args: list[str], results: Path, *, name: str, timeout: float,
                  exit_codes: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """``python -m benchmarks.<module> <args>`` with its results under ``results``; its exit status
    (each benchmark's own verdict) must be one of ``exit_codes``, and ``<name>.json`` is returned
    with the status and the printed report added as ``exit_code`` and ``stdout``."""
    env = dict(os.environ, PYTHONPATH=str(REPO), DISTILL_BENCH_RESULTS=str(results))
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode in exit_codes, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    doc["exit_code"] = proc.returncode
    doc["stdout"] = proc.stdout
    return doc
