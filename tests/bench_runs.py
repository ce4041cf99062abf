"""Running a benchmark's quick form as its user does, for the smoke tests: ``python -m
benchmarks.<module> <args>`` in a fresh process (``run_benchmark``), or its ``main(args)`` in the
test's own (``run_benchmark_main``, a torch import cheaper), its JSON written to a temporary
directory (``DISTILL_BENCH_RESULTS``), so the measured files in benchmarks/results are never touched;
and the checks every such run's figures must pass (``positive``, ``machine_recorded``)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

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


def run_benchmark_main(main: Callable[[list[str]], int], args: list[str], results: Path, *, name: str,
                       env: Mapping[str, str | None] | None = None,
                       exit_codes: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """``main(args)``, the entry point ``python -m benchmarks.<module> <args>`` runs, called in this
    process: a fresh interpreter would import torch again (seconds of CPU), and the servers the
    benchmark starts are processes of their own either way. Its results go under ``results``,
    ``env`` is set for the call (a None value unsets the variable), and the torch thread count
    and the cores it pins this process's threads to (``benchmarks.pinning``) are put back after;
    as ``run_benchmark``, its exit status must be one of ``exit_codes`` and ``<name>.json`` is
    returned with ``exit_code`` and ``stdout`` added."""
    import torch

    from benchmarks import common
    from benchmarks.pinning import pin_process

    threads = torch.get_num_threads()
    cores = os.sched_getaffinity(0)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "RESULTS_DIR", results)
        mp.chdir(REPO)  # where `python -m benchmarks.<module>` runs, for the processes it starts
        mp.setenv("PYTHONPATH", str(REPO))  # as run_benchmark's process had it: its children import the project
        for key, value in (env or {}).items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        try:
            with contextlib.redirect_stdout(out):
                code = main(args)
        except BaseException:
            sys.stdout.write(out.getvalue())  # shown beside the failure, as a failed process's output was
            raise
        finally:
            torch.set_num_threads(threads)
            pin_process(cores)  # threads it started meanwhile (gRPC's) included
    assert code in exit_codes, out.getvalue()[-3000:]
    doc: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    doc["exit_code"] = code
    doc["stdout"] = out.getvalue()
    return doc


def positive(values: Mapping[str, Any]) -> None:
    """Every figure of `values` is a positive finite number (a rate or a ratio a run produced)."""
    bad = {k: v for k, v in values.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)}
    assert not bad, f"not a positive finite figure: {bad}"


def machine_recorded(doc: Mapping[str, Any]) -> None:
    """The run's JSON says which machine measured it."""
    m = doc["machine"]
    assert m["cpu_count"] >= 1 and m["python"] and m["platform"]
