"""NVIDIA's perf_analyzer against a real teacher-server process, in every mode it speaks to us in.

perf_analyzer ships in the tritonclient 2.48 wheel and needs libb64 and the CUDA runtime library
even on CPU; ``benchmarks/perf_analyzer.sh --setup`` installs it into its own cached virtualenv
outside the project's (and libb64 with apt-get when run as root). The fixture runs that once; a
machine where it cannot be installed fails here with the script's message rather than skipping.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import teacher_process

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "benchmarks" / "perf_analyzer.sh"


@pytest.fixture(scope="module")
def perf_analyzer() -> tuple[Path, dict[str, str]]:
    """The perf_analyzer binary and its environment (the CUDA runtime wheel on LD_LIBRARY_PATH)."""
    run = subprocess.run(["bash", str(SETUP), "--setup"], capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, f"benchmarks/perf_analyzer.sh --setup failed:\n{run.stdout}\n{run.stderr}"
    binary = Path(run.stdout.strip().splitlines()[-1])
    venv = binary.parent.parent
    cudart = sorted(venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    assert binary.exists() and cudart, f"perf_analyzer setup left no binary or CUDA runtime under {venv}"
    return binary, {**os.environ, "LD_LIBRARY_PATH": str(cudart[0])}


@pytest.fixture(scope="module")
def affine_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1",
            "--port", "0", "--http-port", "0"]
    with teacher_process(args, tmp_path_factory.mktemp("perf-analyzer")) as (_proc, info):
        yield info


@pytest.mark.parametrize("mode", ["sync", "async", "streaming", "http"])
def test_perf_analyzer_measures_the_teacher(mode: str, perf_analyzer: tuple[Path, dict[str, str]],
                                            affine_process: dict[str, Any]) -> None:
    """Every perf_analyzer mode gets through its metadata, config and statistics reads and its
    inferences against a real teacher-server process, and reports a throughput."""
    binary, env = perf_analyzer
    url = f"127.0.0.1:{affine_process['http_port']}" if mode == "http" else affine_process["endpoint"]
    flags = {"sync": ["-i", "grpc"], "async": ["-i", "grpc", "-a"], "streaming": ["-i", "grpc", "--streaming"],
             "http": ["-i", "http"]}[mode]
    run = subprocess.run(
        [str(binary), "-m", "affine", "-u", url, *flags, "-b", "4", "--measurement-mode", "count_windows",
         "--measurement-request-count", "30", "-s", "1000", "--max-trials", "3"],
        capture_output=True, text=True, timeout=120, check=False, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"Throughput: [0-9.]+ infer/sec", out), out
    assert "Successful request count" in out, out
