"""benchmarks.serving's PyTriton side end to end: PyTriton (the real Triton core, from its own
cached virtualenv) serves RefTeacher beside teacher-server, driven by the same load generator,
and the W2/W3 ratios against it land in the JSON and the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import serving
from tests.bench_runs import run_benchmark_main
from tests.pytriton_env import pytriton_python_or_skip

# The venv may be built here first (pip download and install, about 2 minutes once).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def pytriton_python() -> Path:
    return pytriton_python_or_skip()


def test_the_benchmark_measures_pytriton_beside_teacher_server(pytriton_python: Path, tmp_path: Path) -> None:
    # One repetition, no quiet gate: a smoke run. A window of a few batch times, so even a loaded
    # machine completes several batches of 256 in it. Its main in this process (a fresh interpreter
    # would import torch again); the servers are processes of their own either way.
    doc = run_benchmark_main(serving.main, ["--quick", "--pytriton", "--reps", "1", "--warmup", "0.3", "--duration",
                                            "3", "--max-foreign-cores", "0", "--out", "serving_pytriton_test"],
                             tmp_path, name="serving_pytriton_test")

    # PyTriton ran with the batching teacher-server's layout and answered what the model computes.
    pt = doc["pytriton"]
    assert pt["enabled"] and pt["why"] == "on (--pytriton)"
    assert pt["instances"] == doc["machine"]["server_instances"]
    assert pt["torch_threads"] == doc["machine"]["server_torch_threads"]
    assert (pt["max_batch_size"], pt["max_queue_delay_us"]) == (doc["settings"]["max_batch"],
                                                              doc["settings"]["delay_us"])
    diffs = doc["output_max_abs_diff"]
    assert set(diffs) == {"batching_on", "batching_off", "pytriton"} and 0 <= diffs["pytriton"] <= 1e-3
    assert doc["server_exit_codes"]["pytriton"] == 0

    medians = doc["medians_samples_per_s"]
    assert medians["w2_pytriton_256"] > 0 and medians["w3_pytriton"] > 0
    (w2,) = doc["per_rep"]["w2_pytriton_256"]
    (w3,) = doc["per_rep"]["w3_pytriton"]
    assert w2["errors"] == 0 and w3["errors"] == 0
    assert w2["mean_server_batch"] == 256  # whole batch-256 requests, never split or merged
    assert w3["mean_server_batch"] > 8  # Triton's dynamic batcher merged the batch-8 requests

    ratios = doc["ratios"]
    assert (ratios["w2_server_over_pytriton"]["goal"], ratios["w2_server_over_pytriton"]["goal_op"]) == (1.3, ">=")
    assert (ratios["w3_on_over_pytriton"]["goal"], ratios["w3_on_over_pytriton"]["goal_op"]) == (1.0, ">")
    assert ratios["w2_server_over_pytriton"]["verdict"] == "smoke test only"
    for row in ("W2 PyTriton saturated, batch 256", "W3 PyTriton batching, 64 x batch 8",
                "W2 server / PyTriton (batch 256)", "W3 batching on / PyTriton (64 x batch 8)"):
        assert row in doc["stdout"]


def test_pytriton_is_left_out_unless_the_run_is_cpu_fp32_or_asked_for() -> None:
    off = serving.parse_args(["--no-pytriton"])
    assert off.pytriton == "off" and serving.pytriton_venv_for(off) == (None, "left out (--no-pytriton)")
    cuda = serving.Settings(device="cuda", compute_dtype="FP16")  # auto: never on another device
    venv, why = serving.pytriton_venv_for(cuda)
    assert venv is None and "CPU in FP32" in why
    assert serving.parse_args([]).pytriton == "auto" and serving.parse_args(["--pytriton"]).pytriton == "on"


def test_pytriton_on_another_device_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.parse_args(["--pytriton", "--compute-dtype", "FP16"])
    assert exited.value.code == 2
    assert "--pytriton serves the model on the CPU in FP32: drop --device/--compute-dtype, or --pytriton" in \
        capsys.readouterr().err
